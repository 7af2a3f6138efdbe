"""What bounds pure kahan's compiled step (issue 27): one Adam step over 5.27M elements as one `torch.compile`d kernel,
in the storage of each mode, timed side by side in interleaved rounds on one thread.

The kernels are mpx's own: the widen and fold of each kind (`kernel_widen`/`kernel_fold` of `mpx.pure`), around the same Adam
arithmetic. mpx's split rounds with `bf16_nearest`, integer ops on the bits (an integer view, which inductor's CPU code
writes as a store, a loop over a vector's lanes and a load). The same split rounded by converting to bf16 and back in a
kernel compiled with `emulate_precision_casts` (`kahan_kept_casts`: inductor drops those round trips otherwise) and in
fp32 arithmetic alone (`kahan_float`: Veltkamp's split, with the ranges it cannot round done apart), and one rounding
of the weight (the compensation stored by the conversion, so a pair may not be canonical) show what each costs. Every
arm reads bf16 gradients, so the bytes moved differ only in the weights' storage.

`--exhaustive` instead checks `float_nearest` against the conversion on all 2**32 fp32 bit patterns, eagerly and compiled
(some minutes on one core).
"""
import argparse, statistics, sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).parent))
from _common import clock, header
from mpx.pure import KahanKind
from mpx.lowbit import bf16_nearest

def adam(x, g, m, v, lr=1e-3, b1=.9, b2=.99, eps=1e-5, wd=1e-2, step=10):
    "Adam with decoupled weight decay on fp32 `x`, state `m`,`v` updated in place: the new fp32 weights"
    m.mul_(b1).add_(g, alpha=1-b1); v.mul_(b2).addcmul_(g, g, value=1-b2)
    return x*(1-lr*wd) - lr * (m/(1-b1**step)) / ((v/(1-b2**step)).sqrt() + eps)

def fp32_weights(w, c, g, m, v): w.copy_(adam(w, g.float(), m, v))               # AMP's and the master mode's kernel
def bf16_weights(w, c, g, m, v): w.copy_(adam(w.float(), g.float(), m, v))       # bf16 weights, rounded to nearest, no compensation
def kahan(w, c, g, m, v):                                                         # mpx's: the canonical split, on the bits
    x,gf = KahanKind.kernel_widen(dict(w=w, c=c, g=g), {})
    out = KahanKind.kernel_fold({}, {}, adam(x, gf, m, v)); w.copy_(out['w']); c.copy_(out['c'])
def kahan_one_rounding(w, c, g, m, v):
    x = adam(w.float() + c.float(), g.float(), m, v); hi = bf16_nearest(x); w.copy_(hi); c.copy_(x - hi)

def kept_casts_nearest(x): return x.bfloat16().float()  # a rounding only where inductor keeps round trips (`OPTIONS`)

def float_nearest(x):
    "fp32 `x` to the nearest bf16 (ties to even), still fp32, in fp32 arithmetic alone: the conversion's value for every fp32"
    a = x.abs()
    y = x * torch.where(a < 2.**111, 1., 2.**-32)  # scaled where `65537 * x` could overflow
    t = y * 65537.
    r = (t + (y - t)) * torch.where(a < 2.**111, 1., 2.**32)  # Veltkamp's split: `y`'s 8 high significant bits, to nearest
    k = torch.where(x < 0, -2.**-110, 2.**-110)
    sub = (x + k) - k  # below 2**-126 bf16's numbers are subnormal, 2**-133 apart: to a multiple of that
    r = torch.where(a < 2.**-126, torch.where(sub == 0, x * 0., sub), r)  # `x * 0.`: a zero of `x`'s sign
    return torch.where(a == float('inf'), x, r)

def split_with(nearest):
    "The canonical split, rounded by `nearest`"
    def arm(w, c, g, m, v):
        x = adam(w.float() + c.float(), g.float(), m, v)
        hi = nearest(x); s = hi + nearest(x - hi); hi = nearest(s); w.copy_(hi); c.copy_(s - hi)
    return arm

ARMS = dict(fp32_weights=fp32_weights, bf16_weights=bf16_weights, kahan=kahan, kahan_kept_casts=split_with(kept_casts_nearest),
            kahan_float=split_with(float_nearest), kahan_one_rounding=kahan_one_rounding)
OPTIONS = dict(kahan_kept_casts={'emulate_precision_casts': True})  # round trips through bf16 kept

def exhaustive():
    "`float_nearest` against the conversion on every fp32 bit pattern, eager and compiled"
    torch.set_num_threads(1)
    fs,bad,n = dict(eager=float_nearest, compiled=torch.compile(float_nearest, dynamic=True)),dict(eager=0, compiled=0),1 << 24
    for start in range(0, 1 << 32, n):
        b = torch.arange(start, start + n, dtype=torch.int64)
        x = torch.where(b >= 2**31, b - 2**32, b).to(torch.int32).view(torch.float32)
        ref = x.bfloat16().float()
        for k,f in fs.items():
            r = f(x)
            bad[k] += int(((r.view(torch.int32) != ref.view(torch.int32)) & ~(r.isnan() & ref.isnan())).sum())
    print(f'float_nearest against the conversion, all 2**32 fp32 bit patterns: mismatches {bad}')

def buffers(name, n):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, generator=gen)
    w = w if name == 'fp32_weights' else w.bfloat16()
    return w,torch.zeros(n, dtype=torch.bfloat16),(torch.randn(n, generator=gen)*1e-3).bfloat16(),torch.zeros(n),torch.zeros(n)

def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--n', type=int, default=5_270_000, help='elements (default: the MLP of bench/step.py)')
    ap.add_argument('--rounds', type=int, default=7); ap.add_argument('--reps', type=int, default=5)
    ap.add_argument('--exhaustive', action='store_true', help="check `float_nearest` on every fp32 bit pattern instead")
    a = ap.parse_args()
    if a.exhaustive: return exhaustive()
    header('The compiled step kernel of each storage', f'{a.n:,} elements, Adam; {a.rounds} interleaved rounds of {a.reps} calls, '
           'median call per round; ratio: fp32_weights over the arm, the median of paired per-round ratios')
    fs = {k: torch.compile(f, fullgraph=True, options=OPTIONS.get(k)) for k,f in ARMS.items()}
    bufs = {k: buffers(k, a.n) for k in ARMS}
    for k in ARMS: fs[k](*bufs[k])  # compile
    ms = {k: [] for k in ARMS}
    for _ in range(a.rounds):
        for k in ARMS:
            ts = []
            for _ in range(a.reps): t = clock(); fs[k](*bufs[k]); ts.append(clock() - t)
            ms[k].append(statistics.median(ts) * 1e3)
    print('| kernel | ms a call | bytes moved a parameter | vs fp32_weights |\n|---|---:|---:|---:|')
    moved = dict(fp32_weights=26, bf16_weights=22, kahan=26, kahan_kept_casts=26, kahan_float=26, kahan_one_rounding=26)
    for k in ARMS:
        r = statistics.median(b/x for b,x in zip(ms['fp32_weights'], ms[k]))
        print(f"| {k} | {statistics.median(ms[k]):.2f} | {moved[k]} | {r:.2f}x |")

if __name__ == '__main__': main()
