"""Fused optimizer steps (`mpx.fused`) against fastai's per-parameter loop, on the CPU.

1. Aten ops one optimizer step dispatches (counted with `CountOps`, a `TorchDispatchMode`; on a GPU each is a kernel
   launch) at 10, 100 and 1000 parameter tensors, for SGD with momentum, Adam, RAdam and ranger (ranger: the mean over
   its 6-step Lookahead cycle, one slow-weight sync included). Target: fused at most 2% of the loop at 1000 tensors.
   Also the fused Adam step in pure bf16's storage kinds (widen, step, fold), Kahan and stochastic.
2. Time of one optimizer step, and of one whole training batch through a fastai `Learner`, on 200 `Linear(64, 64)`
   layers (400 tensors) with Adam: fused against the loop, interleaved rounds, the median of paired ratios. Target: 2x.

In every mode, through a fastai `Learner` (fp32, AMP bf16/fp16, master fp16/fp16 flat/bf16, pure kahan/stochastic), each with
`fused=True` against `fused=False` (fp32: `FusedSteps` installed by a callback, as a mode installs it):
3. Aten ops dispatched per training batch from `after_backward` to the end of `after_step` (a counter entered by a callback
   first at `after_backward` and left by one last at `after_step`, so the precision callback's own work there is inside;
   the forward and backward are outside), and separately fastai's `opt.zero_grad()` after it, on chains of `Linear(8, 8)`
   (10, 100 and 1000 tensors) with SGD(mom=.9), Adam, RAdam and ranger: the mean over 6 batches after 5 (RAdam rectified,
   one ranger cycle). Target: fused at most 2% of the loop at 1000 tensors.
4. Time of that step window on 200 `Linear(64, 64)` layers with Adam, batches of 8, each mode fused against the loop,
   interleaved rounds, the median of paired ratios. Target: 2x.

Run: `.venv/bin/python bench/fused.py` (one thread by default; `BENCH_THREADS=n` for more; `--quick`: smaller, for a try)."""
import sys, statistics
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from _common import *
from mpx.fused import FusedSteps
from mpx.pure import KahanKind, StochasticKind
from mpx.test_utils import CountOps
from mpx.patches import is_mpx_precision

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
    "Aten ops of one fused Adam step on `n` tensors held in pure bf16's storage kinds (Kahan: a bf16 compensation each)"
    ps = _params(n)
    kind = KahanKind() if update == 'kahan' else StochasticKind(dict(seed=0, count=0))
    opt = Adam(ps, lr=1e-3)
    FusedSteps(opt, lambda p: kind)
    for p in ps: p.grad = p.grad.bfloat16()
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

def amp_fit_timer(fused, n_batches=24, width=32, bs=64) -> callable:
    "One epoch of AMP bf16 on 200 `Linear(width, width)` with Adam, `fused` or fastai's loop: settled seconds per batch"
    batches = synth_batches((bs, width), n_out=width, n=n_batches)
    learn = learner(chain(width=width), batches, opt_func=Adam, lr=1e-4).to_bf16(fused=fused)
    return learner_step(learn)

def time_table(rounds=7):
    rows = []
    for what,make in (('optimizer step', opt_step_timer), ('training batch (fastai Learner, fp32)', batch_timer),
                      ('AMP bf16 batch, 200 Linear(32, 32), batch 64', amp_fit_timer)):
        res = interleaved(dict(loop=make(False), fused=make(True)), rounds)
        rows.append([what, f"{med(res['loop'])*1e3:.2f}", f"{med(res['fused'])*1e3:.2f}", f"{ratio(res['loop'], res['fused']):.2f}x"])
    table(['200 Linear(64, 64), Adam', 'loop ms:', 'fused ms:', 'speed-up (paired median):'], rows)

# ---- In every mode, through a fastai Learner

MODES = {  # name: a function making learner `l` train in that mode, with fused steps or with fastai's per-parameter loop
    'fp32':             lambda l,fused: l.add_cb(Fuse()) if fused else l,
    'AMP bf16':         lambda l,fused: l.to_bf16(fused=fused),
    'AMP fp16':         lambda l,fused: l.to_fp16(init_scale=2.**8, fused=fused),
    'master fp16':      lambda l,fused: l.to_fp16(loss_scale=512, fused=fused),
    'master bf16':      lambda l,fused: l.to_bf16(master=True, fused=fused),
    'pure kahan':       lambda l,fused: l.to_bf16(pure=True, update='kahan', fused=fused),
    'pure stochastic':  lambda l,fused: l.to_bf16(pure=True, update='stochastic', fused=fused),
}

class Windows:
    "Aten ops (`count`) or seconds of each batch's windows: 'step' (`after_backward` to the end of `after_step`), then 'zero_grad'"
    def __init__(self, count:bool, skip:int=0): self.count,self.skip,self.cur,self.batch = count,skip,None,0; self.reset()
    def reset(self): self.res,self.ops,self.batch = {'step': [], 'zero_grad': []},{},0
    def open(self, k):
        if self.batch < self.skip: return
        self.cur = (k, CountOps().__enter__() if self.count else clock())
    def close(self, k):
        if self.cur is None or self.cur[0] != k: return
        m,self.cur = self.cur[1],None
        if not self.count: return self.res[k].append(clock() - m)
        m.__exit__(None, None, None)
        self.res[k].append(m.n)
        for op,n in m.ops.items(): self.ops[k,op] = self.ops.get((k,op), 0) + n
    def end_batch(self): self.close('zero_grad'); self.batch += 1
    def abandon(self):
        "Leave a window an exception or a cancelled batch left open"
        if self.cur is not None and self.count: self.cur[1].__exit__(None, None, None)
        self.cur = None

class WindowOpen(Callback):
    "First at every event: opens the step window at `after_backward`, ends the zero_grad window at `after_batch`"
    order = -1000
    def __init__(self, w:Windows): self.windows = w
    def after_backward(self): self.windows.open('step')
    def after_batch(self): self.windows.end_batch()
    def after_fit(self): self.windows.abandon()

class WindowClose(Callback):
    "Last at every event: closes the step window at the end of `after_step` and opens the zero_grad window (fastai's `opt.zero_grad()`)"
    order = 1000
    def __init__(self, w:Windows): self.windows = w
    def after_step(self): self.windows.close('step'); self.windows.open('zero_grad')

def deep_chain(n, width, seed=0) -> nn.Module:
    "`n` `Linear(width, width)` layers with orthogonal weights, so activations and gradients keep their size down the chain (no subnormals)"
    torch.manual_seed(seed)
    m = nn.Sequential(*[nn.Linear(width, width) for _ in range(n)])
    for l in m: nn.init.orthogonal_(l.weight)
    return m

def mode_learner(mode, fused, model, batches, w:Windows, opt_func, lr=1e-3) -> Learner:
    "A `learner` (bench/_common.py) on `model` training in `mode`, its windows in `w`"
    learn = learner(model, batches, cbs=[WindowOpen(w), WindowClose(w)], opt_func=opt_func, lr=lr)
    MODES[mode](learn, fused)
    return learn

def skipped(learn) -> int: return sum(getattr(cb, 'skipped_steps', 0) for cb in learn.cbs if is_mpx_precision(cb))

_VIEWS = ('aten.view.', 'aten._unsafe_view.', 'aten.split', 'aten.alias.', 'aten.detach.', 'aten.as_strided.', 'aten.unbind.',
          'aten.t.', 'aten.expand.', 'aten.slice.', 'aten.select.', 'aten._reshape_alias.', 'aten.unsqueeze.', 'aten.squeeze.')
def is_view(op:str) -> bool: return op.startswith(_VIEWS)

def mode_ops(mode, opt, n, fused, warm=5) -> dict:
    "Mean aten ops per batch of the step and zero_grad windows in `mode` on `n` tensors after `warm` batches (ranger: its 6-step cycle)"
    k = 6 if opt == 'ranger' else 2
    w = Windows(count=True, skip=warm)
    learn = mode_learner(mode, fused, deep_chain(n//2, 8), synth_batches((4, 8), n_out=8, n=warm+k), w, OPTS[opt])
    fit_quiet(learn)
    assert len(w.res['step']) == k, (mode, opt, n, fused, len(w.res['step']))
    views = sum(v for (kk,op),v in w.ops.items() if kk == 'step' and is_view(op)) / k
    return dict(step=sum(w.res['step'])/k, zero_grad=sum(w.res['zero_grad'])/k, views=views, skipped=skipped(learn),
                ops={op: v/k for (kk,op),v in w.ops.items() if kk == 'step'})

def _grow(a, b, na, nb) -> str:
    "How `b` (at `nb` tensors) exceeds `a` (at `na`), per added tensor"
    if nb == na: return ''
    d = (b - a) / (nb - na)
    return 'constant' if abs(d) < 1e-9 else f'+{_num(round(d, 2))}/tensor'

def mode_count_table(sizes=(10, 100, 1000), modes=None, opts=None, show_ops=False):
    "The step window's ops in each mode and optimizer, loop and fused; the fused ops over the fp32 learner's fused ones: the mode's own"
    rows,big,notes,fp32 = [],sizes[-1],[],{}
    for mode in modes or MODES:
        for opt in opts or OPTS:
            r = {(n,f): mode_ops(mode, opt, n, f) for n in sizes for f in (False, True)}
            if any(v['skipped'] for v in r.values()): notes.append(f'{mode}, {opt}: skipped steps {[v["skipped"] for v in r.values()]}')
            lo,fu = r[big,False],r[big,True]
            if mode == 'fp32': fp32[opt] = fu['step']
            rows.append([mode, opt, *[_num(r[n,False]['step']) for n in sizes], *[_num(r[n,True]['step']) for n in sizes],
                         f"{100*fu['step']/lo['step']:.2f}%", _grow(r[sizes[0],True]['step'], fu['step'], sizes[0], big),
                         _num(fu['views']), _num(fu['step'] - fp32[opt]) if opt in fp32 else '',
                         f"{_num(lo['zero_grad'])} / {_num(fu['zero_grad'])}"])
            if show_ops: print(mode, opt, {k: v for k,v in sorted(fu['ops'].items(), key=lambda o: -o[1])[:12]})
    table(['mode', 'optimizer', *[f'loop {n}:' for n in sizes], *[f'fused {n}:' for n in sizes], f'fused/loop at {big}:',
           'fused growth:', f'fused views at {big}:', f'fused over fp32 at {big}:', f'zero_grad loop / fused at {big}:'], rows)
    for n in notes: print(f'# {n}')

def mode_step_timer(mode, fused, n_batches=10) -> callable:
    "A function fitting one epoch in `mode` on 200 `Linear(64, 64)`, Adam, batches of 8: `settled` seconds of the step window and the batch"
    w = Windows(count=False)
    learn = mode_learner(mode, fused, deep_chain(200, 64), synth_batches((8, 64), n_out=64, n=n_batches), w, Adam, lr=1e-4)
    def run():
        w.reset(); fit_quiet(learn)
        return settled(w.res['step']), settled(learn.step_timer.times)
    return run

def mode_time_table(rounds=5, modes=None, n_batches=10):
    modes = modes or list(MODES)
    res = interleaved({(m,f): mode_step_timer(m, f, n_batches) for m in modes for f in (False, True)}, rounds)
    rows = []
    for m in modes:
        lo,fu = res[m,False],res[m,True]
        step = lambda v: [x[0] for x in v]
        batch = lambda v: [x[1] for x in v]
        rows.append([m, f'{med(step(lo))*1e3:.2f}', f'{med(step(fu))*1e3:.2f}', f'{ratio(step(lo), step(fu)):.2f}x',
                     f'{med(batch(lo))*1e3:.2f}', f'{med(batch(fu))*1e3:.2f}', f'{ratio(batch(lo), batch(fu)):.2f}x'])
    table(['200 Linear(64, 64), Adam, batch 8', 'step loop ms:', 'step fused ms:', 'step speed-up:', 'batch loop ms:', 'batch fused ms:',
           'batch speed-up:'], rows)

def flat_step_timer(k=20) -> callable:
    "A function timing `k` fused Adam steps on ONE tensor with as many elements as the 200-layer chain: the arithmetic, no per-tensor cost"
    n = sum(p.numel() for p in chain().parameters())
    g = torch.Generator().manual_seed(0)
    p = nn.Parameter(torch.randn(n, generator=g) * .05); p.grad = torch.randn(n, generator=g) * 1e-3
    opt = Adam([p], lr=1e-4)
    FusedSteps(opt)
    def run():
        t = clock()
        for _ in range(k): opt.step()
        return (clock() - t) / k
    return run

def floor_table(rounds=7):
    "Adam's step alone: fastai's loop and the fused step on the chain's 400 tensors, and the fused step on one flat tensor as large"
    res = interleaved(dict(loop=opt_step_timer(False), fused=opt_step_timer(True), flat=flat_step_timer()), rounds)
    n = len(list(chain().parameters()))
    rows = [[what, f'{med(res[k])*1e3:.2f}', f"{ratio(res['loop'], res[k]):.2f}x", f"{(med(res[k]) - med(res['flat']))/n*1e6:.1f}"]
            for k,what in (('loop', 'fastai loop, 400 tensors'), ('fused', 'fused, 400 tensors'),
                           ('flat', 'fused, 1 tensor of the same 832,000 elements'))]
    table(['Adam step alone (arithmetic floor)', 'ms:', 'speed-up over the loop:', 'per-tensor cost us (over the flat one):'], rows)

if __name__ == '__main__':
    quick = '--quick' in sys.argv[1:]
    flags = cpu_flags()
    slow_bf16 = not any(f in flags.split() for f in ('avx512_bf16', 'amx_bf16'))
    header('Fused optimizer steps vs fastai loop' + ' (--quick)'*quick, f'CPU flags: {flags}',
           'bf16 is slow on this CPU: no avx512_bf16 and no amx_bf16, bf16 matmuls and casts are emulated' if slow_bf16 else
           'bf16 has native kernels on this CPU',
           f'load average at the start: {os.getloadavg()[0]:.1f} (a shared machine: timings are noisy, op counts exact)',
           'ops: aten ops dispatched per optimizer step (CountOps); 64-element tensors')
    t0 = time.perf_counter()
    sizes = (10, 100) if quick else (10, 100, 1000)
    count_table(sizes)
    bf16_table(sizes)
    if not quick: time_table()
    print('## In every mode (learner): aten ops per training batch from after_backward to the end of after_step (fused: fused=True; '
          'loop: fused=False, fastai\'s per-parameter loop), chains of Linear(8, 8), batch 4; '
          'zero_grad: fastai\'s opt.zero_grad() after it\n')
    mode_count_table(sizes, opts=['SGD mom', 'Adam'] if quick else None)
    print(f'# step window and whole batch, {3 if quick else 5} interleaved rounds, medians of paired ratios\n')
    mode_time_table(3 if quick else 5, n_batches=6 if quick else 10)
    floor_table(3 if quick else 7)
    print(f'# load average at the end: {os.getloadavg()[0]:.1f}; {time.perf_counter() - t0:.0f} s in all')
