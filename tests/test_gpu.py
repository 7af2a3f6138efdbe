"Key checks on CUDA: `MixedPrecision` dtype, scaler, skips on overflow; every master and pure mode trains; low-bit state (syncs: `test_syncs.py`)"
import math
from functools import partial
import pytest, torch
from torch import nn
from fastai.optimizer import SGD, Adam
from fastai.callback.core import Callback
from mpx.all import MixedPrecision
from mpx.lowbit import LowBitState
from mpx.test_utils import (tiny_learner, fit_quiet, replay, InjectGrad, Snapshot, check_skips_change_nothing, DtypeHook,
                             MASTER_MODES, LossProbe, precision_cb, needs_mode, weights, state_of, state_diffs)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')

DEV = 'cuda'
HALF = dict(fp16=torch.float16, bf16=torch.bfloat16)

@pytest.mark.parametrize('mode', HALF)
def test_compute_dtype(mode):
    "On CUDA the model computes in the mode's dtype during fit and `get_preds`, keeps fp32 weights and returns fp32 preds."
    needs_mode(mode)
    kw = dict(init_scale=2.**8) if mode == 'fp16' else {}  # bf16 takes no loss scale
    learn = tiny_learner(lr=1e-2, device=DEV, cbs=MixedPrecision(mode, **kw))
    with DtypeHook(learn.model[0]) as hook: fit_quiet(learn, 1); preds,_ = learn.get_preds()
    assert len(hook.dtypes) == 12+2 and set(hook.dtypes) == {HALF[mode]}
    assert preds.dtype == torch.float32 and all(p.dtype == torch.float32 and p.is_cuda for p in learn.model.parameters())
    assert learn.mixed_precision.device_type == 'cuda' and learn.mixed_precision.total_steps == 10

def test_scaler_on_cuda():
    "On CUDA the fp16 scale's trajectory equals a standalone CUDA `GradScaler`'s on the same overflows."
    kw = dict(init_scale=2.**8, growth_interval=2)
    learn = tiny_learner(lr=1e-2, device=DEV, cbs=MixedPrecision(**kw))
    fit_quiet(learn, 2, cbs=InjectGrad([3, 4, 11]))
    mp = learn.mixed_precision
    assert mp.device_type == 'cuda' and mp.scaler.dev is None, 'between fits the scale is a host value'
    assert all(mp.step_log.skips[i] for i in (3, 4, 11)) and mp.total_steps == 20
    assert mp.scales == replay(mp.step_log.skips, device=DEV, **kw)

@pytest.mark.parametrize('opt_func', [partial(SGD, mom=.9), Adam], ids=['sgd_mom','adam'])
@pytest.mark.parametrize('value', [math.inf, math.nan], ids=['inf','nan'])
def test_skip_on_overflow(opt_func, value):
    "On CUDA a poisoned gradient skips exactly its step, leaving weights and optimizer state bit-identical, and halves the scale."
    learn = tiny_learner(lr=1e-2, device=DEV, opt_func=opt_func, cbs=MixedPrecision(init_scale=2.**8))
    snap = Snapshot()
    fit_quiet(learn, 1, cbs=[InjectGrad([0, 4, 5], value, ('0.weight', '2.bias')), snap])
    mp = learn.mixed_precision
    assert mp.step_log.skips == [i in (0, 4, 5) for i in range(10)] and mp.loss_scale == 2.**8/8
    check_skips_change_nothing(mp, snap)

TRAINS = {**{f'master_{k}': f for k,f in MASTER_MODES.items()},
          **{f'pure_{u}': partial(lambda learn, u: learn.to_bf16(pure=True, update=u), u=u) for u in ('kahan', 'stochastic')}}

@pytest.mark.parametrize('mode', TRAINS)
def test_modes_train_on_cuda(mode):
    """Every master and pure mode trains on CUDA: no step skipped, the loss falls, and the model stays on the GPU: fp32 after a
    master mode's fit, bf16 after a pure one's (the layout it keeps between fits), whose values a checkpoint holds in fp32."""
    needs_mode(mode)
    learn,probe = TRAINS[mode](tiny_learner(lr=1e-2, device=DEV)),LossProbe()
    fit_quiet(learn, 2, cbs=probe)
    cb = precision_cb(learn)
    assert cb.total_steps == 20 and cb.skipped_steps == 0
    assert probe.losses[-1] < probe.losses[0]
    between = torch.bfloat16 if mode.startswith('pure') else torch.float32
    assert all(p.dtype == between and p.device.type == DEV for p in learn.model.parameters())
    assert all(w.dtype == torch.float32 and w.device.type == DEV for w in weights(learn))

LOWBIT = {'amp_bf16': lambda learn, **kw: learn.to_bf16(**kw), 'pure_kahan': lambda learn, **kw: learn.to_bf16(pure=True, **kw)}

def _lowbit_learner(mode, opt_state, fused, **kw):
    "A tiny Adam learner on CUDA whose 4,096-weight layer holds its state in `opt_state`"
    model = lambda: nn.Sequential(nn.Linear(1, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    return LOWBIT[mode](tiny_learner(model=model, opt_func=Adam, lr=1e-2, n_trn=4, device=DEV, **kw), opt_state=opt_state, fused=fused)

class HeldOn(Callback):
    "The devices of the low-bit codes the optimizer holds after each step"
    order = 100
    def after_step(self):
        self.devices = {v.b.state_bufs[v.k].device.type for s in self.learn.opt.state.values() for v in s.values() if isinstance(v, LowBitState)}

@pytest.mark.parametrize('opt_state', ['8bit', '4bit'])
@pytest.mark.parametrize('mode', LOWBIT)
def test_lowbit_on_cuda(mode, opt_state, tmp_path):
    "On CUDA low-bit state is held on the GPU and trains every weight, compiled within 2% of eager; a checkpoint resumes bit for bit."
    losses = []
    for fused in (True, 'compile'):
        learn,held = _lowbit_learner(mode, opt_state, fused),HeldOn()
        start = weights(learn); fit_quiet(learn, 2, cbs=held)
        assert held.devices == {DEV} and all(not torch.equal(a, b) for a,b in zip(start, weights(learn)))
        losses.append(learn.validate()[0])
    assert abs(losses[0] - losses[1]) <= .02 * losses[0] + 1e-3, losses
    a = _lowbit_learner(mode, opt_state, 'compile', path=tmp_path); fit_quiet(a, 1); order = a.dls.train.rng.getstate(); fit_quiet(a, 1)
    b = _lowbit_learner(mode, opt_state, 'compile', path=tmp_path); fit_quiet(b, 1); b.save('ck', with_opt=True)
    c = _lowbit_learner(mode, opt_state, 'compile', path=tmp_path); c.load('ck', with_opt=True); c.dls.train.rng.setstate(order)
    fit_quiet(c, 1)
    assert not state_diffs(state_of(a), state_of(c)), state_diffs(state_of(a), state_of(c))[:3]
