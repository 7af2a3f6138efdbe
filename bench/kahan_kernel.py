"""What bounds pure kahan's compiled step (issue 27): one Adam step over 5.27M elements as one `torch.compile`d kernel,
in the storage of each mode, timed side by side in interleaved rounds on one thread.

The kernels are mpx's own: the widen and fold of each kind (`kwiden`/`kfold` of `mpx.pure`), around the same Adam
arithmetic. Two variants that mpx does not use show what the canonical Kahan split costs: one rounding of the weight
(the compensation stored by the conversion, so a pair may not be canonical), and a split with fp32 arithmetic alone
(Veltkamp's, `x*(2**16+1)`), which needs no integer view of the bits but rounds ties its own way. Every arm reads
bf16 gradients, so the bytes moved differ only in the weights' storage.
"""
import argparse, statistics, sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).parent))
from _common import clock, header
from mpx.pure import KahanKind, bf16_nearest

def adam(x, g, m, v, lr=1e-3, b1=.9, b2=.99, eps=1e-5, wd=1e-2, step=10):
    "Adam with decoupled weight decay on fp32 `x`, state `m`,`v` updated in place: the new fp32 weights"
    m.mul_(b1).add_(g, alpha=1-b1); v.mul_(b2).addcmul_(g, g, value=1-b2)
    return x*(1-lr*wd) - lr * (m/(1-b1**step)) / ((v/(1-b2**step)).sqrt() + eps)

def fp32_weights(w, c, g, m, v): w.copy_(adam(w, g.float(), m, v))               # AMP's and the master mode's kernel
def bf16_weights(w, c, g, m, v): w.copy_(adam(w.float(), g.float(), m, v))       # bf16 weights, rounded to nearest, no compensation
def kahan(w, c, g, m, v):                                                         # mpx's: the canonical split, on the bits
    x,gf = KahanKind.kwiden(dict(w=w, c=c, g=g), {})
    out = KahanKind.kfold({}, {}, adam(x, gf, m, v)); w.copy_(out['w']); c.copy_(out['c'])
def kahan_one_rounding(w, c, g, m, v):
    x = adam(w.float() + c.float(), g.float(), m, v); hi = bf16_nearest(x); w.copy_(hi); c.copy_(x - hi)
def kahan_veltkamp(w, c, g, m, v):
    x = adam(w.float() + c.float(), g.float(), m, v); t = x * float(2**16 + 1); hi = t - (t - x); w.copy_(hi); c.copy_(x - hi)

ARMS = dict(fp32_weights=fp32_weights, bf16_weights=bf16_weights, kahan=kahan, kahan_one_rounding=kahan_one_rounding,
            kahan_veltkamp=kahan_veltkamp)

def buffers(name, n):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, generator=gen)
    w = w if name == 'fp32_weights' else w.bfloat16()
    return w,torch.zeros(n, dtype=torch.bfloat16),(torch.randn(n, generator=gen)*1e-3).bfloat16(),torch.zeros(n),torch.zeros(n)

def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--n', type=int, default=5_270_000, help='elements (default: the MLP of bench/step.py)')
    ap.add_argument('--rounds', type=int, default=7); ap.add_argument('--reps', type=int, default=5)
    a = ap.parse_args()
    header('The compiled step kernel of each storage', f'{a.n:,} elements, Adam; {a.rounds} interleaved rounds of {a.reps} calls, '
           'median call per round; ratio: fp32_weights over the arm, the median of paired per-round ratios')
    fs = {k: torch.compile(f, fullgraph=True) for k,f in ARMS.items()}
    bufs = {k: buffers(k, a.n) for k in ARMS}
    for k in ARMS: fs[k](*bufs[k])  # compile
    ms = {k: [] for k in ARMS}
    for _ in range(a.rounds):
        for k in ARMS:
            ts = []
            for _ in range(a.reps): t = clock(); fs[k](*bufs[k]); ts.append(clock() - t)
            ms[k].append(statistics.median(ts) * 1e3)
    print('| kernel | ms a call | bytes moved a parameter | vs fp32_weights |\n|---|---:|---:|---:|')
    moved = dict(fp32_weights=26, bf16_weights=22, kahan=26, kahan_one_rounding=26, kahan_veltkamp=26)
    for k in ARMS:
        r = statistics.median(b/x for b,x in zip(ms['fp32_weights'], ms[k]))
        print(f"| {k} | {statistics.median(ms[k]):.2f} | {moved[k]} | {r:.2f}x |")

if __name__ == '__main__': main()
