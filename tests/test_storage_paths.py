"""Robustness 6 (issue 68): torch's own machinery reaching a kept layout's storage between fits (`share_memory()`, a cast by
hand to float64), each tried in every mode that keeps a layout, against the same session without it."""
import pytest, torch
from fastai.basics import Adam, nn
from mpx.all import *
from mpx.test_utils import tiny_learner, fit_quiet, precision_cb, state_of, state_diffs

KEPT = {  # the modes whose layout stays between fits
    'pure_kahan': lambda l: l.to_bf16(pure=True), 'pure_stochastic': lambda l: l.to_bf16(pure=True, update='stochastic'),
    'amp_8bit': lambda l: l.to_bf16(opt_state='8bit'), 'pure_kahan_8bit': lambda l: l.to_bf16(pure=True, opt_state='8bit'),
}

def wide():
    "BatchNorm's statistics, and a 4,096-weight layer whose state a low-bit store holds"
    return nn.Sequential(nn.Linear(1, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))

def session(mode, between=None):
    "A learner in `mode` after a fit, `between(learn)`, and a second fit"
    learn = tiny_learner(lr=1e-2, opt_func=Adam, model=wide)
    KEPT[mode](learn)
    fit_quiet(learn, 1)
    if between is not None: between(learn)
    fit_quiet(learn, 1)
    return learn

@pytest.mark.parametrize('mode', KEPT)
def test_share_memory(mode):
    "`model.share_memory()` between fits (as torch.multiprocessing's queues do to a parameter) moves the buckets' storages: nothing is written, no compensation is lost, and every later step is the session's without it."
    ref = session(mode)
    moved = session(mode, lambda l: l.model.share_memory())
    assert all(p.is_shared() for p in moved.model.parameters())
    assert not state_diffs(state_of(ref), state_of(moved))

@pytest.mark.parametrize('mode', [*KEPT, 'master'])
def test_double_by_hand(mode):
    "`model.double()` between fits changes no value: the next fit takes it back, the session's as without it; `to_fp32()` after it gives an fp32 model that fits."
    if mode == 'master':  # no layout kept: the next fit asks for an fp32 model, and `to_fp32()` gives one
        learn = fit_quiet(tiny_learner(lr=1e-2, opt_func=Adam, model=wide).to_bf16(master=True), 1)
        learn.model.double()
        with pytest.raises(ValueError, match="needs an fp32 model: parameter '0.weight' is torch.float64"): fit_quiet(learn, 1)
    else:
        ref = session(mode)
        learn = session(mode, lambda l: l.model.double())
        assert not state_diffs(state_of(ref), state_of(learn))
        learn.model.double()
    learn.to_fp32()
    assert {t.dtype for t in [*learn.model.parameters(), *learn.model.buffers()] if t.is_floating_point()} == {torch.float32}
    fit_quiet(learn, 1)
