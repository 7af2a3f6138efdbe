"Fault injection for `MixedPrecision` fp16: inf and nan gradients skip exactly their step and change nothing."
import math
import pytest, torch
from functools import partial
from fastai.optimizer import SGD, Adam
from fastai.callback.training import GradientAccumulation, GradientClip
from mpx.all import MixedPrecision
from mpx.test_utils import tiny_learner, fit_quiet, InjectGrad, Snapshot, check_skips_change_nothing, GradNormProbe

OPTS = dict(sgd_mom=partial(SGD, mom=.9), adam=Adam)
SCALE = 2.**8  # small enough that the tiny regression never overflows by itself

def check_scale_halves(mp, init=SCALE):
    "The scale halves after each skipped step and is otherwise constant (growth_interval is never reached)"
    s,sk = mp.scales,mp.step_log.skips
    assert s[0] == init and all(s[i+1] == s[i]*(.5 if sk[i] else 1) for i in range(len(s)-1))
    assert mp.loss_scale == s[-1]*(.5 if sk[-1] else 1) == init*.5**sum(sk)

@pytest.mark.parametrize('opt', OPTS)
@pytest.mark.parametrize('value', [math.inf, -math.inf, math.nan], ids=['inf','-inf','nan'])
@pytest.mark.parametrize('names,at', [
    (('0.weight',), [0]),                  # first weight, very first step (optimizer state still empty)
    (('2.bias',), [4, 5]),                 # last bias, two steps in a row
    (('0.weight','2.bias'), [3, 11, 19]),  # two layers at once, in both epochs, the very last step
    (('0.bias','2.weight'), [9, 10]),      # across the epoch boundary
], ids=['first_weight','last_bias','two_layers','epoch_boundary'])
def test_injected_overflow_skips_step(opt, value, names, at):
    "An inf/nan written into chosen gradients at chosen steps skips exactly those steps, bit-identically, and halves the scale."
    learn = tiny_learner(lr=1e-2, opt_func=OPTS[opt], cbs=MixedPrecision(init_scale=SCALE))
    inj,snap = InjectGrad(at, value, names),Snapshot()
    fit_quiet(learn, 2, cbs=[inj, snap])
    mp = learn.mixed_precision
    assert inj.injected == at
    assert mp.step_log.skips == [i in at for i in range(20)]
    assert (mp.skipped_steps, mp.total_steps, mp.overflow_rate) == (len(at), 20, len(at)/20)
    check_skips_change_nothing(mp, snap)
    check_scale_halves(mp)

@pytest.mark.parametrize('opt', OPTS)
def test_natural_overflow_changes_nothing(opt):
    "At the default init_scale the tiny regression overflows by itself: those steps and an injected one change nothing either."
    learn = tiny_learner(lr=1e-2, opt_func=OPTS[opt], cbs=MixedPrecision())
    snap = Snapshot()
    fit_quiet(learn, 1, cbs=[InjectGrad([7]), snap])
    mp = learn.mixed_precision
    assert mp.step_log.skips[0] and mp.step_log.skips[7], 'step 0 overflows naturally at 2**16, step 7 is injected'
    assert mp.skipped_steps == sum(mp.step_log.skips) and mp.total_steps == 10
    check_skips_change_nothing(mp, snap)
    check_scale_halves(mp, 2.**16)

def test_no_overflow_no_skip():
    "Without injection at a small scale no step is skipped and every step moves every weight (the checks can pass for the right reason)."
    learn = tiny_learner(lr=1e-2, cbs=MixedPrecision(init_scale=SCALE))
    snap = Snapshot()
    fit_quiet(learn, 1, cbs=snap)
    mp = learn.mixed_precision
    assert (mp.skipped_steps, mp.total_steps, mp.overflow_rate, mp.loss_scale) == (0, 10, 0., SCALE)
    check_skips_change_nothing(mp, snap)

@pytest.mark.parametrize('opt', OPTS)
@pytest.mark.parametrize('batch', [0, 3, 8], ids=['first_micro','second_micro','late'])
@pytest.mark.parametrize('value', [math.inf, math.nan], ids=['inf','nan'])
def test_gradient_accumulation(opt, batch, value):
    "With `GradientAccumulation` (2 batches per step) steps are counted per optimizer step and a poisoned micro-batch skips its step."
    learn = tiny_learner(lr=1e-2, opt_func=OPTS[opt], cbs=[MixedPrecision(init_scale=SCALE), GradientAccumulation(n_acc=32)])
    snap = Snapshot()
    fit_quiet(learn, 1, cbs=[InjectGrad([batch], value, ('2.weight',), micro=True), snap])
    mp = learn.mixed_precision
    assert mp.step_log.skips == [i == batch//2 for i in range(5)]
    assert (mp.skipped_steps, mp.total_steps, mp.overflow_rate) == (1, 5, .2)
    check_skips_change_nothing(mp, snap)
    check_scale_halves(mp)

class CountingClip(GradientClip):
    "`GradientClip` that counts its calls"
    calls = 0
    def before_step(self): self.calls += 1; super().before_step()

@pytest.mark.parametrize('opt', OPTS)
@pytest.mark.parametrize('at', [[], [2], [5, 6]], ids=['clean','one_skip','two_skips'])
def test_gradient_clip(opt, at):
    "`GradientClip` runs after unscaling (the clipped norm is `max_norm`, not `max_norm/scale`) and, the host reading the verdict, does not run on a skipped step (on a GPU it does, and the step puts back what it wrote: `test_lean_step`)."
    max_norm,clip = .01,CountingClip(max_norm=.01)
    before_mp,before_clip,after_clip = GradNormProbe(MixedPrecision.order-.5),GradNormProbe(GradientClip.order-.5),GradNormProbe(GradientClip.order+.5)
    learn = tiny_learner(lr=1e-2, opt_func=OPTS[opt], cbs=[MixedPrecision(init_scale=SCALE), clip])
    learn.mixed_precision.skip_on_device = False
    snap = Snapshot()
    fit_quiet(learn, 1, cbs=[InjectGrad(at), before_mp, before_clip, after_clip, snap])
    mp,n_clean = learn.mixed_precision,10-len(at)
    assert mp.step_log.skips == [i in at for i in range(10)]
    assert clip.calls == len(before_clip.norms) == len(after_clip.norms) == n_clean and len(before_mp.norms) == 10
    clean_unscaled = [n/s for i,(n,s) in enumerate(zip(before_mp.norms, mp.scales)) if i not in at]
    assert before_clip.norms == pytest.approx(clean_unscaled, rel=1e-3), 'clipping must see unscaled gradients'
    assert all(n > 10*max_norm for n in before_clip.norms), 'clipping must be active for the check below to mean anything'
    assert after_clip.norms == pytest.approx([max_norm]*n_clean, rel=1e-4)
    check_skips_change_nothing(mp, snap)
