"""The visible state is the truth (issue 33): whatever fastai or a callback changes between two steps (the optimizer's state,
its hypers, its parameter lists, the model's weights and gradients) is what the next step uses, in every mode and under
every `fused` setting. Each case makes one change at one event of a fit and compares the result with plain fastai doing
the same: bit for bit where the eager engine promises it, within a stated tolerance where 16 bits or a compiled kernel
round otherwise."""
import warnings
from functools import partial
import pytest, torch
from torch import nn
from fastai.basics import Callback, SGD, Adam, Optimizer, OptimWrapper, sgd_step, CancelStepException
from fastai.callback.training import GradientAccumulation
import fastai.callback.schedule  # noqa: F401
from mpx.all import *
from mpx.fused import FusedSteps
from mpx.test_utils import tiny_learner, tiny_split, ALL_MODES, fit_quiet, state_of, state_diffs, precision_cb, precision_cbs, weights

pytestmark = pytest.mark.filterwarnings('ignore::UserWarning', 'ignore::FutureWarning')
COMPILE = pytest.param('compile', marks=pytest.mark.compiled)  # where no compiler works: skipped, with the reason
FUSED = [True, False, COMPILE]

@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads(); torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

# ---- 1. fastai's state-changing calls at every event, against plain fastai

class Engine(Callback):
    "What a mode does with the step engine, on an fp32 learner: install it for each fit, the step counts to the host each epoch"
    order = 50
    def __init__(self, fused): self.fused = fused
    def before_fit(self): self.fs = FusedSteps(self.learn.opt, fused=self.fused)
    def after_epoch(self): self.fs.steps_to_host()
    def after_fit(self): self.fs.undo()

def _load_state(learn):
    sd = learn.opt.state_dict()
    learn.opt.load_state_dict({'state': [{k: (v.clone() if torch.is_tensor(v) else v) for k,v in s.items()} for s in sd['state']],
                               'hypers': [dict(h) for h in sd['hypers']]})

CALLS = dict(
    clear_state=lambda l: l.opt.clear_state(),
    load_state_dict=_load_state,
    freeze_to=lambda l: l.freeze_to(1),
    unfreeze=lambda l: l.unfreeze(),
    create_opt=lambda l: l.create_opt(),
    set_hyper=lambda l: l.opt.set_hyper('lr', 3e-2),
    set_step=lambda l: [s.__setitem__('step', 1) for s in l.opt.state.values() if 'step' in s],
    set_avg=lambda l: [s['grad_avg'].mul_(.5) for s in l.opt.state.values() if 'grad_avg' in s],
)
EVENTS = ['before_batch', 'after_pred', 'after_loss', 'before_backward', 'after_backward', 'before_step', 'after_step', 'after_batch']

class CallAt(Callback):
    "Make `call` once, at `event` of the `at`-th training batch"
    order = 60
    def __init__(self, call, event, at=5): self.call,self.event,self.at,self.n,self.done = call,event,at,0,False
    def __getattr__(self, k):
        if k == self.__dict__.get('event'): return self._maybe
        return super().__getattr__(k)
    def _maybe(self):
        if self.training and self.n == self.at and not self.done: self.done = True; CALLS[self.call](self.learn)
    def after_batch(self):
        if self.event == 'after_batch': self._maybe()
        if self.training: self.n += 1

def called(call, event, fused=None, mode=None):
    "Two epochs of Adam with two groups and weight decay, `call` made once at `event` of the second: `state_of`, or the error"
    learn = tiny_learner(opt_func=Adam, splitter=tiny_split, lr=1e-2, wd=1e-2, n_trn=4, cbs=CallAt(call, event))
    if mode: ALL_MODES[mode](learn, fused=fused)
    elif fused is not None: learn.add_cb(Engine(fused))
    try: fit_quiet(learn, 2)
    except Exception as e: return repr(e)[:200]
    return state_of(learn)

def _close(a, b, tol) -> list:
    "Where two `state_of`s differ by more than `tol` relative (tensors), or at all (other values)"
    return [d for d in state_diffs(a, b) if 'max diff' not in d or float(d.rsplit(' ', 1)[1]) > tol]

CASES = [(c, e) for c in CALLS for e in EVENTS]

@pytest.mark.parametrize('fused', [True, COMPILE])  # `fused=False` in fp32 installs no engine step: it would compare fastai with fastai
@pytest.mark.parametrize('call,event', CASES, ids=[f'{c}-{e}' for c,e in CASES])
def test_state_call_follows_fastai(call, event, fused):
    "fastai's state-changing calls at any event: the engine's next steps are plain fastai's, bit for bit (compiled: within 1e-4)."
    ref = called(call, event)
    if isinstance(ref, str): pytest.skip(f'plain fastai fails too: {ref}')
    got = called(call, event, fused)
    assert not isinstance(got, str), got
    diffs = state_diffs(ref, got) if fused != 'compile' else _close(ref, got, 1e-4)
    assert not diffs, diffs[:3]

@pytest.mark.parametrize('fused', [True, COMPILE])
@pytest.mark.parametrize('call', list(CALLS))
def test_state_call_in_amp(call, fused):
    "The same calls in AMP bf16, at `before_step`: the engine steps as fastai's own loop does (`fused=False` installs no engine)."
    ref,got = called(call, 'before_step', False, 'amp_bf16'),called(call, 'before_step', fused, 'amp_bf16')
    if isinstance(ref, str): pytest.skip(f'fastai fails too: {ref}')
    diffs = state_diffs(ref, got) if fused is True else _close(ref, got, 1e-4)
    assert not diffs, diffs[:3]

@pytest.mark.compiled
def test_clear_state_resets_the_compiled_step_count():
    "The failure the issue found: a compiled fit reset by `clear_state` after 4 steps counts 4 more, not 8."
    learn = tiny_learner(opt_func=Adam, lr=1e-2, n_trn=8, cbs=CallAt('clear_state', 'after_step', at=3)).to_bf16(fused='compile')
    fit_quiet(learn)
    assert {s['step'] for s in learn.opt.state_dict()['state']} == {4}

class Chunk(Callback):
    "The engine's windows at most `n` elements: a larger parameter is stepped in pieces"
    order = 60
    def __init__(self, n): self.n = n
    def before_train(self): precision_cb(self.learn).fused_steps.chunk = self.n

@pytest.mark.parametrize('mode,opt_state', [('amp_bf16', 'bf16'), ('amp_bf16', '8bit'), ('pure_kahan', '8bit')])
@pytest.mark.parametrize('call', ['clear_state', 'unfreeze'])
def test_cleared_state_in_pieces(mode, opt_state, call):
    """A state fastai clears between fits is zeros in every piece of a parameter stepped in pieces, as stepped whole: the pieces
    after the first once read the store's old values (a vision fine_tune after lr_find moved the body 3-36x as far as fp32)"""
    def run(chunk):
        learn = tiny_learner(opt_func=Adam, splitter=tiny_split, lr=1e-2, wd=1e-2, n_trn=2, cbs=Chunk(chunk),
                             model=lambda: nn.Sequential(nn.Linear(1, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1)))
        ALL_MODES[mode](learn, opt_state=opt_state)
        fit_quiet(learn)  # the store holds this fit's state, then fastai's dicts are replaced: no state
        CALLS[call](learn)
        return state_of(fit_quiet(learn))
    assert not state_diffs(run(1 << 22), run(1 << 16))[:3]  # 512x512: whole, then in 4 pieces

# ---- 2, 3. writes into the model's weights and gradients, in every mode

MODES = ['amp_bf16', 'amp_fp16', 'master_fp16', 'master_bf16', 'pure_kahan', 'pure_stochastic']

def fp32_view(learn, p) -> torch.Tensor:
    "What the mode steps for parameter `p`, in fp32: the parameter, its master, or `w + c`"
    cb = precision_cb(learn)
    if cb is None or cb.fused_steps is None: return p.detach().float().clone()
    b,i = cb.fused_steps.home[id(p)]
    return b.kind.value(b, i).detach().clone()  # a kind in place gives the parameter itself

WRITES = dict(fill=lambda p,sd: p.fill_(.25), load_state_dict=None)

class WriteAt(Callback):
    "Write 0.25 into the first layer's weight at `event` of the `at`-th batch (in place, under `no_grad`), then record the step"
    def __init__(self, event, how='fill', order=60, at=2): self.event,self.how,self.order,self.at,self.n,self.res = event,how,order,at,0,None
    def __getattr__(self, k):
        if k == self.__dict__.get('event'): return self._write
        return super().__getattr__(k)
    def _write(self):
        if not (self.training and self.n == self.at): return
        p = self.learn.model[0].weight
        with torch.no_grad():
            if self.how == 'fill': p.fill_(.25)
            else:
                sd = {k: v.clone() for k,v in self.learn.model.state_dict().items()}
                sd['0.weight'].fill_(.25); self.learn.model.load_state_dict(sd)
    def after_step(self):
        if self.training and self.n == self.at:
            p = self.learn.model[0].weight
            self.res = (fp32_view(self.learn, p), self.learn.opt.state[p]['grad_avg'].detach().float().clone())
    def after_batch(self):
        if self.training: self.n += 1

WRITE_AT = [('before_batch', 60), ('after_pred', 60), ('after_loss', 60), ('before_backward', 60), ('after_backward', 5),
            ('after_backward', 60), ('before_step', 5), ('before_step', 60)]
TOL = dict(pure_stochastic=2**-8, pure_kahan=1e-5)  # stochastic rounding: within one bf16 spacing of 0.25

@pytest.mark.parametrize('fused', FUSED)
@pytest.mark.parametrize('event,order', WRITE_AT, ids=[f'{e}-{o}' for e,o in WRITE_AT])
@pytest.mark.parametrize('mode', MODES)
def test_weight_write_reaches_the_step(mode, event, order, fused):
    "A weight written in place before a step is what that step starts from: its master takes it, its compensation is reset."
    w = WriteAt(event, order=order)
    learn = tiny_learner(opt_func=partial(SGD, mom=.9), lr=1e-2, wd=0., n_trn=4, cbs=w)
    ALL_MODES[mode](learn, fused=fused)
    fit_quiet(learn)
    x,avg = w.res
    expected = .25 - 1e-2 * avg  # SGD with momentum: the step from the written weight
    assert (x - expected).abs().max() <= TOL.get(mode, 1e-6), (x - expected).abs().max()

class WriteUnstepped(Callback):
    "Write 0.25 into the first layer's weight in place (`no_grad`) after the fit's last step, or just before a `learn.save` mid-fit"
    order = 60
    def __init__(self, save:bool): self.save = save
    def after_epoch(self):
        if not self.save: self._write()
    def after_batch(self):
        if self.save and self.training and self.iter == 1: self._write(); self.learn.save('mid')
    def _write(self):
        with torch.no_grad(): self.learn.model[0].weight.fill_(.25)

@pytest.mark.parametrize('fused', FUSED)
@pytest.mark.parametrize('save', [False, True], ids=['after_the_last_step', 'before_a_save'])
@pytest.mark.parametrize('mode', MODES)
def test_weight_write_with_no_step_after_it(mode, save, fused, tmp_path):
    "A weight written after the last step, or just before a save mid-fit, is what the fit leaves, or saves, exactly: not the master's old value."
    learn = tiny_learner(opt_func=partial(SGD, mom=.9), lr=1e-2, wd=0., n_trn=4, path=tmp_path, cbs=WriteUnstepped(save))
    ALL_MODES[mode](learn, fused=fused)
    fit_quiet(learn)
    got = torch.load(tmp_path/'models'/'mid.pth', weights_only=False)['model']['0.weight'] if save else weights(learn)[0]  # fp32 values
    assert got.dtype == torch.float32 and torch.equal(got, torch.full_like(got, .25)), got.flatten()[:3]

@pytest.mark.parametrize('fused', FUSED)
@pytest.mark.parametrize('mode', MODES)
def test_load_state_dict_mid_fit(mode, fused):
    "`learn.model.load_state_dict(...)` from a callback mid-fit reaches the step, as a direct write does."
    w = WriteAt('after_backward', how='load_state_dict')
    learn = tiny_learner(opt_func=partial(SGD, mom=.9), lr=1e-2, wd=0., n_trn=4, cbs=w)
    ALL_MODES[mode](learn, fused=fused)
    fit_quiet(learn)
    x,avg = w.res
    assert (x - (.25 - 1e-2 * avg)).abs().max() <= TOL.get(mode, 1e-6)

class EditGrad(Callback):
    "Multiply (or replace) every model gradient by 3 at `event`, and keep the first step's `grad_avg` (SGD momentum: the stepped gradient)"
    def __init__(self, event, order, how='mul'): self.event,self.order,self.how,self.avg,self.n = event,order,how,None,0
    def __getattr__(self, k):
        if k == self.__dict__.get('event'): return self._edit
        return super().__getattr__(k)
    def _edit(self):
        if not self.training or self.n: return
        for p in self.learn.model.parameters():
            if p.grad is None: continue
            if self.how == 'mul':
                with torch.no_grad(): p.grad.mul_(3)
            else: p.grad = p.grad * 3
    def after_step(self):
        if self.training and self.avg is None:
            self.avg = [self.learn.opt.state[p]['grad_avg'].detach().float().clone() for p in self.learn.model.parameters()]
    def after_batch(self):
        if self.training: self.n += 1

EDIT_AT = [('after_backward', 5), ('after_backward', 60), ('before_step', 5), ('before_step', 60)]
GRAD_TOL = dict(amp_fp16=2e-2, master_fp16=2e-2)

def _first_avg(mode, event, order, how, fused=True):
    e = EditGrad(event, order, how)
    learn = tiny_learner(opt_func=partial(SGD, mom=.9), lr=1e-2, wd=0., n_trn=2, cbs=e)
    if mode: ALL_MODES[mode](learn, fused=fused)
    fit_quiet(learn)
    return e.avg

@pytest.mark.parametrize('fused', FUSED)
@pytest.mark.parametrize('how', ['mul', 'replace'])
@pytest.mark.parametrize('event,order', EDIT_AT, ids=[f'{e}-{o}' for e,o in EDIT_AT])
@pytest.mark.parametrize('mode', MODES)
def test_grad_edit_is_this_steps(mode, event, order, how, fused):
    "A gradient edited between the backward and the step (any callback order) is the gradient this step uses, not the next one."
    ref,got = _first_avg(None, event, order, how),_first_avg(mode, event, order, how, fused)
    for a,b in zip(ref, got):  # the edit lost, or applied a step late, is a factor of 3
        assert (a - b).norm() <= GRAD_TOL.get(mode, 1e-2) * a.norm(), ((a - b).norm() / a.norm())

@pytest.mark.parametrize('mode', ['master_fp16', 'master_bf16'])
def test_grad_edit_with_accumulation(mode):
    "With `GradientAccumulation` the gradients still add up in fp32 and an edit before the step applies to their sum."
    def run(mode):
        e = EditGrad('before_step', 60)
        learn = tiny_learner(opt_func=partial(SGD, mom=.9), lr=1e-2, wd=0., n_trn=3, cbs=[GradientAccumulation(48), e])
        if mode: ALL_MODES[mode](learn)
        fit_quiet(learn); return e.avg
    for a,b in zip(run(None), run(mode)): assert (a - b).norm() <= 1e-2 * a.norm()

# ---- 4. every kind of optimizer fastai accepts, under every fused setting

class MyOpt(Optimizer):
    "A user's subclass with its own step"
    def step(self, closure=None): super().step()

OPTS = dict(fastai_adam=Adam, torch_adamw=partial(OptimWrapper, opt=torch.optim.AdamW), torch_sgd=partial(OptimWrapper, opt=torch.optim.SGD),
            subclass=lambda ps, **kw: MyOpt(ps, [sgd_step], **kw))

# `fused='compile'` steps foreign optimizers and a subclass's own step eagerly, by design: only fastai's Adam runs a kernel
_KINDS = [pytest.param(o, f, marks=pytest.mark.compiled) if (o, f) == ('fastai_adam', 'compile') else (o, f)
          for o in OPTS for f in (True, False, 'compile')]

@pytest.mark.parametrize('opt,fused', _KINDS, ids=[f'{o}-{f}' for o in OPTS for f in (True, False, 'compile')])
@pytest.mark.parametrize('mode', ['amp_bf16', 'amp_fp16', 'master_bf16', 'pure_kahan'])
def test_every_optimizer_kind(mode, opt, fused):
    """fastai's optimizers, torch's through `OptimWrapper` and a subclass with its own step train in every mode and fused setting;
    where `fused='compile'` cannot compile a foreign step it says why, once."""
    learn = tiny_learner(opt_func=OPTS[opt], lr=1e-2, n_trn=4)
    ALL_MODES[mode](learn, fused=fused)
    start = weights(learn)
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('always')
        fit_quiet(learn)
    said = [str(w.message) for w in ws if 'steps eagerly' in str(w.message)]
    assert all(not torch.equal(a, b) for a,b in zip(start, weights(learn)))
    want = {torch.bfloat16} if mode == 'pure_kahan' else {torch.float32}  # pure bf16 keeps its layout between fits
    assert {p.dtype for p in learn.model.parameters()} == want
    if fused == 'compile' and opt != 'fastai_adam': assert len(said) == 1 and ('OptimWrapper' in said[0] or 'overrides' in said[0]), said
    else: assert not said, said

# ---- 5. a scale update that fails does not wedge the clean-up

@pytest.mark.parametrize('mode', ['amp_fp16', 'master_fp16_dynamic'])
def test_failed_scale_update_leaves_nothing(mode, monkeypatch):
    "A scale update that raises ends the fit with its error, and the learner still leaves the mode: fp32, no callback left."
    learn = ALL_MODES[mode](tiny_learner(lr=1e-2))
    cb = precision_cb(learn)
    def boom(found): raise RuntimeError('scale update failed')
    monkeypatch.setattr(cb, '_update_scale', boom)
    with pytest.raises(RuntimeError, match='scale update failed'): fit_quiet(learn)
    learn.to_fp32()
    assert not precision_cbs(learn) and {p.dtype for p in learn.model.parameters()} == {torch.float32}
    fit_quiet(learn)

@pytest.mark.parametrize('kw,bad', [(dict(hysteresis=2**31), 'hysteresis=2147483648'), (dict(growth_interval=2**63), 'growth_interval=9223372036854775808'),
                                   (dict(loss_scale=512, dynamic=True, growth_interval=2**40), 'growth_interval=1099511627776')])
def test_huge_ints_refused_at_the_call(kw, bad):
    "Integers past what the scaler's int32 tensors hold are refused when the call is made, naming the argument; nothing changes."
    learn = tiny_learner()
    with pytest.raises(ValueError, match=bad.replace('*', r'\*')): learn.to_fp16(**kw)
    assert not precision_cbs(learn)
