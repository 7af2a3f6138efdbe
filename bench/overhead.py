"""Per-step cost of the precision callbacks on a tiny model, where Python, not arithmetic, is the step.

fp32 learner vs mpx AMP fp16/bf16, mpx master fp16 (per-tensor and flat) and fastai 2.8's `MixedPrecision` fp16/bf16,
all on one tiny MLP, fastai's SGD, prebatched data; interleaved rounds, each timing the second half of an epoch: times
are medians, ratios the median of the rounds' paired ratios, the added time that ratio less one times the fp32 median.
fastai's callback runs twice: as it is ('off on CPU': it autocasts and scales on 'cuda' only, so off CUDA both switch
themselves off and it trains in fp32) and with its autocast and `GradScaler` on the CPU ('on CPU', `FastaiAMPOnCPU`:
what it does on a GPU). fastai's `NonNativeMixedPrecision` is tried too: it refuses to run off CUDA.
Run: `.venv/bin/python bench/overhead.py`."""
import time
from _common import *
from copy import deepcopy

ROUNDS,N_BATCHES,BS = 40,10,16

MODES = {
    'fp32 learner':                 lambda l: l,
    **MPX_MODES,
    'fastai AMP fp16 (off on CPU)': lambda l: l.add_cb(ffp16.MixedPrecision()),
    'fastai AMP bf16 (off on CPU)': lambda l: l.add_cb(ffp16.MixedPrecision(amp_mode='bf16')),
    'fastai AMP fp16 (on CPU)':     lambda l: l.add_cb(FastaiAMPOnCPU()),
    'fastai AMP bf16 (on CPU)':     lambda l: l.add_cb(FastaiAMPOnCPU(amp_mode='bf16')),
}

def tiny(): return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))

def non_native_error(batches) -> str:
    "What fastai's `NonNativeMixedPrecision` says when asked to fit on the CPU"
    learn = learner(tiny(), batches, cbs=[ffp16.ModelToHalf(), ffp16.NonNativeMixedPrecision()])
    try: fit_quiet(learn)
    except AssertionError as e: return f"AssertionError: {str(e).splitlines()[-1].strip()}"
    return "ran (a CUDA device?)"

def plot(t):
    plt = plt_agg()
    fig,ax = plt.subplots(figsize=(8, 3.6))
    bars = ax.barh(range(len(t)), [med(v)*1e3 for v in t.values()], color=['C7']+['C0']*4+['C1']*4)
    ax.bar_label(bars, fmt='%.2f', fontsize=7)
    ax.set_yticks(range(len(t)), list(t)); ax.invert_yaxis()
    ax.set(xlabel='ms per training step (median)', title=f"Callback overhead on a tiny MLP, {cpu_name()}, 1 thread")
    savefig(fig, 'overhead')

def main():
    header("precision-callback overhead per step", f"MLP 16->32->2, batch {BS}, {N_BATCHES} prebatched batches an epoch, fastai SGD, {ROUNDS} interleaved rounds timing each epoch's second half: median step, ratios the median of paired ratios")
    batches,model = synth_batches((BS, 16), 2, n=N_BATCHES),tiny()
    learners = {k: f(learner(deepcopy(model), batches)) for k,f in MODES.items()}
    t = interleaved({k: learner_step(l) for k,l in learners.items()}, ROUNDS)
    f = t['fp32 learner']
    table(['mode', 'compute dtype', 'ms/step:', 'vs fp32 learner:', 'added ms/step:'],
          [[k, dtype_of(learners[k]), f"{med(v)*1e3:.3f}", f"{ratio(v, f):.2f}x", f"{(ratio(v, f)-1)*med(f)*1e3:+.3f}"] for k,v in t.items()])
    print(f"fastai NonNativeMixedPrecision on the CPU: {non_native_error(batches)}")
    plot(t)

if __name__ == '__main__':
    s = time.perf_counter(); main(); print(f"# {time.perf_counter()-s:.0f} s")
