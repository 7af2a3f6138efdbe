"""`flat_master` (fastai v1's flag) has no effect: the master mode's fp32 masters are always flat, one buffer a parameter group (split
by weight decay), under every `fused` setting. The flag is accepted for fastai v1's code, and says so with a `FutureWarning` at the
user's line; it changes nothing."""
import warnings
import pytest, torch
from torch import nn
from fastai.basics import Callback
import fastai.callback.schedule  # fit_one_cycle
from mpx.all import *
from mpx.test_utils import tiny_learner, tiny_split, state_of, state_diffs, OPTIMIZERS, fit_quiet

def deep_model():
    "Two hidden layers and a BatchNorm: the body group holds two weights (weight decay) and biases and BatchNorm parameters (none)"
    return nn.Sequential(nn.Linear(1, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))

def learner(opt, **kw):
    learn = tiny_learner(model=deep_model, n_trn=4, n_val=1, opt_func=OPTIMIZERS[opt], splitter=tiny_split, lr=1e-2, wd=1e-2)
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('always')
        learn.to_fp16(loss_scale=512, **kw)
    return learn,ws

@pytest.mark.parametrize('flat', [True, False])
def test_flat_master_warns_at_the_users_line(flat):
    "Either value of `flat_master` gives one `FutureWarning`, naming this file's line and saying masters are always flat."
    _,ws = learner('adam', flat_master=flat)
    fw = [w for w in ws if issubclass(w.category, FutureWarning)]
    assert len(fw) == 1 and 'always flat' in str(fw[0].message) and fw[0].filename == __file__

@pytest.mark.parametrize('opt', ['sgd', 'adam', 'lamb', 'ranger', 'torch_adamw'])
def test_flat_master_changes_nothing(opt):
    "With or without `flat_master=True`, fit, freeze, fit, unfreeze and fit_one_cycle leave bit-identical weights and state."
    res = []
    for kw in ({}, dict(flat_master=True)):
        learn,_ = learner(opt, **kw)
        fit_quiet(learn); learn.freeze(); fit_quiet(learn); learn.unfreeze(); fit_quiet(learn, method='fit_one_cycle')
        res.append(state_of(learn))
    assert not state_diffs(*res), state_diffs(*res)[:3]

class Buffers(Callback):
    order = 100
    def after_step(self): self.n,self.groups = len(self.learn.master_precision.masters.buffers),len(self.learn.opt.param_lists)

@pytest.mark.parametrize('fused', [True, False, pytest.param('compile', marks=pytest.mark.compiled)])
def test_masters_always_flat(fused):
    "Under every `fused` setting the masters live in flat fp32 buffers: one a group, split where weight decay is off for some."
    learn,_ = learner('adam', fused=fused)
    learn.opt_func = OPTIMIZERS['adam']; learn.wd_bn_bias = False
    b = Buffers(); fit_quiet(learn, cbs=b)
    assert b.n == 2 * b.groups  # each group: its weights (weight decay) and its biases (none); BatchNorm stays fp32, outside
