"""One pass per step (issue 27): where a training batch's time goes in every mpx mode, against the other ways to train the
same model in 16 bits.

Side by side in one interleaved run, on an MLP 512-2048-2048-10 (5.27M parameters) at batch 256 with Adam:
- every mpx mode (AMP bf16 and fp16, master bf16 and fp16, pure bf16 kahan and stochastic, fp32; AMP bf16 and pure kahan
  with 8-bit optimizer state, `opt_state='8bit'`; pure kahan with bf16 state, as optimi keeps its state), each with `fused=True`
  (eager steps over flat buffers, the default) and, where the installed mpx takes it, `fused='compile'`;
- a fastai `Learner` on a bf16 model with optimi's `AdamW(kahan_sum=True)` through `OptimWrapper`;
- raw AMP loops (bf16 autocast, no fastai) with torch's `AdamW(fused=True)` and `AdamW(foreach=True)`, and the foreach
  one with its `step` under `torch.compile` (what compiling a step gives on this CPU, as a reference for `fused='compile'`).

Per batch: forward (`before_batch` to the end of `after_loss`), backward (to `after_backward`), the step window
(`after_backward` to the end of `after_step`: the precision callback's own work and the optimizer step) and the whole
batch, in ms (medians over rounds of each epoch's settled second half), and the speed against mpx AMP bf16 (eager) as the
median of the rounds' paired ratios; minor page faults per batch and per step window; then, in untimed passes, host
syncs (`CountSyncs`) and aten ops (`CountOps`) per step window and per batch. `torch.compile`d code does not run as
itself under a dispatch mode (it runs its eager ops), so compiled arms get no op counts and their syncs are counted
with torch's profiler instead. A compiled arm's first fit (its compilation) is untimed and reported apart.

`--chain` times instead the engine's host work (issue 48): whole `fit(1)`s (16 batches of 64 and a validation batch) of
200 `Linear(32, 32)` layers with fastai's Adam in AMP bf16, `fused=True` against fastai's loop (`fused=False`), in
interleaved rounds (the speed-up: the median of the rounds' paired ratios), where small layers make the step's Python
the cost, as a GPU's launches do.

Run: `.venv/bin/python bench/step.py` (`make bench` installs torch-optimi); `--quick` for a smoke run; `--modes` to choose
arms (the fp16 modes are left out by default: fp16 is emulated and slow on CPUs); `--threads n` (default 1,
`BENCH_THREADS`); `--profile` for the top aten ops of some arms' step windows."""
import argparse, os, sys, time, resource
from pathlib import Path

MPX_NAMES = ['AMP bf16', 'AMP fp16', 'master bf16', 'master fp16', 'pure kahan', 'pure stochastic', 'fp32', 'AMP bf16 8bit', 'pure kahan 8bit', 'pure kahan bf16 state']
OTHER_NAMES = ['optimi kahan', 'raw fused', 'raw foreach', 'raw compiled']
FP16 = ['AMP fp16', 'master fp16']
DEFAULT = [n for n in MPX_NAMES + OTHER_NAMES if n not in FP16]

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--quick', action='store_true', help='smoke run: MLP 128-512-512-10 at batch 64, 3 rounds of 6 batches')
    ap.add_argument('--modes', default=','.join(DEFAULT),
                    help=f"comma-separated arms, or 'all' (default: all but {FP16}); of {MPX_NAMES + OTHER_NAMES}")
    ap.add_argument('--eager-only', action='store_true', help="skip the fused='compile' arms")
    ap.add_argument('--rounds', type=int, help='interleaved rounds (default 7; --quick 3)')
    ap.add_argument('--batches', type=int, help='batches an epoch, of which the second half is timed (default 16; --quick 6)')
    ap.add_argument('--threads', type=int, default=int(os.environ.get('BENCH_THREADS', 1)), help='torch threads (default 1)')
    ap.add_argument('--profile', default='', help="comma-separated arms ('AMP bf16', 'pure kahan compile'...) whose step window to profile")
    ap.add_argument('--chain', action='store_true', help="the engine's host work: fits of 200 Linear(32, 32), fused=True against False")
    args = ap.parse_args(argv)
    args.modes = MPX_NAMES + OTHER_NAMES if args.modes == 'all' else [m.strip() for m in args.modes.split(',')]
    bad = [m for m in args.modes if m not in MPX_NAMES + OTHER_NAMES]
    if bad: ap.error(f'unknown arms {bad}: choose from {MPX_NAMES + OTHER_NAMES}')
    if 'AMP bf16' not in args.modes: args.modes.insert(0, 'AMP bf16')  # the reference of every ratio
    args.rounds = args.rounds or (3 if args.quick else 7)
    args.batches = args.batches or (6 if args.quick else 16)
    return args

if __name__ == '__main__':
    ARGS = parse_args()
    os.environ['BENCH_THREADS'] = str(ARGS.threads)  # before `_common`, which sets torch's threads and its clock from it

sys.path.insert(0, str(Path(__file__).parent))
from _common import *
import torch.nn.functional as F
import mpx.fused, mpx.compiled
from mpx.fused import FusedSteps
from mpx.core import check_args
from mpx.patches import is_mpx_precision
from mpx.test_utils import CountSyncs, CountOps

LR = 1e-3
ADAM_KW = dict(betas=(.9, .99), eps=1e-5, weight_decay=1e-2)  # fastai's Adam defaults (wd decoupled), for the other optimizers

def cpu_flags() -> dict:
    "Whether the CPU has the features that decide 16-bit speed, from /proc/cpuinfo"
    try: fl = set(next(l for l in open('/proc/cpuinfo') if l.startswith('flags')).split(':', 1)[1].split())
    except (OSError, StopIteration): fl = set()
    return {f: f in fl for f in ('avx512f', 'avx512_bf16', 'amx_bf16', 'amx_tile', 'avx512_fp16')}

def minflt() -> int: return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

# ---- marks: the clock, page faults and a counter at named points of each training batch

class Marks:
    "Per training batch, the clock, minor page faults and `counter.n` at: start, fwd, step0, step1 and next (the next batch's start)"
    def __init__(self): self.counter,self.prof,self.rows,self.seq = None,False,[],[]
    def reset(self): self.rows,self.seq = [],[]
    def mark(self, k):
        if self.prof:
            with torch.profiler.record_function(f'mark {k}'): pass  # a point in the profile: syncs between two are the window's
        self.rows[-1][k] = [clock(), minflt(), getattr(self.counter, 'n', 0)]
        self.seq.append(self.rows[-1][k])
    def start(self):
        if self.rows: self.mark('next')
        self.rows.append({}); self.mark('start')
    def end(self):
        if self.rows and 'next' not in self.rows[-1]: self.mark('next')

PHASES = dict(forward=('start', 'fwd'), backward=('fwd', 'step0'), step=('step0', 'step1'), batch=('start', 'next'))
T,FLT,N = 0,1,2  # what a mark holds

def deltas(rows, phase, what=T) -> list:
    "`what` (T, FLT or N) over `phase` in each of `rows` that has it (a skipped step has no step1)"
    a,b = PHASES[phase]
    return [r[b][what] - r[a][what] for r in rows if a in r and b in r]

def mean(v) -> float: return sum(v) / len(v) if v else float('nan')

class MarkFirst(Callback):
    "First at every event: starts each training batch and the step window"
    order = -1000
    def __init__(self, marks): self.marks = marks
    def before_train(self): self.marks.reset()
    def before_batch(self):
        if self.training: self.marks.start()
    def after_backward(self): self.marks.mark('step0')
    def after_train(self): self.marks.end()

class MarkLast(Callback):
    "Last at every event: ends the forward (with the loss) and the step window"
    order = 1000
    def __init__(self, marks): self.marks = marks
    def after_loss(self):
        if self.training: self.marks.mark('fwd')
    def after_step(self): self.marks.mark('step1')

# ---- the arms

class Fuse(Callback):
    "fp32's fused steps (fp32 has no precision callback to take `fused`), installed for each fit as a mode installs them"
    order = 50
    def __init__(self, fused=True):
        if fused is not True: check_args(fused=fused)  # mpx's own rule for `fused` (FusedSteps takes any truthy value as True)
        self.kw = dict(fused=fused)
    def before_fit(self): self.fs = FusedSteps(self.learn.opt, **self.kw)
    def after_fit(self): self.fs.undo()

MODES = {  # mpx modes: name -> a function making learner `l` train in that mode with `fused` (True: eager; 'compile')
    'AMP bf16':        lambda l,fused: l.to_bf16(fused=fused),
    'AMP fp16':        lambda l,fused: l.to_fp16(fused=fused),
    'master bf16':     lambda l,fused: l.to_bf16(master=True, fused=fused),
    'master fp16':     lambda l,fused: l.to_fp16(loss_scale=512, fused=fused),
    'pure kahan':      lambda l,fused: l.to_bf16(pure=True, fused=fused),
    'pure stochastic': lambda l,fused: l.to_bf16(pure=True, update='stochastic', fused=fused),
    'fp32':            lambda l,fused: l.add_cb(Fuse(fused)),
    'AMP bf16 8bit':   lambda l,fused: l.to_bf16(fused=fused, opt_state='8bit'),  # low-bit optimizer state (issue 35)
    'pure kahan 8bit': lambda l,fused: l.to_bf16(pure=True, fused=fused, opt_state='8bit'),
    'pure kahan bf16 state': lambda l,fused: l.to_bf16(pure=True, fused=fused, opt_state='bf16'),  # optimi's state dtype (issue 48)
}

class BF16Model(Callback):
    "A bf16 model without mpx: float inputs in bf16 (token ids stay integers), fp32 predictions out for the loss, as optimi trains"
    order = 10
    def before_batch(self): self.learn.xb = tuple(x.bfloat16() if x.is_floating_point() else x for x in self.xb)
    def after_pred(self): self.learn.pred = self.pred.float()

class LearnerArm:
    "A fastai `Learner` (bench/_common.py's `learner`) whose training batches mark `marks`"
    def __init__(self, model, batches, opt_func=Adam, cbs=None):
        self.marks = Marks()
        self.learn = learner(model, batches, cbs=[MarkFirst(self.marks), MarkLast(self.marks)] + L(cbs), opt_func=opt_func, lr=LR)
    def run(self): fit_quiet(self.learn)
    def dtype(self) -> str: return dtype_of(self.learn)
    def skipped(self) -> int: return sum(getattr(c, 'skipped_steps', 0) for c in self.learn.cbs if is_mpx_precision(c))

def mpx_arm(name, fused, model, batches) -> LearnerArm:
    arm = LearnerArm(model, batches)
    MODES[name](arm.learn, fused)
    return arm

def optimi_arm(model, batches) -> LearnerArm:
    "fastai + optimi: a bf16 model stepped by `optimi.AdamW(kahan_sum=True)` through fastai's `OptimWrapper`"
    import optimi
    opt = partial(optimi.AdamW, kahan_sum=True, **ADAM_KW)
    return LearnerArm(model.bfloat16(), batches, opt_func=partial(OptimWrapper, opt=opt), cbs=BF16Model())

class RawLoop:
    "The raw AMP loop, no fastai: bf16 autocast, fp32 loss, torch's AdamW (`opt_kw`: `fused=True` or `foreach=True`)"
    def __init__(self, model, batches, compile_step=False, **opt_kw):
        self.model,self.batches,self.marks = model,batches,Marks()
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR, **ADAM_KW, **opt_kw)
        self.step = torch.compile(self.opt.step) if compile_step else self.opt.step
    def run(self):
        m = self.marks; m.reset()
        for xb,yb in self.batches:
            m.start()
            with torch.autocast('cpu', dtype=torch.bfloat16): out = self.model(xb)
            loss = F.cross_entropy(out.float(), yb)
            m.mark('fwd')
            loss.backward()
            m.mark('step0')
            self.step()
            m.mark('step1')
            self.opt.zero_grad()
        m.end()
    def dtype(self) -> str: return 'bfloat16'
    def skipped(self) -> int: return 0

OTHERS = {  # name: (what it is, a function making the arm from a model and batches)
    'optimi kahan': ('fastai + optimi AdamW(kahan_sum) on a bf16 model', optimi_arm),
    'raw fused':    ('raw AMP bf16 loop, torch AdamW(fused=True)', partial(RawLoop, fused=True)),
    'raw foreach':  ('raw AMP bf16 loop, torch AdamW(foreach=True)', partial(RawLoop, foreach=True)),
    'raw compiled': ('raw AMP bf16 loop, torch.compile(AdamW(foreach=True).step)', partial(RawLoop, foreach=True, compile_step=True)),
}

def make_arms(names, compile_too, model_fn, batches) -> tuple:
    "The arms to run, by label (a compiled mpx arm's label ends in ' compile'), with each label's description; what was skipped and why"
    arms,what,skipped = {},{},[]
    for n in names:
        if n in MODES:
            for fused in (True, 'compile') if compile_too else (True,):
                label = n if fused is True else f'{n} compile'
                set_seed(0)
                try: arms[label] = mpx_arm(n, fused, model_fn(), batches)
                except (ValueError, TypeError, NotImplementedError, RuntimeError) as e:
                    if fused is True: raise
                    skipped.append(f"{label}: this mpx refuses fused='compile' ({type(e).__name__}: {e})"); continue
                what[label] = f"{'fp32, FusedSteps by a callback' if n == 'fp32' else 'mpx ' + n}, fused={fused!r}"
        else:
            desc,make = OTHERS[n]
            set_seed(0)
            try: arms[n] = make(model_fn(), batches)
            except ImportError as e: skipped.append(f'{n}: {e} (pip install --no-deps torch-optimi==0.3.3, as `make bench` does)'); continue
            what[n] = desc
    return arms,what,skipped

def is_compiled(label) -> bool: return label.endswith(' compile') or label == 'raw compiled'

def eager_fallback(label) -> str|None:
    "Why a compiled mpx arm steps eagerly (a kernel failed to compile, once a process a storage kind), or None"
    if not label.endswith(' compile'): return None
    return '; '.join(getattr(mpx.compiled, '_failed', {}).values()) or None

# ---- timing

def timed(arm) -> dict:
    "One epoch of `arm`: the settled (second half) median of each phase in seconds and of page faults; the first batch; the fit's wall time"
    t0 = time.perf_counter()
    arm.run()
    wall,rows = time.perf_counter() - t0,arm.marks.rows
    res = {p: settled(deltas(rows, p)) for p in PHASES}
    half = rows[len(rows)//2:]  # page faults come in bursts (glibc returns and re-maps its large blocks now and then): means, not medians
    res.update(flt_batch=mean(deltas(half, 'batch', FLT)), flt_step=mean(deltas(half, 'step', FLT)),
               first=deltas(rows[:1], 'batch')[0], wall=wall)
    return res

def progress(msg): print(f'# [{time.strftime("%H:%M:%S")}, load {os.getloadavg()[0]:.2f}] {msg}', file=sys.stderr, flush=True)

def run_rounds(arms, rounds) -> tuple:
    "Warm each arm up with one untimed fit (compilation included; an arm whose compiled fit fails is dropped), then time rounds"
    warm,dropped = {},[]
    for k in list(arms):
        t0 = time.perf_counter()
        try: arms[k].run()
        except Exception as e:
            if not is_compiled(k): raise
            dropped.append(f'{k}: its first fit failed ({type(e).__name__}: {str(e)[:200]})'); del arms[k]; continue
        why = eager_fallback(k)
        if why: dropped.append(f'{k}: its kernels step eagerly ({why})'); del arms[k]; continue
        warm[k] = time.perf_counter() - t0
    progress(f'warm-up done ({sum(warm.values()):.0f} s)')
    res = {k: [] for k in arms}
    for i in range(rounds):
        for k,a in arms.items(): res[k].append(timed(a))
        progress(f'round {i+1}/{rounds} done')
    skips = {k: a.skipped() for k,a in arms.items()}
    return res,warm,dropped,skips

# ---- counting (untimed)

def count_dispatch(arm, counter) -> tuple:
    "Mean `counter.n` per step window and per batch over one epoch (its first batch left out), counted by a dispatch mode"
    arm.marks.counter = counter
    try:
        with counter: arm.run()
    finally: arm.marks.counter = None
    rows = arm.marks.rows[1:]
    return mean(deltas(rows, 'step', N)),mean(deltas(rows, 'batch', N))

def _profiled(arm):
    "One epoch of `arm` under torch's profiler, every mark a point in it"
    arm.marks.prof = True
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p: arm.run()
    finally: arm.marks.prof = False
    return sorted(p.events(), key=lambda e: e.time_range.start)

def count_syncs_profiled(arm) -> tuple:
    "Host syncs (`aten::_local_scalar_dense`) per step window and per batch from torch's profiler: compiled code runs as itself there"
    evs = _profiled(arm)
    n,i,marks = 0,0,arm.marks.seq  # after the run: each run starts a new `seq`
    for e in evs:
        if e.name == 'aten::_local_scalar_dense': n += 1
        elif e.name.startswith('mark '): marks[i][N] = n; i += 1
    rows = arm.marks.rows[1:]
    return mean(deltas(rows, 'step', N)),mean(deltas(rows, 'batch', N))

def step_profile(arm, top=10) -> list:
    "The aten ops with the most self CPU time inside the step windows: (op, calls, us) per step"
    inside,tot,cnt,windows = False,{},{},0
    for e in _profiled(arm):
        if e.name == 'mark step0': inside = True; windows += 1
        elif e.name == 'mark step1': inside = False
        elif inside and e.name.startswith('aten::'):
            tot[e.name] = tot.get(e.name, 0) + e.self_cpu_time_total; cnt[e.name] = cnt.get(e.name, 0) + 1
    return [(k, cnt[k]/windows, tot[k]/windows) for k in sorted(tot, key=tot.get, reverse=True)[:top]]

def counts(arms) -> dict:
    "Host syncs and aten ops per step window and per batch, by arm: dispatch modes for eager arms, the profiler for compiled ones"
    res = {}
    for k,a in arms.items():
        if is_compiled(k): res[k] = dict(syncs=count_syncs_profiled(a), ops=None, how='profiler')
        else: res[k] = dict(syncs=count_dispatch(a, CountSyncs()), ops=count_dispatch(a, CountOps()), how='CountSyncs')
    ref = count_syncs_profiled(arms['AMP bf16'])[0]  # the profiler's count checked against CountSyncs where both can count
    print(f"# syncs/step of AMP bf16: {num(ref)} by the profiler, {num(res['AMP bf16']['syncs'][0])} by CountSyncs"
          f"{'' if ref == res['AMP bf16']['syncs'][0] else ': THEY DIFFER, the profiler counts of compiled arms are suspect'}")
    progress('counts done')
    return res

# ---- report

def ms(x) -> str: return f'{1e3*x:.1f}'
def num(x) -> str: return 'n/a' if x is None or x != x else f'{x:.1f}'.removesuffix('.0')

def main_table(res, what, arms, skips):
    ref = [r['batch'] for r in res['AMP bf16']]
    rows = []
    for k,rs in res.items():
        col = lambda p: [r[p] for r in rs]
        rows.append([k, what[k], arms[k].dtype(), *[ms(med(col(p))) for p in ('forward', 'backward', 'step', 'batch')],
                     f"{ratio(ref, col('batch')):.2f}x", f"{mean(col('flt_batch')):,.0f}", f"{mean(col('flt_step')):,.0f}", skips[k]])
    table(['arm', 'what', 'compute dtype', 'forward ms:', 'backward ms:', 'step window ms:', 'batch ms:', 'speed vs AMP bf16:',
           'minor faults/batch (mean):', 'minor faults/step (mean):', 'skipped steps:'], rows)

def count_table(cnt, res, warm):
    rows = []
    for k,c in cnt.items():
        ops = c['ops'] or (None, None)
        col = lambda p: [r[p] for r in res[k]]
        rows.append([k, num(c['syncs'][0]), num(c['syncs'][1]), c['how'], num(ops[0]), num(ops[1]), f'{warm[k]:.1f}',
                     f"{med(col('wall')):.1f}", ms(med(col('first'))), ms(med(col('batch')))])
    table(['arm', 'host syncs/step:', 'host syncs/batch:', 'syncs counted by', 'aten ops/step:', 'aten ops/batch:',
           'first (warm-up) fit s:', 'timed fit s:', 'first batch of a timed fit ms:', 'settled batch ms:'], rows)

def speed(res, a, b):
    "How much faster arm `a` trains than arm `b` (b's batch time over a's, the median of paired rounds); None if either is missing"
    if a not in res or b not in res: return None
    return ratio([r['batch'] for r in res[b]], [r['batch'] for r in res[a]])

TARGETS = [  # (target, arm, reference arm, at least)
    ("fused='compile': pure kahan >= 1.2x eager AMP bf16 (today's default)", 'pure kahan compile', 'AMP bf16', 1.2),
    ("fused='compile': pure kahan >= 1.0x compiled AMP bf16", 'pure kahan compile', 'AMP bf16 compile', 1.0),
    ("fused='compile': master bf16 >= 1.0x compiled AMP bf16", 'master bf16 compile', 'AMP bf16 compile', 1.0),
    ("fused='compile': pure kahan >= 1.1x fastai + optimi Kahan AdamW", 'pure kahan compile', 'optimi kahan', 1.1),
    ("fused='compile' (issue 48): pure kahan >= 1.05x fastai + optimi Kahan AdamW", 'pure kahan compile', 'optimi kahan', 1.05),
    ("fused='compile' (issue 48), like for like: pure kahan with bf16 state, as optimi keeps it, >= 1.05x fastai + optimi", 'pure kahan bf16 state compile', 'optimi kahan', 1.05),
    ("fused='compile': AMP bf16 >= 0.9x the raw loop with torch's fused AdamW", 'AMP bf16 compile', 'raw fused', 0.9),
    ('eager default (issue 48): pure kahan >= 0.95x AMP bf16', 'pure kahan', 'AMP bf16', 0.95),
    ("fused='compile' (issue 35): AMP bf16 with 8-bit state >= 0.9x its fp32 state", 'AMP bf16 8bit compile', 'AMP bf16 compile', 0.9),
    ("fused='compile' (issue 35): pure kahan with 8-bit state >= 0.9x its fp32 state", 'pure kahan 8bit compile', 'pure kahan compile', 0.9),
]

def target_table(res, cnt):
    rows = []
    for t,a,b,lo in TARGETS:
        s = speed(res, a, b)
        rows.append([t, 'not measured: ' + (a if a not in res else b) + ' did not run' if s is None else f'{s:.2f}x',
                     '' if s is None else 'yes' if s >= lo else 'no'])
    checking = {k: c['syncs'][0] for k,c in cnt.items() if k.endswith(' compile') and not k.startswith('fp32')}
    rows.append(["fused='compile': 0 host syncs per step in every checking mode",
                 ', '.join(f'{k}: {num(v)}' for k,v in checking.items()) or "not measured: no fused='compile' arm ran",
                 ('yes' if all(v == 0 for v in checking.values()) else 'no') if checking else ''])
    table(['target', 'measured', 'met'], rows)

def profile_tables(arms, names):
    for k in names:
        if k not in arms: print(f'# --profile {k!r}: no such arm in this run\n'); continue
        print(f'## Top aten ops in the step window: {k} (self CPU time under the profiler, per step)\n')
        table(['op', 'calls/step:', 'us/step:'], [[op, num(c), f'{t:,.0f}'] for op,c,t in step_profile(arms[k])])

def chain_model(n=200, width=32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(n)])

def chain_fits(args):
    "fit(1) of 200 Linear(32, 32) in AMP bf16 with Adam, fused=True against fastai's loop: interleaved rounds, paired ratios"
    rounds = args.rounds
    header("The engine's host work (--chain)", '200 Linear(32, 32), fastai Adam lr 1e-4, AMP bf16; a fit(1) is 16 batches of 64 and a '
           f'validation batch; {rounds} interleaved rounds of one fit each arm (the first fit untimed); speed-up = the loop\'s fit '
           'time over the fused one\'s, the median of paired per-round ratios',
           f'load average at the start: {" ".join(f"{x:.2f}" for x in os.getloadavg())}')
    batches = synth_batches((64, 32), n_out=32, n=16)
    dls = lambda: DataLoaders(DataLoader(batches, bs=None), DataLoader(batches[:1], bs=None), device=torch.device('cpu'))
    learns = {f: Learner(dls(), chain_model(), loss_func=CrossEntropyLossFlat(), opt_func=Adam, lr=1e-4).to_bf16(fused=f)
              for f in (False, True)}
    for l in learns.values(): fit_quiet(l)
    res = {f: [] for f in learns}
    for _ in range(rounds):
        for f,l in learns.items():
            t = clock(); fit_quiet(l); res[f].append(clock() - t)
    rs = sorted(a / b for a,b in zip(res[False], res[True]))
    rows = [[f'fused={f}', f'{med(v)*1e3:.0f}', ' '.join(f'{x*1e3:.0f}' for x in v)] for f,v in res.items()]
    table(['arm', 'fit ms (median)', 'rounds ms'], rows)
    print(f"speed-up of fused=True (median of paired ratios): {med(rs):.2f}x (rounds {rs[0]:.2f}-{rs[-1]:.2f}); target (issue 48) >= 1.5x: "
          f"{'yes' if med(rs) >= 1.5 else 'no'}; load average at the end: {os.getloadavg()[0]:.2f}")

def main(args):
    if args.chain: return chain_fits(args)
    flags = cpu_flags()
    size = (128, 512, 64) if args.quick else (512, 2048, 256)
    model_fn = partial(mlp, size[0], size[1])
    n_params = sum(p.numel() for p in model_fn().parameters())
    header('One pass per step' + ' (--quick)'*args.quick,
           'CPU flags: ' + ', '.join(f"{f} {'yes' if v else 'no'}" for f,v in flags.items()),
           f'MLP {size[0]}-{size[1]}-{size[1]}-10 ({n_params/1e6:.2f}M parameters), batch {size[2]}, fastai Adam (others: AdamW with '
           f'its hyper-parameters, betas {ADAM_KW["betas"]}, eps {ADAM_KW["eps"]}, wd {ADAM_KW["weight_decay"]}), lr {LR}',
           f'{args.rounds} interleaved rounds of {args.batches}-batch epochs, each timed over its second half; medians; '
           'speed = AMP bf16 (eager) batch time over the arm\'s, the median of paired per-round ratios',
           f'load average at the start: {" ".join(f"{x:.2f}" for x in os.getloadavg())}')
    t0 = time.perf_counter()
    batches = synth_batches((size[2], size[0]), n=args.batches)
    arms,what,skipped = make_arms(args.modes, not args.eager_only, model_fn, batches)
    if args.eager_only: skipped.append("every fused='compile' arm: --eager-only")
    progress(f'{len(arms)} arms: {list(arms)}')
    res,warm,dropped,skips = run_rounds(arms, args.rounds)
    for s in skipped + dropped: print(f'# skipped {s}')
    left = [n for n in MPX_NAMES + OTHER_NAMES if n not in args.modes]
    if left: print(f'# not in --modes: {left}')
    print(f'\n## Per batch ({args.rounds} rounds, load average now {os.getloadavg()[0]:.2f})\n')
    main_table(res, what, arms, skips)
    print('## Host syncs and aten ops (untimed passes, means over an epoch less its first batch), first fits\n')
    print('# compiled arms: no aten op counts (a TorchDispatchMode makes torch.compile\'d code run its eager ops, so they would '
          'count eager code); their syncs are counted with torch\'s profiler. A first fit holds any compilation.')
    cnt = counts(arms)
    print()
    count_table(cnt, res, warm)
    print("## The issue's targets, from this run\n")
    target_table(res, cnt)
    if args.profile: profile_tables(arms, [p.strip() for p in args.profile.split(',')])
    print(f'# load average at the end: {" ".join(f"{x:.2f}" for x in os.getloadavg())}; {time.perf_counter() - t0:.0f} s in all')

if __name__ == '__main__': main(ARGS)
