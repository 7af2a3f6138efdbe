"""Per-step cost of the precision callbacks on a tiny model, where Python, not arithmetic, is the step.

fp32 learner vs mpx AMP fp16/bf16, mpx master fp16 (per-tensor and flat) and fastai 2.8's `MixedPrecision` fp16/bf16,
all on one tiny MLP, fastai's SGD, prebatched data; interleaved rounds, each timing the second half of an epoch: times
are medians, ratios the median of the rounds' paired ratios, the added time that ratio less one times the fp32 median.
fastai's callback runs twice: as it is ('off on CPU': it autocasts and scales on 'cuda' only, so off CUDA both switch
themselves off and it trains in fp32) and with its autocast and `GradScaler` on the CPU ('on CPU', `FastaiAMPOnCPU`:
what it does on a GPU). fastai's `NonNativeMixedPrecision` is tried too: it refuses to run off CUDA.
A second table prices the bf16 finite-check guard: bf16 AMP and bf16 master with `check_finite=True` (one fused inf/nan
check and one host sync per optimizer step) against `check_finite=False` (neither) and fp32, on the same model in one
interleaved run, with the host syncs each adds per step (counted with `CountSyncs`, as `bench/syncs.py` does); where this
mpx has no `check_finite` yet it says so instead. Run: `.venv/bin/python bench/overhead.py` (`... overhead.py guard`:
the guard table only)."""
import inspect, sys, time
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

def has_check_finite() -> bool:
    "Whether this mpx's `MixedPrecision` and `MasterPrecision` take `check_finite`"
    return all('check_finite' in inspect.signature(c.__init__).parameters for c in (MixedPrecision, MasterPrecision))

GUARD_MODES = {  # name: (what makes a learner train that way, the row whose time the guard's cost is measured against)
    'fp32 learner':                     (lambda l: l, None),
    'AMP bf16, check_finite=False':     (lambda l: l.to_bf16(check_finite=False), None),
    'AMP bf16, check_finite=True':      (lambda l: l.to_bf16(check_finite=True), 'AMP bf16, check_finite=False'),
    'master bf16, check_finite=False':  (lambda l: l.to_bf16(master=True, check_finite=False), None),
    'master bf16, check_finite=True':   (lambda l: l.to_bf16(master=True, check_finite=True), 'master bf16, check_finite=False'),
}

def syncs_per_step(learn, base:int) -> float:
    "Host syncs per optimizer step of one fit of `learn` beyond `base`, the fp32 learner's"
    with CountSyncs() as c: fit_quiet(learn)
    return (c.n - base) / N_BATCHES

def guard():
    "Time bf16 with and without the finite-check guard against fp32, side by side, with the syncs each adds per step"
    header("cost of the bf16 finite-check guard (check_finite)", f"MLP 16->32->2, batch {BS}, {N_BATCHES} prebatched batches an epoch, fastai SGD, {ROUNDS} interleaved rounds timing each epoch's second half: median step, ratios the median of paired ratios")
    if not has_check_finite():
        print("note: this mpx's MixedPrecision/MasterPrecision take no `check_finite` argument yet, so there is no bf16 guard to switch off and nothing to compare: the guard table is skipped\n")
        return
    batches,model = synth_batches((BS, 16), 2, n=N_BATCHES),tiny()
    learners = {k: f(learner(deepcopy(model), batches)) for k,(f,_) in GUARD_MODES.items()}
    for k,l in list(learners.items()):
        try: fit_quiet(l)
        except Exception as e: print(f"note: {k} does not train here and is left out: {type(e).__name__}: {e}"); del learners[k]
    t = interleaved({k: learner_step(l) for k,l in learners.items()}, ROUNDS)
    f,rows = t['fp32 learner'],[]
    with CountSyncs() as c: fit_quiet(learners['fp32 learner'])
    base = c.n
    for k,v in t.items():
        ref = GUARD_MODES[k][1] if GUARD_MODES[k][1] in t else None
        vs_off = f"{ratio(v, t[ref]):.3f}x ({(ratio(v, t[ref])-1)*med(t[ref])*1e3:+.4f} ms)" if ref else ''
        rows.append([k, dtype_of(learners[k]), f"{med(v)*1e3:.3f}", f"{ratio(v, f):.2f}x", vs_off, f"{syncs_per_step(learners[k], base):g}"])
    table(['mode', 'compute dtype', 'ms/step:', 'vs fp32 learner:', 'guard vs check_finite=False:', 'host syncs/step:'], rows)

if __name__ == '__main__':
    s = time.perf_counter()
    if sys.argv[1:] != ['guard']: main()
    guard(); print(f"# {time.perf_counter()-s:.0f} s")
