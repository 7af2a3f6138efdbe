"""Shared setup of the benchmark scripts: the machine line, prebatched synthetic data, models, learners, interleaved timing, tables and plots."""
import os, platform, statistics, time, warnings
from functools import partial
from pathlib import Path
import torch
from torch import nn
import fastai
from fastai.basics import *
from fastai.data.load import DataLoader
from fastai.callback.progress import *
import fastai.callback.fp16 as ffp16
from mpx.all import *
from mpx.test_utils import CountSyncs

PLOTS = Path(__file__).parent/'plots'
torch.set_num_threads(int(os.environ.get('BENCH_THREADS', 1)))  # one thread: a busy second core stalls OpenMP's parallel ops and turns timings into noise
# On one thread every op (backward too) runs on the calling thread, so its CPU time is the step's time without the time other processes took
clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
warnings.filterwarnings('ignore', message='.*CUDA is not available.*')  # fastai's AMP callback on CPU: said once in the scripts' text

def cpu_name() -> str:
    "The CPU's model name from /proc/cpuinfo, else `platform`'s"
    try: return next(l.split(':', 1)[1].strip() for l in open('/proc/cpuinfo') if l.startswith('model name'))
    except (OSError, StopIteration): return platform.processor() or platform.machine()

def machine() -> str:
    "One line naming the CPU, the threads, the clock and the library versions"
    n = torch.get_num_threads()
    return f"{cpu_name()}, {n} thread{'s'*(n > 1)} (clock: time.{clock.__name__}), torch {torch.__version__}, fastai {fastai.__version__}"

def header(title, *notes):
    "Print the script's title line with the machine, then `notes` as comment lines"
    print(f"# {title}: {machine()}")
    for n in notes: print(f"# {n}")
    print()

def synth_batches(x_shape, n_out=10, n=8, seed=0) -> list:
    "`n` prebatched (x, y) pairs: x of `x_shape` (batch first), y integer classes below `n_out`"
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(x_shape, generator=g), torch.randint(0, n_out, x_shape[:1], generator=g)) for _ in range(n)]

def prebatched_dls(batches, device='cpu') -> DataLoaders:
    "fastai `DataLoaders` on `device` yielding `batches` as they are (no per-item collation to time)"
    return DataLoaders(DataLoader(batches, bs=None), DataLoader(batches[:1], bs=None), device=torch.device(device))

def mlp(n_in=1024, hidden=4096, n_out=10) -> nn.Module:
    "The matmul-heavy model: `n_in`->`hidden`->`hidden`->`n_out` with ReLUs"
    return nn.Sequential(nn.Linear(n_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, n_out))

def _conv(ni, nf, stride=2): return nn.Sequential(nn.Conv2d(ni, nf, 3, stride, 1, bias=False), nn.BatchNorm2d(nf), nn.ReLU())

def small_cnn(c=32, n_out=10) -> nn.Module:
    "A small CNN for 3x32x32 images: three strided conv-BN-ReLU blocks of `c`, `2c`, `4c` channels, pooled, one linear"
    return nn.Sequential(_conv(3, c), _conv(c, 2*c), _conv(2*c, 4*c), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4*c, n_out))

torch_sgd = partial(OptimWrapper, opt=torch.optim.SGD, momentum=.9)  # the raw loops' optimizer, so learner and loop step alike

MPX_MODES = {  # name: what makes a learner train in that mpx mode
    'mpx AMP bf16':         lambda l: l.to_bf16(),
    'mpx AMP fp16':         lambda l: l.to_fp16(),
    'mpx master fp16':      lambda l: l.to_fp16(loss_scale=512),
}

class FastaiAMPOnCPU(ffp16.MixedPrecision):
    "fastai's `MixedPrecision` with its autocast and `GradScaler` on the CPU (fastai hard-codes 'cuda', so off CUDA both switch off): its GPU behaviour"
    def before_fit(self):
        super().before_fit()
        self.autocast,self.learn.scaler = torch.autocast('cpu', dtype=self.autocast.fast_dtype),torch.amp.GradScaler('cpu', **self.kwargs)

class NoValidate(Callback):
    "Skip the validation epoch: the scripts time training steps only"
    def before_validate(self): raise CancelValidException()

def first_layer(model) -> nn.Module: return first(m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d)))

class DtypeProbe(Callback):
    "Record, in `dtype`, the dtype of the first conv or linear layer's output in a fit's first training batch"
    order = 100  # after every precision callback's `before_batch`
    def before_fit(self): self.dtype,self.h = None,None
    def before_batch(self):
        if self.h is None and self.dtype is None: self.h = first_layer(self.model).register_forward_hook(self._hook)
    def after_pred(self):
        if self.h is not None: self.h.remove(); self.h = None  # not inside the forward: torch.compile cannot trace a hook removing itself
    def _hook(self, m, i, o): self.dtype = o.dtype

def short(dtype) -> str: return str(dtype).replace('torch.', '')

def learner(model, batches, cbs=None, opt_func=SGD, lr=1e-3, loss_func=None, device='cpu') -> Learner:
    "A `Learner` on `prebatched_dls(batches, device)` without validation, timing its steps (`StepTimer`) and probing its compute dtype (`DtypeProbe`)"
    cbs = [NoValidate(), StepTimer(), DtypeProbe()] + L(cbs)
    return Learner(prebatched_dls(batches, device), model.to(device), loss_func=loss_func or CrossEntropyLossFlat(), opt_func=opt_func, lr=lr, cbs=cbs)

def fit_quiet(learn, n_epoch=1):
    "`learn.fit(n_epoch)` with no progress bar and no logging"
    with learn.no_bar(), learn.no_logging(): learn.fit(n_epoch)
    return learn

class StepTimer(Callback):
    "Record each training batch's start; `times` are the intervals between them (the last one ends at `after_train`)"
    order = -100  # first at every event, so every other callback's work falls inside the interval
    def before_train(self): self.starts = []
    def before_batch(self): self.starts.append(clock())
    def after_train(self):
        s = self.starts + [clock()]
        self.times = [b-a for a,b in zip(s, s[1:])]

def settled(times) -> float:
    "The median of an epoch's second half of step times: the first half settles the caches and clocks the previous mode left"
    return statistics.median(times[len(times)//2:])

def learner_step(learn) -> callable:
    "A function fitting `learn` (made by `learner`) for one epoch and returning its `settled` seconds per training step"
    return lambda: settled(fit_quiet(learn).step_timer.times)

def dtype_of(learn) -> str:
    "The compute dtype `learn`'s `DtypeProbe` saw in its last fit"
    return short(learn.dtype_probe.dtype)

def raw_step(model, batches, dtype=None, lr=1e-3) -> callable:
    "A function running the raw torch loop (autocast to `dtype` if given, `torch.optim.SGD`) over `batches`; `settled` seconds per step"
    opt,loss_func = torch.optim.SGD(model.parameters(), lr=lr, momentum=.9),nn.CrossEntropyLoss()
    def run():
        s = []
        for xb,yb in batches:
            s.append(clock())
            with torch.autocast('cpu', dtype=dtype, enabled=dtype is not None): out = model(xb)
            loss_func(out.float(), yb).backward()
            opt.step(); opt.zero_grad()
        s.append(clock())
        return settled([b-a for a,b in zip(s, s[1:])])
    return run

def interleaved(runs:dict, rounds=5) -> dict:
    "Call every function of `runs` once (warm-up), then once per round, round after round; each one's results, round by round"
    for f in runs.values(): f()
    res = {k: [] for k in runs}
    for _ in range(rounds):
        for k,f in runs.items(): res[k].append(f())
    return res

def med(v) -> float: return statistics.median(v)

def ratio(a, b) -> float:
    "The median over rounds of `a`'s result over `b`'s in the same round: paired, so the machine's drift between rounds cancels"
    return statistics.median(x/y for x,y in zip(a, b))

def table(headers, rows):
    "Print a markdown table; `headers` as 'name' (left), 'name:' (right-aligned) or ':name:' (centred)"
    names = [h.strip(':') for h in headers]
    align = ['---:' if h.endswith(':') and not h.startswith(':') else ':---:' if h.startswith(':') else '---' for h in headers]
    print('| ' + ' | '.join(names) + ' |')
    print('|' + '|'.join(align) + '|')
    for r in rows: print('| ' + ' | '.join(map(str, r)) + ' |')
    print()

def savefig(fig, name, folder=PLOTS):
    "Write `fig` to `folder/<name>.png` (`bench/plots` by default) and say so"
    folder = Path(folder); folder.mkdir(parents=True, exist_ok=True)
    fig.tight_layout(); fig.savefig(folder/f'{name}.png', dpi=110)
    print(f"plot: {os.path.relpath(folder/f'{name}.png')}")

def plt_agg():
    "matplotlib's pyplot on the Agg backend (no display needed)"
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    return plt

def torchao_adamw8bit(**kwargs) -> callable:
    "An `opt_func` for fastai: torchao's `AdamW8bit` through `OptimWrapper`, its `lr` a tensor again before each step"
    from torchao.optim import AdamW8bit
    class FastaiAdamW8bit(AdamW8bit):
        "`AdamW8bit` under fastai's `OptimWrapper`, which writes `lr` as a number (torchao refuses one: it keeps a tensor)"
        def step(self, closure=None):
            for g in self.param_groups:
                if not isinstance(g['lr'], torch.Tensor): g['lr'] = torch.tensor(float(g['lr']))
            return super().step(closure)
    return partial(OptimWrapper, opt=partial(FastaiAdamW8bit, **kwargs))
