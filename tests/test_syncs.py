"Host syncs, counted (never timed): on a CPU one per optimizer step in every mode (fp16's scaler check, bf16's finite check), on a GPU none (the verdict stays on the device), none with check_finite=False, on any model, at any parameter count, with gradient accumulation too; what a skipped step and reading the telemetry cost."
from functools import partial
import pytest, torch
from torch import nn
from fastai.basics import Module
from fastai.callback.training import GradientAccumulation
from fastai.callback.fp16 import grad_overflow
import mpx.all  # `Learner.to_fp16`, `to_bf16`
from mpx.test_utils import tiny_learner, tiny_model, fit_quiet, count_syncs, precision_cb, CountSyncs, MODES, needs_mode

class ManyParams(Module):
    "A regression with `n` parameter tensors: a linear layer and the mean of `n`-2 scalar biases added to its output"
    def __init__(self, n): self.lin,self.ps = nn.Linear(1, 1),nn.ParameterList([nn.Parameter(torch.zeros(1)) for _ in range(n-2)])
    def forward(self, x): return self.lin(x) + sum(self.ps) / len(self.ps)  # the mean: a step moves the output as much at any `n`

SYNCS = {  # name: (puts a learner in the mode, the host syncs it adds per clean optimizer step)
    'amp_fp16':              (MODES['amp_fp16'], 1),  # a scale at which these models' steps do not overflow: clean steps only
    'amp_bf16':              (MODES['amp_bf16'], 1),
    'amp_bf16_unchecked':    (partial(MODES['amp_bf16'], check_finite=False), 0),
    'master_fp16':           (MODES['master_fp16'], 1),
    'master_bf16':           (MODES['master_bf16'], 1),
    'master_bf16_unchecked': (partial(MODES['master_bf16'], check_finite=False), 0),
}
MODELS = dict(mlp=tiny_model, batchnorm=partial(tiny_model, bn=True),  # BatchNorm: its statistics are saved for a skip without a sync
              many_params=partial(ManyParams, 200))  # a sync per parameter tensor would show 200 times over
DEVICES = ['cpu', pytest.param('cuda', marks=pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU'))]

@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('acc', [False, True], ids=['plain', 'grad_acc'])
@pytest.mark.parametrize('model', MODELS)
@pytest.mark.parametrize('mode', SYNCS)
def test_syncs_per_optimizer_step(mode, model, acc, device):
    "The mode adds exactly its syncs per optimizer step (not per micro-batch, not per parameter) to the same fit in fp32."
    needs_mode(mode, device)
    make,per_step = SYNCS[mode]
    if device == 'cuda': per_step = 0  # the verdict stays on the device: reads at a fit's ends only (`test_lean_step`)
    def learner(n): return tiny_learner(lr=1e-2, model=MODELS[model], n_trn=n, device=device, cbs=GradientAccumulation(n_acc=32) if acc else None)  # n batches of 16: n steps, or n/2 accumulated
    def added(n):
        learn = make(learner(n))
        res = count_syncs(learn) - count_syncs(learner(n))
        cb = precision_cb(learn)
        assert (cb.total_steps, cb.skipped_steps) == (n//2 if acc else n, 0)
        return res
    steps = 2 if acc else 4  # the steps 8 batches take beyond 4's
    more = added(8) - added(4)
    assert more == per_step * steps, f'{more} host syncs over {steps} more optimizer steps'
    if device == 'cpu': assert added(4) == per_step * steps  # and nothing at a fit's ends

def test_skipped_step_pays_for_its_diagnosis():
    "At fp16's default scale the tiny regression overflows by itself: on a CPU every step still costs one sync, and only a skipped step pays (at most 4) for naming the parameter."
    base = count_syncs(tiny_learner(lr=1e-2))
    learn = tiny_learner(lr=1e-2).to_fp16()
    added,mp = count_syncs(learn) - base,learn.mixed_precision
    assert mp.total_steps == 10 and mp.skipped_steps > 0 and mp.last_overflow is not None
    assert 10 < added <= 10 + 4*mp.skipped_steps, f'{added} host syncs over 10 steps, {mp.skipped_steps} skipped'

@pytest.mark.parametrize('device', DEVICES)
def test_skipped_step_on_the_device_reads_nothing(device):
    "Skipped on the device (a GPU's default, forced on a CPU), overflowing steps cost no sync; the epoch's end diagnoses the last one, its step and scale."
    def fit(n, on=True):
        learn = tiny_learner(lr=1e-2, n_trn=n, device=device).to_fp16()
        learn.mixed_precision.skip_on_device = on
        return learn,count_syncs(learn)
    (a,n4),(b,n8) = fit(4),fit(8)
    assert n8 == n4, f'{n8 - n4} host syncs over 4 more steps'
    mp = b.mixed_precision
    assert mp.skipped_steps > 0 and mp.last_overflow is not None and mp.last_overflow.param is None
    assert mp.last_overflow.step == max(i for i,s in enumerate(mp.step_log.skips) if s)
    assert not a.mixed_precision.skipped_steps or fit(4, on=False)[0].mixed_precision.skipped_steps == a.mixed_precision.skipped_steps

def test_telemetry_reads_do_not_sync():
    "Reading the step counters costs no host sync, and reading `scales` at most one."
    learn = fit_quiet(tiny_learner(lr=1e-2).to_fp16(), 1)
    mp = learn.mixed_precision
    with CountSyncs() as c: mp.total_steps, mp.skipped_steps, mp.overflow_rate, mp.step_log.skips
    assert c.n == 0
    with CountSyncs() as c: s = mp.scales
    assert c.n <= 1 and len(s) == 10

def test_counter_sees_per_tensor_syncs():
    "The counter is not blind: fastai's legacy `grad_overflow` reads every gradient, one sync per tensor."
    ps = [nn.Parameter(torch.zeros(2, dtype=torch.half)) for _ in range(10)]
    for p in ps: p.grad = torch.ones_like(p)
    with CountSyncs() as c: grad_overflow([ps])
    assert c.n == 10
