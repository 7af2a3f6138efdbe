"""Classes of failure found by using fastai as users do: calls before the first fit, checkpoints inside a gradient-accumulation
window, `validate`/`get_preds`/`lr_find` called from a callback mid-fit. Each mode is held to what fp32 fastai does: the same
steps, and weights as close to fp32's after the call as the mode's are without it."""
import functools, tempfile
from pathlib import Path
import pytest, torch
from fastai.basics import Callback, load_learner
from fastai.callback.training import GradientAccumulation
from fastai.callback.hook import summary  # noqa: F401 (patches `Learner.summary`)
import fastai.callback.schedule  # noqa: F401 (lr_find)
from mpx.all import *
from mpx.test_utils import tiny_learner, tabular_app_learner, ALL_MODES, precision_cb, state_of, state_diffs, fit_quiet, learner_problems
from planted import nested_effect_dropped

pytestmark = pytest.mark.filterwarnings('ignore::UserWarning')

# ---- before the first fit, with and without an optimizer

BEFORE = dict(validate=lambda l: l.validate(), get_preds=lambda l: l.get_preds(), summary=lambda l: l.summary())

@pytest.mark.parametrize('with_opt', [False, True], ids=['no_opt', 'opt'])
@pytest.mark.parametrize('call', BEFORE)
@pytest.mark.parametrize('mode', ALL_MODES)
def test_before_first_fit(mode, call, with_opt):
    "Every call a user makes before the first fit works in every mode, twice, leaves an fp32 model, and a fit follows."
    learn = tiny_learner(bn=True, lr=1e-2)
    if with_opt: learn.create_opt()
    ALL_MODES[mode](learn)
    for _ in range(2): BEFORE[call](learn)
    assert learner_problems(learn) == []
    assert fit_quiet(learn).mixed_precision.total_steps == 10 and learner_problems(learn) == []

@pytest.mark.parametrize('mode', ['master_fp16', 'master_bf16', 'pure_kahan', 'amp_bf16'])
def test_app_before_first_fit(mode, tmp_path):
    "On the tabular application: `predict`, `validate` and `summary` first, and an exported learner loaded with `cpu=False`."
    learn = tabular_app_learner(path=tmp_path)
    ALL_MODES[mode](learn)
    row = learn.dls.valid_ds.items.iloc[0]
    learn.predict(row); learn.validate(); learn.summary()
    fit_quiet(learn).export('x.pkl')
    new = load_learner(tmp_path/'x.pkl', cpu=False)
    preds,_ = new.get_preds(dl=learn.dls.valid)
    assert preds.dtype == torch.float32 and preds.isfinite().all() and learner_problems(new) == []

# ---- save/load inside a gradient-accumulation window

EVENTS = ['before_batch', 'after_pred', 'after_loss', 'before_backward', 'after_backward', 'before_step', 'after_step', 'after_batch',
          'after_epoch']

class SaveAt(Callback):
    "Save (and reload) the learner with its optimizer at `event` of every training batch"
    def __init__(self, event, load, order):
        self.load,self.order = load,order
        setattr(self, event, self.checkpoint)
    def checkpoint(self):
        self.learn.save('mid', with_opt=True)
        if self.load: self.learn.load('mid', with_opt=True)

def accumulate(mode, tmp_path, cbs=()):
    "A learner in `mode` (None: fp32) fit for 2 epochs with steps every 3 batches of 16 (`GradientAccumulation`), and its final `state_of`"
    learn = tiny_learner(bn=True, lr=1e-2, path=tmp_path, cbs=[GradientAccumulation(48), *cbs])
    if mode: ALL_MODES[mode](learn)
    fit_quiet(learn, 2)
    return learn,state_of(learn)

@functools.cache
def plain_accumulate(mode):
    "`accumulate` without checkpoints: each mode's reference, made once"
    learn,state = accumulate(mode, Path(tempfile.mkdtemp()))
    return precision_cb(learn).total_steps,state

@functools.cache
def fp32_fails(event, order, load) -> str:
    "Why fp32 fastai fails with these checkpoints ('' where it does not): a load between forward and backward does"
    try: accumulate(None, Path(tempfile.mkdtemp()), [SaveAt(event, load, order)]); return ''
    except RuntimeError as e: return repr(e)[:120]

# every event once, a load where fp32 allows it, and the master gradients' two sides of `after_backward`
CHECKPOINTS = [(e, 11, e in ('before_step', 'after_step', 'after_batch', 'after_epoch')) for e in EVENTS] + [('after_backward', 9, False)]
KEY_MODES = ['amp_fp16', 'master_fp16', 'master_fp16_dynamic', 'master_bf16', 'pure_kahan', 'pure_stochastic']

@pytest.mark.parametrize('event,order,load', CHECKPOINTS, ids=[f'{e}-{o}-{"load" if l else "save"}' for e,o,l in CHECKPOINTS])
@pytest.mark.parametrize('mode', KEY_MODES)
def test_checkpoint_in_accumulation(mode, event, order, load, tmp_path):
    "A save (and a load, where fp32 fastai allows one) at any event, inside an accumulation window too, leaves training bit-identical."
    if fp32_fails(event, order, load): pytest.skip(f'fp32 fastai fails too: {fp32_fails(event, order, load)}')
    steps,ref = plain_accumulate(mode)
    learn,got = accumulate(mode, tmp_path, [SaveAt(event, load, order)])
    assert not state_diffs(ref, got), state_diffs(ref, got)[:3]
    assert precision_cb(learn).total_steps == steps == 6 and learner_problems(learn) == []

# ---- validate / get_preds / lr_find called from a callback mid-fit

NESTED = dict(validate=lambda l: l.validate(), get_preds=lambda l: l.get_preds(),
              lr_find=lambda l: l.lr_find(num_it=6, show_plot=False, suggest_funcs=None))
NEST_EVENTS = ['after_pred', 'after_backward', 'after_step', 'after_batch', 'after_epoch']
NEST_CASES = [(e, c) for e in NEST_EVENTS for c in NESTED if c != 'lr_find' or e in ('after_step', 'after_epoch')]

class CallAt(Callback):
    "Call `call(learn)` once: at the second training batch's `event`, or at the first `after_epoch`"
    order = 11
    def __init__(self, event, call):
        self.event,self.call,self.n,self.busy = event,call,0,False
        setattr(self, event, self.fire)
    def fire(self):
        if self.busy or (self.event != 'after_epoch' and not self.training): return
        self.n += 1
        if self.n != (1 if self.event == 'after_epoch' else 2): return
        self.busy = True
        try: self.call(self.learn)
        finally: self.busy = False

class _Steps(Callback):
    "Counts the optimizer steps (skipped ones too), the nested call's included"
    order,n = 50,0
    def after_step(self): self.n += 1

def _nested_run(mode, event, call):
    "The final `state_of` and step count of a 2-epoch fit in `mode` (None: fp32) with `call` at `event`; or the exception, the problems"
    steps = _Steps()
    learn = tiny_learner(lr=1e-2, path=Path(tempfile.mkdtemp()), cbs=[steps] + ([CallAt(event, NESTED[call])] if call else []))
    if mode: ALL_MODES[mode](learn)
    try: fit_quiet(learn, 2)
    except Exception as e: return e,learner_problems(learn)
    assert learner_problems(learn) == []
    return state_of(learn),steps.n

nested_run = functools.cache(_nested_run)

def _dist(a:dict, b:dict) -> float: return sum(float((x - y).norm()**2) for x,y in zip(a['weights'], b['weights']))**.5

def check_nested(mode, event, call, got):
    """`got`, a `nested_run` in `mode`, against fp32 fastai making the same call: the same exception where fp32 fails; else the same steps,
    the mode's own run without the call bit for bit where the call changes nothing in fp32, and where it does, weights as close to fp32's
    with the call as the mode's are to fp32's without it (three times): a mode dropping the call's effect ends where it was never made"""
    fp32 = nested_run(None, event, call)
    if isinstance(fp32[0], Exception):
        same = type(got[0]) is type(fp32[0]) and str(got[0]).splitlines()[:2] == str(fp32[0]).splitlines()[:2]
        assert same, f'{mode} failed otherwise: {got[0]!r}'
        assert got[1] == [], f'{mode} after the failed fit: {got[1]}'
        return
    assert not isinstance(got[0], Exception), f'{mode} failed where fp32 works: {got[0]!r}'
    assert got[1] == fp32[1], f'{mode} made {got[1]} optimizer steps, fp32 {fp32[1]}'
    plain,fp32_plain = nested_run(mode, None, None),nested_run(None, None, None)
    if not state_diffs(fp32_plain[0], fp32[0]):  # the call changes nothing in fp32: nothing in the mode either
        assert not state_diffs(plain[0], got[0]), state_diffs(plain[0], got[0])[:3]
        return
    d,noise,effect = _dist(got[0], fp32[0]),_dist(plain[0], fp32_plain[0]),_dist(fp32[0], fp32_plain[0])
    assert d <= 3 * noise, f'{mode} ends {d:.3g} from fp32 with the call, {noise:.3g} from it without (the call moves fp32 by {effect:.3g})'

@pytest.mark.parametrize('event,call', NEST_CASES, ids=[f'{e}-{c}' for e,c in NEST_CASES])
@pytest.mark.parametrize('mode', KEY_MODES + ['amp_bf16'])
def test_nested_call(mode, event, call):
    "A call fastai allows mid-fit does in every mode what it does in fp32 (its effect on the rest of the fit, or its error)."
    check_nested(mode, event, call, nested_run(mode, event, call))

@pytest.mark.parametrize('event,call', [('after_pred', 'validate'), ('after_epoch', 'lr_find')])
def test_nested_check_sees_a_dropped_effect(event, call):
    "Negative control: a mode that undid what a nested `validate` or `lr_find` does to the fit fails `check_nested`."
    with nested_effect_dropped(): got = _nested_run('master_fp16', event, call)
    with pytest.raises(AssertionError): check_nested('master_fp16', event, call, got)

# ---- a callback failing in the before_fit of a validation

class FailFirstBeforeFit(Callback):
    "Raises in the first `before_fit`, after the precision callback's"
    order,n = 11,0
    def before_fit(self):
        self.n += 1
        if self.n == 1: raise RuntimeError('boom')

@pytest.mark.parametrize('call', ['validate', 'get_preds'])
@pytest.mark.parametrize('mode', ALL_MODES)
def test_failed_validation_start(mode, call):
    "A callback that raises in a validation's `before_fit` leaves an fp32 model and a learner whose next calls run (not wait forever)."
    learn = tiny_learner(bn=True, cbs=FailFirstBeforeFit())
    ALL_MODES[mode](learn)
    with pytest.raises(RuntimeError, match='boom'): BEFORE[call](learn)
    assert learner_problems(learn) == []
    BEFORE[call](learn)
    assert fit_quiet(learn).mixed_precision.total_steps == 10 and learner_problems(learn) == []
