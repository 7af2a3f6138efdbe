"Shared setup for the pytest matrices: a seeded tiny learner, gradient fault injection, state snapshots and probes."
import math
from functools import partial
import torch
from torch import nn, Tensor
from torch.utils.data import TensorDataset
from fastai.torch_core import Module, set_seed
from fastai.data.core import TfmdDL, DataLoaders
from fastai.losses import MSELossFlat
from fastai.optimizer import SGD
from fastai.callback.core import Callback
from fastai.learner import Learner
from mpx.all import MixedPrecision, MasterPrecision, CountSyncs

__all__ = ['tiny_model', 'TupleModel', 'first_mse', 'synth_dls', 'tiny_learner', 'fit_quiet', 'count_syncs', 'replay', 'precision_cbs', 'InjectGrad', 'state_of',
           'same_state', 'all_weights_changed', 'Snapshot', 'check_skips_change_nothing', 'grad_norm', 'GradNormProbe', 'DtypeHook', 'PredProbe', 'LossProbe']

def tiny_model(): return nn.Sequential(nn.Linear(1,8), nn.ReLU(), nn.Linear(8,1))

class TupleModel(Module):
    "`tiny_model` whose forward returns its output twice, as a tuple or (`as_list`) a list; module level so it pickles"
    def __init__(self, as_list=False): self.body,self.as_list = tiny_model(),as_list
    def forward(self, x): out = self.body(x); return [out, 2*out] if self.as_list else (out, 2*out)

def first_mse(pred, y):
    "MSE of the first of a tuple of predictions; module level so it pickles"
    return MSELossFlat()(pred[0], y)

class SynthDS(TensorDataset):
    "`TensorDataset` that `Learner.export` can empty"
    def new_empty(self): return type(self)(*[t[:0] for t in self.tensors])

def synth_dls(n_trn=10, n_val=2, bs=16, device=None):
    "fastai's `synth_dbunch` regression (y = 2x+3+noise, x of shape (bs,1)) on datasets that `Learner.export` can empty"
    def ds(n): x = torch.randn(bs*n, 1); return SynthDS(x, 2*x + 3 + .1*torch.randn(bs*n, 1))
    return DataLoaders(TfmdDL(ds(n_trn), bs=bs, shuffle=True, num_workers=0), TfmdDL(ds(n_val), bs=bs, num_workers=0), device=device)

def tiny_learner(seed=0, model=None, opt_func=partial(SGD, mom=.9), lr=1e-2, loss_func=None, n_trn=10, device=None, **kwargs):
    "A seeded `Learner` on `synth_dls(n_trn)` (train batches of 16, 2 valid batches), `tiny_model` by default, data and model on `device`"
    set_seed(seed, reproducible=True)
    model = (model or tiny_model()).to(device or 'cpu')
    return Learner(synth_dls(n_trn, device=device), model, lr=lr, loss_func=loss_func or MSELossFlat(), opt_func=opt_func, **kwargs)

def fit_quiet(learn, n_epoch=1, method='fit', **kwargs):
    "Call `learn.<method>(n_epoch, **kwargs)` with no progress bar and no logging"
    with learn.no_bar(), learn.no_logging(): getattr(learn, method)(n_epoch, **kwargs)
    return learn

def count_syncs(precision=None, acc=False, device=None):
    "Host syncs over one quiet epoch of `tiny_learner`, with `MixedPrecision(**precision)` if given, `GradientAccumulation(32)` if `acc`"
    from fastai.callback.training import GradientAccumulation
    learn = tiny_learner(device=device, cbs=GradientAccumulation(n_acc=32) if acc else None)
    if precision is not None: learn.add_cb(MixedPrecision(**precision))
    with learn.no_bar(), learn.no_logging(), CountSyncs() as c: learn.fit(1)
    return c.n,learn

def replay(skips, init_scale=2.**16, growth_factor=2., backoff_factor=.5, growth_interval=2000, device='cpu'):
    "The scale a standalone `torch.amp.GradScaler` multiplies each step's loss by, when the steps flagged in `skips` overflow"
    p = torch.zeros(1, device=device, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.)
    scaler = torch.amp.GradScaler(torch.device(device).type, init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor, growth_interval=growth_interval)
    scales = []
    for skip in skips:
        scales.append(scaler.get_scale())
        scaler.scale((p+1.).sum()).backward()
        if skip: p.grad.fill_(math.inf)
        scaler.step(opt); scaler.update(); opt.zero_grad()
    return scales

def precision_cbs(learn):
    "The precision callbacks on `learn`, mpx's and fastai's"
    import fastai.callback.fp16 as ffp16
    types = (MixedPrecision, MasterPrecision, ffp16.MixedPrecision, ffp16.NonNativeMixedPrecision, ffp16.ModelToHalf)
    return [c for c in learn.cbs if isinstance(c, types)]

class InjectGrad(Callback):
    "Write `value` into the first element of the gradients of `names` (model parameter names) at the steps in `at`"
    order = MixedPrecision.order-1  # before `MixedPrecision` unscales and checks
    def __init__(self,
        at, # Indices of the optimizer steps (or, with `micro`, training batches) to poison, counted over every fit
        value=math.inf, # inf, -inf or nan
        names=('0.weight',), # Parameter names from `model.named_parameters()`
        micro=False, # Inject in `after_backward` of a training batch, not in `before_step`
    ): self.at,self.value,self.names,self.micro,self.count,self.injected = set(at),value,names,micro,0,[]
    def before_step(self):
        if not self.micro: self._inject()
    def after_backward(self):
        if self.micro: self._inject()
    def _inject(self):
        if self.count in self.at:
            ps = dict(self.learn.model.named_parameters())
            for n in self.names: ps[n].grad.view(-1)[0] = self.value
            self.injected.append(self.count)
        self.count += 1

def state_of(learn):
    "Copies of the model's parameters and of the optimizer state of each"
    ps = list(learn.model.parameters())
    return ([p.detach().clone() for p in ps],
            [{k:(v.clone() if isinstance(v, Tensor) else v) for k,v in learn.opt.state.get(p, {}).items()} for p in ps])

def _same(a, b): return torch.equal(a, b) if isinstance(a, Tensor) else a == b

def same_state(s1, s2) -> bool:
    "Whether two `state_of` snapshots are bit-identical: every weight and every optimizer-state entry"
    (w1,o1),(w2,o2) = s1,s2
    return all(map(torch.equal, w1, w2)) and all(d1.keys() == d2.keys() and all(_same(d1[k], d2[k]) for k in d1) for d1,d2 in zip(o1, o2))

def all_weights_changed(s1, s2) -> bool:
    "Whether every parameter tensor differs between two `state_of` snapshots"
    return not any(map(torch.equal, s1[0], s2[0]))

class Snapshot(Callback):
    "Keep `state_of(learn)` from before training and after every optimizer step, skipped steps included, in `snaps`"
    order = MixedPrecision.order+1
    def __init__(self): self.snaps = []
    def before_fit(self):
        if not self.snaps: self.snaps.append(state_of(self.learn))
    def after_step(self): self.snaps.append(state_of(self.learn))

def check_skips_change_nothing(mp, snap):
    "Assert that every skipped step leaves weights and optimizer state bit-identical; every other step changes every weight"
    assert len(snap.snaps) == mp.total_steps+1
    for i,skipped in enumerate(mp.step_log.skips):
        if skipped: assert same_state(snap.snaps[i], snap.snaps[i+1]), f'skipped step {i} changed the state'
        else: assert all_weights_changed(snap.snaps[i], snap.snaps[i+1]), f'clean step {i} left a weight unchanged'

def grad_norm(learn) -> float:
    "The total 2-norm of the model's gradients"
    return torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in learn.model.parameters() if p.grad is not None])).item()

class GradNormProbe(Callback):
    "Record `grad_norm` in `before_step` at `order` (a float, to slot between two callbacks)"
    def __init__(self, order): self.order,self.norms = order,[]
    def before_step(self): self.norms.append(grad_norm(self.learn))

class DtypeHook:
    "Forward hook on `module` recording its output dtypes in `dtypes`; a context manager that removes it"
    def __init__(self, module): self.dtypes,self.h = [],module.register_forward_hook(lambda m,i,o: self.dtypes.append(o.dtype))
    def __enter__(self): return self
    def __exit__(self, *args): self.h.remove()

class PredProbe(Callback):
    "Record the dtypes of `learn.pred` (a tensor or a tuple/list of them) right after `MixedPrecision.after_pred`"
    order = MixedPrecision.order+1
    def __init__(self): self.dtypes = []
    def after_pred(self): self.dtypes.append([p.dtype for p in (self.pred if isinstance(self.pred, (list, tuple)) else [self.pred])])

class LossProbe(Callback):
    "Record `learn.loss` (what fastai logs) after every training batch"
    def __init__(self): self.losses = []
    def after_batch(self):
        if self.training: self.losses.append(self.loss.item())
