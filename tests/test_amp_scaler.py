"The loss-scale trajectory of `MixedPrecision` equals a standalone `torch.amp.GradScaler`'s on the same overflow sequence."
import math
import pytest, torch
from hypothesis import given, settings, strategies as st
from mpx.all import MixedPrecision
from mpx.test_utils import tiny_learner, fit_quiet, InjectGrad, replay

def run_mp(at, n_epoch=2, **kwargs):
    "`MixedPrecision(**kwargs)` after `n_epoch` epochs of the tiny learner with overflows injected at the steps in `at`"
    learn = tiny_learner(lr=1e-2, cbs=MixedPrecision(**kwargs))
    fit_quiet(learn, n_epoch, cbs=InjectGrad(at))
    return learn.mixed_precision

def check_matches_torch(mp, at, **kwargs):
    "`mp`'s scales equal `replay` of its own overflow log, which contains every injected step"
    skips = mp.step_log.skips
    assert all(skips[i] for i in at) and len(mp.scales) == len(skips) == mp.total_steps
    assert mp.scales == replay(skips, **kwargs)
    assert mp.loss_scale == replay(skips+[False], **kwargs)[-1]

SETTINGS = [  # init_scale, growth_factor, backoff_factor, growth_interval, injected steps
    (2.**8,  2.,  .5,  1, [3]),
    (2.**8,  2.,  .5,  2, [0, 1, 2]),
    (2.**4,  4.,  .25, 3, [5, 6, 12]),
    (2.**10, 1.5, .5,  5, [2, 3, 4, 10]),
    (2.**8,  1.5, .25, 1, [0, 19]),
    (2.**6,  4.,  .5,  5, [4, 5, 14, 15, 16]),
    (2.**16, 2.,  .25, 2000, []),
    (2.**16, 4.,  .5,  2, [8, 9]),
]

@pytest.mark.parametrize('init_scale,growth_factor,backoff_factor,growth_interval,at', SETTINGS,
                         ids=[f'2^{int(math.log2(i))}-x{g}-x{b}-every{n}-at{a}' for i,g,b,n,a in SETTINGS])
def test_trajectory_matches_gradscaler(init_scale, growth_factor, backoff_factor, growth_interval, at):
    "For each setting and injection pattern, the scale of every step equals `GradScaler`'s on the same overflow sequence."
    kw = dict(init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor, growth_interval=growth_interval)
    mp = run_mp(at, **kw)
    assert mp.total_steps == 20 and mp.skipped_steps == sum(mp.step_log.skips)
    check_matches_torch(mp, at, **kw)

def test_trajectory_moves():
    "The settings above really exercise growth, backoff and natural overflow (so the equality is not trivially true)."
    mp = run_mp([3], init_scale=2.**8, growth_interval=1)
    s = mp.scales
    assert any(b > a for a,b in zip(s, s[1:])) and any(b < a for a,b in zip(s, s[1:]))
    assert mp.skipped_steps > 1, 'the scale grows every step until the tiny regression overflows by itself'

@settings(max_examples=15, deadline=None)
@given(at=st.sets(st.integers(0, 19), max_size=8), growth_interval=st.integers(1, 4), backoff_factor=st.sampled_from([.5, .25]))
def test_random_injections(at, growth_interval, backoff_factor):
    "For random injection steps the scale trajectory still equals `GradScaler`'s."
    kw = dict(init_scale=2.**8, growth_interval=growth_interval, backoff_factor=backoff_factor)
    check_matches_torch(run_mp(sorted(at), **kw), at, **kw)

def test_persists_across_fits():
    "A second fit continues the first's scale and growth tracker with the same scaler."
    kw = dict(init_scale=2.**4, growth_interval=3)
    learn = tiny_learner(lr=1e-2, cbs=MixedPrecision(**kw))
    inj = InjectGrad([4, 13])  # counts steps over both fits
    fit_quiet(learn, 1, cbs=inj)
    mp = learn.mixed_precision
    scaler,scale1,tracker1,scales1 = mp.scaler,mp.loss_scale,mp.scaler.growth_tracker,mp.scales
    assert mp.total_steps == 10 and tracker1 == 2, 'after the skip at step 4, steps 5..9 grow once (at 7) and leave 2 clean steps'
    fit_quiet(learn, 1, cbs=inj)
    assert mp.scaler is scaler and mp.total_steps == 20 and inj.injected == [4, 13]
    assert mp.scales[:10] == scales1 and mp.scales[10] == scale1
    assert mp.scales[11] == 2*scale1, 'one more clean step reaches growth_interval=3: the tracker was not reset'
    check_matches_torch(mp, [4, 13], **kw)

def test_long_run():
    "Past the step log's 256-step buffer, with overflows around its boundary, the trajectory still equals `GradScaler`'s."
    kw = dict(init_scale=2.**8, growth_interval=7)
    learn = tiny_learner(lr=1e-2, n_trn=130, cbs=MixedPrecision(**kw))
    fit_quiet(learn, 2, cbs=InjectGrad([10, 255, 256, 257]))
    mp = learn.mixed_precision
    assert mp.total_steps == 260
    check_matches_torch(mp, [10, 255, 256, 257], **kw)

def test_bf16_has_no_scaler():
    "A bf16 learner logs a scale of 1.0 for every step, never skips, and has no scaler."
    learn = tiny_learner(lr=1e-2, cbs=MixedPrecision('bf16'))
    fit_quiet(learn, 2)
    mp = learn.mixed_precision
    assert mp.scaler is None and mp.loss_scale == 1.0
    assert mp.scales == [1.0]*20 and (mp.total_steps, mp.skipped_steps, mp.overflow_rate) == (20, 0, 0.)
