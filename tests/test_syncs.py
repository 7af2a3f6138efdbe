"Host syncs per optimizer step, counted (never timed): one in every mode (fp16's scaler check, bf16's finite check), none with bf16's check_finite=False, at any parameter count, with gradient accumulation too."
import pytest, torch
from torch import nn
from fastai.basics import Module
from fastai.callback.training import GradientAccumulation
from fastai.callback.fp16 import grad_overflow
from mpx.all import *
from _helpers import tiny_learner, precision_cbs

class ManyParams(Module):
    "A regression with `n` parameter tensors: a linear layer and the mean of `n`-2 scalar biases added to its output"
    def __init__(self, n): self.lin,self.ps = nn.Linear(1, 1),nn.ParameterList([nn.Parameter(torch.zeros(1)) for _ in range(n-2)])
    def forward(self, x): return self.lin(x) + sum(self.ps) / len(self.ps)  # the mean: a step moves the output as much at any `n`

PRECISION = {  # name: (the callback, the host syncs it adds per optimizer step)
    'amp_fp16':    (lambda: MixedPrecision('fp16', init_scale=2.**8), 1),  # a scale that does not overflow here: clean steps only
    'amp_bf16':    (lambda: MixedPrecision('bf16'), 1),
    'amp_bf16_unchecked': (lambda: MixedPrecision('bf16', check_finite=False), 0),
    'master_fp16': (lambda: MasterPrecision('fp16'), 1),
    'master_flat': (lambda: MasterPrecision('fp16', flat_master=True), 1),
}

def fit_syncs(learn) -> int:
    "Host syncs of one quiet fit of `learn`"
    with learn.no_bar(), learn.no_logging(), CountSyncs() as c: learn.fit(1)
    return c.n

@pytest.mark.parametrize('acc', [False, True], ids=['plain', 'grad_acc'])
@pytest.mark.parametrize('n', [10, 200])
@pytest.mark.parametrize('name', list(PRECISION))
def test_syncs_per_optimizer_step(name, n, acc):
    "The callback adds exactly its syncs per optimizer step (not per micro-batch, not per parameter) to the same learner's fit without it."
    make,per_step = PRECISION[name]
    learn = tiny_learner(model=ManyParams(n), n_trn=4, cbs=GradientAccumulation(n_acc=32) if acc else None)  # 4 batches of 16: 4 steps, or 2 accumulated
    base = fit_syncs(learn)
    learn.add_cb(make())
    added,(cb,) = fit_syncs(learn) - base,precision_cbs(learn)
    steps = 2 if acc else 4
    assert (cb.total_steps, cb.skipped_steps) == (steps, 0)
    assert added == per_step * steps, f'{added} syncs over {steps} optimizer steps'

def test_counter_sees_per_tensor_syncs():
    "The counter is not blind: fastai's legacy `grad_overflow` reads every gradient, one sync per tensor."
    ps = [nn.Parameter(torch.zeros(2, dtype=torch.half)) for _ in range(10)]
    for p in ps: p.grad = torch.ones_like(p)
    with CountSyncs() as c: grad_overflow([ps])
    assert c.n == 10
