"""Train a small CNN on scikit-learn's 8x8 digits in fp32, AMP bf16 and AMP fp16 with fastai + mpx, then compare.

Run from the repo root: `.venv/bin/python demo/digits.py [--epochs N]`. No download: the digits ship with scikit-learn.
Timings are whatever this machine gives: on a CPU without native bf16/fp16 kernels the half-precision modes are
*slower* than fp32 (the point here is loss scaling and skipped steps you can observe, not speed)."""
import argparse, statistics, time
from sklearn.datasets import load_digits
import fastai
from fastai.basics import *
from fastai.callback.progress import *
from fastai.callback.schedule import *
from mpx.all import *

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

def get_dls(bs=64, device='cpu'):
    "fastai `DataLoaders` over lists of (x,y) tuples; the train order comes from the global seed"
    (xt,yt),(xv,yv) = get_data()
    return DataLoaders.from_dsets(list(zip(xt,yt)), list(zip(xv,yv)), bs=bs, device=device)

def conv(ni, nf, stride=1):
    "3x3 conv, BatchNorm, ReLU"
    return nn.Sequential(nn.Conv2d(ni, nf, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(nf), nn.ReLU())

def get_model():
    "8x8 -> 8x8 -> 4x4 -> 2x2, then global average pooling and a linear head"
    return nn.Sequential(conv(1,16), conv(16,32,2), conv(32,64,2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64,10))

class EpochTimer(Callback):
    "Wall time of the training phase of each epoch (forward, backward, step), validation excluded"
    def before_fit(self): self.times = []
    def before_train(self): self.t0 = time.perf_counter()
    def after_train(self): self.times.append(time.perf_counter() - self.t0)

def train(mode='fp32', epochs=5, bs=64, lr=1e-2, device='cpu'):
    "Train from the same seed (same init, same data order) in `mode`; return a row of measurements"
    set_seed(42, reproducible=True)
    dls,model = get_dls(bs, device),get_model()
    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), metrics=accuracy, cbs=EpochTimer())
    if mode == 'bf16': learn.to_bf16()
    elif mode == 'fp16': learn.to_fp16()
    elif mode != 'fp32': raise ValueError(f'unknown mode {mode!r}')
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

def main(epochs=5, bs=64, device='cpu'):
    rows = [train(m, epochs, bs, device=device) for m in MODES]
    print(f'\ndevice: {device} ({torch.get_num_threads()} threads) | torch {torch.__version__} | fastai {fastai.__version__}'
          f' | {epochs} epochs, bs {bs}, s/epoch = median training-phase wall time')
    print(format_table(rows))
    return rows

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--epochs', type=int, default=5)
    p.add_argument('--bs', type=int, default=64)
    p.add_argument('--device', default='cpu', help="e.g. 'cuda' where there is a GPU")
    a = p.parse_args()
    main(a.epochs, a.bs, a.device)
