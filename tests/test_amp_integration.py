"fastai integrations of `to_fp16`/`to_bf16` on CPU: schedules, predictions, logging, export, patches, bad input (host syncs: `test_syncs.py`)."
import math, subprocess, sys
import pytest, torch
import fastai.callback.fp16 as fastai_fp16
from fastai.callback.schedule import *  # lr_find, fit_one_cycle, fine_tune
from fastai.callback.core import Callback, CancelBatchException
from fastai.callback.training import GradientAccumulation
from fastai.learner import load_learner
from mpx.all import MixedPrecision, MasterPrecision
from mpx.test_utils import (tiny_learner, fit_quiet, weights, precision_cbs, TupleModel, first_mse, DtypeHook, PredProbe, LossProbe,
                            ramp_learner, StepLrs, check_step_lrs)
from planted import lr_scaled, lr_frozen

HALF = dict(fp16=torch.float16, bf16=torch.bfloat16)

def to_mode(learn, mode, **kwargs):
    "`learn.to_fp16(**kwargs)` or `learn.to_bf16()`"
    return learn.to_fp16(**kwargs) if mode == 'fp16' else learn.to_bf16()

@pytest.mark.parametrize('mode', HALF)
def test_lr_find_restores_weights(mode, tmp_path):
    "`lr_find` runs and afterwards the weights, the loss scale and the telemetry are those from before it."
    learn = to_mode(tiny_learner(lr=1e-2, path=tmp_path), mode)
    w,scale = weights(learn),learn.mixed_precision.loss_scale
    with learn.no_bar(), learn.no_logging(): res = learn.lr_find(num_it=10, show_plot=False)
    assert math.isfinite(res.valley) and learn.mixed_precision.total_steps == 0 and learn.mixed_precision.loss_scale == scale
    assert all(map(torch.equal, w, learn.model.parameters()))

@pytest.mark.parametrize('mode', HALF)
@pytest.mark.parametrize('method,kw', [('fit_one_cycle', {}), ('fine_tune', dict(freeze_epochs=1))], ids=['fit_one_cycle','fine_tune'])
def test_schedules(mode, method, kw):
    "`fit_one_cycle` and `fine_tune` train through the callback: every optimizer step counted, weights moved, losses finite."
    learn = to_mode(tiny_learner(lr=1e-2), mode, init_scale=2.**8)
    w = weights(learn)
    fit_quiet(learn, 2 if method == 'fit_one_cycle' else 1, method=method, **kw)
    mp = learn.mixed_precision
    assert (mp.total_steps, mp.skipped_steps) == (20, 0)
    assert not any(map(torch.equal, w, learn.model.parameters()))
    assert all(math.isfinite(l) for l in learn.recorder.losses)

def ramp_lrs(mode, method) -> StepLrs:
    "`method` (`fit_one_cycle` or `fine_tune`, one epoch at 1e-2) on a `ramp_learner` in `mode` (None: fp32): each step's lr, set and used"
    probe = StepLrs()
    learn = ramp_learner(lr=1e-2, cbs=probe)
    if mode: to_mode(learn, mode, init_scale=2.**8)
    getattr(learn, method)(1, 1e-2)
    return probe

@pytest.mark.parametrize('mode', HALF)
@pytest.mark.parametrize('method', ['fit_one_cycle', 'fine_tune'])
def test_schedule_reaches_the_step(mode, method):
    "Each step of `fit_one_cycle` and `fine_tune` moves the weights by the lr fastai's schedule set, as in fp32: plain SGD by hand."
    check_step_lrs(ramp_lrs(mode, method), asked=ramp_lrs(None, method).asked)

@pytest.mark.parametrize('bug', [lambda: lr_scaled(1.05), lambda: lr_scaled(.5), lr_frozen], ids=['lr_x1.05', 'lr_x0.5', 'lr_frozen'])
def test_wrong_step_lr_is_caught(bug):
    "Negative control: the engine stepping with 1.05 or 0.5 times fastai's lr, or with the fit's first lr all along, fails the check."
    with bug(), pytest.raises(AssertionError, match='where fastai set'): check_step_lrs(ramp_lrs('bf16', 'fit_one_cycle'))

@pytest.mark.parametrize('mode', HALF)
def test_get_preds_and_validate_autocast(mode):
    "`get_preds` and `validate` compute in half precision (a forward hook sees it) and return fp32."
    learn = to_mode(tiny_learner(lr=1e-2), mode)
    with DtypeHook(learn.model[0]) as hook: preds,targs = learn.get_preds()
    assert hook.dtypes and set(hook.dtypes) == {HALF[mode]}
    assert preds.dtype == torch.float32 and preds.shape == targs.shape == (32, 1)
    with DtypeHook(learn.model[2]) as hook, learn.no_bar(): loss = learn.validate()[0]
    assert set(hook.dtypes) == {HALF[mode]} and math.isfinite(loss)
    learn.to_fp32()
    assert torch.allclose(learn.get_preds()[0], preds, rtol=.02, atol=.02), 'half precision predictions close to fp32 ones'

@pytest.mark.parametrize('mode', HALF)
@pytest.mark.parametrize('as_list', [False, True], ids=['tuple','list'])
def test_listy_preds_are_fp32(mode, as_list):
    "A model returning a tuple or list of half tensors gives the loss a tuple or list of fp32 tensors."
    learn = to_mode(tiny_learner(lr=1e-2, model=TupleModel(as_list), loss_func=first_mse), mode, init_scale=2.**8)
    probe = PredProbe()
    with DtypeHook(learn.model.body[2]) as hook: fit_quiet(learn, 1, cbs=probe)
    assert set(hook.dtypes) == {HALF[mode]}
    assert len(probe.dtypes) == 12 and all(d == [torch.float32]*2 for d in probe.dtypes)

@pytest.mark.parametrize('mode', HALF)
@pytest.mark.parametrize('acc', [False, True], ids=['plain','grad_acc'])
def test_logged_loss_is_unscaled(mode, acc):
    "The recorded losses match an fp32 run's (at a learning rate too small for skipped steps to matter), not 2**16 times them."
    def run(mode):
        learn = tiny_learner(lr=1e-5, cbs=GradientAccumulation(n_acc=32) if acc else None)
        if mode: to_mode(learn, mode)
        probe = LossProbe()
        fit_quiet(learn, 1, cbs=probe)
        return learn,torch.tensor(learn.recorder.losses),torch.tensor(probe.losses)
    _,smooth32,raw32 = run(None)
    learn,smooth,raw = run(mode)
    if mode == 'fp16': assert learn.mixed_precision.skipped_steps > 0, 'the loss really was scaled by 2**16 and overflowed'
    assert torch.allclose(smooth, smooth32, rtol=.05) and torch.allclose(raw, raw32, rtol=.05)

def test_export_round_trip(tmp_path):
    "After a fit, `export` + `load_learner` keep the callback with its scale, mode and log, and the loaded learner fits on."
    learn = tiny_learner(lr=1e-2, path=tmp_path, model=TupleModel(), loss_func=first_mse).to_fp16()
    fit_quiet(learn, 1)
    mp = learn.mixed_precision
    learn.export(tmp_path/'learn.pkl')
    learn2 = load_learner(tmp_path/'learn.pkl', cpu=False)
    mp2 = learn2.mixed_precision
    assert len(precision_cbs(learn2)) == 1 and isinstance(mp2, MixedPrecision) and mp2 is not mp
    assert (mp2.amp_mode, mp2.loss_scale, mp2.total_steps, mp2.skipped_steps) == ('fp16', mp.loss_scale, 10, mp.skipped_steps)
    assert mp2.scales == mp.scales and mp2.step_log.skips == mp.step_log.skips
    assert all(map(torch.equal, learn.model.parameters(), learn2.model.parameters()))
    learn2.dls = learn.dls
    fit_quiet(learn2, 1)
    assert mp2.total_steps == 20 and mp2.scales[10] == mp.loss_scale

def test_load_learner_cpu_goes_fp32(tmp_path):
    "`load_learner(cpu=True)` calls `Learner.to_fp32`, which is mpx's: the loaded learner has no precision callback and fp32 weights."
    learn = tiny_learner(lr=1e-2, path=tmp_path).to_bf16()
    fit_quiet(learn, 1)
    learn.export(tmp_path/'learn.pkl')
    learn2 = load_learner(tmp_path/'learn.pkl')
    assert precision_cbs(learn2) == [] and not hasattr(learn2, 'mixed_precision')
    assert all(p.dtype == torch.float32 for p in learn2.model.parameters())

def test_patches_survive_fastai_imports():
    "Importing `fastai.callback.all` and `fastai.tabular.all` after `mpx.all` leaves `to_fp16/to_bf16/to_fp32` mpx's."
    code = ("from mpx.all import *\nimport fastai.callback.all, fastai.tabular.all\nfrom fastai.learner import Learner\n"
            "print(*[f'{getattr(Learner, n).__module__}:{getattr(Learner, n).__code__.co_filename}' for n in ('to_fp16','to_bf16','to_fp32')])")
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True).stdout.split()
    assert len(out) == 3 and all(o.startswith('mpx.learner:') and o.replace('\\','/').endswith('mpx/learner.py') for o in out), out

def _apply(learn, call):
    if call == 'fastai': learn.add_cb(fastai_fp16.MixedPrecision())
    elif call == 'fastai_non_native': learn.to_non_native_fp16()
    elif call == 'mpx_cb': learn.add_cb(MixedPrecision('bf16'))
    elif call == 'master': learn.to_fp16(master=True)
    else: getattr(learn, f'to_{call}')()

CALLS = [
    (['fp16', 'fp16'], 'fp16'), (['fp16', 'bf16'], 'bf16'), (['bf16', 'fp16'], 'fp16'), (['bf16', 'bf16', 'bf16'], 'bf16'),
    (['fastai', 'fp16'], 'fp16'), (['fastai', 'bf16'], 'bf16'), (['fastai_non_native', 'bf16'], 'bf16'),
    (['mpx_cb', 'fp16'], 'fp16'), (['fp16', 'fp32'], None), (['fastai', 'fp32'], None), (['fastai_non_native', 'fp32'], None),
    (['fp16', 'bf16', 'fp32', 'fp32', 'fp16'], 'fp16'), (['fp32'], None),
    (['fp16', 'master'], 'master'), (['master', 'bf16'], 'bf16'), (['master', 'fp32'], None),
]

@pytest.mark.parametrize('calls,expect', CALLS, ids=[f"{'>'.join(c)}=>{e}" for c,e in CALLS])
def test_one_precision_callback(calls, expect):
    "Any mix of `to_fp16`, `to_bf16`, `to_fp32` and fastai's precision callbacks leaves exactly the last mpx mode, or none after `to_fp32`."
    learn = tiny_learner(lr=1e-2)
    for c in calls: _apply(learn, c)
    cbs = precision_cbs(learn)
    if expect is None: assert cbs == [] and not hasattr(learn, 'mixed_precision') and not hasattr(learn, 'master_precision')
    elif expect == 'master': assert len(cbs) == 1 and type(cbs[0]) is MasterPrecision and learn.mixed_precision is cbs[0]  # the alias load_learner(cpu=True) looks for
    else: assert len(cbs) == 1 and type(cbs[0]) is MixedPrecision and cbs[0].amp_mode == expect and learn.mixed_precision is cbs[0]

def test_to_fp32_after_fit():
    "`to_fp32` after an fp16 fit leaves an fp32 model, computed in fp32, that still trains."
    learn = tiny_learner(lr=1e-2).to_fp16(init_scale=2.**8)
    fit_quiet(learn, 1)
    learn.to_fp32()
    assert precision_cbs(learn) == [] and all(p.dtype == torch.float32 for p in learn.model.parameters())
    w = weights(learn)
    with DtypeHook(learn.model[0]) as hook: fit_quiet(learn, 1)
    assert set(hook.dtypes) == {torch.float32} and not any(map(torch.equal, w, learn.model.parameters()))
    assert all(math.isfinite(l) for l in learn.recorder.losses)

BAD = [  # kwargs, exception, the bad value its message must contain
    (dict(growth_factor=1.), ValueError, '1.0'), (dict(growth_factor=.5), ValueError, '0.5'),
    (dict(growth_factor=math.inf), ValueError, 'inf'), (dict(growth_factor='2'), TypeError, "'2'"),
    (dict(backoff_factor=0.), ValueError, '0.0'), (dict(backoff_factor=1.), ValueError, '1.0'), (dict(backoff_factor=-.5), ValueError, '-0.5'),
    (dict(init_scale=0.), ValueError, '0.0'), (dict(init_scale=-1), ValueError, '-1'), (dict(init_scale=math.inf), ValueError, 'inf'),
    (dict(init_scale=math.nan), ValueError, 'nan'), (dict(init_scale='1'), TypeError, "'1'"),
    (dict(growth_interval=0), ValueError, '0'), (dict(growth_interval=-3), ValueError, '-3'),
    (dict(growth_interval=2.), TypeError, '2.0'), (dict(growth_interval=True), TypeError, 'True'),
    (dict(enabled='yes'), TypeError, "'yes'"), (dict(enabled=1), TypeError, '1'),
    (dict(amp_mode='fp8'), ValueError, "'fp8'"), (dict(amp_mode=torch.float32), ValueError, 'torch.float32'), (dict(amp_mode=None), ValueError, 'None'),
]

@pytest.mark.parametrize('kwargs,exc,bad', BAD, ids=[','.join(f'{k}={v!r}' for k,v in kw.items()) for kw,*_ in BAD])
def test_bad_args(kwargs, exc, bad):
    "Invalid constructor arguments raise a `ValueError`/`TypeError` naming the argument and echoing the bad value."
    with pytest.raises(exc) as e: MixedPrecision(**kwargs)
    assert bad in str(e.value) and (next(iter(kwargs)) in str(e.value))

@pytest.mark.parametrize('kwargs,exc', [(dict(growth_factor=.5), ValueError), (dict(init_scale=math.inf), ValueError),
                                        (dict(growth_interval=2.), TypeError), (dict(bad=1), TypeError), (dict(amp_mode='bf16'), TypeError),
                                        (dict(init_scale=2.**8, loss_scale=512), ValueError)])
def test_failed_to_fp16_keeps_previous_callback(kwargs, exc):
    "A `to_fp16` call that raises leaves the learner's previous precision callback in place."
    learn = tiny_learner(lr=1e-2).to_bf16()
    prev = learn.mixed_precision
    with pytest.raises(exc): learn.to_fp16(**kwargs)
    assert precision_cbs(learn) == [prev] and learn.mixed_precision is prev and prev.learn is learn

def test_disabled():
    "`enabled=False` keeps the callback but computes in fp32 with no scaling: every logged scale is 1.0."
    learn = tiny_learner(lr=1e-2, cbs=MixedPrecision(enabled=False))
    with DtypeHook(learn.model[0]) as hook: fit_quiet(learn, 1)
    mp = learn.mixed_precision
    assert set(hook.dtypes) == {torch.float32} and mp.scaler is None
    assert (mp.loss_scale, mp.scales, mp.total_steps, mp.skipped_steps) == (1.0, [1.0]*10, 10, 0)

class Interrupt(Exception): "Stands for a `KeyboardInterrupt` (which pytest would take for itself)"

class InterruptAt(Callback):
    "Raise `Interrupt` at `event` of the third training batch, from `order`"
    def __init__(self, event, order): self.event,self.order,self.n = event,order,0
    def __call__(self, event_name):
        if event_name == self.event and self.training:
            self.n += 1
            if self.n == 3: raise Interrupt()
        super().__call__(event_name)

@pytest.fixture
def autocast_off():
    "Switch CPU autocast off after the test, should a test leave it on"
    yield
    if torch.is_autocast_enabled('cpu'): torch.set_autocast_enabled('cpu', False); torch.autocast_decrement_nesting()

def test_fit_after_interrupt_in_forward(autocast_off):
    "A fit interrupted during the forward pass (Ctrl-C in a notebook) does not break the next fit, which ends with autocast off."
    learn = tiny_learner(lr=1e-2).to_fp16(init_scale=2.**8)
    with pytest.raises(Interrupt): fit_quiet(learn, 1, cbs=InterruptAt('after_pred', MixedPrecision.order-1))
    fit_quiet(learn, 1)
    assert learn.mixed_precision.total_steps == 12 and not torch.is_autocast_enabled('cpu')

def test_fit_after_interrupt_in_step():
    "A fit interrupted during the optimizer step (Ctrl-C in a notebook) does not break the next fit."
    learn = tiny_learner(lr=1e-2).to_fp16(init_scale=2.**8)
    with pytest.raises(Interrupt): fit_quiet(learn, 1, cbs=InterruptAt('before_step', MixedPrecision.order+1))
    fit_quiet(learn, 1)
    assert learn.mixed_precision.total_steps == 13

class CancelThirdStep(Callback):
    "Cancel the third training batch in `before_step`, after `MixedPrecision` checked its gradients"
    order = MixedPrecision.order+1
    def before_step(self):
        if self.iter == 2: raise CancelBatchException()

def test_cancel_batch_after_check():
    "A callback after `MixedPrecision` that cancels a batch in `before_step` does not break the following steps."
    learn = tiny_learner(lr=1e-2).to_fp16(init_scale=2.**8)
    fit_quiet(learn, 1, cbs=CancelThirdStep())
    assert learn.mixed_precision.total_steps == 10
