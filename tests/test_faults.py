"Fault injection into the loss and the inputs, PyTorch's GradScaler reference case, LossScaler properties, overflow diagnosis."
import math, warnings
import pandas as pd
import pytest, torch
from hypothesis import given, settings, strategies as st
from fastai.basics import Callback
from fastai.callback.progress import CSVLogger
from fastai.callback.core import CancelStepException
from fastai.callback.training import GradientAccumulation, GradientClip
from mpx.all import *
from mpx.test_utils import tiny_learner, fit_quiet, replay, precision_cb, InjectGrad, PoisonLoss, PoisonInput, Snapshot, check_skips_change_nothing

SCALED = dict(  # fp16 callbacks whose scale starts at 2**8 in each mode (dynamic, but fastai v1's static one): the diagnosis reports it
    amp=lambda: MixedPrecision(init_scale=2.**8), master=lambda: MasterPrecision(loss_scale=2.**8),
    master_dynamic=lambda: MasterPrecision(loss_scale=2.**8, dynamic=True))

@pytest.mark.parametrize('mode', SCALED)
@pytest.mark.parametrize('where', ['loss', 'input'])
@pytest.mark.parametrize('value', [math.inf, math.nan])
@pytest.mark.parametrize('extras', ['none', 'acc', 'clip'])
def test_poisoned_loss_or_input(mode, where, value, extras):
    "An inf or nan in the loss or in an input batch skips that optimizer step and changes nothing, with accumulation or clipping too."
    acc = extras == 'acc'
    poison,snap = (PoisonLoss if where == 'loss' else PoisonInput)(at=[4] if acc else [2], value=value),Snapshot()
    cbs = [SCALED[mode](), poison, snap] + ([GradientAccumulation(n_acc=32)] if acc else []) + ([GradientClip(max_norm=.5)] if extras == 'clip' else [])
    check_skips_change_nothing(precision_cb(fit_quiet(tiny_learner(lr=1e-2, cbs=cbs))), snap, [2])

def test_gradscaler_reference_case():
    "PyTorch's reference: a scaled run with an inf at one iteration against an fp32 control that skips that step: same weights and optimizer state, exact scale."
    class SkipAt(Callback):
        order = 9
        def __init__(self, at): self.at,self.i = at,0
        def before_step(self):
            self.i += 1
            if self.i - 1 == self.at: raise CancelStepException()
    control = fit_quiet(tiny_learner(lr=1e-2, cbs=SkipAt(3)))
    for cb in (MixedPrecision(init_scale=128., growth_interval=1), MasterPrecision(loss_scale=128., dynamic=True, growth_interval=1)):
        scaled = fit_quiet(tiny_learner(lr=1e-2, cbs=[cb, InjectGrad(at=[3], micro=isinstance(cb, MasterPrecision))]))
        assert cb.scales == [128., 256., 512., 1024., 512., 1024., 2048., 4096., 8192., 16384.] and cb.loss_scale == 128. * 2.**9 * .5
        tol = dict(atol=2e-2, rtol=2e-2)
        for a,b in zip(control.model.parameters(), scaled.model.parameters()): assert torch.allclose(a, b, **tol)
        for a,b in zip(control.model.parameters(), scaled.model.parameters()): assert torch.allclose(control.opt.state[a]['grad_avg'], scaled.opt.state[b]['grad_avg'], **tol)

@settings(max_examples=40, deadline=None)
@given(seq=st.lists(st.booleans(), min_size=1, max_size=60), interval=st.integers(1, 6), growth=st.sampled_from([1.5, 2., 3.]),
       backoff=st.sampled_from([.25, .5, .75]), log2_init=st.integers(0, 16))
def test_loss_scaler_equals_gradscaler(seq, interval, growth, backoff, log2_init):
    "Within its bounds, LossScaler's dynamic trajectory equals torch.amp.GradScaler's on any overflow sequence and settings."
    kw = dict(init_scale=2.**log2_init, growth_factor=growth, backoff_factor=backoff, growth_interval=interval)
    ls = LossScaler(**kw, min_scale=2.**-126, max_scale=2.**127)
    assert [(ls.scale, ls.update(f))[0] for f in seq] == replay(seq, **kw)

@settings(max_examples=30, deadline=None)
@given(seq=st.lists(st.booleans(), min_size=2, max_size=40), cut=st.integers(0, 40), dynamic=st.booleans())
def test_loss_scaler_state_dict_round_trip(seq, cut, dynamic):
    "A LossScaler restored from `state_dict` at any point continues exactly as the original."
    a = LossScaler(init_scale=16., growth_interval=3, dynamic=dynamic, min_scale=1., max_scale=2.**10)
    cut = min(cut, len(seq))
    for f in seq[:cut]: a.update(f)
    b = LossScaler(); b.load_state_dict(a.state_dict())
    assert [a.update(f) for f in seq[cut:]] == [b.update(f) for f in seq[cut:]] and a.state_dict() == b.state_dict()

@pytest.mark.parametrize('mode', SCALED)
@pytest.mark.parametrize('name,value,kind', [('2.bias', math.inf, 'inf'), ('0.weight', math.nan, 'nan'), ('2.weight', -math.inf, 'inf')])
def test_diagnosis_names_the_parameter(mode, name, value, kind):
    "A skipped step whose verdict the host reads records the first parameter, by module name, whose gradient went non-finite, and its kind."
    cb = SCALED[mode]()
    cb.skip_on_device = False  # (on a GPU the verdict stays there: `test_lean_step`)
    fit_quiet(tiny_learner(lr=1e-2, cbs=[cb, InjectGrad(at=[5], value=value, names=(name,), micro=True)]))
    assert (cb.last_overflow.step, cb.last_overflow.param, cb.last_overflow.kind, cb.last_overflow.scale) == (5, name, kind, 2.**8)

def test_warns_once_when_stuck():
    "Ten overflows in a row at the scale's floor warn once, naming the parameter (its verdict read on the host) and suggesting bf16; above the floor there is no warning."
    for cb,warned in ((MasterPrecision(), True), (MasterPrecision(loss_scale=2.**20, dynamic=True, min_scale=1.), False), (MixedPrecision(init_scale=2.**8), True)):
        cb.skip_on_device = False
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter('always')
            fit_quiet(tiny_learner(lr=1e-2, cbs=[cb, InjectGrad(at=range(15), names=('2.bias',), micro=True)]))
        msgs = [str(w.message) for w in ws if 'in a row had inf/nan gradients' in str(w.message)]
        assert len(msgs) == int(warned) and cb.skipped_steps == 10
        if warned: assert "'2.bias'" in msgs[0] and 'learn.to_bf16()' in msgs[0]

def test_columns_reach_csv_logger(tmp_path):
    "With `log_loss_scale()`, CSVLogger writes the loss scale and the epoch's skipped steps."
    learn = tiny_learner(lr=1e-2, path=tmp_path, cbs=[InjectGrad(at=[1, 12])]).to_fp16(init_scale=2.**8).log_loss_scale()
    fit_quiet(learn, 2, cbs=CSVLogger())
    df = pd.read_csv(tmp_path/'history.csv')
    assert list(df['loss_scale']) == [128., 64.] and list(df['skipped_steps']) == [1, 1]
