"""Pins each fastai (and fastcore) behaviour that mpx's patches in `mpx.patches` rely on: a fastai upgrade that changes one
fails here, in the test named after it, rather than somewhere deep in a fit."""
import inspect, threading
import pytest, torch
from fastai.basics import Learner, Callback, ContextManagers, noop, save_model, load_model, CancelFitException
import fastai.learner
from mpx.all import *
import mpx.patches as patches
from mpx.test_utils import tiny_learner, fit_quiet
from fastai.callback.training import GradientClip
import fastai.callback.fp16 as fastai_fp16

fastai_ = lambda name: getattr(getattr(Learner, name), '_fastai')

def test_every_patch_keeps_fastais_original():
    "Each patched method keeps fastai's original on `_fastai` (fastcore's on `_fastcore`), so a reload wraps nothing twice."
    for name in ('_with_events', '__enter__', 'add_cb', 'remove_cb', 'add_cbs', 'save', 'load'):
        orig = fastai_(name)
        assert orig.__module__.startswith('fastai'), (name, orig.__module__)
    assert ContextManagers.__enter__._fastcore.__module__.startswith('fastcore')

def test_with_events_skips_after_event_on_other_exceptions():
    "fastai's `_with_events(f, event_type, ex, final)` runs `after_<event>` only when `f` raises `ex`: mpx must finish the callback itself."
    assert list(inspect.signature(fastai_('_with_events')).parameters) == ['self', 'f', 'event_type', 'ex', 'final']
    seen = []
    class Rec(Callback):
        def after_fit(self): seen.append('after_fit')
    learn = tiny_learner(cbs=Rec())
    def boom(): raise RuntimeError('x')
    with pytest.raises(RuntimeError): fastai_('_with_events')(learn, boom, 'fit', CancelFitException)
    assert seen == []

def test_enter_runs_before_fit_after_the_lock():
    "`validation_context` enters the learner's lock, then the learner, whose `__enter__` runs `before_fit` and `before_epoch`."
    learn,seen = tiny_learner(),[]
    class Rec(Callback):
        def before_fit(self): seen.append('before_fit')
        def before_epoch(self): seen.append('before_epoch')
    learn.add_cb(Rec())
    fastai_('__enter__')(learn)
    assert seen == ['before_fit', 'before_epoch']
    cms = learn.validation_context().default
    assert cms[-1] is learn and any(isinstance(c, type(threading.Lock())) or 'lock' in type(c).__name__.lower() for c in cms)

def test_fastcore_context_managers_leave_entered_ones():
    "fastcore's `ContextManagers.__enter__` leaves the managers it entered when a later one fails (the patch exits them): drop the patch when this fails."
    lock = threading.Lock()
    class Fail:
        def __enter__(self): raise RuntimeError('x')
        def __exit__(self, *a): pass
    cms = ContextManagers([lock, Fail()])
    with pytest.raises(RuntimeError): ContextManagers.__enter__._fastcore(cms)
    assert lock.locked()
    lock.release()
    cms = ContextManagers([lock, Fail()])
    with pytest.raises(RuntimeError): cms.__enter__()  # mpx's
    assert not lock.locked()

def test_add_cb_sets_the_named_attribute():
    "fastai's `add_cb` sets `cb.learn` and `learn.<cb.name>`; `load_learner(cpu=True)` calls `to_fp32()` on a learner with `mixed_precision`."
    learn,cb = tiny_learner(),MixedPrecision('bf16')
    fastai_('add_cb')(learn, cb)
    assert cb.learn is learn and getattr(learn, cb.name) is cb
    assert 'mixed_precision' in inspect.getsource(fastai.learner.load_learner)
    assert list(inspect.signature(fastai_('remove_cb')).parameters) == ['self', 'cb']

def test_add_cbs_keeps_those_added_before_a_refusal():
    "fastai's `add_cbs` adds one at a time and keeps those added before one that fails; `added_cbs` (`fit(cbs=...)`) adds before its `try`."
    learn,clip = tiny_learner().to_bf16(),GradientClip(1e-4)
    with pytest.raises(ValueError): fastai_('add_cbs')(learn, [clip, fastai_fp16.MixedPrecision()])
    assert clip in learn.cbs
    src = inspect.getsource(Learner.added_cbs)
    assert src.index('self.add_cbs(cbs)') < src.index('try:')

def test_refused_fit_leaves_none_of_its_cbs():
    "A fit refused for one of its `cbs` (a second precision callback) leaves none of them on the learner: the next fit does not clip."
    learn,ref = tiny_learner(lr=1e-2).to_bf16(),tiny_learner(lr=1e-2).to_bf16()
    before = list(learn.cbs)
    with pytest.raises(ValueError, match='already has the precision callback'):
        learn.fit(1, cbs=[GradientClip(1e-4), fastai_fp16.MixedPrecision()])
    assert list(learn.cbs) == before and 'gradient_clip' not in learn.__dict__
    fit_quiet(learn)
    fit_quiet(ref)
    assert all(torch.equal(a, b) for a,b in zip(learn.model.parameters(), ref.model.parameters()))

def test_save_and_load_go_through_the_optimizers_state_dict(tmp_path):
    "`save_model` writes `opt.state_dict()` and `load_model` reads it back through `opt.load_state_dict`: where the loss scale rides."
    calls = []
    class Opt:
        def state_dict(self): calls.append('state_dict'); return {'mpx': 1}
        def load_state_dict(self, sd): calls.append(('load', sd))
    model = torch.nn.Linear(1, 1)
    save_model(tmp_path/'m.pth', model, Opt(), with_opt=True)
    load_model(tmp_path/'m.pth', model, Opt(), with_opt=True)
    assert calls == ['state_dict', ('load', {'mpx': 1})]

def test_patched_save_and_load_keep_fastais_signatures():
    "mpx's `save` and `load` show the arguments fastai's take (`with_opt`, `pickle_protocol`, `strict`...)."
    assert {'with_opt', 'pickle_protocol'} <= set(inspect.signature(Learner.save).parameters)
    assert {'device', 'with_opt', 'strict'} <= set(inspect.signature(Learner.load).parameters)

def test_fastai_version_is_supported():
    "The installed fastai is in the range the patches are pinned against; another one gets a warning naming both."
    assert patches.check_fastai_version()
    with pytest.warns(UserWarning, match='fastai 3.0.0 is installed'): assert not patches.check_fastai_version('3.0.0')
