"""Train a wide MLP on scikit-learn's 8x8 digits in fp32, AMP bf16 and AMP fp16 with fastai + mpx, then compare.

Run from the repo root: `.venv/bin/python demo/digits.py [--epochs N]`. No download: the digits ship with scikit-learn.
First the precision advisor says what this machine has (e.g. AVX512-BF16 or AMX on a CPU, tensor cores on a GPU) and
which mode it recommends for this model, from one batch's numerics and a few timed steps. The MLP's two 512-wide
hidden layers make the matmuls, not fastai's per-batch overhead, take the time, so the table shows what 16 bits buy
here: faster than fp32 where the hardware has fast bf16 or fp16 kernels, several times slower where it has none.
Timings are whatever this machine gives. `get_model` is the small CNN of the digits tutorial (`--arch cnn`)."""
import argparse, statistics, time
from sklearn.datasets import load_digits
import fastai
from fastai.basics import *
from fastai.callback.progress import *
from fastai.callback.schedule import *
from mpx.all import *
from mpx.advisor import *

MODES = ('fp32', 'bf16', 'fp16')
COLS = ('mode', 'accuracy (valid)', 's/epoch', 'speed-up vs fp32', 'final loss scale', 'skipped steps')

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

def get_mlp(width=512):
    "64 pixels -> `width` -> `width` -> 10: wide enough that 16-bit matmuls can pay off"
    return nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))

ARCHS = dict(mlp=get_mlp, cnn=get_model)

class EpochTimer(Callback):
    "Wall time of the training phase of each epoch (forward, backward, step), validation excluded"
    def before_fit(self): self.times = []
    def before_train(self): self.t0 = time.perf_counter()
    def after_train(self): self.times.append(time.perf_counter() - self.t0)

def get_learner(bs=128, device='cpu', arch='mlp'):
    "A learner from seed 42 (same init, same data order every time), in fp32"
    set_seed(42, reproducible=True)
    return Learner(get_dls(bs, device), ARCHS[arch](), loss_func=CrossEntropyLossFlat(), metrics=accuracy, cbs=EpochTimer())

def advise(bs=128, device='cpu', arch='mlp'):
    "The advisor's report on the demo's learner: hardware, one batch's numerics and a few timed steps per mode"
    return get_learner(bs, device, arch).precision_report(time=True)

def format_advice(report):
    "The hardware line, the recommendation and its reasons"
    return '\n'.join([f'hardware: {report.hardware}', f'advisor: {report.recommended} recommended'] + [f'  - {r}' for r in report.reasons])

def train(mode='fp32', epochs=5, bs=128, lr=1e-2, device='cpu', arch='mlp'):
    "Train from the same seed (same init, same data order) in `mode`; return a row of measurements"
    if mode not in MODES: raise ValueError(f'unknown mode {mode!r}')
    learn = get_learner(bs, device, arch)
    if mode == 'bf16': learn.to_bf16()
    elif mode == 'fp16': learn.to_fp16()
    print(f'\n== {mode}')
    learn.fit_one_cycle(epochs, lr)
    mp = getattr(learn, 'mixed_precision', None)  # absent in fp32
    return dict(mode=mode, accuracy=float(learn.recorder.values[-1][-1]),  # last epoch's metric: accuracy
                secs_per_epoch=statistics.median(learn.epoch_timer.times),  # median: a slow first epoch does not count
                loss_scale=None if mp is None else float(mp.loss_scale),
                skipped_steps=None if mp is None else int(mp.skipped_steps),
                total_steps=None if mp is None else int(mp.total_steps))

def _cells(r, fp32_secs):
    "One table row as strings; '-' where a value does not apply"
    speedup = f'{fp32_secs/r["secs_per_epoch"]:.2f}x' if fp32_secs else '-'
    scale = '-' if r['loss_scale'] is None else f'{r["loss_scale"]:g}'
    skipped = '-' if r['skipped_steps'] is None else f'{r["skipped_steps"]} of {r["total_steps"]}'
    return (r['mode'], f'{r["accuracy"]:.4f}', f'{r["secs_per_epoch"]:.3f}', speedup, scale, skipped)

def format_table(rows):
    "Plain-text table; speed-up is fp32 s/epoch divided by this mode's (needs an fp32 row)"
    fp32_secs = next((r['secs_per_epoch'] for r in rows if r['mode'] == 'fp32'), None)
    lines = [COLS] + [_cells(r, fp32_secs) for r in rows]
    ws = [max(len(l[i]) for l in lines) for i in range(len(COLS))]
    fmt = lambda l: '  '.join(c.ljust(w) for c,w in zip(l,ws)).rstrip()
    return '\n'.join([fmt(lines[0]), '  '.join('-'*w for w in ws)] + [fmt(l) for l in lines[1:]])

def main(epochs=5, bs=128, device='cpu', arch='mlp', threads=1):
    "The advisor's report, then a training run per mode and the comparison table"
    if threads: torch.set_num_threads(threads)  # one thread: on a shared machine a busy core stalls every parallel op, whatever the mode
    report = advise(bs, device, arch)
    print(format_advice(report))
    rows = [train(m, epochs, bs, device=device, arch=arch) for m in MODES]
    print(f'\ndevice: {device} ({torch.get_num_threads()} threads) | torch {torch.__version__} | fastai {fastai.__version__}'
          f' | {arch}, {epochs} epochs, bs {bs}, s/epoch = median training-phase wall time')
    print(f'hardware: {report.hardware}\nadvisor: {report.recommended} recommended ({report.reasons[0]})')
    print(format_table(rows))
    return rows

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--epochs', type=int, default=5)
    p.add_argument('--bs', type=int, default=128)
    p.add_argument('--device', default='cpu', help="e.g. 'cuda' where there is a GPU")
    p.add_argument('--arch', default='mlp', choices=list(ARCHS), help="'mlp': the wide MLP; 'cnn': the tutorial's small CNN")
    p.add_argument('--threads', type=int, default=1, help="torch's CPU threads; 0: torch's choice")
    a = p.parse_args()
    main(a.epochs, a.bs, a.device, a.arch, a.threads)
