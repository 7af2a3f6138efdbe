"""Loss-scale hysteresis (DeepSpeed's semantics) and schedules that do not count skipped steps (issue 28): the scale's trajectory
against a transcription of DeepSpeed's `DynamicLossScaler`, on the host and on the device, in both fp16 modes, across fits and
checkpoints; `schedule_skips=False` against fp32 with overflows injected, across a checkpoint and a resumed fit."""
import random
import pytest, torch
from fastai.basics import Callback, Adam
import fastai.callback.schedule  # noqa: F401 (fit_one_cycle)
from mpx.all import *
from mpx.scaler import update_scale_
from mpx.test_utils import tiny_learner, fit_quiet, precision_cb, InjectGrad, replay, StepProfile, check_compiled_steps

pytestmark = pytest.mark.filterwarnings('ignore::UserWarning')

class DeepSpeedScaler:
    "DeepSpeed's `DynamicLossScaler.update_scale` (consecutive_hysteresis=False, its default), transcribed: the reference"
    def __init__(self, init_scale, scale_factor=2., scale_window=1000, min_scale=1., delayed_shift=1):
        self.cur_scale,self.scale_factor,self.scale_window,self.min_scale = init_scale,scale_factor,scale_window,min_scale
        self.delayed_shift,self.cur_hysteresis,self.cur_iter,self.last_overflow_iter = delayed_shift,delayed_shift,0,-1
    def update_scale(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1: self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else: self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            self.cur_hysteresis = self.delayed_shift
            self.cur_scale *= self.scale_factor
        self.cur_iter += 1

def sequences(n=8, length=40, seed=0):
    rng = random.Random(seed)
    return [[rng.random() < p for _ in range(length)] for p in (.05, .2, .5) for _ in range(n // 3 + 1)]

@pytest.mark.parametrize('hysteresis', [1, 2, 3])
def test_loss_scaler_is_deepspeeds(hysteresis):
    "`LossScaler(hysteresis=N)` follows DeepSpeed's `DynamicLossScaler(delayed_shift=N)` step for step, overflow sequences of every density."
    for seq in sequences():
        ls,ds = LossScaler(2.**10, growth_interval=3, hysteresis=hysteresis, max_scale=2.**40),DeepSpeedScaler(2.**10, scale_window=3, delayed_shift=hysteresis)
        got,want = [],[]
        for f in seq: got.append(ls.update(f)); ds.update_scale(f); want.append(ds.cur_scale)
        assert got == want, (seq, got, want)

def test_hysteresis_semantics():
    "hysteresis=2: one overflow is absorbed, the second backs off, every later one too until the scale grows and the budget refills."
    ls = LossScaler(8., growth_interval=3, hysteresis=2)
    seq = [True, False, False, False, True, True, True, False, False, False, True]
    assert [ls.update(f) for f in seq] == [8., 8., 8., 16., 16., 8., 4., 4., 4., 8., 8.]
    assert (ls.skipped_updates, ls.hysteresis_left) == (5, 1) and 'hysteresis 1/2' in repr(ls)

@pytest.mark.parametrize('hysteresis', [1, 3])
def test_device_update_is_the_hosts(hysteresis):
    "On the device (`to_device`, `update(tensor)`) the scale, growth run, budget and counts follow the host's, bounds included, with no host sync."
    for seq in sequences(6, 30, seed=1):
        host = LossScaler(2.**6, growth_interval=2, hysteresis=hysteresis, min_scale=2., max_scale=2.**8)
        dev = LossScaler(2.**6, growth_interval=2, hysteresis=hysteresis, min_scale=2., max_scale=2.**8).to_device('cpu')
        for f in seq: host.update(f); dev.update(torch.tensor([float(f)]))
        assert dev.state_dict() == host.state_dict()

def test_update_scale_at_one_is_gradscalers():
    "`update_scale_` with no hysteresis and no bounds is `GradScaler.update`'s kernel: the same trajectory as a real `GradScaler`."
    for seq in sequences(3, 30, seed=2):
        s,t = torch.full((), 256.),torch.zeros((), dtype=torch.int32)
        got = []
        for f in seq: got.append(float(s)); update_scale_(s, t, None, torch.tensor([float(f)]), 2., .5, 3)
        assert got == replay(seq, init_scale=256., growth_interval=3)

def _scales(make, overflow_at, micro=False, n_trn=12, compiled=False):
    "The scales of a fit with overflows at `overflow_at`; `compiled`: every step checked to have run in compiled regions"
    learn,prof = make(tiny_learner(opt_func=Adam, lr=1e-2, n_trn=n_trn)),StepProfile(wide=True)
    fit_quiet(learn, 1, cbs=[InjectGrad(at=overflow_at, micro=micro), *(prof.cbs if compiled else [])])
    if compiled: check_compiled_steps(prof)
    return learn,precision_cb(learn).scales

@pytest.mark.parametrize('fused', [True, pytest.param('compile', marks=pytest.mark.compiled)])
@pytest.mark.parametrize('mode', ['amp', 'master'])
def test_fp16_modes_with_hysteresis(mode, fused):
    "`to_fp16(hysteresis=2)` in AMP and in the dynamic master mode: the scale each step used is DeepSpeed's, eager and compiled."
    at = [1, 5, 6, 7]
    make = (lambda l: l.to_fp16(init_scale=2.**8, growth_interval=3, hysteresis=2, fused=fused)) if mode == "amp" else \
           (lambda l: l.to_fp16(loss_scale=2.**8, dynamic=True, growth_interval=3, hysteresis=2, fused=fused))
    learn,got = _scales(make, at, micro=mode == 'master', compiled=fused == 'compile')
    ds,want = DeepSpeedScaler(2.**8, scale_window=3, delayed_shift=2),[]
    for i in range(12): want.append(ds.cur_scale); ds.update_scale(i in at)
    assert got == want and precision_cb(learn).skipped_steps == 4

def test_hysteresis_lives_across_fits_and_checkpoints(tmp_path):
    "The budget left persists from fit to fit and in a checkpoint, as the scale does: a loaded learner backs off where the original would."
    def learner(): return tiny_learner(opt_func=Adam, lr=1e-2, n_trn=4, path=tmp_path).to_fp16(init_scale=2.**8, hysteresis=3)
    a = learner(); fit_quiet(a, 1, cbs=InjectGrad(at=[0, 1]))  # two overflows: the budget 3 -> 1, the scale kept
    assert a.mixed_precision.loss_scale == 2.**8
    a.save('ck', with_opt=True)
    b = learner(); b.load('ck', with_opt=True)
    for l in (a, b): fit_quiet(l, 1, cbs=InjectGrad(at=[0]))  # the third overflow backs off, in the next fit and in the loaded one
    assert a.mixed_precision.loss_scale == b.mixed_precision.loss_scale == 2.**7

# ---- schedules that do not count skipped steps

class LrAtUpdates(Callback):
    "The learning rate of every optimizer step, and the steps skipped (from the precision callback's log, at the fit's end)"
    order = 9  # before the check: a step the host skips, and one the device does, alike
    def __init__(self): self.lrs,self.skips = [],[]
    def before_fit(self): self.skips += [None]  # this fit's steps' skips, at its end
    def before_step(self): self.lrs.append(self.learn.opt.hypers[-1]['lr'])
    def after_fit(self):
        cb = next((c for c in self.learn.cbs if hasattr(c, 'step_log')), None)
        n = len(self.lrs) - sum(map(len, self.skips[:-1]))  # this fit's steps
        self.skips[-1] = [False]*n if cb is None else list(map(bool, cb.step_log.skips[-n:]))
    @property
    def updates(self) -> list:
        "The learning rates of the steps not skipped"
        return [lr for lr,s in zip(self.lrs, (s for f in self.skips for s in f)) if not s]

def one_cycle_lrs(mode_kw, at, n_trn=12, epochs=2, **kw):
    learn = tiny_learner(opt_func=Adam, lr=1e-2, n_trn=n_trn, **kw)
    if mode_kw is not None: learn.to_fp16(**mode_kw)
    probe = LrAtUpdates()
    fit_quiet(learn, epochs, 'fit_one_cycle', lr_max=1e-2, cbs=[probe, InjectGrad(at=at)])
    return probe.updates,learn

def test_skipped_steps_do_not_advance_the_schedule():
    "With `schedule_skips=False` the real updates get fp32's one-cycle schedule from its start; by default skipped steps use up their share."
    at = [0, 1, 2, 13]
    ref,_ = one_cycle_lrs(None, [])
    kept,learn = one_cycle_lrs(dict(init_scale=2.**8, schedule_skips=False), at)
    assert precision_cb(learn).skipped_steps == len(at)
    assert kept == ref[:len(kept)] and len(kept) == len(ref) - len(at)  # the k-th real update gets fp32's k-th learning rate
    used,_ = one_cycle_lrs(dict(init_scale=2.**8), at)  # fastai's default: the schedule counts every batch
    assert used == [lr for i,lr in enumerate(ref) if i not in at]

def test_schedule_skips_across_a_checkpoint(tmp_path):
    "The steps the schedule has not counted go into a checkpoint: a fit resumed from it (`start_epoch`) goes on with the same learning rates."
    kw = dict(init_scale=2.**8, schedule_skips=False)
    full,_ = one_cycle_lrs(kw, [0, 1, 2], path=tmp_path)
    class SaveAfterEpoch0(Callback):
        order = 100
        def after_epoch(self):
            if self.epoch == 0: self.learn.save('e0', with_opt=True)
    learn = tiny_learner(opt_func=Adam, lr=1e-2, n_trn=12, path=tmp_path).to_fp16(**kw)
    fit_quiet(learn, 2, 'fit_one_cycle', lr_max=1e-2, cbs=[InjectGrad(at=[0, 1, 2]), SaveAfterEpoch0()])
    new = tiny_learner(opt_func=Adam, lr=1e-2, n_trn=12, path=tmp_path).to_fp16(**kw)
    new.load('e0', with_opt=True)
    assert new.mixed_precision._sched_skipped == 3
    probe = LrAtUpdates()
    fit_quiet(new, 2, 'fit_one_cycle', lr_max=1e-2, start_epoch=1, cbs=probe)
    assert probe.updates == full[-len(probe.updates):] and len(probe.updates) == 12

def test_hysteresis_budget_in_the_callbacks_repr():
    "The callback says the budget left, in AMP and the dynamic master mode; nothing where there is no hysteresis."
    amp = tiny_learner(opt_func=Adam, n_trn=4).to_fp16(init_scale=2.**8, hysteresis=3)
    assert 'hysteresis=3/3' in repr(amp.mixed_precision)
    fit_quiet(amp, 1, cbs=InjectGrad(at=[0]))
    assert 'hysteresis=2/3' in repr(amp.mixed_precision)
    master = tiny_learner(opt_func=Adam, n_trn=4).to_fp16(master=True, dynamic=True, loss_scale=2.**8, hysteresis=2)
    fit_quiet(master, 1, cbs=InjectGrad(at=[0]))
    assert 'hysteresis=1/2' in repr(master.master_precision)
    for l in (tiny_learner().to_fp16(), tiny_learner().to_fp16(master=True), tiny_learner().to_bf16()):
        assert 'hysteresis' not in repr(precision_cb(l))
