"""GPU suite: a ResNet-style CNN (channels_last) and a small GPT in fp32, TF32, mpx bf16 (with and without its finite check)/fp16/master
fp16/pure bf16 (kahan, stochastic), fastai 2.8's `MixedPrecision` fp16/bf16 and raw PyTorch AMP loops: step time, throughput,
MFU against the dense bf16 peak, peak memory. Also, on the same device: the master mode's per-step bookkeeping against fastai's legacy
helpers (`master_bookkeeping.py`'s steps, fused steps off and on), the host syncs per optimizer step of every mode (`syncs.py`'s count),
fused against per-parameter steps with fastai's `Adam` (CNN at batch 64, GPT; AMP bf16, master fp16, pure kahan and stochastic),
fp8 (`learn.to_fp8`, tensorwise and rowwise, eager and `torch.compile`d) against bf16 on an MLP-heavy model and the GPT, low-bit
optimizer state (`opt_state`, compiled AMP bf16 and pure kahan, fastai's Adam: each state's step time against fp32 state's, and its
peak memory), issue 48's comparisons (bench/step.py's arms on the MLP and the GPT: mpx AMP bf16 and pure kahan, eager and compiled,
against fastai + optimi's Kahan AdamW on a bf16 model; and `--chain`'s fits of 200 small layers, fused steps against fastai's loop),
and the GPT's steps under `torch.profiler` (kernels, GPU time, host syncs) for mpx bf16, fastai's bf16 and the raw loop.
`--only` picks sections.

Without CUDA it prints one line and exits 0 (`make bench` runs every bench/*.py); `--smoke` runs it in miniature on the CPU
to check the code paths (fp8 is emulated there: its rows show only the emulation's overhead). The main table's modes train their own
copy of one model with `torch.optim.AdamW` (wrapped in fastai's `OptimWrapper` in the learners), on prebatched synthetic data already
on the GPU, without validation. Times are the training epochs' steps after their first three (an epoch's set-up and its first
launches, and a compiled model's compilation), between two `torch.cuda.synchronize()`s, learners and raw loops alike, in interleaved
rounds: medians, and ratios the median of the rounds' paired ratios; TF32 is off in every mode but 'tf32'. Peak memory (main table
only) is `torch.cuda.max_memory_allocated()` over one fit of each mode run alone, less what was allocated before its model was built
(the data). FLOPs per step are counted once with `torch.utils.flop_counter.FlopCounterMode` (fp32, so fp8 rows show bf16-equivalent
TFLOP/s).

On a GPU machine with PyTorch but without fastai or a network (as the project's lent H100/H200 machines are):
    here:  bash bench/gpu_wheels.sh          # wheels: fastai, the pure-Python packages it needs that the image lacks, torchao, optimi
    carry `bench/wheels` with the working tree (it ignores itself in git), then there:
           python3 -m pip install -q --no-index --no-deps --target /tmp/site bench/wheels/*.whl && export PYTHONPATH=/tmp/site:$PWD
           cd bench && python3 gpu.py --plots $OUT --rounds 3 --only book,syncs,fused,fp8   # ~300 s on an H100
           python3 gpu.py --plots $OUT --rounds 3 --only main,profile                         # ~270 s
           python3 gpu.py --rounds 5 --only lowbit                                           # not yet timed on a GPU
           python3 gpu.py --rounds 5 --only optimi,chain                                     # not yet timed on a GPU
The default batch sizes leave room on an 80 GB H100 for every mode's copy of the model to stay resident."""
import argparse, gc, sys, textwrap, time
import torch
if __name__ == '__main__' and not torch.cuda.is_available() and '--smoke' not in sys.argv:
    print("bench/gpu.py: skipped, no CUDA device (run it on a GPU machine, as its docstring says)"); sys.exit(0)
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode
from _common import *
import mpx.fp8  # `learn.to_fp8`; torchao is imported on first use only
import mpx.compiled  # `_failed`: why a compiled step fell back to eager steps
from step import BF16Model, ADAM_KW, chain_model  # bench/step.py's arms of issue 48, on this device
from copy import deepcopy

DEV,N_BATCHES,SKIP = 'cuda',16,3  # `--smoke`: 'cpu',3,1. The first SKIP steps of an epoch are not timed
PEAKS = [('H100 PCIe', 756.), ('H100', 989.4), ('H200', 989.4), ('H800', 989.4), ('GH200', 989.4), ('A100', 312.), ('L40S', 362.), ('A10', 125.), ('L4', 121.)]  # dense bf16 TFLOP/s

def peak_tflops(name) -> float:
    "The dense bf16 peak (TFLOP/s) of the GPU called `name`, nan if unknown"
    return next((p for k,p in PEAKS if k in name), float('nan'))

class BasicBlock(Module):
    "ResNet's basic block: two 3x3 conv-BN, a projection shortcut where the shape changes"
    def __init__(self, ni, nf, stride=1):
        self.convs = nn.Sequential(nn.Conv2d(ni, nf, 3, stride, 1, bias=False), nn.BatchNorm2d(nf), nn.ReLU(inplace=True), nn.Conv2d(nf, nf, 3, 1, 1, bias=False), nn.BatchNorm2d(nf))
        self.short = nn.Identity() if ni == nf and stride == 1 else nn.Sequential(nn.Conv2d(ni, nf, 1, stride, bias=False), nn.BatchNorm2d(nf))
    def forward(self, x): return F.relu(self.convs(x) + self.short(x))

def resnet(widths=(64, 128, 256, 512), depth=2, n_out=1000) -> nn.Module:
    "A ResNet-18-style CNN (`depth` blocks per stage) in channels_last"
    layers,ni = [nn.Conv2d(3, widths[0], 7, 2, 3, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)],widths[0]
    for i,nf in enumerate(widths):
        for j in range(depth): layers.append(BasicBlock(ni, nf, 2 if i and not j else 1)); ni = nf
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(ni, n_out)).to(memory_format=torch.channels_last)

class Block(Module):
    "A pre-norm transformer block: causal self-attention (`scaled_dot_product_attention`) and a 4x GELU MLP"
    def __init__(self, d, n_head):
        self.n_head,self.ln1,self.qkv,self.proj = n_head,nn.LayerNorm(d),nn.Linear(d, 3*d),nn.Linear(d, d)
        self.ln2,self.mlp = nn.LayerNorm(d),nn.Sequential(nn.Linear(d, 4*d), nn.GELU(), nn.Linear(4*d, d))
    def forward(self, x):
        B,T,C = x.shape
        q,k,v = self.qkv(self.ln1(x)).view(B, T, 3, self.n_head, C//self.n_head).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))

class GPT(Module):
    "A GPT-2-small-style language model: token and position embeddings, `n_layer` blocks, a final norm and an untied head"
    def __init__(self, vocab=50304, d=768, n_layer=12, n_head=12, seq=1024):
        self.tok,self.pos = nn.Embedding(vocab, d),nn.Embedding(seq, d)
        self.blocks,self.ln,self.head = nn.Sequential(*[Block(d, n_head) for _ in range(n_layer)]),nn.LayerNorm(d),nn.Linear(d, vocab, bias=False)
    def forward(self, idx): return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device)))))

def cnn_case(bs, smoke):
    "The CNN, its batches (3x224x224 images, 1000 classes), what a sample is, and a label"
    model,size = (resnet((8, 16, 32, 64), 1, 10), 32) if smoke else (resnet(), 224)
    xs = [(x.contiguous(memory_format=torch.channels_last), y) for x,y in synth_batches((bs, 3, size, size), 10 if smoke else 1000, n=N_BATCHES)]
    return model, xs, 'img', f"ResNet-18-style, {size}px, bs {bs}"

def gpt_case(bs, smoke):
    "The GPT, its batches (random tokens, next-token targets), what a sample is, and a label"
    kw = dict(vocab=128, d=64, n_layer=2, n_head=4, seq=32) if smoke else dict()
    model,g = GPT(**kw),torch.Generator().manual_seed(0)
    V,T = kw.get('vocab', 50304),kw.get('seq', 1024)
    toks = [torch.randint(0, V, (bs, T+1), generator=g) for _ in range(N_BATCHES)]
    return model, [(t[:, :-1], t[:, 1:]) for t in toks], 'tok', f"GPT {kw.get('n_layer', 12)}x{kw.get('d', 768)}, bs {bs}x{T}"

def sync():
    "Wait for the GPU's queued work (nothing to wait for on the CPU)"
    if DEV == 'cuda': torch.cuda.synchronize()

class CudaTimer(Callback):
    "Seconds per training step of a fit's training epoch from step `SKIP` on (no set-up, no first launches), synchronised at both ends"
    order = -100
    def before_batch(self):
        if self.training and self.iter == SKIP: sync(); self.t0 = time.perf_counter()
    def after_train(self): sync(); self.per_step = (time.perf_counter() - self.t0) / (self.n_iter - SKIP)

def raw_loop(model, batches, loss_func, dtype=None, fused=False) -> callable:
    "A function running the raw PyTorch AMP loop (autocast to `dtype`, a `GradScaler` for fp16, torch's AdamW, `fused` or not)"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused or None)
    scaler = torch.amp.GradScaler(DEV, enabled=dtype == torch.float16)
    def run():
        for i,(xb,yb) in enumerate(batches):
            if i == SKIP: sync(); t0 = time.perf_counter()  # timed as `CudaTimer` times a learner
            with torch.autocast(DEV, dtype=dtype, enabled=dtype is not None): loss = loss_func(model(xb), yb)
            scaler.scale(loss).backward(); scaler.step(opt); scaler.update(); opt.zero_grad()
        sync(); return (time.perf_counter() - t0) / (len(batches) - SKIP)
    return run

adamw = partial(OptimWrapper, opt=torch.optim.AdamW)
fused_adamw = partial(OptimWrapper, opt=partial(torch.optim.AdamW, fused=True))

def _host_read(l):
    "`to_bf16()` whose host reads each step's finite check (mpx before issue 67): the device path's reference"
    l.to_bf16()
    l.mixed_precision.skip_on_device = False
    return l

MODES = {  # name: (what makes a learner's precision, or the raw loop's autocast dtype), TF32 on[, the learner's optimizer]
    # the learners step torch's AdamW (wrapped) unless a third entry says otherwise: the 'Adam' modes step fastai's Adam, which
    # mpx's engine steps over flat buffers (eagerly, or in one compiled kernel)
    'fp32': (lambda l: l, False), 'tf32': (lambda l: l, True),
    'mpx bf16': (lambda l: l.to_bf16(), False), 'mpx bf16 check_finite=False': (lambda l: l.to_bf16(check_finite=False), False),
    'mpx fp16': (lambda l: l.to_fp16(), False),
    'mpx pure bf16 kahan': (lambda l: l.to_bf16(pure=True, update='kahan'), False),
    'mpx pure bf16 stochastic': (lambda l: l.to_bf16(pure=True, update='stochastic'), False),
    'fastai fp16': (lambda l: l.add_cb(ffp16.MixedPrecision()), False), 'fastai bf16': (lambda l: l.add_cb(ffp16.MixedPrecision(amp_mode='bf16')), False),
    'mpx bf16 Adam': (lambda l: l.to_bf16(), False, Adam), 'mpx bf16 Adam compile': (lambda l: l.to_bf16(fused='compile'), False, Adam),
    'mpx pure kahan Adam compile': (lambda l: l.to_bf16(pure=True, fused='compile'), False, Adam),
    # issue 67: a learner's default optimizer (fastai's Adam) under fastai's own callbacks and mpx's, the verdict on the device
    # or read by the host; torch's fused AdamW, which takes the verdict as `GradScaler` hands it; pure stochastic compiled
    'fastai bf16 Adam': (lambda l: l.add_cb(ffp16.MixedPrecision(amp_mode='bf16')), False, Adam),
    'fastai fp16 Adam': (lambda l: l.add_cb(ffp16.MixedPrecision()), False, Adam),
    'mpx fp16 Adam': (lambda l: l.to_fp16(), False, Adam), 'mpx bf16 Adam host read': (_host_read, False, Adam),
    'mpx bf16 Adam DeviceLosses': (lambda l: l.add_cb(DeviceLosses()).to_bf16(), False, Adam),  # the recorder's reads spared too
    'fastai bf16 Adam DeviceLosses': (lambda l: l.add_cb(DeviceLosses()).add_cb(ffp16.MixedPrecision(amp_mode='bf16')), False, Adam),
    'mpx bf16 fused AdamW': (lambda l: l.to_bf16(), False, fused_adamw),
    'fastai bf16 fused AdamW': (lambda l: l.add_cb(ffp16.MixedPrecision(amp_mode='bf16')), False, fused_adamw),
    'mpx pure stochastic Adam compile': (lambda l: l.to_bf16(pure=True, update='stochastic', fused='compile'), False, Adam),
    'raw AMP bf16 loop': (torch.bfloat16, False), 'raw AMP fp16 loop': (torch.float16, False),
    'raw AMP bf16 loop fused AdamW': ((torch.bfloat16, True), False),
}
KEEP = ('fp32', 'raw AMP bf16 loop', 'raw AMP fp16 loop')  # the references of the ratios: kept by every `--modes`

def set_tf32(on):
    "Let fp32 matmuls and convolutions use TF32 tensor cores, or not"
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = on

def build(name, model, batches, loss_func):
    "Mode `name` on its own copy of `model`: a function timing one epoch (seconds per step) and its learner, if any"
    how,tf32,*opt = MODES[name]
    m = deepcopy(model).to(DEV)
    if isinstance(how, tuple): learn,run = None,raw_loop(m, batches, loss_func, *how)
    elif isinstance(how, torch.dtype): learn,run = None,raw_loop(m, batches, loss_func, how)
    else:
        learn = how(learner(m, batches, cbs=CudaTimer(), opt_func=opt[0] if opt else adamw, lr=1e-4, loss_func=loss_func, device=DEV))
        run = lambda: fit_quiet(learn).cuda_timer.per_step
    def timed(): set_tf32(tf32); return run()
    return timed, learn

def peak_memory(name, model, batches, loss_func) -> float:
    "GiB at the peak of one fit of mode `name` run alone, less what was allocated before (the data); nan off CUDA"
    return peak_of(lambda: build(name, model, batches, loss_func)[0])  # the timing function holds the learner

def peak_of(make) -> float:
    "GiB at the peak of one timed fit of the timer `make` builds, run alone, less what was allocated before; nan off CUDA"
    cuda = DEV == 'cuda'
    if cuda: gc.collect(); torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    run = make(); run(); res = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else float('nan')
    del run; gc.collect()
    if cuda: torch.cuda.empty_cache()
    return res

def step_flops(model, batches, loss_func) -> float:
    "FLOPs of one fp32 forward and backward pass on the first batch"
    m,(xb,yb) = deepcopy(model).to(DEV),batches[0]
    with FlopCounterMode(display=False) as fc: loss_func(m(xb), yb).backward()
    return fc.get_total_flops()

def skipped(learn) -> str:
    "Skipped steps of an mpx fp16 learner, over its timed fits"
    cb = first(c for c in (learn.cbs if learn else []) if isinstance(c, (MixedPrecision, MasterPrecision)))
    return f"{cb.skipped_steps}/{cb.total_steps}" if cb is not None and cb.amp_mode is AMPMode.FP16 else ''

def failure(e) -> str:
    "An exception as one short line: its type and the first line of its message"
    lines = [l.strip() for l in str(e).splitlines() if l.strip() and not l.startswith('Exception occured in')]
    return f"{type(e).__name__}: {(lines or [''])[0][:200]}"

def measure(case, bs, smoke, rounds, modes=tuple(MODES)) -> tuple:
    "Every mode's peak memory (a mode whose fit fails is left out, its error kept), then their interleaved timings, for one model"
    model,cpu_batches,unit,label = case(bs, smoke)
    batches,loss_func = [(x.to(DEV), y.to(DEV)) for x,y in cpu_batches],CrossEntropyLossFlat()
    flops,mem,failed = step_flops(model, batches, loss_func),{},{}
    for k in modes:
        try: mem[k] = peak_memory(k, model, batches, loss_func)
        except Exception as e: failed[k] = failure(e); gc.collect()
    built = {k: build(k, model, batches, loss_func) for k in modes if k not in failed}
    t = interleaved({k: run for k,(run,_) in built.items()}, rounds)
    skips = {k: skipped(l) for k,(_,l) in built.items()}
    return label, dict(t=t, mem=mem, flops=flops, samples=batches[0][1].numel(), unit=unit, skipped=skips, failed=failed)

def rows(name, r, peak) -> list:
    "Table rows of one model: ms/step, throughput, speed-up against fp32, TFLOP/s, MFU, peak memory, skipped fp16 steps"
    f = r['t']['fp32']
    return [[name, k, f"{med(t)*1e3:.1f}", f"{r['samples']/med(t):,.0f} {r['unit']}/s", f"{ratio(f, t):.2f}x", f"{r['flops']/med(t)/1e12:.1f}", f"{r['flops']/med(t)/1e12/peak:.1%}",
             f"{r['mem'][k]:.2f}", r['skipped'][k]] for k,t in r['t'].items()]

def summary(name, t, failed:dict) -> list:
    "mpx against the raw loops (speed as a share of theirs), mpx bf16's speed-up over fp32 and TF32, pure bf16's over mpx bf16"
    def r(a, b, fmt, unit=''):
        if a in t and b in t: return format(ratio(t[a], t[b]), fmt) + unit
        return 'failed' if a in failed or b in failed else 'not run'  # `--modes` left it out
    return [name, r('fastai bf16 Adam', 'mpx bf16 Adam', '.2f', 'x'), r('fastai fp16 Adam', 'mpx fp16 Adam', '.2f', 'x'),
            r('fastai bf16 fused AdamW', 'mpx bf16 fused AdamW', '.2f', 'x'), r('fastai bf16', 'mpx bf16', '.2f', 'x'),
            r('mpx bf16 Adam host read', 'mpx bf16 Adam', '.2f', 'x'), r('mpx bf16 Adam', 'mpx bf16 Adam DeviceLosses', '.2f', 'x'),
            r('fastai bf16 Adam', 'fastai bf16 Adam DeviceLosses', '.2f', 'x'),
            r('raw AMP bf16 loop', 'mpx bf16', '.1%'), r('raw AMP bf16 loop', 'mpx bf16 check_finite=False', '.1%'),
            r('raw AMP fp16 loop', 'mpx fp16', '.1%'),
            r('raw AMP bf16 loop fused AdamW', 'mpx bf16 Adam compile', '.1%'),
            r('mpx bf16 Adam compile', 'mpx pure kahan Adam compile', '.2f', 'x'),
            r('fp32', 'mpx bf16', '.2f', 'x'), r('tf32', 'mpx bf16', '.2f', 'x'),
            r('mpx bf16', 'mpx pure bf16 kahan', '.2f', 'x')]

def bookkeeping(sizes=(100, 1000), numel=1024, rounds=7, k=5) -> list:
    "`master_bookkeeping.py`'s fastai and mpx steps (fastai's SGD; mpx fused and per-parameter) on `DEV`, timed between two syncs: rows"
    import master_bookkeeping as mb
    def mpx_setup(n, numel, flat, fused):  # `mb.mpx_setup`, the callback's fit state (and fused steps) begun as `before_fit` begins them
        learn,cb = mb.make_learner(n, numel),MasterPrecision(loss_scale=mb.SCALE, fused=fused)
        learn.add_cb(cb); cb._begin_fit()
        give = mb.grad_source(list(learn.model.parameters()))
        def step(): give(); cb.after_backward(); cb.before_step(); cb.after_step(); learn.opt.zero_grad()
        return step
    res = []
    for n in sizes:
        for flat in (False, True):
            with torch.device(DEV):
                steps = dict(fastai=mb.fastai_setup(n, numel, flat), loop=mpx_setup(n, numel, flat, False),
                             fused=mpx_setup(n, numel, flat, True))
            def timed(step):
                sync(); t0 = time.perf_counter()
                for _ in range(k): step()
                sync(); return (time.perf_counter() - t0) / k
            t = interleaved({name: partial(timed, st) for name,st in steps.items()}, rounds)
            res.append([n, flat, f"{med(t['fastai'])*1e3:.3f}", f"{med(t['loop'])*1e3:.3f}", f"{ratio(t['fastai'], t['loop']):.1f}x",
                        f"{med(t['fused'])*1e3:.3f}", f"{ratio(t['fastai'], t['fused']):.1f}x",
                        mb.syncs(steps['fastai']), mb.syncs(steps['fused'])])
    return res

SYNC_MODES = {  # name: the precision callback whose host syncs per optimizer step are counted
    'mpx AMP fp16': lambda: MixedPrecision('fp16'), 'mpx AMP bf16': lambda: MixedPrecision('bf16'),
    'mpx AMP bf16, check_finite=False': lambda: MixedPrecision('bf16', check_finite=False),
    'mpx master fp16': lambda: MasterPrecision('fp16'),
    'mpx master bf16': lambda: MasterPrecision('bf16'), 'mpx pure bf16 kahan': lambda: PureBF16(update='kahan'),
    'mpx pure bf16 stochastic': lambda: PureBF16(update='stochastic'),
    'fastai AMP fp16': lambda: ffp16.MixedPrecision(), 'fastai AMP bf16': lambda: ffp16.MixedPrecision(amp_mode='bf16'),
}

def sync_counts(sizes=(10, 1000)) -> list:
    "Host syncs per optimizer step each mode adds on `DEV` (`syncs.py`'s count: a fit with the callback less one without): table rows"
    import syncs as sy
    def per_step(cb, n):
        learn = learner(sy.ManyParams(n), synth_batches((16, 8), 2, n=sy.N_BATCHES), device=DEV)
        base = sy.fit_syncs(learn)
        return (sy.fit_syncs(learn.add_cb(cb)) - base) / sy.N_BATCHES
    def cell(cb, n):
        try: return f"{per_step(cb, n):g}"
        except Exception as e: return f"fails: {failure(e)[:120]}"
    return [[k] + [cell(cb(), n) for n in sizes] for k,cb in SYNC_MODES.items()]

def timed_modes(makers:dict, rounds) -> tuple:
    "Make and warm up each mode's timing function (one that fails is left out, its error kept), then time them in interleaved rounds"
    runs,failed = {},{}
    for k,make in makers.items():
        try: f = make(); f(); runs[k] = f
        except Exception as e: failed[k] = failure(e); gc.collect()
    res = {k: [] for k in runs}
    for _ in range(rounds):
        for k,f in runs.items(): res[k].append(f())
    return res, failed

def learner_timer(model, batches, how, opt_func=adamw) -> callable:
    "A function timing one epoch (seconds per step) of a learner on its own copy of `model`, its precision set by `how`"
    learn = learner(deepcopy(model).to(DEV), batches, cbs=CudaTimer(), opt_func=opt_func, lr=1e-4, loss_func=CrossEntropyLossFlat(), device=DEV)
    learn = how(learn)
    return lambda: fit_quiet(learn).cuda_timer.per_step

def on_dev(batches) -> list: return [(x.to(DEV), y.to(DEV)) for x,y in batches]

FUSED_MODES = {  # name: what makes a learner train in that mode, its fastai optimizer stepped in bulk (`f=True`) or per parameter
    'mpx AMP bf16': lambda l,f: l.to_bf16(fused=f),
    # the callback added directly: at 171ac26 `to_bf16(pure=True)` refused `fused` (fixed on main since)
    'mpx pure bf16 kahan': lambda l,f: l.add_cb(PureBF16(update='kahan', fused=f)),
    'mpx pure bf16 stochastic': lambda l,f: l.add_cb(PureBF16(update='stochastic', fused=f)),
}

def fused_rows(cases, rounds) -> list:
    "Each mode with fastai's `Adam`, fused steps on against off, on each (case, batch size): table rows, and the failures"
    rows,fails = [],[]
    for case,bs in cases:
        model,batches,_,label = case(bs, DEV == 'cpu')
        batches = on_dev(batches)
        makers = {(k,f): partial(learner_timer, model, batches, partial(how, f=f), Adam)
                  for k,how in FUSED_MODES.items() for f in (False, True)}
        t,failed = timed_modes(makers, rounds)
        fails += [f"{label}: {k} fused={f}: {e}" for (k,f),e in failed.items()]
        for k in FUSED_MODES:
            if (k,False) in t and (k,True) in t:
                rows.append([label, k, f"{med(t[k,False])*1e3:.2f}", f"{med(t[k,True])*1e3:.2f}", f"{ratio(t[k,False], t[k,True]):.2f}x"])
        del makers; gc.collect()
        if DEV == 'cuda': torch.cuda.empty_cache()
    return rows, fails

def mlp_case(bs, smoke):
    "The MLP-heavy model: `n` Linear(d, d) layers with GELUs between them, d-feature inputs and d classes"
    d,n = (64, 4) if smoke else (4096, 8)
    model = nn.Sequential(*[m for _ in range(n) for m in (nn.Linear(d, d), nn.GELU())][:-1])
    return model, synth_batches((bs, d), d, n=N_BATCHES), 'sample', f"MLP {n}x Linear({d}, {d}), bs {bs}"

def compiled(learn, smoke):
    "`learn` with its model compiled (inductor; `aot_eager` in a smoke run, which only checks the code path)"
    learn.remove_cb(DtypeProbe)  # its forward hook removes itself mid-forward, which dynamo cannot trace
    learn.model = torch.compile(learn.model, backend='aot_eager' if smoke else 'inductor')
    return learn

def fp8_modes(smoke, compile_rowwise) -> dict:
    "name: what makes a learner train in that mode: bf16 and fp8 (tensorwise, rowwise), eager and compiled"
    c = partial(compiled, smoke=smoke)
    res = {'mpx bf16': lambda l: l.to_bf16(),
           'fp8 tensorwise': lambda l: l.to_fp8('tensorwise'), 'fp8 rowwise': lambda l: l.to_fp8('rowwise'),
           'mpx bf16 compiled': lambda l: c(l).to_bf16(), 'fp8 tensorwise compiled': lambda l: c(l).to_fp8('tensorwise')}
    if compile_rowwise: res['fp8 rowwise compiled'] = lambda l: c(l).to_fp8('rowwise')
    return res

def fp8_rows(cases, rounds, smoke) -> list:
    "fp8 against bf16 (eager and compiled, torch's AdamW) on each (case, batch size, compile rowwise too): table rows, and the failures"
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    rows,fails = [],[]
    for case,bs,crw in cases:
        model,batches,unit,label = case(bs, smoke)
        batches = on_dev(batches)
        flops,n = step_flops(model, batches, CrossEntropyLossFlat()),batches[0][1].numel()
        makers = {k: partial(learner_timer, model, batches, how) for k,how in fp8_modes(smoke, crw).items()}
        t0 = time.perf_counter()
        t,failed = timed_modes(makers, rounds)
        fails += [f"{label}: {k}: {e}" for k,e in failed.items()]
        r = lambda a,b: f"{ratio(t[a], t[b]):.2f}x" if a in t and b in t else ''
        for k,v in t.items():
            base = 'mpx bf16 compiled' if 'compiled' in k else 'mpx bf16'
            rows.append([label, k, f"{med(v)*1e3:.2f}", f"{n/med(v):,.0f} {unit}/s", f"{flops/med(v)/1e12:.1f}",
                         r('mpx bf16', k), r(base, k)])
        print(f"# {label}: fp8 modes timed in {time.perf_counter()-t0:.0f} s (compiles included)")
        del makers; gc.collect()
        if DEV == 'cuda': torch.cuda.empty_cache()
    return rows, fails

LOWBIT_MODES = {  # name: what makes a learner train in that mode with optimizer state `s`, compiled steps (issue 35's target)
    'mpx AMP bf16': lambda l,s: l.to_bf16(opt_state=s, fused='compile'),
    'mpx pure bf16 kahan': lambda l,s: l.to_bf16(pure=True, opt_state=s, fused='compile'),
}
LOWBIT_STATES = ('fp32', 'bf16', '8bit', '4bit')

def lowbit_rows(cases, rounds) -> list:
    "Each mode with fastai's `Adam`, compiled, its state in fp32, bf16, 8 and 4 bits, and eager with 8-bit state: table rows, failures"
    rows,fails = [],[]
    for case,bs in cases:
        model,batches,_,label = case(bs, DEV == 'cpu')
        batches = on_dev(batches)
        makers = {(k,s,'compile'): partial(learner_timer, model, batches, partial(how, s=s), Adam)
                  for k,how in LOWBIT_MODES.items() for s in LOWBIT_STATES}
        for k in LOWBIT_MODES:  # eager 8-bit state beside them, as the issue asks
            makers[k,'8bit','eager'] = partial(learner_timer, model, batches, lambda l,k=k: _eager8(l, k), Adam)
        mem = {}
        for key,make in makers.items():
            try: mem[key] = peak_of(make)
            except Exception as e: fails.append(f"{label}: {key}: {failure(e)}"); gc.collect()
        t,failed = timed_modes({key: m for key,m in makers.items() if key in mem}, rounds)
        fails += [f"{label}: {key}: {e}" for key,e in failed.items()]
        for (k,s,how),v in t.items():
            peer = t.get((k,'fp32','compile'))
            rows.append([label, k, s, how, f"{med(v)*1e3:.2f}", f"{ratio(peer, v):.2f}x" if peer else '', f"{mem[k,s,how]:.2f}"])
        del makers; gc.collect()
        if DEV == 'cuda': torch.cuda.empty_cache()
    return rows, fails

def _eager8(learn, k): return learn.to_bf16(pure=True, opt_state='8bit') if 'pure' in k else learn.to_bf16(opt_state='8bit')

OPTIMI = 'fastai + optimi kahan'
OPTIMI_MODES = {  # issue 48's mpx arms: name, what makes a learner train in that mode with fastai's `Adam`
    'mpx AMP bf16': lambda l: l.to_bf16(), 'mpx AMP bf16 compile': lambda l: l.to_bf16(fused='compile'),
    'mpx pure kahan': lambda l: l.to_bf16(pure=True), 'mpx pure kahan compile': lambda l: l.to_bf16(pure=True, fused='compile'),
    'mpx pure kahan bf16 state compile': lambda l: l.to_bf16(pure=True, fused='compile', opt_state='bf16'),  # optimi's state dtype
}
OPTIMI_TARGETS = [  # (issue 48's target, arm, reference arm, speed at least), as bench/step.py prints them
    ("compiled pure kahan >= 1.05x fastai + optimi kahan", 'mpx pure kahan compile', OPTIMI, 1.05),
    ("like for like: compiled pure kahan, bf16 state, >= 1.05x fastai + optimi kahan", 'mpx pure kahan bf16 state compile', OPTIMI, 1.05),
    ("compiled pure kahan >= 1.0x compiled AMP bf16", 'mpx pure kahan compile', 'mpx AMP bf16 compile', 1.0),
    ("eager pure kahan >= 0.95x eager AMP bf16", 'mpx pure kahan', 'mpx AMP bf16', 0.95),
]

def optimi_kahan() -> callable:
    "fastai's `opt_func` for optimi's `AdamW(kahan_sum=True)` with fastai Adam's hyper-parameters"
    try: import optimi
    except ImportError as e: raise ImportError(f"{e} (pip install --no-deps torch-optimi==0.3.3)") from e
    return partial(OptimWrapper, opt=partial(optimi.AdamW, kahan_sum=True, **ADAM_KW))

def bf16_model(learn):
    "`learn` training its model in bf16 with `BF16Model`: converted in place, before the fit makes its optimizer"
    learn.model.bfloat16()
    return learn.add_cb(BF16Model())

def optimi_rows(cases, rounds) -> tuple:
    "Issue 48's arms (mpx with fastai's `Adam`, fastai + optimi) on each (case, batch size): table rows, target rows, failures"
    rows,goals,fails = [],[],[]
    for case,bs in cases:
        model,batches,_,label = case(bs, DEV == 'cpu')
        batches = on_dev(batches)
        makers = {k: partial(learner_timer, model, batches, how, Adam) for k,how in OPTIMI_MODES.items()}
        makers[OPTIMI] = lambda: learner_timer(model, batches, bf16_model, optimi_kahan())  # imports optimi: a failure is this arm's
        t,failed = timed_modes(makers, rounds)
        fails += [f"{label}: {k}: {e}" for k,e in failed.items()]
        vs = lambda ref,k: f"{ratio(t[ref], t[k]):.2f}x" if ref in t else 'failed'
        rows += [[label, k, f"{med(v)*1e3:.2f}", vs(OPTIMI, k), vs('mpx AMP bf16', k)] for k,v in t.items()]
        for goal,a,b,lo in OPTIMI_TARGETS:
            s = ratio(t[b], t[a]) if a in t and b in t else None
            goals.append([label, goal, f"not measured: {a if a not in t else b} failed" if s is None else f"{s:.2f}x",
                          '' if s is None else 'yes' if s >= lo else 'no'])
        del makers; gc.collect()
        if DEV == 'cuda': torch.cuda.empty_cache()
    return rows, goals, fails

def chain_fits(rounds) -> dict:
    "bench/step.py's `--chain` on `DEV`: `fit(1)`s of 200 Linear(32, 32) (fastai's Adam, AMP bf16), fused=False and True; seconds a fit"
    batches = on_dev(synth_batches((64, 32), n_out=32, n=16))
    make = lambda: Learner(prebatched_dls(batches, DEV), chain_model().to(DEV), loss_func=CrossEntropyLossFlat(), opt_func=Adam, lr=1e-4)
    learns = {f: make().to_bf16(fused=f) for f in (False, True)}
    def timed(learn):
        sync(); t0 = time.perf_counter()
        fit_quiet(learn); sync()  # the fit's queued kernels are its time too
        return time.perf_counter() - t0
    return interleaved({f: partial(timed, l) for f,l in learns.items()}, rounds)

def profile_gap(bs, smoke) -> list:
    "Per training step of the GPT, under `torch.profiler`: kernels launched, their GPU time, host syncs, CPU time of the step's ops"
    from torch.profiler import profile, ProfilerActivity
    from torch.autograd import DeviceType
    model,batches,_,label = gpt_case(bs, smoke)
    batches,loss_func,rows = on_dev(batches),CrossEntropyLossFlat(),[]
    acts = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA]*(DEV == 'cuda')
    for k in ('raw AMP bf16 loop', 'mpx bf16 Adam', 'mpx bf16 Adam host read', 'mpx bf16 Adam DeviceLosses', 'fastai bf16 Adam',
              'mpx bf16 fused AdamW', 'mpx bf16',
              'fastai bf16'):
        run,learn = build(k, model, batches, loss_func); run(); run()
        with profile(activities=acts) as prof: run()
        ev,n = prof.key_averages(),len(batches)
        count = lambda *names: sum(e.count for e in ev if e.key in names) / n
        gpu = sum(e.self_device_time_total for e in ev if e.device_type == DeviceType.CUDA) / n / 1e3
        launches = count('cudaLaunchKernel', 'cuLaunchKernel', 'cudaLaunchKernelExC', 'cuLaunchKernelEx')
        syncs = count('cudaStreamSynchronize', 'cudaDeviceSynchronize', 'cudaEventSynchronize')
        rows.append([label, k, f"{launches:.0f}", f"{gpu:.1f}", f"{syncs:.2f}", f"{count('cudaMemcpyAsync'):.1f}",
                     f"{count('aten::item', 'aten::_local_scalar_dense'):.2f}"])
        if k == 'mpx bf16 Adam': top = ev.table(sort_by='self_cpu_time_total', row_limit=12, max_name_column_width=50)
        del run, learn; gc.collect()
    return rows, top

def plot(res, out, gpu_name):
    plt = plt_agg()
    fig,axs = plt.subplots(1, len(res), figsize=(8*len(res), 4.2), squeeze=False)
    for ax,(name,r) in zip(axs[0], res.items()):
        f = r['t']['fp32']
        colors = ['C2' if 'raw' in k else 'C1' if 'fastai' in k else 'C0' if 'mpx' in k else 'C7' for k in r['t']]
        bars = ax.bar(range(len(r['t'])), [ratio(f, t) for t in r['t'].values()], color=colors)
        ax.bar_label(bars, fmt='%.2fx', fontsize=7)
        ax.set_xticks(range(len(r['t'])), [textwrap.fill(k, 8, break_long_words=False) for k in r['t']], fontsize=6.5)
        ax.axhline(1, color='k', lw=.8); ax.set(title=name, ylabel='speed-up vs fp32')
    fig.suptitle(f"Training step speed-up, {gpu_name}", fontsize=9)
    savefig(fig, 'gpu_speedup', out)

SECTIONS = ['book', 'syncs', 'fused', 'fp8', 'lowbit', 'optimi', 'chain', 'main', 'profile']

def main(args):
    name = torch.cuda.get_device_name() if DEV == 'cuda' else f'CPU smoke run ({cpu_name()})'
    peak = peak_tflops(name) if DEV == 'cuda' else 1.
    header("GPU suite",
           f"device: {name}, CUDA {torch.version.cuda}, dense bf16 peak {peak:g} TFLOP/s (MFU = counted FLOPs / step time / peak)",
           f"{N_BATCHES} batches an epoch, the last {N_BATCHES-SKIP} timed, {args.rounds} interleaved rounds, medians; "
           f"sections: {args.only}")
    smoke,only,t0 = args.smoke,args.only.split(','),time.perf_counter()
    done = lambda what: print(f"# {what} done at {time.perf_counter()-t0:.0f} s\n")
    torch.backends.cudnn.benchmark = True
    if 'book' in only:
        rounds = 1 if smoke else 7
        print(f"# master-mode bookkeeping per step on {DEV}: 1024 elements per tensor, {rounds} interleaved rounds of 5 steps, medians;")
        print("# mpx with fused steps off (fastai's per-parameter zero_grad) and on (one _foreach_zero_)")
        table(['tensors:', ':flat:', 'fastai ms/step:', 'mpx fused=False ms/step:', 'speed-up:', 'mpx fused=True ms/step:', 'speed-up:',
               'fastai syncs/step:', 'mpx syncs/step:'], bookkeeping(rounds=rounds))
        done('bookkeeping')
    if 'syncs' in only:
        print(f"# host syncs per optimizer step on {DEV} (CountSyncs: a fit with the callback less one without, / steps)")
        table(['mode', '10 tensors:', '1000 tensors:'], sync_counts())
        done('syncs')
    if 'fused' in only:
        print(f"# fused steps against fastai's per-parameter loop: fastai's Adam (lr 1e-4), each mode fused=False and fused=True, "
              f"{args.rounds} rounds")
        rws,fails = fused_rows(((cnn_case, args.fused_cnn_bs), (gpt_case, args.gpt_bs)), args.rounds)
        table(['model', 'mode', 'fused=False ms/step:', 'fused=True ms/step:', 'speed-up (paired):'], rws)
        for f in fails: print(f"# failed: {f}")
        done('fused')
    if 'fp8' in only:
        emu = not mpx.fp8.real_fp8(DEV)
        if emu: print("# fp8 is EMULATED here (no fp8 kernels on this device): its rows show only the emulation's overhead, not fp8's speed")
        print(f"# fp8 (torchao Float8Linear, mpx's default filter: first and last Linear stay bf16) against bf16, torch's AdamW, "
              f"{args.rounds} rounds;"
              " compiled: torch.compile of the model before the precision is set")
        rws,fails = fp8_rows(((mlp_case, args.mlp_bs, True), (gpt_case, args.gpt_bs, False)), args.rounds, smoke)
        table(['model', 'mode', 'ms/step:', 'throughput:', 'TFLOP/s (bf16 count):', 'vs eager bf16:', 'vs bf16 (same compile):'], rws)
        for f in fails: print(f"# failed: {f}")
        done('fp8')
    if 'lowbit' in only:
        print(f"# optimizer state in fp32, bf16, 8 and 4 bits (`opt_state`), fastai's Adam (lr 1e-4), compiled steps (`fused='compile'`) "
              f"and eager 8-bit, {args.rounds} rounds; speed against the same mode with fp32 state (paired), which issue 35 wants "
              "at 0.9x or more for 8 bits; peak GiB of one fit run alone")
        cases = {'gpt': (gpt_case, args.gpt_bs), 'mlp': (mlp_case, args.lowbit_mlp_bs)}
        rws,fails = lowbit_rows([c for k,c in cases.items() if k in args.models.split(',')], args.rounds)
        table(['model', 'mode', 'opt_state', 'steps', 'ms/step:', 'vs fp32 state:', 'peak GiB:'], rws)
        for f in fails: print(f"# failed: {f}")
        done('lowbit')
    if 'optimi' in only:
        print(f"# issue 48: mpx (fastai's Adam, lr 1e-4) against a fastai Learner on a bf16 model stepped by optimi's "
              f"AdamW(kahan_sum=True) (fastai Adam's betas, eps and wd), {args.rounds} rounds; "
              "speed = the other arm's step time over this one's (paired)")
        rws,goals,fails = optimi_rows(((mlp_case, args.lowbit_mlp_bs), (gpt_case, args.gpt_bs)), args.rounds)
        table(['model', 'arm', 'ms/step:', f'vs {OPTIMI}:', 'vs mpx AMP bf16 (eager):'], rws)
        table(['model', 'target (issue 48)', 'measured:', 'met'], goals)
        for f in fails: print(f"# failed: {f}")
        fell_back = getattr(mpx.compiled, '_failed', {})  # a kernel that failed to compile steps eagerly: its arm is not what it says
        for why in fell_back.values(): print(f"# compiled arms step eagerly: {why}")
        done('optimi')
    if 'chain' in only:
        print(f"# issue 48, the engine's host work (bench/step.py --chain) on {DEV}: fit(1)s of 200 Linear(32, 32), "
              f"fastai's Adam (lr 1e-4), AMP bf16, 16 batches of 64 and a validation batch, {args.rounds} interleaved rounds after "
              "one untimed fit each, synchronised wall time; speed-up = the loop's fit time over the fused one's, "
              "the median of paired ratios")
        t = chain_fits(args.rounds)
        rws = [[f'fused={f}', f'{med(v)*1e3:.1f}', ' '.join(f'{x*1e3:.1f}' for x in v)] for f,v in t.items()]
        table(['arm', 'fit ms (median):', 'rounds ms'], rws)
        s = ratio(t[False], t[True])
        print(f"speed-up of fused=True (median of paired ratios): {s:.2f}x; target (issue 48) >= 1.5x: {'yes' if s >= 1.5 else 'no'}")
        done('chain')
    res = {}
    modes = [k for k in MODES if k in KEEP or not args.modes or any(m.strip() == k for m in args.modes.split(','))]
    if 'main' in only:
        cases = {'gpt': (gpt_case, args.gpt_bs), 'cnn': (cnn_case, args.cnn_bs)}
        for case,bs in [c for k,c in cases.items() if k in args.models.split(',')]:  # each model's table as soon as it is measured
            n,r = measure(case, bs, smoke, args.rounds, modes); res[n] = r
            table(['model', 'mode', 'ms/step:', 'throughput:', 'vs fp32:', 'TFLOP/s:', 'MFU:', 'peak GiB:', 'fp16 skipped/steps:'],
                  rows(n, r, peak))
            for k,e in r['failed'].items(): print(f"# {n}: {k} failed: {e}")
            done(n)
        table(['model', 'mpx bf16 Adam vs fastai bf16 Adam (>= 1.0x):', 'mpx fp16 Adam vs fastai fp16 Adam:',
               'mpx bf16 fused AdamW vs fastai bf16 fused AdamW:', 'mpx bf16 vs fastai bf16 (torch AdamW, host read):',
               'verdict on the device vs read by the host (mpx bf16 Adam):', 'DeviceLosses (mpx bf16 Adam):',
               'DeviceLosses (fastai bf16 Adam):',
               'mpx bf16 / raw bf16 loop speed:', 'mpx bf16 check_finite=False / raw bf16 loop:',
               'mpx fp16 / raw fp16 loop speed:', 'mpx bf16 Adam compile / raw loop fused AdamW (>= 95%):',
               'pure kahan Adam compile vs mpx bf16 Adam compile (>= 1.0x):',
               'mpx bf16 vs fp32:', 'mpx bf16 vs tf32:', 'pure kahan vs mpx bf16:'],
              [summary(n, r['t'], r['failed']) for n,r in res.items()])
        plot(res, args.plots, name)
    if 'profile' in only:
        print("# the GPT under torch.profiler, one epoch each after two warm ones, per training step (all its batches)")
        rws,top = profile_gap(args.gpt_bs, smoke)
        table(['model', 'mode', 'kernel launches:', 'GPU kernel ms:', 'host syncs (stream/device/event):', 'cudaMemcpyAsync:',
               'aten::item:'], rws)
        print("# mpx bf16 Adam, ops by self CPU time (the whole epoch):"); print(top)
        done('profile')

def parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--cnn-bs', type=int, default=256); p.add_argument('--gpt-bs', type=int, default=16)
    p.add_argument('--fused-cnn-bs', type=int, default=64); p.add_argument('--mlp-bs', type=int, default=8192)
    p.add_argument('--lowbit-mlp-bs', type=int, default=1024)
    p.add_argument('--rounds', type=int, default=5); p.add_argument('--plots', default=str(PLOTS), help='folder for gpu_speedup.png')
    p.add_argument('--only', default=','.join(SECTIONS), help=f"comma-separated sections to run, of {SECTIONS}")
    p.add_argument('--modes', default='', help=f"main's modes, comma-separated names of {list(MODES)} (default: all; {KEEP} always)")
    p.add_argument('--models', default='gpt,cnn,mlp', help="main's and lowbit's models, comma-separated: gpt, cnn (main), mlp (lowbit)")
    p.add_argument('--smoke', action='store_true', help='a miniature run on the CPU, to check the code paths')
    return p.parse_args()

if __name__ == '__main__':
    args = parse()
    DEV,N_BATCHES,SKIP = ('cpu', 3, 1) if args.smoke else ('cuda', 16, 3)
    if args.smoke: args.cnn_bs,args.gpt_bs,args.fused_cnn_bs,args.mlp_bs,args.lowbit_mlp_bs,args.rounds = 4,2,4,16,16,1
    s = time.perf_counter(); main(args); print(f"# {time.perf_counter()-s:.0f} s")
