"""One fit scope (issue 34): everything a fit installs (the optimizer's methods, the learner's attributes, the half model, the
step engine's flat buffers, fp8's module swaps) is undone by one close of the fit's ledger, however the fit ends. A snapshot
of the learner, its optimizer and its model before a fit equals the one after it, in every mode and `fused` setting, after
a fit that ends normally and after one that raises at any event."""
import pytest, torch
from torch import nn
from fastai.basics import Callback, Adam
from mpx.all import *
from mpx.test_utils import tiny_learner, tiny_split, ALL_MODES, fit_quiet

pytestmark = pytest.mark.filterwarnings('ignore::UserWarning', 'ignore::FutureWarning')
MODES = {**{k: ALL_MODES[k] for k in ('amp_fp16', 'amp_bf16', 'master_fp16', 'master_bf16', 'pure_kahan', 'pure_stochastic')},
         'fp8': lambda l, **kw: l.to_fp8(**kw)}
EVENTS = ['before_fit', 'before_epoch', 'before_train', 'before_batch', 'after_pred', 'after_loss', 'before_backward',
          'after_backward', 'before_step', 'after_step', 'after_batch', 'after_train', 'before_validate', 'after_epoch']
# what fastai itself sets on a learner during a fit: its bookkeeping, not something installed
FASTAI_FIT = {'epoch', 'n_epoch', 'iter', 'n_iter', 'train_iter', 'pct_train', 'training', 'dl', 'xb', 'yb', 'pred', 'loss',
              'loss_grad', 'smooth_loss', 'final_record', 'opt', 'cancel_train', 'cancel_valid'}

def _storage(t) -> tuple: return (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())

def snapshot(learn) -> dict:
    "What a fit may change and must put back: attributes, methods, hooks, module types, parameters' dtypes and storage"
    m,opt = learn.model,learn.opt
    ps = list(m.parameters())
    hooks = [(n, len(x._forward_hooks), len(x._forward_pre_hooks), len(x._backward_hooks), len(x._state_dict_hooks),
              len(x._load_state_dict_pre_hooks)) for n,x in m.named_modules()]
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)] if opt is not None else []
    return dict(
        learner={k: id(v) for k,v in vars(learn).items() if k not in FASTAI_FIT},
        opt={k: id(v) for k,v in vars(opt).items() if k not in ('state', 'hypers')} if opt is not None else None,
        opt_lists=[[id(p) for p in pg] for pg in opt.param_lists] if opt is not None else None,
        modules=[(n, type(x)) for n,x in m.named_modules()], hooks=hooks,
        params=[(id(p), p.dtype, p.requires_grad, tuple(p.shape), p.stride()) for p in ps],
        grads=[None if p.grad is None else (p.grad.dtype, tuple(p.grad.shape)) for p in ps],
        own_storage=all(_storage(p)[1] == p.numel() * p.element_size() for p in ps)
                    and all(_storage(t)[1] == t.numel() * t.element_size() for t in state),
        shared=len({_storage(t)[0] for t in ps + state}) == len(ps) + len(state),
        autocast=torch.is_autocast_enabled('cpu'),
    )

class Boom(Callback):
    "Raise at `event` of the second training batch (or at once where the event is once a fit)"
    order = 50
    def __init__(self, event): self.event,self.n = event,0
    def __getattr__(self, k):
        if k == self.__dict__.get('event'): return self._boom
        return super().__getattr__(k)
    def _boom(self):
        if self.event in ('before_batch', 'after_pred', 'after_loss', 'before_backward', 'after_backward', 'before_step', 'after_step', 'after_batch'):
            self.n += self.training
            if self.n < 2: return
        raise RuntimeError('boom')

def learner(mode, fused, cbs=()):
    learn = tiny_learner(model=lambda: nn.Sequential(nn.Linear(1, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1)),
                         opt_func=Adam, splitter=tiny_split, lr=1e-2, n_trn=3, cbs=list(cbs))
    MODES[mode](learn, fused=fused)
    fit_quiet(learn)  # the optimizer exists, and has state, before the snapshot
    return learn

def _diff(a, b) -> list: return [k for k in a if a[k] != b[k]]

@pytest.mark.parametrize('fused', [True, False, pytest.param('compile', marks=pytest.mark.compiled)])
@pytest.mark.parametrize('mode', list(MODES))
def test_fit_leaves_nothing(mode, fused):
    "A fit that ends normally leaves the learner, its optimizer and its model as they were before it."
    learn = learner(mode, fused)
    before = snapshot(learn)
    fit_quiet(learn)
    assert not _diff(before, snapshot(learn)), _diff(before, snapshot(learn))

@pytest.mark.parametrize('event', EVENTS)
@pytest.mark.parametrize('fused', [True, False, pytest.param('compile', marks=pytest.mark.compiled)])
@pytest.mark.parametrize('mode', list(MODES))
def test_failed_fit_leaves_nothing(mode, fused, event):
    "A fit that raises at any event leaves the learner, its optimizer and its model as they were before it."
    learn = learner(mode, fused)
    before = snapshot(learn)
    boom = Boom(event); learn.add_cb(boom)
    with pytest.raises(RuntimeError, match='boom'): fit_quiet(learn)
    learn.remove_cb(boom)
    after = snapshot(learn)
    assert not _diff(before, after), [(k, before[k], after[k]) for k in _diff(before, after)][:2]
    fit_quiet(learn)  # and the next fit runs

@pytest.mark.parametrize('mode', ['amp_bf16', 'master_bf16'])
def test_snapshot_sees_a_leak(mode, monkeypatch):
    "The check can fail: an engine whose undo is dropped from the ledger leaves its methods and flat buffers behind."
    from mpx.fused import FusedSteps
    learn = learner(mode, True)
    before = snapshot(learn)
    monkeypatch.setattr(FusedSteps, 'undo', lambda self: None)
    fit_quiet(learn)
    assert {'opt', 'own_storage'} & set(_diff(before, snapshot(learn)))
