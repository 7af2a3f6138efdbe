"Bad input: every constructor and patch argument fails with a clear error naming the value, before the learner changes."
import math
from unittest import mock
import pytest, torch
from torch import nn
from mpx.all import *
from mpx.core import autocast_device_type
from mpx.test_utils import tiny_learner, fit_quiet, precision_cbs

SCALER_BAD = [  # kwargs, exception, text its message must contain
    (dict(init_scale=0.), ValueError, 'init_scale=0.0 is out of range'), (dict(init_scale=math.nan), ValueError, 'init_scale=nan'),
    (dict(init_scale='8'), TypeError, "init_scale='8' is a str"), (dict(growth_factor=1.), ValueError, 'growth_factor=1.0'),
    (dict(backoff_factor=1.), ValueError, 'backoff_factor=1.0'), (dict(backoff_factor=0), ValueError, 'backoff_factor=0'),
    (dict(growth_interval=0), ValueError, 'growth_interval=0'), (dict(growth_interval=1.5), TypeError, 'growth_interval=1.5'),
    (dict(min_scale=0.), ValueError, 'min_scale=0.0'), (dict(max_scale=-2.), ValueError, 'max_scale=-2.0'),
    (dict(min_scale=4., max_scale=2.), ValueError, 'min_scale=4.0 > max_scale=2.0'), (dict(dynamic='no'), TypeError, "dynamic='no'"),
    (dict(init_scale=2.**30), ValueError, 'outside [min_scale, max_scale]'), (dict(init_scale=.5), ValueError, 'outside [min_scale, max_scale]'),
    # at and beyond fp32's limits: a scale is an fp32 number in the kernels
    (dict(init_scale=1e39, dynamic=False), ValueError, 'init_scale=1e+39 is out of range'),
    (dict(max_scale=1e39), ValueError, 'max_scale=1e+39 is out of range'), (dict(min_scale=1e-39), ValueError, 'min_scale=1e-39'),
    (dict(growth_factor=1e39), ValueError, 'growth_factor=1e+39'), (dict(backoff_factor=1e-46), ValueError, 'backoff_factor=1e-46'),
]
ids = lambda table: [','.join(f'{k}={v!r}' for k,v in kw.items()) for kw,*_ in table]

@pytest.mark.parametrize('kwargs,exc,msg', SCALER_BAD, ids=ids(SCALER_BAD))
def test_loss_scaler_bad_args(kwargs, exc, msg):
    "LossScaler rejects each invalid setting with the value and what is allowed."
    with pytest.raises(exc, match=None) as e: LossScaler(**kwargs)
    assert msg in str(e.value)

MASTER_BAD = [(dict(loss_scale=0), ValueError, 'loss_scale=0 is out of range'), (dict(loss_scale=-512), ValueError, 'loss_scale=-512'),
              (dict(flat_master='yes'), TypeError, "flat_master='yes'"), (dict(dynamic=1), TypeError, 'dynamic=1'),
              (dict(amp_mode='fp32'), ValueError, "Unknown amp_mode 'fp32'"), (dict(dynamic=True, growth_factor=.9), ValueError, 'growth_factor=0.9'),
              (dict(dynamic=True, loss_scale=2.**25), ValueError, 'outside [min_scale, max_scale]'), (dict(dynamic=True, min_scale=8., max_scale=4.), ValueError, 'min_scale=8.0 > max_scale=4.0'),
              (dict(growth_interval=10), ValueError, 'growth_interval=10 has no effect with a static loss scale'), (dict(check_finite='no'), TypeError, "check_finite='no'"),
              (dict(loss_scale=1e39), ValueError, 'loss_scale=1e+39 is out of range'), (dict(loss_scale=math.inf), ValueError, 'loss_scale=inf')]

@pytest.mark.parametrize('kwargs,exc,msg', MASTER_BAD, ids=ids(MASTER_BAD))
def test_master_bad_args(kwargs, exc, msg):
    "MasterPrecision rejects each invalid setting at construction, and through `to_fp16` leaves the learner's callback in place."
    with pytest.raises(exc) as e: MasterPrecision(**kwargs)
    assert msg in str(e.value)
    if 'amp_mode' in kwargs: return  # not a `to_fp16` argument
    learn = tiny_learner(lr=1e-2).to_bf16()
    prev = learn.mixed_precision
    with pytest.raises(exc): learn.to_fp16(master=True, **kwargs)
    assert precision_cbs(learn) == [prev]

PATCH_BAD = [
    ('to_fp16', dict(init_scale=8., loss_scale=8.), ValueError, "['init_scale'] are MixedPrecision arguments but ['loss_scale'] select MasterPrecision"),
    ('to_fp16', dict(enabled=False, flat_master=True), ValueError, "['enabled'] are MixedPrecision arguments but ['flat_master']"),
    ('to_fp16', dict(master=True, init_scale=8.), ValueError, "['master=True'] select MasterPrecision"),
    ('to_fp16', dict(master='yes'), TypeError, "master='yes' is a str"),
    ('to_fp16', dict(loss_scel=8.), TypeError, 'loss_scel'),
    ('to_bf16', dict(master=1), TypeError, 'master=1 is a int'),
    ('to_bf16', dict(flat_master=True, enabled=True), ValueError, "['enabled'] are MixedPrecision arguments"),
    ('to_fp16', dict(lossscale=512), TypeError, "unexpected keyword argument 'lossscale' (did you mean 'loss_scale'?): it takes master, and ["),
    ('to_bf16', dict(updat='kahan', pure=True), TypeError, "'updat' (did you mean 'update'?)"),
    ('to_fp16', dict(init_scale=1e39), ValueError, 'init_scale=1e+39 is out of range'),
    ('to_fp16', dict(loss_scale=1e39), ValueError, 'loss_scale=1e+39 is out of range'),
    ('to_fp16', dict(growth_factor=math.inf), ValueError, 'growth_factor=inf is out of range'),
    # pure training is bf16 only: fp16 asked for it fails, whatever comes with it, and is never trained as pure bf16
    ('to_fp16', dict(pure=True), ValueError,
     'to_fp16(pure=True): pure training keeps bf16 weights (PureBF16), so it is bf16 only: use learn.to_bf16(pure=True, ...)'),
    ('to_fp16', dict(pure=True, update='kahan'), ValueError, "to_fp16(pure=True, update='kahan'): pure training keeps bf16 weights"),
    ('to_fp16', dict(pure=True, update='stochastic', seed=1), ValueError, "to_fp16(pure=True, update='stochastic', seed=1): pure training"),
    ('to_fp16', dict(pure=True, master=True), ValueError, 'to_fp16(pure=True): pure training'),
    ('to_fp16', dict(pure=True, loss_scale=512), ValueError, 'to_fp16(pure=True): pure training'),
    ('to_fp16', dict(pure=True, init_scale=8.), ValueError, 'to_fp16(pure=True): pure training'),
    ('to_fp16', dict(pure=True, check_finite=False), ValueError, 'to_fp16(pure=True): pure training'),
    ('to_fp16', dict(update='kahan'), ValueError, "to_fp16(update='kahan'): pure training keeps bf16 weights"),
    ('to_fp16', dict(pure=1), TypeError, 'pure=1 is a int'),
    # the step engine's `fused`, hysteresis and schedule_skips (one pass per step, the first five minutes)
    ('to_fp16', dict(fused='yes'), ValueError, "fused='yes' is not allowed: fused must be True, False or 'compile'"),
    ('to_bf16', dict(fused=1), TypeError, "fused=1 is a int: fused must be True, False or 'compile'"),
    ('to_bf16', dict(pure=True, fused='Compile'), ValueError, "fused='Compile' is not allowed"),
    ('to_fp16', dict(hysteresis=0), ValueError, 'hysteresis=0 is out of range: hysteresis must be an integer from 1 to 2**31-1'),
    ('to_fp16', dict(hysteresis=2.), TypeError, 'hysteresis=2.0 is a float: hysteresis must be an integer from 1'),
    ('to_bf16', dict(hysteresis=2), ValueError, "hysteresis=2 has no effect in bf16: bf16 has fp32's range and needs no loss scaling. "
                                                "Drop hysteresis, or train in fp16: learn.to_fp16(hysteresis=2)"),
    ('to_fp16', dict(loss_scale=512, hysteresis=2), ValueError, 'hysteresis=2 has no effect with a static loss scale: pass dynamic=True'),
    ('to_fp16', dict(enabled=False, hysteresis=2), ValueError, 'hysteresis=2 has no effect with enabled=False'),
    ('to_bf16', dict(schedule_skips='no'), TypeError, "schedule_skips='no' is a str"),
    ('to_bf16', dict(check_finite=False, schedule_skips=False), ValueError, 'schedule_skips=False has no effect with check_finite=False'),
    # low-bit state needs the engine's own steps: refused at the call, the old callback (its scale, its step log) kept
    ('to_bf16', dict(opt_state='8bit', fused=False), ValueError, "opt_state='8bit' needs the step engine's own steps, and fused=False"),
    ('to_fp16', dict(opt_state='4bit', fused=False), ValueError, "opt_state='4bit' needs the step engine's own steps"),
    ('to_fp16', dict(loss_scale=512, opt_state='bf16', fused=False), ValueError,
     "pass fused=True or fused='compile' with it, or opt_state='fp32'"),
    ('to_bf16', dict(pure=True, opt_state='8bit', fused=False), ValueError, "opt_state='8bit' needs the step engine's own steps"),
]

@pytest.mark.parametrize('patch,kwargs,exc,msg', PATCH_BAD, ids=[f'{p}:{k}' for p,k,*_ in PATCH_BAD])
def test_patch_bad_args(patch, kwargs, exc, msg):
    "A bad `to_fp16`/`to_bf16` call raises before anything changes; the learner still trains with its old callback."
    learn = tiny_learner(lr=1e-2).to_fp16(loss_scale=64.)
    prev = learn.master_precision
    with pytest.raises(exc) as e: getattr(learn, patch)(**kwargs)
    assert msg in str(e.value) and precision_cbs(learn) == [prev]
    assert fit_quiet(learn).master_precision.total_steps == 10

def test_bf16_on_a_gpu_without_it():
    "bf16 on a CUDA device without bf16 fails in before_fit with a clear error, before the model or optimizer change."
    for to in (lambda l: l.to_bf16(), lambda l: l.to_bf16(master=True)):
        learn = to(tiny_learner(lr=1e-2))
        w = [p.detach().clone() for p in learn.model.parameters()]
        with mock.patch('mpx.core.torch.cuda.is_bf16_supported', return_value=False), mock.patch('mpx.core.torch.cuda.get_device_name', return_value='Tesla T4'), \
             mock.patch('mpx.callback.training_device', return_value=torch.device('cuda')):
            with pytest.raises(ValueError, match="amp_mode='bf16' needs a GPU with bfloat16 support.*Tesla T4"): fit_quiet(learn)
        assert all(torch.equal(a, b) for a,b in zip(w, learn.model.parameters())) and {p.dtype for p in learn.model.parameters()} == {torch.float32}
        assert 'parameters' not in learn.__dict__
        assert precision_cbs(fit_quiet(learn))[0].total_steps == 10

def test_master_with_mixed_dtypes():
    "MasterPrecision (fused or not) on a model with an fp64 parameter fails before changing anything; after `.float()` it trains."
    for fused in (False, True):
        model = nn.Sequential(nn.Linear(1, 8), nn.ReLU(), nn.Linear(8, 1))
        model[2].double()
        learn = tiny_learner(lr=1e-2, model=model).to_fp16(loss_scale=512, fused=fused)
        with pytest.raises(ValueError, match="parameter '2.weight' is torch.float64"): fit_quiet(learn)
        assert [p.dtype for p in learn.model.parameters()] == [torch.float32]*2 + [torch.float64]*2
        learn.model.float()
        assert fit_quiet(learn).master_precision.total_steps == 10

def test_unknown_device():
    "A device without autocast fails with the device named and the supported ones listed."
    with pytest.raises(ValueError, match="Device 'meta' has no autocast support: mixed precision runs on 'cuda', 'cpu' or 'mps'"): autocast_device_type('meta')
