"""One rank of the 2-process runs of tests/test_parallel.py, or (with no torchrun) the 1-process runs they are compared to:
`torchrun --standalone --nproc_per_node=2 tests/parallel_worker.py OUTDIR CASE...`. Each case trains a small regression on
the CPU with gloo, one global batch of 32 samples a step (32/world a rank), and writes this rank's results to
OUTDIR/CASE/rank{R}.json. `ddp_*` cases run under fastai's `distrib_ctx` (DDP), `fsdp_*` cases under `to_fsdp` (FSDP2).
MPX_HANG_DUMP=SECONDS prints every rank's stack and exits after that long, to find where a hung collective waits."""
import json, os, sys, time
from pathlib import Path
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from fastai.basics import *
from fastai.callback.schedule import *
from fastai.distributed import *
from mpx.all import *
from mpx.distributed import *
from mpx.parallel import gathered
import dist_worker  # its fastai patch: DistributedDL broadcasts on the CPU under gloo (fastai's DDP; `to_fsdp` needs none)

if os.environ.get('MPX_HANG_DUMP'):
    import faulthandler; faulthandler.dump_traceback_later(int(os.environ['MPX_HANG_DUMP']), exit=True)
WORLD,RANK = int(os.environ.get('WORLD_SIZE', 1)),int(os.environ.get('RANK', 0))
HIDDEN = 64  # 4545 parameters: 18,180 bytes of fp32 gradients a step

class Inject(nn.Module):
    "Identity; in backward, while `armed`, the gradient flowing into feature 0 of the layer before it made inf"
    armed = False
    def forward(self, x):
        if self.armed and x.requires_grad: x.register_hook(lambda g: g.index_fill(1, torch.tensor([0]), float('inf')))
        return x

def model():
    return nn.Sequential(nn.Linear(4, HIDDEN), Inject(), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))

def learner(path, precision, opt_func=partial(SGD, mom=.9), lr=1e-2):
    "32 samples, one global batch a step (32/WORLD a rank); the model drawn after seeding; SGD, whose steps scale with the gradients"
    set_seed(0, reproducible=True)
    x = torch.randn(32, 4); y = x @ torch.tensor([[1.], [2.], [-1.], [.5]]) + 3
    dls = DataLoaders.from_dsets(list(zip(x, y)), list(zip(x, y)), bs=32 // WORLD, shuffle=False, num_workers=0)
    return precision(Learner(dls, model(), loss_func=MSELossFlat(), opt_func=opt_func, lr=lr, path=path))

class Arm(Callback):
    "Arm the model's `Inject` on rank `rank` at the optimizer steps in `at`: under FSDP2, an inf in the shards of one rank only"
    order = 9
    def __init__(self, at, rank): self.at,self.rank,self.i = set(at),rank,0
    def before_batch(self):
        inj = first(m for m in get_model(self.model).modules() if isinstance(m, Inject))
        inj.armed = self.training and self.i in self.at and RANK == self.rank
    def after_backward(self): self.i += 1

class InjectGrad(Callback):
    "Make the first weight's fp32 gradient `value` on every rank at the steps in `at`, before DDP all-reduces it"
    order = 9
    def __init__(self, at, value): self.at,self.value,self.i = set(at),value,0
    def before_fit(self):
        p = first(get_model(self.model).parameters())
        if not hasattr(p, '_injected'): p._injected = p.register_hook(lambda g: torch.full_like(g, self.value) if self.i in self.at else g)
    def after_backward(self): self.i += 1

def local(t): return t.to_local() if hasattr(t, 'to_local') else t

class LocalInf(Callback):
    "Record, at each optimizer step, whether this rank's own gradient shards hold an inf or nan"
    order,run_valid = 9,False
    def __init__(self): self.seen = []
    def before_step(self):
        gs = [local(p.grad) for p in self.learn.opt.all_params(with_grad=True).itemgot(0)]
        self.seen.append(not all(bool(g.isfinite().all()) for g in gs))

class CountedDDP(Callback):
    "Under DDP with no mpx hook, torch's own fp32 all-reduce hook (DDP's default, in Python), so that `Sent` counts it"
    order = 12
    def before_train(self):
        m = self.model
        if not isinstance(m, nn.parallel.DistributedDataParallel) or hasattr(m, '_counted'): return
        m.register_comm_hook(None, default_hooks.allreduce_hook); m._counted = True

class Sent:
    "Count the bytes of every `dist.all_reduce` (DDP's gradients), and the dtypes of FSDP2's all-gathers and reduce-scatters"
    def __enter__(self):
        self.all_reduce,self.gather,self.scatter,self.saved = 0,set(),set(),{}
        for name,f in (('all_reduce', self._ar), ('all_gather_single', self._ag), ('reduce_scatter_single', self._rs)):
            if hasattr(dist, name): self.saved[name] = getattr(dist, name); setattr(dist, name, f)
        return self
    def __exit__(self, *a):
        for name,f in self.saved.items(): setattr(dist, name, f)
    def _ar(self, t, *a, **k): self.all_reduce += t.numel() * t.element_size(); return self.saved['all_reduce'](t, *a, **k)
    def _ag(self, out, inp, *a, **k): self.gather.add(str(inp.dtype)); return self.saved['all_gather_single'](out, inp, *a, **k)
    def _rs(self, output, input, *a, **k):
        self.scatter.add(str(input.dtype))
        return self.saved['reduce_scatter_single'](output, input, *a, **k)

def full(t) -> torch.Tensor: return t.full_tensor() if hasattr(t, 'full_tensor') else t  # a collective for a DTensor: every rank
def full_weights(learn) -> list:
    "Every parameter, whole (gathered on every rank when sharded), flattened in model order"
    return torch.cat([full(p).detach().flatten().float() for p in learn.model.parameters()]).tolist()

def opt_state(learn) -> list:
    "The optimizer's state tensors, whole, flattened"
    return [t.flatten().tolist() for s in gathered(learn.opt.state_dict())['state'] for t in s.values() if isinstance(t, torch.Tensor)]

def fit(learn, n=8, method='fit', **kwargs):
    with learn.no_bar(), learn.no_logging(): getattr(learn, method)(n, **kwargs)
    return learn

def find_lr(learn, n=6):
    with learn.no_bar(), learn.no_logging(): learn.lr_find(num_it=n, show_plot=False, suggest_funcs=())

def log(learn) -> dict:
    cb = learn.mixed_precision
    return dict(scales=cb.scales, skips=cb.step_log.skips, loss_scale=cb.loss_scale, steps=cb.total_steps, weights=full_weights(learn),
                last_overflow=cb.last_overflow and cb.last_overflow.param)

def shard(learn): return learn.to_fsdp() if WORLD > 1 else learn
def ddp(learn): return learn.distrib_ctx(sync_bn=False, cpu=True) if WORLD > 1 else learn.no_logging()

# ---- DDP: 16-bit gradient communication
def ddp_run(path, precision, cb=None, counted=False):
    learn = learner(path, precision)
    learn.add_cbs([c for c in (cb, CountedDDP() if counted else None) if c is not None])
    with ddp(learn), Sent() as sent: fit(learn)
    return dict(log(learn), bytes_per_step=sent.all_reduce / learn.mixed_precision.total_steps)

def ddp_fp32(path): return ddp_run(path, lambda l: l.to_bf16(), counted=True)
def ddp_master(path): return ddp_run(path, lambda l: l.to_fp16(master=True), counted=True)
def ddp_pure(path): return ddp_run(path, lambda l: l.to_bf16(pure=True), counted=True)
def ddp_bf16(path): return ddp_run(path, lambda l: l.to_bf16(comm='bf16'))
def ddp_fp16(path): return ddp_run(path, lambda l: l.to_fp16(init_scale=2.**8, growth_interval=3, comm='fp16'))
# 4e4 on each rank fits fp16 (max 65504); their sum does not: an overflow of the compressed all-reduce alone
def ddp_fp16_sum(path): return ddp_run(path, lambda l: l.to_fp16(init_scale=2.**8, comm='fp16'), cb=InjectGrad([3], 4e4))
def ddp_fp32_sum(path): return ddp_run(path, lambda l: l.to_fp16(init_scale=2.**8), cb=InjectGrad([3], 4e4))

def ddp_lifecycle(path):
    "One hook a DDP model: fastai wraps a new one every fit (two epochs; one epoch; a validate between); its dtype set back after each"
    learn,calls = learner(path, lambda l: l.to_bf16(comm='bf16')),[]
    register = nn.parallel.DistributedDataParallel.register_comm_hook
    nn.parallel.DistributedDataParallel.register_comm_hook = lambda self, *a: (calls.append(a[0]), register(self, *a))[1]
    try:
        with ddp(learn), Sent() as sent: fit(learn, 2); learn.validate(); fit(learn, 1)
    finally: nn.parallel.DistributedDataParallel.register_comm_hook = register
    steps = learn.mixed_precision.total_steps
    return dict(hooks=len(calls), dtypes_after=[str(s.dtype) for s in calls], bytes=sent.all_reduce, steps=steps)

# ---- FSDP2
def fsdp_run(path, precision, cb=None, opt_func=partial(SGD, mom=.9), n=8):
    learn,inf = shard(learner(path, precision, opt_func)),LocalInf()
    learn.add_cbs([inf] + ([cb] if cb else []))
    seen = set()
    learn.model[0].register_forward_pre_hook(lambda m,i: seen.add(str(m.weight.dtype)))  # after FSDP2's all-gather
    with Sent() as sent: fit(learn, n)
    ps = list(learn.model.parameters())
    kinds = lambda ts: sorted({f'{type(t).__name__} {t.dtype}' for t in ts if t is not None})
    return dict(log(learn), local_inf=inf.seen, compute=sorted(seen), params=kinds(ps), grads=kinds(p.grad for p in ps),
                gathered=sorted(sent.gather), scattered=sorted(sent.scatter))

def fsdp_bf16(path): return fsdp_run(path, lambda l: l.to_bf16())
def fsdp_fp16(path): return fsdp_run(path, lambda l: l.to_fp16(init_scale=2.**8, growth_interval=3), Arm([3], rank=WORLD - 1))
def fsdp_master(path):
    return fsdp_run(path, lambda l: l.to_fp16(loss_scale=2.**8, dynamic=True, growth_interval=3), Arm([3], rank=WORLD - 1))
def fsdp_master_bf16(path): return fsdp_run(path, lambda l: l.to_bf16(master=True))

OPTS = dict(sgd=partial(SGD, mom=.9), adam=Adam, radam=RAdam, qhadam=QHAdam, lamb=Lamb, rmsprop=RMSProp,
            adamw_torch=partial(OptimWrapper, opt=torch.optim.AdamW))
LOOPED = dict(larc=Larc, ranger=ranger)  # mpx's fused Larc and Lookahead steps refuse DTensors: fastai's loop (fused=False)

def fsdp_opts(path):
    res = {k: fsdp_run(path, lambda l: l.to_bf16(), opt_func=o, n=3)['weights'] for k,o in OPTS.items()}
    return dict(res, **{k: fsdp_run(path, lambda l: l.to_bf16(fused=False), opt_func=o, n=3)['weights'] for k,o in LOOPED.items()})

class ValidateInside(Callback):
    "A `validate` nested in the fit, after its first epoch (fastai's `DistributedTrainer` fails on one: it unwraps DDP twice)"
    order,done = 100,False
    def after_epoch(self):  # `validate` runs `after_epoch` too
        if not self.done: self.done = True; self.learn.validate()

def fsdp_lr_find(path):
    "lr_find leaves the weights and the optimizer as they were, on every rank; then fit_one_cycle, with a validate nested in it"
    learn = shard(learner(path, lambda l: l.to_bf16()))
    fit(learn, 2)
    before,state = full_weights(learn),opt_state(learn)
    find_lr(learn, 10)
    after,same_opt = full_weights(learn),opt_state(learn) == state
    fit(learn, 4, 'fit_one_cycle', cbs=ValidateInside())
    return dict(restored=before == after, same_opt=same_opt, weights=full_weights(learn), files=sorted(os.listdir(path/'models')))

def fsdp_opt_state(path):
    "A sharded learner switched to low-bit optimizer state: its fit refused before anything changes; switched back, it trains"
    learn = shard(learner(path, lambda l: l.to_bf16(), Adam))
    fit(learn, 2)
    before,state = full_weights(learn),opt_state(learn)
    learn.to_bf16(opt_state='8bit')
    err = None
    try: fit(learn, 2)
    except ValueError as e: err = str(e)
    unchanged = full_weights(learn) == before and opt_state(learn) == state
    fit(learn.to_bf16(), 2)
    kinds = sorted({f'{type(v).__name__} {v.dtype}' for s in learn.opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)})
    return dict(err=err, unchanged=unchanged, steps=learn.mixed_precision.total_steps, state=kinds)

def ckpt(l): return l.to_fp16(init_scale=2.**8, growth_interval=3)

def fsdp_ckpt(path):
    "Load the 1-process checkpoint 'one' into a sharded learner, train on, and save 'two' for one process to load (1 process: 'two_one')"
    learn = shard(learner(path, ckpt, Adam)).load('one')
    cb = learn.mixed_precision
    grad_avg = full(learn.opt.state[first(learn.model.parameters())]['grad_avg']).flatten().tolist()
    loaded = dict(weights=full_weights(learn), loss_scale=cb.loss_scale, scales=cb.scales, grad_avg=grad_avg)
    fit(learn, 3)
    learn.save('two' if WORLD > 1 else 'two_one')
    return dict(loaded=loaded, **log(learn))

def one_ckpt(path):
    "The checkpoint 'one' the 2-process run loads: three steps in one process"
    learn = fit(learner(path, ckpt, Adam), 3)
    learn.save('one')
    return log(learn)

class RaiseAt(Callback):
    "Raise on every rank after the training batch `at` of the fit (an error in a user's callback)"
    def __init__(self, at): self.at,self.i = at,0
    def after_batch(self):
        if not self.training: return
        self.i += 1
        if self.i == self.at: raise RuntimeError('planted')

def fsdp_raises(path):
    "A fit cut by an exception on every rank: the learner's loaders as they were, and a fit after it"
    learn = shard(learner(path, lambda l: l.to_bf16()))
    try: fit(learn, 8, cbs=RaiseAt(3))
    except RuntimeError as e: err = str(e)
    loaders = [type(dl).__name__ for dl in learn.dls.loaders]
    fit(learn, 2)
    return dict(log(learn), err=err, loaders=loaders)

CASES = dict(ddp_fp32=ddp_fp32, ddp_master=ddp_master, ddp_pure=ddp_pure, ddp_bf16=ddp_bf16, ddp_fp16=ddp_fp16, ddp_fp16_sum=ddp_fp16_sum,
             ddp_fp32_sum=ddp_fp32_sum, ddp_lifecycle=ddp_lifecycle, fsdp_bf16=fsdp_bf16, fsdp_fp16=fsdp_fp16, fsdp_master=fsdp_master,
             fsdp_master_bf16=fsdp_master_bf16, fsdp_opts=fsdp_opts, fsdp_lr_find=fsdp_lr_find, fsdp_ckpt=fsdp_ckpt, one_ckpt=one_ckpt,
             fsdp_opt_state=fsdp_opt_state, fsdp_raises=fsdp_raises)

def main(out, *cases):
    for case in cases:
        path = Path(out)/case
        path.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        res = CASES[case](Path(out).parent/'ckpt' if 'ckpt' in case else path)  # one checkpoint folder for the 1- and 2-process runs
        (path/f'rank{RANK}.json').write_text(json.dumps(dict(res, seconds=time.perf_counter() - t)))
        if WORLD > 1: dist.barrier()

if __name__ == '__main__': main(*sys.argv[1:])
