"""Train an MLP on scikit-learn's 8x8 digits in fp32, AMP bf16 and AMP fp16 with fastai + mpx, then compare.

Run from the repo root: `.venv/bin/python demo/digits.py [--epochs N]`. No download: the digits ship with scikit-learn.
First the precision advisor says what this machine has (e.g. AVX512-BF16 or AMX on a CPU, tensor cores on a GPU) and
which mode it recommends for this model, from one batch's numerics and a few timed steps. Then each mode trains the
same model from the same seed, and a table compares accuracy and speed and says why a mode is faster or slower.

The model's size comes from the hardware. Where bf16 or fp16 computes fast, the MLP's hidden layers are 1024 wide, so
that the matmuls, not the per-batch work of fastai, autocast's casts and the optimizer, take most of a step, and the
16-bit gain shows in the table as it does in the advisor's timed steps; batches of 256 help too, as a step's matmuls
grow with the batch and its casts and optimizer step do not. Where neither computes fast, the layers are 256 wide, so
that the 16-bit runs, many times slower than fp32 there, still end in a minute or so. Off a terminal (a log file, a pipe, CI)
progress is one line per epoch: `learn.quiet_progress()`. `get_model` is the digits tutorial's small CNN (`--arch cnn`)."""
import argparse, time
from sklearn.datasets import load_digits
import fastai
from fastai.basics import *
from fastai.callback.progress import *
from fastai.callback.schedule import *
from mpx.all import *
from mpx.advisor import *

MODES = ('fp32', 'bf16', 'fp16')
COLS = ('mode', 'accuracy (valid)', 's/epoch', 'speed-up vs fp32', 'final loss scale', 'skipped steps', 'why')
WIDE,NARROW = 1024,256  # the MLP's hidden width where a 16-bit dtype computes fast, and where none does

def get_data(valid_pct=0.2, seed=42):
    "Digits as (N,1,8,8) float32 in [0,1] and int64 labels, split train/valid with a fixed seed"
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32)[:,None] / 16.
    y = torch.tensor(d.target, dtype=torch.int64)
    idx = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_valid = int(len(x) * valid_pct)
    return (x[idx[n_valid:]], y[idx[n_valid:]]), (x[idx[:n_valid]], y[idx[:n_valid]])

class TensorDL(DataLoader):
    "A fastai `DataLoader` over tensors `x` and `y` that indexes a whole batch at once: no per-item collation"
    def __init__(self, x, y, **kwargs): self.x,self.y = x,y; super().__init__(range(len(x)), **kwargs)
    def create_item(self, i): return i
    def create_batch(self, idxs): idxs = torch.tensor(idxs); return self.x[idxs], self.y[idxs]

def get_dls(bs=64, device='cpu'):
    "fastai `DataLoaders` of (x,y) batches, the training ones shuffled (their order comes from the global seed)"
    (xt,yt),(xv,yv) = get_data()
    return DataLoaders(TensorDL(xt, yt, bs=bs, shuffle=True, drop_last=True), TensorDL(xv, yv, bs=bs), device=device)

def conv(ni, nf, stride=1):
    "3x3 conv, BatchNorm, ReLU"
    return nn.Sequential(nn.Conv2d(ni, nf, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(nf), nn.ReLU())

def get_model():
    "8x8 -> 8x8 -> 4x4 -> 2x2, then global average pooling and a linear head"
    return nn.Sequential(conv(1,16), conv(16,32,2), conv(32,64,2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64,10))

def get_mlp(width=WIDE):
    "64 pixels -> `width` -> `width` -> 10"
    return nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))

def mlp_width(hw:Hardware) -> int:
    "The MLP's hidden width for hardware `hw`: wide where a 16-bit dtype computes fast, so that its matmuls decide a step's time"
    return WIDE if hw.bf16_fast or hw.fp16_fast else NARROW

def describe(arch='mlp', width=WIDE) -> str:
    "The model in a few words"
    return f'MLP 64-{width}-{width}-10' if arch == 'mlp' else 'CNN 16-32-64 channels'

def epoch_clock(device='cpu'):
    "This thread's CPU time where torch computes on it alone, on a CPU (time other processes take is not counted); else wall time"
    return time.thread_time if torch.device(device).type == 'cpu' and torch.get_num_threads() == 1 else time.perf_counter

class EpochTimer(Callback):
    "Time of the training phase of each epoch (forward, backward, step), validation excluded, by `clock`"
    def __init__(self, clock=time.perf_counter): self.clock = clock
    def before_fit(self): self.times = []
    def before_train(self): self.t0 = self.clock()
    def after_train(self):
        if torch.cuda.is_initialized(): torch.cuda.synchronize()  # the epoch's kernels are done
        self.times.append(self.clock() - self.t0)

def get_learner(bs=256, device='cpu', arch='mlp', width=WIDE):
    "A learner from seed 42 (same init, same data order every time), in fp32, its progress one line per epoch off a terminal"
    set_seed(42, reproducible=True)
    model = get_mlp(width) if arch == 'mlp' else get_model()
    timer = EpochTimer(epoch_clock(device))
    return Learner(get_dls(bs, device), model, loss_func=CrossEntropyLossFlat(), metrics=accuracy, cbs=timer).quiet_progress()

def advise(bs=256, device='cpu', arch='mlp', width=WIDE):
    "The advisor's report on the demo's learner: hardware, one batch's numerics and a few timed steps per mode"
    return get_learner(bs, device, arch, width).precision_report(time=True)

def format_advice(report):
    "The hardware line, the recommendation and its reasons"
    head = [f'hardware: {report.hardware}', f'advisor: {report.recommended} recommended']
    return '\n'.join(head + [f'  - {plain_text(r)}' for r in report.reasons])  # a terminal shows no markdown: `0` as '0'

def outlook(hw:Hardware, arch='mlp', width=WIDE) -> str:
    "What the table below can show on hardware `hw`, said before the runs"
    fast = [m for m in ('bf16', 'fp16') if getattr(hw, f'{m}_fast')]
    if not fast: return (f'model: {describe(arch, width)}. This {hw.device} computes neither bf16 nor fp16 fast: expect the 16-bit '
                         'runs to be slower than fp32 (the table says why); they train here to compare accuracy. Use fp32 on it.')
    if arch != 'mlp': return f'model: {describe(arch, width)}'
    return f'model: {describe(arch, width)}: its matmuls, fast in {" and ".join(fast)} here, take most of a step'

def train(mode='fp32', epochs=8, bs=256, lr=5e-3, device='cpu', arch='mlp', width=WIDE):
    "Train from the same seed (same init, same data order) in `mode`; return a row of measurements"
    if mode not in MODES: raise ValueError(f'unknown mode {mode!r}')
    print(f'\n== {mode}', flush=True)
    learn = get_learner(bs, device, arch, width)
    if mode == 'bf16': learn.to_bf16()
    elif mode == 'fp16': learn.to_fp16()
    learn.fit_one_cycle(epochs, lr)
    mp = getattr(learn, 'mixed_precision', None)  # absent in fp32
    return dict(mode=mode, accuracy=float(learn.recorder.values[-1][-1]),  # last epoch's metric: accuracy
                secs_per_epoch=min(learn.epoch_timer.times),  # the least disturbed epoch: warm-up and other processes only add time
                loss_scale=None if mp is None else float(mp.loss_scale),
                skipped_steps=None if mp is None else int(mp.skipped_steps),
                total_steps=None if mp is None else int(mp.total_steps))

def _note(hw:Hardware, mode:str) -> str:
    "The hardware's note on `mode`, without its 'bf16: ' prefix"
    return next((n.split(': ', 1)[1] for n in hw.notes if n.startswith(f'{mode}: ')), '')

def why(mode:str, speedup:float|None, hw:Hardware) -> str:
    "Why `mode` trained at `speedup` times fp32's speed on `hw`: the hardware's reason, or the overhead where the hardware is fast"
    if mode == 'fp32' or speedup is None: return '-'
    if speedup >= 1: return _note(hw, mode) or '-'
    return slow_reason(hw, mode) or (f'{mode} computes fast here, but at this model size the per-batch work (casts, optimizer, '
                                     'fastai) outweighs what its faster matmuls save')

def _cells(r, fp32_secs, hw):
    "One table row as strings; '-' where a value does not apply"
    speedup = fp32_secs/r['secs_per_epoch'] if fp32_secs else None
    scale = '-' if r['loss_scale'] is None else f'{r["loss_scale"]:g}'
    skipped = '-' if r['skipped_steps'] is None else f'{r["skipped_steps"]} of {r["total_steps"]}'
    return (r['mode'], f'{r["accuracy"]:.4f}', f'{r["secs_per_epoch"]:.3f}', '-' if speedup is None else f'{speedup:.2f}x',
            scale, skipped, why(r['mode'], speedup, hw))

def _fp32_secs(rows): return next((r['secs_per_epoch'] for r in rows if r['mode'] == 'fp32'), None)

def format_table(rows, hw:Hardware):
    "Plain-text table; speed-up is fp32 s/epoch divided by this mode's (needs an fp32 row); `why` from `hw`"
    lines = [COLS] + [_cells(r, _fp32_secs(rows), hw) for r in rows]
    ws = [max(len(l[i]) for l in lines) for i in range(len(COLS))]
    fmt = lambda l: '  '.join(c.ljust(w) for c,w in zip(l,ws)).rstrip()
    return '\n'.join([fmt(lines[0]), '  '.join('-'*w for w in ws[:-1]) + '  ---'] + [fmt(l) for l in lines[1:]])

def verdict(report, rows) -> str:
    "Whether the table bears out the advisor's pick: the pick's speed-up in training against the one it measured"
    speedups = {r['mode']: _fp32_secs(rows)/r['secs_per_epoch'] for r in rows}
    pick,measured = report.recommended,report.speedups.get(report.recommended)
    if pick == 'fp32':
        others = ', '.join(f'{m} {s:.2f}x' for m,s in speedups.items() if m != 'fp32')
        return f'verdict: fp32, the advisor\'s pick, is the mode to use here: in training the 16-bit modes ran at {others} its speed'
    if pick not in speedups: return f'verdict: {pick}, the advisor\'s pick, was not trained here'
    said = f'{speedups[pick]:.2f}x fp32\'s speed in training'
    if measured is not None: said += f', {measured:.2f}x in the advisor\'s timed steps'
    if speedups[pick] > 1: return f'verdict: {pick}, the advisor\'s pick, ran at {said}'
    return (f'verdict: {pick}, the advisor\'s pick, ran at only {said}: they disagree. The machine may have been busy during '
            'one of them; run again, or time it with learn.precision_report(time=True) on your own model')

def main(epochs=8, bs=256, device='cpu', arch='mlp', threads=1, width=None):
    "The advisor's report, then a training run per mode, the comparison table and the verdict"
    if threads: torch.set_num_threads(threads)  # one thread: on a shared machine a busy core stalls every parallel op, whatever the mode
    hw = detect_hardware(device)
    width = width or mlp_width(hw)
    report = advise(bs, device, arch, width)
    print(format_advice(report))
    print(outlook(report.hardware, arch, width))
    rows = [train(m, epochs, bs, device=device, arch=arch, width=width) for m in MODES]
    n,clock = torch.get_num_threads(),'CPU' if epoch_clock(device) is time.thread_time else 'wall'
    print(f'\ndevice: {device}, {n} thread{"s"*(n > 1)} | torch {torch.__version__} | fastai {fastai.__version__} | '
          f'{describe(arch, width)}, {epochs} epochs, bs {bs} | s/epoch: the fastest epoch\'s training phase, in {clock} time')
    print(f'hardware: {report.hardware}\nadvisor: {report.recommended} recommended ({plain_text(report.reasons[0])})')
    print(format_table(rows, report.hardware))
    print(verdict(report, rows))
    return rows

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--epochs', type=int, default=8)
    p.add_argument('--bs', type=int, default=256)
    p.add_argument('--device', default='cpu', help="e.g. 'cuda' where there is a GPU")
    p.add_argument('--arch', default='mlp', choices=['mlp', 'cnn'], help="'mlp': the MLP; 'cnn': the tutorial's small CNN")
    p.add_argument('--width', type=int, default=None, help=f"the MLP's hidden width; default {WIDE}, or {NARROW} where 16 bits are slow")
    p.add_argument('--threads', type=int, default=1, help="torch's CPU threads; 0: torch's choice")
    a = p.parse_args()
    main(a.epochs, a.bs, a.device, a.arch, a.threads, a.width)
