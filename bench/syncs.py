"""Host syncs per training step, counted with `CountSyncs`: mpx's callbacks and fastai 2.8's, at 10, 100 and 1000 parameter tensors.

Each mode's count is the syncs of a fit with the callback minus those of a fit of the same learner without it (fastai's
own per-batch syncs), divided by the optimizer steps; fastai's legacy `grad_overflow` is counted on the gradients of N
half tensors directly. Counts, not times: they are the same on any machine, except fastai's AMP callback, whose
`GradScaler` and autocast switch themselves off where CUDA is missing. Run: `.venv/bin/python bench/syncs.py`."""
import textwrap, time
from _common import *

N_BATCHES,SIZES = 4,(10, 100, 1000)

class ManyParams(Module):
    "A linear layer and the mean of `n`-2 bias vectors added to its output: `n` parameter tensors, every one trained"
    def __init__(self, n): self.lin,self.ps = nn.Linear(8, 2),nn.ParameterList([nn.Parameter(torch.zeros(2)) for _ in range(n-2)])
    def forward(self, x): return self.lin(x) + sum(self.ps) / len(self.ps)

MODES = {  # name: (the callback, syncs per step on CUDA: mpx's as tests/test_gpu.py checks, fastai's from its code)
    'mpx AMP fp16':                 (lambda: MixedPrecision('fp16'), '1'),
    'mpx AMP bf16':                 (lambda: MixedPrecision('bf16'), '1'),
    'mpx AMP bf16, check_finite=False': (lambda: MixedPrecision('bf16', check_finite=False), '0'),
    'mpx master fp16 per-tensor':   (lambda: MasterPrecision('fp16'), '1'),
    'mpx master bf16':              (lambda: MasterPrecision('bf16'), '1'),
    'fastai AMP fp16 (off on CPU)': (lambda: ffp16.MixedPrecision(), '2'),
    'fastai AMP bf16 (off on CPU)': (lambda: ffp16.MixedPrecision(amp_mode='bf16'), '0'),
    'fastai AMP fp16 (on CPU)':     (lambda: FastaiAMPOnCPU(), '2'),
}

def fit_syncs(learn) -> int:
    "Host syncs of one quiet fit of `learn`"
    with CountSyncs() as c: fit_quiet(learn)
    return c.n

def per_step(cb, n) -> float:
    "Syncs per optimizer step that the callback `cb` adds to a learner of `n` parameter tensors"
    learn = learner(ManyParams(n), synth_batches((16, 8), 2, n=N_BATCHES))
    base = fit_syncs(learn)
    return (fit_syncs(learn.add_cb(cb)) - base) / N_BATCHES

def grad_overflow_syncs(n) -> int:
    "Host syncs of fastai's legacy `grad_overflow` on `n` half parameters with gradients"
    ps = [nn.Parameter(torch.zeros(2, dtype=torch.half)) for _ in range(n)]
    for p in ps: p.grad = torch.ones_like(p)
    with CountSyncs() as c: ffp16.grad_overflow([ps])
    return c.n

def fmt(v) -> str: return f"{v:g}"

def plot(res):
    plt = plt_agg()
    fig,ax = plt.subplots(figsize=(9, 4.2))
    w = .8/len(SIZES)
    for j,n in enumerate(SIZES):
        bars = ax.bar([i + (j-1)*w for i in range(len(res))], [v[j] for v in res.values()], w, label=f'{n} tensors')
        ax.bar_label(bars, fmt='%g', fontsize=6)
    ax.set_xticks(range(len(res)), [textwrap.fill(k, 13) for k in res], fontsize=7)
    ax.set(yscale='symlog', ylabel='host syncs per optimizer step', title='Host syncs per optimizer step (CountSyncs, CPU run)')
    ax.legend(fontsize=7)
    savefig(fig, 'syncs')

def main():
    header("host syncs per optimizer step", f"CountSyncs over a quiet fit of {N_BATCHES} batches, with the callback minus without it, / steps")
    res = {k: [per_step(cb(), n) for n in SIZES] for k,(cb,_) in MODES.items()}
    res['fastai grad_overflow (legacy)'] = [grad_overflow_syncs(n) for n in SIZES]
    gpu = {k: e for k,(_,e) in MODES.items()} | {'fastai grad_overflow (legacy)': 'N'}
    table(['mode'] + [f'{n} tensors:' for n in SIZES] + ['on CUDA (from the code):'], [[k] + list(map(fmt, v)) + [gpu[k]] for k,v in res.items()])
    plot(res)

if __name__ == '__main__':
    s = time.perf_counter(); main(); print(f"# {time.perf_counter()-s:.0f} s")
