"""Every call the docs call read-only changes nothing (issue 45): `precision_report`, `summary`, the callback's `repr`, its
telemetry (`loss_scale`, `skipped_steps`, `total_steps`, `overflow_rate`, `scales`, `last_overflow`), its `state_dict()` and
`opt.state_dict()`. Each is taken mid-fit (at `before_step`, after the precision callback's check, and at `after_step`) and
between fits, in every mode and `fused` setting: the weights, the optimizer state, the step engine's own buffers, the
parameters' version counters and the telemetry are bit-identical just after each call, and the run ends where one without
the calls ends. fastai's `summary` is taken between fits only: in plain fastai, without mpx, a `summary` mid-fit (a
`get_preds` nested in the fit) changes where the fit ends."""
import pytest, torch
from torch import nn
from fastai.basics import Callback
import fastai.callback.hook  # noqa: F401 (Learner.summary)
from mpx.all import *
from mpx.trial import _untouched
from mpx.test_utils import tiny_learner, fit_quiet, InjectGrad, precision_cb, state_of, state_diffs, ALL_MODES_FP8

pytestmark = pytest.mark.filterwarnings('ignore::UserWarning', 'ignore::FutureWarning')
COMPILE = pytest.param('compile', marks=pytest.mark.compiled)
FUSED = [False, True, COMPILE]
MODES = ['amp_fp16', 'amp_bf16', 'master_fp16', 'master_bf16', 'pure_kahan', 'pure_stochastic', 'fp8']

@pytest.fixture(autouse=True)
def _one_thread(one_thread): yield

def mlp(): return nn.Sequential(nn.Linear(1, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))  # one fp8 layer

def telemetry(learn) -> dict:
    "Every telemetry attribute of the precision callback, and its `state_dict()`"
    cb = precision_cb(learn)
    return dict(loss_scale=cb.loss_scale, skipped=cb.skipped_steps, total=cb.total_steps, rate=cb.overflow_rate, scales=cb.scales,
                last=cb.last_overflow, sd=cb.state_dict())

def _summary(learn):
    "fastai's `summary`, its draw of a batch (which moves the data's RNGs, in plain fastai too) put back"
    with _untouched(learn.dls.train): return learn.summary()

READS = dict(precision_report=lambda l: l.precision_report(), summary=_summary, repr=lambda l: repr(precision_cb(l)), telemetry=telemetry,
             cb_state_dict=lambda l: precision_cb(l).state_dict(), opt_state_dict=lambda l: l.opt and l.opt.state_dict())
MID_FIT = [k for k in READS if k != 'summary']

def hidden(learn) -> dict:
    "What a read could change without showing in `state_of`: the step engine's buffers (masters, Kahan compensations), version counters"
    fs = precision_cb(learn).fused_steps
    bufs = [{k: v.detach().clone() for k,v in vars(b).items() if isinstance(v, torch.Tensor)} for b in getattr(fs, 'buckets', [])]
    return dict(bufs=bufs, versions=[p._version for p in learn.model.parameters()])

def snapshot(learn) -> dict: return dict(state=state_of(learn), hidden=hidden(learn), telemetry=telemetry(learn))

def check_reads(learn, where:str, names=tuple(READS)):
    "Make each read of `names`; assert it left the snapshot bit-identical"
    for name in names:
        before = snapshot(learn)
        READS[name](learn)
        diffs = state_diffs(before, snapshot(learn))
        assert not diffs, f'{name} {where} changed {diffs[:3]}'

class ReadAt(Callback):
    "Make every read at `event` of the optimizer steps in `at` (counted over every fit)"
    order = PrecisionCallback.order + 2  # after the precision callback's check (`before_step`) and its copy into the model (`after_step`)
    def __init__(self, event, at): self.event,self.at,self.n = event,set(at),0
    def before_step(self):
        if self.event == 'before_step' and self.n in self.at: check_reads(self.learn, f'at before_step {self.n}', MID_FIT)
    def after_step(self):
        if self.event == 'after_step' and self.n in self.at: check_reads(self.learn, f'at after_step {self.n}', MID_FIT)
    def after_batch(self):
        if self.training: self.n += 1

def run(mode, fused, reads:bool):
    "Two fits of 4 steps, the 6th step overflowing; with `reads`, every read at two steps of each fit and between the fits"
    cbs = [InjectGrad(at=[5], micro=True)] + ([ReadAt('before_step', [1, 6]), ReadAt('after_step', [2, 5])] if reads else [])
    learn = ALL_MODES_FP8[mode](tiny_learner(model=mlp, lr=1e-2, n_trn=4, cbs=cbs), fused=fused)
    if reads: check_reads(learn, 'before the first fit')
    fit_quiet(learn)
    if reads: check_reads(learn, 'between fits')
    fit_quiet(learn)
    return snapshot(learn)

@pytest.mark.parametrize('fused', FUSED)
@pytest.mark.parametrize('mode', MODES)
def test_reads_change_nothing(mode, fused):
    "Each read leaves everything bit-identical where it is made, and the run with them ends where the run without them ends."
    ref,got = run(mode, fused, False),run(mode, fused, True)
    assert ref['telemetry']['skipped'] == 1, 'the overflow the telemetry should show did not happen'
    diffs = state_diffs(ref, got)
    assert not diffs, diffs[:3]
