"""Fused optimizer steps (`mpx.fused`) against fastai's per-parameter loop, on the CPU.

1. Aten ops one optimizer step dispatches (counted with `CountOps`, a `TorchDispatchMode`; on a GPU each is a kernel
   launch) at 10, 100 and 1000 parameter tensors, for SGD with momentum, Adam, RAdam and ranger (ranger: the mean over
   its 6-step Lookahead cycle, one slow-weight sync included). Target: fused at most 2% of the loop at 1000 tensors.
   Also the fused Adam step with the bulk pure-bf16 widen/fold hooks (`bf16_hooks`), Kahan and stochastic.
2. Time of one optimizer step, and of one whole training batch through a fastai `Learner`, on 200 `Linear(64, 64)`
   layers (400 tensors) with Adam: fused against the loop, interleaved rounds, the median of paired ratios. Target: 2x.

Run: `.venv/bin/python bench/fused.py` (one thread by default; `BENCH_THREADS=n` for more)."""
import sys, statistics
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from _common import *
from mpx.fused import FusedSteps, CountOps, bf16_hooks

def cpu_flags() -> str:
    "The CPU flags that decide low-precision speed, from /proc/cpuinfo"
    try: flags = set(next(l for l in open('/proc/cpuinfo') if l.startswith('flags')).split(':', 1)[1].split())
    except (OSError, StopIteration): return 'unknown'
    keep = ['avx2', 'fma', 'f16c', 'avx512f', 'avx512_bf16', 'avx512_fp16', 'amx_bf16', 'amx_tile']
    return ' '.join(f if f in flags else f'no-{f}' for f in keep)

OPTS = {'SGD mom': partial(SGD, mom=.9), 'Adam': Adam, 'RAdam': RAdam, 'ranger': ranger}

def _params(n, numel=64, seed=0):
    "`n` parameter tensors of `numel` elements with gradients"
    g = torch.Generator().manual_seed(seed)
    ps = [nn.Parameter(torch.randn(numel, generator=g)) for _ in range(n)]
    for p in ps: p.grad = torch.randn(numel, generator=g) * 1e-2
    return ps

def ops_per_step(opt_func, n, fused, warm=10, k=6) -> float:
    "Mean aten ops of `k` consecutive steps after `warm` ones (RAdam rectified by then) on `n` tensors"
    opt = opt_func(_params(n), lr=1e-3)
    if fused: FusedSteps(opt)
    for _ in range(warm): opt.step()
    with CountOps() as c:
        for _ in range(k): opt.step()
    return c.n / k

def _num(x) -> str: return f'{x:.1f}'.removesuffix('.0')

def count_table(sizes=(10, 100, 1000)):
    rows = []
    for name,f in OPTS.items():
        for n in sizes:
            loop,fused = ops_per_step(f, n, False),ops_per_step(f, n, True)
            rows.append([name, n, _num(loop), _num(fused), f'{100*fused/loop:.2f}%'])
    table(['optimizer', 'tensors:', 'loop ops/step:', 'fused ops/step:', 'fused/loop:'], rows)

def bf16_ops(update, n, warm=3) -> int:
    "Aten ops of one fused Adam step on `n` bf16 tensors through `bf16_hooks` (Kahan: a bf16 compensation each; else stochastic)"
    ps = [nn.Parameter(p.detach().bfloat16()) for p in _params(n)]
    for p,q in zip(ps, _params(n)): p.grad = q.grad.bfloat16()
    comp = {p: torch.zeros_like(p) for p in ps} if update == 'kahan' else {}
    opt = Adam(ps, lr=1e-3)
    FusedSteps(opt, *bf16_hooks(comp, gen=torch.Generator().manual_seed(0)))
    for _ in range(warm): opt.step()
    with CountOps() as c: opt.step()
    return c.n

def bf16_table(sizes=(10, 100, 1000)):
    rows = [[u, n, bf16_ops(u, n)] for u in ('kahan', 'stochastic') for n in sizes]
    table(['pure bf16 update (bulk widen/fold)', 'tensors:', 'fused Adam ops/step:'], rows)

def chain(n=200, width=64, seed=0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(n)])

def opt_step_timer(fused, k=20) -> callable:
    "A function timing `k` Adam steps on the 200-layer chain (gradients set once); seconds per step"
    m = chain()
    for p in m.parameters(): p.grad = torch.randn_like(p) * 1e-3
    opt = Adam(list(m.parameters()), lr=1e-4)
    if fused: FusedSteps(opt)
    def run():
        t = clock()
        for _ in range(k): opt.step()
        return (clock() - t) / k
    return run

class Fuse(Callback):
    "Fused steps for each fit, as a precision mode will install them"
    order = 50
    def before_fit(self): self.fs = FusedSteps(self.learn.opt)
    def after_fit(self): self.fs.undo()

def batch_timer(fused, n_batches=24) -> callable:
    "A function fitting one epoch of `n_batches` batches of 64 on the 200-layer chain with Adam; settled seconds per batch"
    batches = synth_batches((64, 64), n_out=64, n=n_batches)
    learn = learner(chain(), batches, cbs=[Fuse()] if fused else None, opt_func=Adam, lr=1e-4)
    return learner_step(learn)

def time_table(rounds=7):
    rows = []
    for what,make in (('optimizer step', opt_step_timer), ('training batch (fastai Learner, fp32)', batch_timer)):
        res = interleaved(dict(loop=make(False), fused=make(True)), rounds)
        rows.append([what, f"{med(res['loop'])*1e3:.2f}", f"{med(res['fused'])*1e3:.2f}", f"{ratio(res['loop'], res['fused']):.2f}x"])
    table(['200 Linear(64, 64), Adam', 'loop ms:', 'fused ms:', 'speed-up (paired median):'], rows)

if __name__ == '__main__':
    header('Fused optimizer steps vs fastai loop', f'CPU flags: {cpu_flags()}',
           'ops: aten ops dispatched per optimizer step (CountOps); 64-element tensors')
    count_table()
    bf16_table()
    time_table()
