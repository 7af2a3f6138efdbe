"""A smoke test of an installed mpx, as a user's script runs it: every mode fits once, `precision_report`, `to_fp8` where
torchao is installed, and `import mpx.distributed` where accelerate is.

tests/test_packaging.py runs `python smoke.py` in a fresh venv that holds only the built wheel and its dependencies, outside
the repository. `make compat` runs `python smoke.py --full` with the declared minimum versions: each mode also with each
`fused` setting and each optimizer-state storage. It prints a line a fit and ends with 'smoke: N fits passed'."""
import argparse, importlib.util, time, warnings
import torch
from torch.utils.data import TensorDataset
from fastai.basics import *
from mpx.all import *
from mpx.compiled import _failed as fallbacks  # the compiled steps that failed to build and stepped eagerly, with why

def get_learner(seed=0) -> Learner:
    "A small MLP regressing random data: its middle layer multiples of 16 wide (fp8) with 4096+ weights (low-bit state); quiet"
    set_seed(seed)
    x = torch.randn(256, 16)
    y = x @ torch.randn(16, 16) / 4
    dls = DataLoaders.from_dsets(TensorDataset(x[:192], y[:192]), TensorDataset(x[192:], y[192:]), bs=32, device='cpu')
    model = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 16))  # fp8, low-bit: the middle
    return Learner(dls, model, loss_func=MSELossFlat(), opt_func=Adam, lr=1e-3).quiet_progress()

MODES = dict(  # each of mpx's modes as a user calls it
    amp_fp16=lambda l, **kw: l.to_fp16(**kw), amp_bf16=lambda l, **kw: l.to_bf16(**kw),
    master_fp16=lambda l, **kw: l.to_fp16(loss_scale=512, **kw), master_bf16=lambda l, **kw: l.to_bf16(master=True, **kw),
    pure_kahan=lambda l, **kw: l.to_bf16(pure=True, **kw),
    pure_stochastic=lambda l, **kw: l.to_bf16(pure=True, update='stochastic', **kw))

def fit_one(name:str, **kwargs) -> None:
    "Fit mode `name` once with `kwargs`; raise where the loss is not finite or nothing was stepped; True where a compiled step fell back"
    t0 = time.perf_counter()
    learn = MODES[name](get_learner(), **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        with learn.no_logging(): learn.fit(1)
    loss = learn.recorder.losses[-1].item()
    if not math.isfinite(loss): raise RuntimeError(f"{name} {kwargs}: loss {loss}")
    cb = first(learn.cbs, risinstance(PrecisionCallback))
    if cb is None or cb.total_steps == 0: raise RuntimeError(f"{name} {kwargs}: no precision callback stepped ({learn.cbs})")
    notes = sorted({str(w.message).splitlines()[0][:160] for w in caught if 'is slow on this' not in str(w.message)})
    eager = sorted(set(fallbacks.values()))
    fallbacks.clear()
    print(f"{name} {kwargs}: loss {loss:.4f}, {cb.total_steps} steps, {time.perf_counter()-t0:.1f}s"
          + (f", COMPILED STEP FELL BACK TO EAGER: {eager}" if eager else '') + ''.join(f"\n  warning: {n}" for n in notes))
    learn.to_fp32()
    return bool(eager)

def main(full=False) -> int:
    import mpx, fastai, fastcore
    print(f"mpx {mpx.__version__} from {mpx.__file__}; "
          f"torch {torch.__version__}, fastai {fastai.__version__}, fastcore {fastcore.__version__}")
    runs = [(m, {}) for m in MODES]
    if full:
        runs += [(m, dict(fused=f)) for m in MODES for f in (False, 'compile')]
        runs += [(m, dict(opt_state=s)) for m in ('amp_bf16', 'master_fp16', 'pure_kahan') for s in ('bf16', '8bit', '4bit')]
        runs += [('pure_kahan', dict(opt_state=s, fused='compile')) for s in ('bf16', '8bit', '4bit')]
    eager = sum(fit_one(name, **kw) for name,kw in runs)
    r = get_learner().precision_report()
    print(f"precision_report: recommended {r.recommended}")
    learn = get_learner().to_auto_precision()
    print(f"to_auto_precision: {[type(c).__name__ for c in learn.cbs if isinstance(c, PrecisionCallback)] or 'fp32'}")
    n = len(runs)
    if importlib.util.find_spec('torchao'):
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')  # fp8 is emulated (slow) on a CPU: it says so
            learn = get_learner().to_fp8()
            with learn.no_logging(): learn.fit(1)
        print(f"to_fp8: loss {learn.recorder.losses[-1].item():.4f}")
        n += 1
    else: print("to_fp8: torchao not installed (pip install 'mpx[fp8]'), skipped")
    if importlib.util.find_spec('accelerate'):
        import mpx.distributed
        print("import mpx.distributed: ok")
    else: print("mpx.distributed: accelerate not installed (pip install 'mpx[fsdp]'), skipped")
    print(f"smoke: {n} fits passed" + (f" ({eager} compiled fits stepped eagerly: see above)" if eager else ''))
    return 0

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--full', action='store_true', help='each mode also with each fused setting and optimizer-state storage')
    raise SystemExit(main(p.parse_args().full))
