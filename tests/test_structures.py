"""Every structure fastai allows, in every mode, as a class of cases (issue 26): the optimizer's structure changed from a
callback mid-fit, an optimizer's own `zero_grad`, a parameter twice in the optimizer (tied weights), sparse gradients and
fastai's GANs. Each case is compared with fp32 fastai, and fused steps with fastai's loop where both run."""
import functools
from functools import partial
import pytest, torch
from torch import nn
from torch.nn import functional as F
from fastai.basics import Callback, Module, Optimizer, SGD
from mpx.all import *
from mpx.test_utils import *

pytestmark = [pytest.mark.filterwarnings('ignore::UserWarning'),  # slow-dtype and emulated-fp8 warnings on CPUs
              pytest.mark.usefixtures('one_thread')]

SIXTEEN = lambda: nn.Sequential(nn.Linear(1, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))  # fp8 takes its middle layer
EPS = dict(amp_fp16=2e-2, master_fp16=2e-2, master_fp16_dynamic=2e-2,  # the change's relative error against fp32
           fp8=.3)  # emulated fp8 matmuls in a 16-wide layer: 3 bits of mantissa

def apply_mode(learn, mode, **kw):
    if mode is not None: ALL_MODES_FP8[mode](learn, **kw)
    return learn

# ---- 1. the optimizer's structure changed from a callback mid-fit

class ChangeAt(Callback):
    "At the start of epoch 1: `unfreeze()`, `freeze()` or `create_opt()`; then note the weights, to see which the epoch moves"
    order = 5
    def __init__(self, what): self.what,self.before = what,None
    def before_epoch(self):
        if self.epoch != 1: return
        getattr(self.learn, self.what)()
        with suspended(self.learn): self.before = weights(self.learn)  # the fp32 model the fit would leave: the masters, `w + c`

def changed(mode, what, opt):
    "Which parameters the epoch after the change moved, their `requires_grad` after the fit, the weights, the start"
    learn = tiny_learner(model=SIXTEEN, splitter=tiny_split, opt_func=OPTIMIZERS[opt], lr=1e-2, n_trn=4)
    apply_mode(learn, mode)
    start = weights(learn)
    if what == 'unfreeze': learn.freeze()
    cb = ChangeAt(what)
    fit_quiet(learn, 2, cbs=cb)
    ws = weights(learn)
    return [not torch.equal(a, b) for a,b in zip(ws, cb.before)],[p.requires_grad for p in learn.model.parameters()],ws,start

@functools.cache
def changed_fp32(what, opt): return changed(None, what, opt)

@pytest.mark.parametrize('opt', ['adam', 'sgd', 'ranger', 'torch_adamw'])
@pytest.mark.parametrize('what', ['unfreeze', 'freeze', 'create_opt'])
@pytest.mark.parametrize('mode', list(ALL_MODES_FP8))
def test_structure_changed_mid_fit(mode, what, opt):
    "`unfreeze()`, `freeze()` or `create_opt()` from a callback mid-fit: the same layers train after it as in fp32, flags as in fp32."
    moved,flags,ws,start = changed(mode, what, opt)
    ref_moved,ref_flags,ref_ws,_ = changed_fp32(what, opt)
    assert flags == ref_flags, f'requires_grad {flags}, fp32 {ref_flags}'
    assert moved == ref_moved, f'moved in the epoch after {what}(): {moved}, fp32 {ref_moved}'
    assert rel_err(ws, ref_ws, start) < EPS.get(mode, .1)

# ---- 2. an optimizer's own zero_grad

class _NoneZero(Optimizer):
    "fastai's optimizer, but `zero_grad` drops the gradients (torch's `set_to_none`): a branch unused in a batch is then not stepped"
    def zero_grad(self):
        for p,*_ in self.all_params(with_grad=True): p.grad = None

def none_zero(opt_func):
    def f(params, **kw): o = opt_func(params, **kw); o.__class__ = _NoneZero; return o
    return f

class Branchy(Module):
    "A layer used on every other batch only (`use` set by `Alternate`)"
    def __init__(self): self.a,self.b,self.head,self.use = nn.Linear(1, 16),nn.Linear(16, 16),nn.Linear(16, 1),True
    def forward(self, x): h = F.relu(self.a(x)); return self.head(F.relu(self.b(h)) if self.use else h)

class Alternate(Callback):
    order = 0
    def before_batch(self): self.learn.model.use = self.training and self.iter % 2 == 0

def branchy(mode, opt, fused=True):
    learn = tiny_learner(model=Branchy, opt_func=none_zero(OPTIMIZERS[opt]), lr=1e-2, n_trn=5, cbs=Alternate())
    apply_mode(learn, mode, **({} if mode is None else dict(fused=fused)))
    fit_quiet(learn, 1)
    return [learn.opt.state[p].get('step') for p in learn.model.parameters()],weights(learn)

@pytest.mark.parametrize('opt', ['adam', 'radam', 'qhadam'])
@pytest.mark.parametrize('mode', list(ALL_MODES_FP8))
def test_own_zero_grad_kept(mode, opt):
    "An optimizer subclass's own `zero_grad` (gradients to None) is kept in every mode: the branch is stepped as often as in fp32."
    ref_steps,_ = branchy(None, opt)
    assert ref_steps[2] < ref_steps[0]  # the case is what it claims: the branch misses batches
    for fused in (True, False):
        steps,_ = branchy(mode, opt, fused)
        assert steps == ref_steps, f'fused={fused}: steps {steps}, fp32 {ref_steps}'

# ---- 3, 4. a parameter twice in the optimizer: tied weights, in one group and across two

def tied(mode, opt, across, fused=True):
    learn = tied_learner(across=across, opt_func=OPTIMIZERS[opt], lr=1e-2, n_trn=4)
    apply_mode(learn, mode, **({} if mode is None else dict(fused=fused)))
    start = weights(learn)
    fit_quiet(learn, 1)
    return state_of(learn),start

TIED_MODES = [m for m in ALL_MODES]  # fp8: the tied layers are 8 wide, below fp8's 16

@pytest.mark.parametrize('across', [False, True], ids=['one_group', 'two_groups'])
@pytest.mark.parametrize('opt', ['adam', 'sgd', 'ranger', 'lamb'])
@pytest.mark.parametrize('mode', TIED_MODES)
def test_tied_weights(mode, opt, across):
    "A weight twice in the optimizer is stepped twice a step, its state carried over, as fastai steps it: fused equals the loop bit for bit, and fp32 within tolerance."
    (fused,start),(loop,_) = tied(mode, opt, across),tied(mode, opt, across, fused=False)
    assert not state_diffs(loop, fused), state_diffs(loop, fused)[:3]
    ref,_ = tied(None, opt, across)
    if opt != 'sgd':  # SGD keeps no step count
        assert [s.get('step') for s in fused['state']] == [s.get('step') for s in ref['state']]
    lamb_sr = 1.3 if (mode, opt) == ('pure_stochastic', 'lamb') else 1  # over 6 seeds of its rounding: 0.087 to 0.121 from fp32
    assert rel_err(fused['weights'], ref['weights'], start) < EPS.get(mode, .1) * lamb_sr

def test_fp16_amp_unscales_a_shared_parameter_once():
    "The case of issue 26: under fp16 AMP a weight in two groups trains as in fp32 (it was unscaled twice: relative error 0.996)."
    (got,start),(ref,_) = tied('amp_fp16', 'adam', True),tied(None, 'adam', True)
    tw = 2  # `enc.weight`, tied to `dec.weight`, the third parameter
    assert rel_err([got['weights'][tw]], [ref['weights'][tw]], [start[tw]]) < 2e-2

# ---- 5. sparse gradients

def sparse(mode, opt, fused=True):
    learn = sparse_learner(opt_func=opt)
    apply_mode(learn, mode, **({} if mode is None else dict(fused=fused)))
    start = weights(learn)
    fit_quiet(learn, 2)
    return weights(learn),start,learn

SPARSE_OPTS = dict(sgd=partial(SGD, mom=0.), sgd_mom_wd=partial(SGD, mom=.9, wd=.1))

@pytest.mark.parametrize('opt', list(SPARSE_OPTS))
@pytest.mark.parametrize('mode', list(ALL_MODES))
def test_sparse_gradients(mode, opt):
    "`nn.Embedding(sparse=True)` with fastai's SGD trains in every mode, fused as by the loop, within tolerance of fp32."
    (ws,start,learn),(wl,_,_) = sparse(mode, SPARSE_OPTS[opt]),sparse(mode, SPARSE_OPTS[opt], fused=False)
    ref,_,_ = sparse(None, SPARSE_OPTS[opt])
    assert all(torch.equal(a, b) for a,b in zip(ws, wl))
    assert not torch.equal(ws[0], start[0]), 'the embedding did not train'
    assert rel_err(ws, ref, start) < EPS.get(mode, .1) and precision_cb(learn).skipped_steps == 0

# ---- 6. fastai's GANs

class FirstWeights(Callback):
    "The fp32 weights the mode starts its fit from (pure bf16 rounds them to its precision first)"
    order = 11
    def __init__(self): self.ws = None
    def before_fit(self):
        if self.ws is None:
            with suspended(self.learn): self.ws = weights(self.learn)

def gan(mode, wgan):
    learn = gan_learner(wgan=wgan)
    apply_mode(learn, mode)
    start,first = weights(learn),FirstWeights()
    fit_quiet(learn, 2, cbs=first)
    return weights(learn),start,first.ws

@functools.cache
def gan_fp32(wgan): return gan(None, wgan)

# Adversarial training amplifies what rounding does. The largest `rel_err` seen: .035 (fp16), .031 (bf16, Kahan), .12 (stochastic rounding),
# .19 (fp8); no training at all scores 1
GAN_EPS = dict(pure_stochastic=.25, fp8=.4)

@pytest.mark.parametrize('wgan', [True, False], ids=['wgan', 'gan'])
@pytest.mark.parametrize('mode', list(ALL_MODES_FP8))
def test_gan(mode, wgan):
    "A GAN trains in every mode within tolerance of fp32, generator and critic; a clipping WGAN is refused in the master modes before the fit."
    if wgan and mode.startswith('master'):
        learn = apply_mode(gan_learner(wgan=True), mode)
        w = weights(learn)
        with pytest.raises(ValueError, match=r'GANTrainer\(clip=0.01\) clamps the critic'): fit_quiet(learn, 1)
        assert all(torch.equal(a, b) for a,b in zip(w, weights(learn))) and {p.dtype for p in learn.model.parameters()} == {torch.float32}
        return
    ws,start,first = gan(mode, wgan)
    ref,_,_ = gan_fp32(wgan)
    moved = [not torch.equal(a, b) for a,b in zip(ws, first)]  # from where the mode started (pure bf16 rounds fp32 weights first)
    assert moved == [not torch.equal(a, b) for a,b in zip(ref, start)] and sum(moved) >= len(moved) - 1, moved  # the layers fp32 trains
    assert rel_err(ws, ref, start) < GAN_EPS.get(mode, .08)
