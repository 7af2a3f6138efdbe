"""The overflow telemetry (`last_overflow`, the "steps in a row" warning) as eager steps document it, in every `fused` setting
(issue 45, item 8): `lr_find`'s trial steps leave no trace in it; a compiled step's overflow is recorded at the scale the step
ran at; reading the telemetry during a compiled fit (`log_loss_scale()` does, each validation) turns nothing off."""
import warnings
import pytest, torch
from fastai.basics import Callback
import fastai.callback.schedule  # noqa: F401 (lr_find)
from mpx.all import *
from mpx.scaler import Overflow
from mpx.test_utils import tiny_learner, fit_quiet, InjectGrad, precision_cb, names_overflows

pytestmark = pytest.mark.filterwarnings('ignore::UserWarning', 'ignore::FutureWarning')
COMPILE = pytest.param('compile', marks=pytest.mark.compiled)
FUSED = [False, True, COMPILE]
SCALED = {'amp_fp16': lambda l, **kw: l.to_fp16(init_scale=2.**8, **kw),
          'master_fp16_dynamic': lambda l, **kw: l.to_fp16(loss_scale=2.**8, dynamic=True, **kw)}

@pytest.fixture(autouse=True)
def _one_thread(one_thread): yield

class SeenInFit(Callback):
    "Keep the precision callback's `last_overflow` at `after_fit`, after it settled and before `lr_find` loads the learner back"
    order = 50
    def after_fit(self): self.seen = precision_cb(self.learn).last_overflow

def _expected(cb, step):
    "`last_overflow` of a step skipped at scale 256 with an inf in '0.weight': compiled or skipped on a GPU, the gradients are gone"
    return Overflow(step, '0.weight', 'inf', 256.) if names_overflows(cb) else Overflow(step, None, 'inf or nan', 256.)

@pytest.mark.parametrize('fused', FUSED)
@pytest.mark.parametrize('mode', list(SCALED))
def test_lr_find_leaves_no_overflow(mode, fused, tmp_path):
    "After `lr_find` (whose last trial steps overflow), `last_overflow` is the one before it; the next fit's overflow is recorded."
    seen = SeenInFit()
    learn = SCALED[mode](tiny_learner(n_trn=8, lr=1e-2, path=tmp_path, cbs=seen), fused=fused)
    with learn.no_bar(), learn.no_logging(): learn.lr_find(num_it=100, show_plot=False, suggest_funcs=())
    cb = precision_cb(learn)
    assert seen.seen is not None and seen.seen.step > 8, f'lr_find had no overflow to leave behind: {seen.seen}'
    assert (cb.total_steps, cb.last_overflow) == (0, None)
    fit_quiet(learn)
    assert (cb.total_steps, cb.last_overflow) == (8, None)
    learn.add_cb(InjectGrad(at=[3], micro=True))  # the 4th step of the next fit: step 11 of the log
    fit_quiet(learn)
    assert cb.step_log.skips == [False]*11 + [True] + [False]*4
    assert cb.last_overflow == _expected(cb, 11)

@pytest.mark.parametrize('fused', FUSED)
@pytest.mark.parametrize('mode', list(SCALED))
def test_overflow_scale_and_checkpoint(mode, fused, tmp_path):
    "A skipped step is recorded at the scale it ran at (256, not the 128 after it), and `state_dict` carries it to a checkpoint."
    learn = SCALED[mode](tiny_learner(lr=1e-2, path=tmp_path, cbs=InjectGrad(at=[3], micro=True)), fused=fused)
    cb = precision_cb(fit_quiet(learn))
    assert cb.last_overflow == _expected(cb, 3) and cb.scales[3:5] == [256., 128.]
    assert cb.state_dict()['last_overflow'] == _expected(cb, 3)._asdict()
    learn.save('ck')
    cb.load_state_dict({**cb.state_dict(), 'last_overflow': None})
    learn.load('ck')
    assert cb.last_overflow == _expected(cb, 3)

class ReadEachBatch(Callback):
    "Read the telemetry a user would during a fit, after every batch"
    order = 60
    def after_batch(self):
        cb = precision_cb(self.learn)
        self.read = (cb.skipped_steps, cb.overflow_rate, cb.epoch_skipped_steps)

@pytest.mark.parametrize('reader', ['log_loss_scale', 'each_batch'])
@pytest.mark.parametrize('fused', FUSED)
def test_reading_keeps_the_diagnosis(fused, reader):
    "Ten skipped steps in a row at the floor warn once and record the last, whether or not the telemetry is read during the fit."
    inject = InjectGrad(at=range(15), names=('2.bias',), micro=True)
    learn = tiny_learner(lr=1e-2, cbs=inject).to_fp16(loss_scale=512, fused=fused)  # a static scale: at its floor
    if reader == 'log_loss_scale': learn.log_loss_scale()
    else: learn.add_cb(ReadEachBatch())
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('always')
        fit_quiet(learn)
    cb = precision_cb(learn)
    msgs = [str(w.message) for w in ws if 'in a row had inf/nan gradients at loss scale 512' in str(w.message)]
    assert len(msgs) == 1 and cb.skipped_steps == 10
    assert (cb.last_overflow.step, cb.last_overflow.scale) == (9, 512.)
