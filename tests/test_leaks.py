"Nothing leaks, nothing reaches the weights: autocast after failed fits, one precision callback, the bf16 guard, BatchNorm statistics, strict arguments (its host syncs: `test_syncs.py`)."
import math, warnings
import pytest, torch
from torch import nn
import fastai.callback.fp16 as fastai_fp16
from fastai.basics import Module
from fastai.learner import Learner
from fastai.callback.core import Callback, CancelFitException
from fastai.callback.training import GradientAccumulation
from mpx.all import *
from mpx.hardware import _runs_in_autocast
from mpx.test_utils import (names_overflows, tiny_learner, tiny_model, tiny_dls, fit_quiet, precision_cbs, precision_cb, MODES, BASIC_MODES, InjectGrad, PoisonLoss,
                            Snapshot, check_skips_change_nothing)

DEVICES = ['cpu'] + (['cuda'] if torch.cuda.is_available() else [])

def autocast_state() -> list:
    "Whether autocast is on, and its dtype, for every device type here"
    return [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in DEVICES]

PRISTINE = autocast_state()

@pytest.fixture(autouse=True)
def reset_autocast():
    "Put autocast back as the process started, should a failing test leave it on, so one leak does not fail the tests after it"
    yield
    for d,on,dt in PRISTINE: torch.set_autocast_enabled(d, on); torch.set_autocast_dtype(d, dt)

def learner(mode=None, bn=False, **kwargs):
    "A seeded `tiny_learner` (with a BatchNorm if `bn`) in `mode` (one of `MODES`), or fp32"
    learn = tiny_learner(lr=1e-2, bn=bn, **kwargs)
    return MODES[mode](learn) if mode else learn

def assert_nothing_left(learn, before):
    "Autocast as `before`, an fp32 model whose own parameters the optimizer (and `learn.parameters`) holds, and fp32 matmuls"
    assert autocast_state() == before, f'autocast {autocast_state()} after the fit, {before} before it'
    assert {p.dtype for p in learn.model.parameters()} == {torch.float32}
    model_ps = [id(p) for p in learn.model.parameters()]
    assert [id(p) for p in learn.parameters()] == model_ps
    if learn.opt is not None: assert [id(p) for pg in learn.opt.param_lists for p in pg] == model_ps
    assert torch.matmul(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.float32

class Boom(Exception): "A bug in user code: a callback, the model or the loss"

BATCH_EVENTS = ['before_batch', 'after_pred', 'after_loss', 'before_backward', 'after_backward', 'before_step', 'after_step', 'after_batch']
EVENTS = ['before_fit', 'before_epoch', 'before_train', *BATCH_EVENTS, 'after_train', 'before_validate', 'after_epoch', 'after_fit']

class RaiseAt(Callback):
    "Raise `exc` at `event` from `order`: at its second call for a batch event (the second training batch), else at its first"
    def __init__(self, event, exc=Boom, order=MixedPrecision.order+1): self.event,self.exc,self.order,self.n = event,exc,order,0
    def __call__(self, event_name):
        if event_name == self.event:
            self.n += 1
            if self.n == (2 if event_name in BATCH_EVENTS else 1): raise self.exc()
        super().__call__(event_name)

SIDES = dict(before_cb=MixedPrecision.order-1, after_cb=MixedPrecision.order+1)

# Autocast never outlives a fit

@pytest.mark.parametrize('side', SIDES)
@pytest.mark.parametrize('event', EVENTS)
@pytest.mark.parametrize('mode', BASIC_MODES)
def test_exception_in_event(mode, event, side):
    "An exception raised by a callback at any event, before or after the precision callback's handler, leaves autocast, the model and the optimizer as before the fit."
    learn,before = learner(mode),autocast_state()
    with pytest.raises(Boom): fit_quiet(learn, cbs=RaiseAt(event, order=SIDES[side]))
    assert_nothing_left(learn, before)

class FailingForward(Module):
    "`tiny_model` whose forward raises `Boom` on its third call"
    def __init__(self): self.body,self.n = tiny_model(),0
    def forward(self, x):
        self.n += 1
        if self.n == 3: raise Boom()
        return self.body(x)

class FailingLoss:
    "MSE that raises `Boom` on its third call (a shape bug in a loss, say)"
    def __init__(self): self.n = 0
    def __call__(self, pred, y):
        self.n += 1
        if self.n == 3: raise Boom()
        return nn.functional.mse_loss(pred, y)

@pytest.mark.parametrize('where', ['forward', 'loss'])
@pytest.mark.parametrize('mode', BASIC_MODES)
def test_exception_in_model_or_loss(mode, where):
    "An exception in the model's forward or in the loss function leaves autocast, the model and the optimizer as before the fit."
    learn = MODES[mode](tiny_learner(lr=1e-2, model=FailingForward()) if where == 'forward' else tiny_learner(lr=1e-2, loss_func=FailingLoss()))
    before = autocast_state()
    with pytest.raises(Boom): fit_quiet(learn)
    assert_nothing_left(learn, before)

@pytest.mark.parametrize('exc', [KeyboardInterrupt, CancelFitException], ids=['KeyboardInterrupt', 'CancelFitException'])
@pytest.mark.parametrize('mode', BASIC_MODES)
def test_interrupt_or_cancel_fit(mode, exc):
    "Ctrl-C or a `CancelFitException` in the middle of a forward pass leaves autocast, the model and the optimizer as before the fit."
    learn,before = learner(mode),autocast_state()
    if exc is KeyboardInterrupt:
        with pytest.raises(KeyboardInterrupt): fit_quiet(learn, cbs=RaiseAt('after_pred', exc))
    else: fit_quiet(learn, cbs=RaiseAt('after_pred', exc))
    assert_nothing_left(learn, before)

@pytest.mark.parametrize('fails', [False, True], ids=['clean_fit', 'failed_fit'])
@pytest.mark.parametrize('mode', BASIC_MODES)
def test_fit_inside_users_autocast(mode, fails):
    "A fit started inside the user's own bf16 autocast, clean or failed, leaves that autocast on, in bf16."
    learn = learner(mode)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        before = autocast_state()
        if fails:
            with pytest.raises(Boom): fit_quiet(learn, cbs=RaiseAt('after_pred'))
        else: fit_quiet(learn)
        assert torch.is_autocast_enabled('cpu') and torch.get_autocast_dtype('cpu') == torch.bfloat16
        assert autocast_state() == before
    assert autocast_state() == PRISTINE

@pytest.mark.parametrize('method', ['get_preds', 'validate'])
@pytest.mark.parametrize('mode', BASIC_MODES)
def test_failed_inference(mode, method):
    "`get_preds` or `validate` that raise in the middle of a forward pass leave autocast as it was."
    learn,before = learner(mode),autocast_state()
    with pytest.raises(Boom), learn.no_bar(): getattr(learn, method)(cbs=RaiseAt('after_pred'))
    assert_nothing_left(learn, before)

@pytest.mark.parametrize('mode', BASIC_MODES)
def test_to_fp32_after_failed_fit(mode):
    "`to_fp32` after a failed fit leaves autocast off, an fp32 model and no precision callback, and the learner trains in fp32."
    learn = learner(mode)
    with pytest.raises(Boom): fit_quiet(learn, cbs=RaiseAt('after_pred'))
    learn.to_fp32()
    assert precision_cbs(learn) == [] and not torch.is_autocast_enabled('cpu')
    assert_nothing_left(fit_quiet(learn), PRISTINE)

# One precision callback per learner

SECOND = {  # name: (give the learner its first precision callback, the second one added next to it)
    'to_fp16+mpx_MixedPrecision':    (lambda l: l.to_fp16(), lambda: MixedPrecision('bf16')),
    'to_fp16+fastai_MixedPrecision': (lambda l: l.to_fp16(), lambda: fastai_fp16.MixedPrecision()),
    'to_bf16+MasterPrecision':       (lambda l: l.to_bf16(), lambda: MasterPrecision()),
    'master+mpx_MixedPrecision':     (lambda l: l.to_fp16(master=True), lambda: MixedPrecision()),
    'fastai_MixedPrecision+mpx':     (lambda l: l.add_cb(fastai_fp16.MixedPrecision()), lambda: MixedPrecision('bf16')),
}

@pytest.mark.parametrize('case', SECOND)
def test_second_precision_callback_refused(case):
    "Adding a second precision callback is a `ValueError` naming both and pointing to `to_fp16`/`to_bf16`/`to_fp32`; the first stays and trains."
    make_first,make_second = SECOND[case]
    learn,second = make_first(tiny_learner(lr=1e-2)),make_second()
    (cb,) = precision_cbs(learn)
    with pytest.raises(ValueError) as e: learn.add_cb(second)
    msg = str(e.value)
    assert type(cb).__name__ in msg and type(second).__name__ in msg and all(f in msg for f in ('to_fp16', 'to_bf16', 'to_fp32')), msg
    assert precision_cbs(learn) == [cb] and getattr(learn, cb.name) is cb and cb.learn is learn
    fit_quiet(learn)
    if not isinstance(cb, fastai_fp16.MixedPrecision): assert cb.total_steps == 10

def test_two_precision_callbacks_at_construction():
    "`Learner(cbs=[MixedPrecision(), MasterPrecision()])` is a `ValueError` naming both callbacks."
    with pytest.raises(ValueError) as e: Learner(tiny_dls(), tiny_model(), loss_func=nn.MSELoss(), cbs=[MixedPrecision(), MasterPrecision()])
    assert 'MixedPrecision' in str(e.value) and 'MasterPrecision' in str(e.value)

def test_switching_modes_still_replaces():
    "`to_bf16` after `to_fp16` replaces the callback, with no error."
    learn = tiny_learner(lr=1e-2).to_fp16().to_bf16()
    assert [(type(c), c.amp_mode) for c in precision_cbs(learn)] == [(MixedPrecision, 'bf16')]

# bf16 does not let inf/nan reach the weights

POISON = {  # name: (a callback poisoning training step 2, the first parameter whose gradient it makes non-finite)
    'nan_loss': (lambda: PoisonLoss(at=[2], value=math.nan), '0.weight'),
    'nan_grad': (lambda: InjectGrad(at=[2], value=math.nan, names=('2.bias',), micro=True), '2.bias'),
}

@pytest.mark.parametrize('poison', POISON)
@pytest.mark.parametrize('mode', BASIC_MODES)
def test_nonfinite_step_skipped(mode, poison):
    "In every mode a step whose gradients hold a nan is skipped, changes no weight or optimizer state, is counted and diagnosed."
    make,param = POISON[poison]
    snap = Snapshot()
    learn = fit_quiet(learner(mode, cbs=[make(), snap]))
    cb = precision_cb(learn)
    check_skips_change_nothing(cb, snap, [2])
    assert cb.skipped_steps == 1 and cb.last_overflow.param == (param if names_overflows(cb) else None)  # on a GPU: the step only
    assert all(p.isfinite().all() for p in learn.model.parameters())

@pytest.mark.parametrize('mode', BASIC_MODES)
def test_warns_after_skips_in_a_row(mode):
    "Ten non-finite steps in a row issue one `UserWarning` saying so, in every mode."
    learn = learner(mode, cbs=InjectGrad(at=range(10), value=math.nan, names=('2.bias',), micro=True))
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('always')
        fit_quiet(learn)
    assert precision_cb(learn).skipped_steps == 10
    assert len([w for w in ws if issubclass(w.category, UserWarning) and 'in a row' in str(w.message)]) == 1

@pytest.mark.parametrize('mode', ['amp_bf16', 'master_bf16'])
def test_check_finite_false_lets_nan_through(mode):
    "With `check_finite=False` (the documented opt-out) a nan loss does reach the weights, and no step is skipped."
    learn = fit_quiet(MODES[mode](learner(cbs=PoisonLoss(at=[2], value=math.nan)), check_finite=False))
    assert precision_cb(learn).skipped_steps == 0
    assert any(p.isnan().any() for p in learn.model.parameters())

CHECK_FINITE = {  # name: (a precision callback made with `check_finite=v`, whether it is fp16: its scaler checks whatever `v` says)
    'MixedPrecision': (lambda v: MixedPrecision('bf16', check_finite=v), False),
    'MasterPrecision': (lambda v: MasterPrecision('bf16', check_finite=v), False),
    'to_fp16': (lambda v: precision_cb(tiny_learner(lr=1e-2).to_fp16(init_scale=2.**8, check_finite=v)), True),
    'to_bf16': (lambda v: precision_cb(tiny_learner(lr=1e-2).to_bf16(check_finite=v)), False),
}

@pytest.mark.parametrize('value', [True, False])
@pytest.mark.parametrize('make', CHECK_FINITE)
def test_check_finite_accepted(make, value):
    "`check_finite` is accepted by both callbacks and both patches, and does what it says: a nan step skipped, or (bf16, False) taken."
    cb,fp16 = CHECK_FINITE[make][0](value),CHECK_FINITE[make][1]
    learn = fit_quiet(tiny_learner(lr=1e-2, cbs=[cb, PoisonLoss(at=[2], value=math.nan)]))
    checks = value or fp16
    assert cb.check_finite is value and cb.skipped_steps == (1 if checks else 0) and cb.total_steps == 10
    assert all(p.isfinite().all() for p in learn.model.parameters()) == checks, 'a nan step taken where checked, or skipped where not'

@pytest.mark.parametrize('value', ['no', 0, None], ids=repr)
@pytest.mark.parametrize('make', CHECK_FINITE)
def test_check_finite_not_bool(make, value):
    "A `check_finite` that is not a bool is a `ValueError`/`TypeError` naming it and echoing the value."
    with pytest.raises((ValueError, TypeError)) as e: CHECK_FINITE[make][0](value)
    assert f'check_finite={value!r}' in str(e.value), str(e.value)

# A skipped step leaves BatchNorm's statistics alone

def bn_stats(learn) -> list:
    "Copies of the BatchNorm's running mean, running variance and batch count"
    bn = next(m for m in learn.model.modules() if isinstance(m, nn.BatchNorm1d))
    return [bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone()]

class NanSample(Callback):
    "Write nan into one row of the inputs of training batch `at`; keep the BatchNorm statistics as they were before batch `first`'s forward and before batch `at+1`'s"
    order = MixedPrecision.order-1
    def __init__(self, at, first): self.at,self.first,self.stats = at,first,{}
    def before_batch(self):
        if not self.training: return
        if self.iter == self.at: self.learn.xb = (self.xb[0].clone().index_fill_(0, torch.tensor([3]), math.nan),)
        if self.iter in (self.first, self.at+1): self.stats[self.iter] = bn_stats(self.learn)  # before any forward of that batch

@pytest.mark.parametrize('acc', [False, True], ids=['plain', 'grad_acc'])
@pytest.mark.parametrize('mode', BASIC_MODES)
def test_skipped_step_restores_batchnorm(mode, acc):
    "A step skipped for a nan sample leaves BatchNorm's running statistics as before its (first micro-batch's) forward, and validation finite."
    at,first = (5, 4) if acc else (3, 3)  # with 2 micro-batches per step, batch 5 is the second of step 2
    probe = NanSample(at, first)
    learn = fit_quiet(learner(mode, bn=True, cbs=[probe] + ([GradientAccumulation(n_acc=32)] if acc else [])))
    cb = precision_cb(learn)
    assert cb.step_log.skips == [i == (2 if acc else 3) for i in range(5 if acc else 10)]
    assert all(map(torch.equal, probe.stats[first], probe.stats[at+1])), 'running statistics changed by a skipped step'
    assert math.isfinite(learn.validate()[0])

# Arguments and models that cannot work are refused up front

REFUSED = {  # name: (the call, on a learner in fp16 AMP, or with no learner; what the ValueError must say; what it must not)
    'to_bf16(loss_scale=512)':             (lambda l: l.to_bf16(loss_scale=512), ['loss_scale'], []),
    'to_bf16(init_scale=1024.)':           (lambda l: l.to_bf16(init_scale=1024.), ['init_scale'], []),
    "MixedPrecision('bf16',init_scale)":   (lambda l: MixedPrecision('bf16', init_scale=1024.), ['init_scale'], []),
    "MasterPrecision('bf16',loss_scale)":  (lambda l: MasterPrecision('bf16', loss_scale=512), ['loss_scale'], []),
    'to_fp16(loss_scale=-1)':              (lambda l: l.to_fp16(loss_scale=-1), ['loss_scale=-1'], ['init_scale']),
    'to_fp16(min_scale>max_scale)':        (lambda l: l.to_fp16(loss_scale=512, dynamic=True, min_scale=4., max_scale=2.), ['min_scale=4.0', 'max_scale=2.0'], []),
    'MasterPrecision(static,growth_interval)': (lambda l: MasterPrecision(loss_scale=512, growth_interval=100), ['growth_interval'], []),
}

@pytest.mark.parametrize('case', REFUSED)
def test_refused_arguments(case):
    "An argument that cannot work in the chosen mode is a `ValueError` naming it as passed, before the learner's callback changes."
    call,says,not_says = REFUSED[case]
    learn = tiny_learner(lr=1e-2).to_fp16(init_scale=2.**8)
    prev = learn.mixed_precision
    with pytest.raises(ValueError) as e: call(learn)
    msg = str(e.value)
    assert all(s in msg for s in says) and not any(s in msg for s in not_says), msg
    assert precision_cbs(learn) == [prev]

HALF = {'fp16_model,to_fp16': (torch.float16, 'amp_fp16'), 'fp16_model,to_bf16': (torch.float16, 'amp_bf16'),
        'bf16_model,to_bf16': (torch.bfloat16, 'amp_bf16'), 'bf16_model,to_fp16': (torch.bfloat16, 'amp_fp16')}

@pytest.mark.parametrize('case', HALF)
def test_half_model_under_amp(case):
    "AMP on a half model fails before the fit starts, saying AMP needs fp32 weights and what to do; the model is untouched."
    dtype,mode = HALF[case]
    learn = tiny_learner(lr=1e-2)
    learn.model.to(dtype)
    learn = MODES[mode](learn)
    w = [p.detach().clone() for p in learn.model.parameters()]
    with pytest.raises(ValueError) as e: fit_quiet(learn)
    msg = str(e.value)
    assert 'AMP needs fp32 weights' in msg and 'learn.to_fp32()' in msg and 'master=True' in msg, msg
    assert all(p.dtype == dtype for p in learn.model.parameters()) and all(map(torch.equal, w, learn.model.parameters()))
    assert precision_cb(learn).total_steps == 0 and autocast_state() == PRISTINE

class LSTMRegressor(Module):
    "An LSTM over a length-1 sequence and a linear head: fp16 autocast on a CPU has no LSTM kernel"
    def __init__(self): self.lstm,self.head = nn.LSTM(1, 4, batch_first=True),nn.Linear(4, 1)
    def forward(self, x): return self.head(self.lstm(x[:, None])[0][:, -1])

def lstm_runs(dtype) -> bool: return _runs_in_autocast(nn.LSTM, dtype)

@pytest.mark.parametrize('mode', ['fp16', 'bf16'])
def test_no_kernel_for_the_dtype(mode):
    "An LSTM with no kernel in a mode on the CPU fails naming the mode and the layer, leaves nothing behind, and the advice holds on this machine: the other 16-bit dtype is named only where its LSTM runs here, and what is named trains."
    dtype,other = (torch.float16, 'bf16') if mode == 'fp16' else (torch.bfloat16, 'fp16')
    if lstm_runs(dtype): pytest.skip(f'this CPU has an LSTM kernel for {mode} under autocast')
    learn = getattr(tiny_learner(lr=1e-2, model=LSTMRegressor()), f'to_{mode}')()
    with pytest.raises(RuntimeError) as e: fit_quiet(learn)
    msg = str(e.value)
    assert f"under MixedPrecision(amp_mode='{mode}') an op of its LSTM `lstm` has no {mode} kernel on cpu: " in msg, msg
    assert 'learn.to_fp32()' in msg
    assert_nothing_left(learn, PRISTINE)
    if lstm_runs(torch.bfloat16 if mode == 'fp16' else torch.float16):
        assert f'learn.to_{other}()' in msg, msg
        assert precision_cb(fit_quiet(getattr(learn, f'to_{other}')())).total_steps == 10
    else:
        assert f'learn.to_{other}()' not in msg and f'{other} has no kernel on this cpu either, for its LSTM' in msg, msg
        fit_quiet(learn.to_fp32())
    assert_nothing_left(learn, PRISTINE)

class HalfRefused(Module):
    "A layer of a kind no probe knows, whose op has no fp16 kernel"
    def forward(self, x):
        if x.dtype == torch.float16: raise RuntimeError('"my_op" not implemented for \'Half\'')
        return x

def test_no_kernel_in_an_unknown_layer():
    "A layer of a kind the probes do not know: the error names it and the other dtype, and says that precision_report() tries each mode."
    learn = tiny_learner(lr=1e-2, model=nn.Sequential(nn.Linear(1, 4), HalfRefused(), nn.Linear(4, 1))).to_fp16()
    with pytest.raises(RuntimeError) as e: fit_quiet(learn)
    msg = str(e.value)
    assert "an op of its HalfRefused `1` has no fp16 kernel on cpu: train in bf16 (learn.to_bf16()) or fp32" in msg, msg
    assert 'learn.precision_report() tries each mode on this machine' in msg
    assert_nothing_left(learn, PRISTINE)
