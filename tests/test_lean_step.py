"""Never wait, never hold twice (issue 67): a step whose finite check's verdict stays on the device is the host path's
step bit for bit (weights, state, step counts, BatchNorm's statistics, the loss scale, the telemetry), skipped or
not, in every mode, fastai optimizer, store and `fused` setting, and reads nothing to the host inside a batch."""
from functools import partial
import pytest, torch
from fastai.basics import Callback, nn, Adam, SGD, RAdam, QHAdam, Lamb, Larc, ranger, OptimWrapper
from mpx.all import *
from mpx.pure import Stream, stream_key
from mpx.eager import SkipGuard
from mpx.progress import _DeviceSmoothLoss
from mpx.test_utils import (ALL_MODES, tiny_learner, fit_quiet, precision_cb, state_of, state_diffs, PoisonLoss,
                            CountSyncs)

def wide_model():
    "160,000 weights in one layer: a low-bit store holds them, and an eager step takes them in pieces"
    return nn.Sequential(nn.Linear(1, 400), nn.ReLU(), nn.Linear(400, 400), nn.BatchNorm1d(400), nn.Linear(400, 1))

class BatchReads(Callback):
    "Host reads (`_local_scalar_dense`) inside each training batch, from its first event to its last (`BatchEnd`)"
    order = -1000
    def before_fit(self): self.reads,self.mode = [],None
    def before_batch(self):
        if not self.training: return
        self.mode = CountSyncs()
        self.mode.__enter__()
    def end(self):
        if self.mode is None: return
        self.mode.__exit__(None, None, None)
        self.reads.append(self.mode.n)
        self.mode = None

class BatchEnd(Callback):
    "Ends `reads`' count after every other callback's `after_batch`"
    order = 1000
    def __init__(self, reads): self.reads = reads
    def after_batch(self): self.reads.end()
    def after_cancel_batch(self): self.reads.end()

POISON = [0, 3, 4, 9]  # the first step, two in a row, the last: each skipped

def fit(mode:str, opt_func, on:bool, poison=POISON, n_epoch:int=1, more=list, **kwargs):
    "A learner in `mode` after `n_epoch` (with the callbacks `more()` makes), its steps' verdicts on the device (`on`) or read by the host"
    reads = BatchReads()
    learn = tiny_learner(lr=1e-2, model=wide_model, opt_func=opt_func, cbs=[PoisonLoss(at=poison), reads, BatchEnd(reads), *more()])
    ALL_MODES[mode](learn, **kwargs)
    precision_cb(learn).skip_on_device = on
    fit_quiet(learn, n_epoch)
    return learn,reads.reads

def telemetry(cb) -> tuple:
    return cb.skipped_steps,cb.total_steps,cb.loss_scale,[float(s) for s in cb.scales],list(map(bool, cb.step_log.skips))

def check_same(mode, opt_func, n_epoch=1, poison=POISON, more=list, **kwargs) -> tuple:
    "Assert the device path's fit is the host path's, bit for bit; the reads inside each batch of both"
    host,host_reads = fit(mode, opt_func, False, poison, n_epoch, more, **kwargs)
    dev,dev_reads = fit(mode, opt_func, True, poison, n_epoch, more, **kwargs)
    assert not state_diffs(state_of(host), state_of(dev))
    assert telemetry(precision_cb(host)) == telemetry(precision_cb(dev))
    assert precision_cb(host).skipped_steps >= len(poison)  # the poisoned batches' (the first epoch's), and any overflow
    assert same_values(host.opt.state_dict(), dev.opt.state_dict())
    return host_reads,dev_reads

def same_values(a, b) -> bool:
    "Whether `a` and `b` (a state dict: dicts, lists, tensors, numbers) are equal, each tensor bit for bit"
    if isinstance(a, torch.Tensor): return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict): return isinstance(b, dict) and a.keys() == b.keys() and all(same_values(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)): return type(a) == type(b) and len(a) == len(b) and all(map(same_values, a, b))
    return a == b

FASTAI = dict(sgd=partial(SGD, mom=.9, wd=1e-2), adam=partial(Adam, wd=1e-2), radam=RAdam, qhadam=QHAdam, lamb=Lamb)

@pytest.mark.parametrize('opt', FASTAI)
@pytest.mark.parametrize('mode', ALL_MODES)
def test_device_skip_is_host_skip(mode, opt):
    "Skipped on the device, each mode and fastai optimizer gives the host path's weights, state and telemetry, with no read in a batch."
    host_reads,dev_reads = check_same(mode, FASTAI[opt])
    assert dev_reads == [0]*10, dev_reads
    assert all(n >= 1 for n in host_reads), host_reads  # the control: the host path reads each step's verdict

@pytest.mark.parametrize('opt_state', ['bf16', '8bit', '4bit'])
@pytest.mark.parametrize('mode', ['amp_bf16', 'master_fp16', 'pure_kahan', 'pure_stochastic'])
def test_device_skip_lowbit(mode, opt_state):
    "Low-bit state (codes and block scales) is put back too, bit for bit, over two epochs."
    _,dev_reads = check_same(mode, FASTAI['adam'], n_epoch=2, opt_state=opt_state)
    assert dev_reads == [0]*20

@pytest.mark.parametrize('mode', ['master_fp16', 'pure_kahan', 'pure_stochastic'])
def test_device_skip_fastai_loop(mode):
    "fused=False: the engine steps the widened kinds with fastai's loop, and puts back what it wrote."
    _,dev_reads = check_same(mode, FASTAI['adam'], fused=False)
    assert dev_reads == [0]*10

def test_larc_reads_its_rates():
    "LARC's step reads each layer's rate to the host (as fastai's does): skipped on the device, its steps are the host path's."
    host_reads,dev_reads = check_same('amp_bf16', Larc)
    assert any(dev_reads), dev_reads  # LARC's own reads, not the verdict's

@pytest.mark.parametrize('opt', ['ranger', 'torch_adamw'])
def test_host_reads_where_it_must(opt):
    "Lookahead counts its steps and a torch optimizer steps its own state: the host reads the verdict, the same steps."
    opts = dict(ranger=ranger, torch_adamw=partial(OptimWrapper, opt=torch.optim.AdamW))
    host_reads,dev_reads = check_same('amp_bf16', opts[opt])
    assert all(n >= 1 for n in dev_reads), dev_reads

@pytest.mark.parametrize('mode', ['amp_fp16', 'master_fp16', 'pure_kahan'])
def test_clip_and_accumulation(mode):
    "`GradientClip` (which runs on a step the device skips: its clipped nan gradients are put back) and `GradientAccumulation` give the host path's steps."
    from fastai.callback.training import GradientClip, GradientAccumulation
    more = lambda: [GradientClip(.01), GradientAccumulation(n_acc=32)]  # two batches of 16 a step
    _,dev_reads = check_same(mode, FASTAI['adam'], n_epoch=2, poison=[1, 6, 9], more=more)  # steps 0, 3 and 4
    assert dev_reads == [0]*20

def test_amp_fp16_dynamic_scale():
    "fp16's dynamic scale is updated on the device: the scales, and the steps they skipped, are the host path's."
    host_reads,dev_reads = check_same('amp_fp16', FASTAI['adam'], n_epoch=2)
    assert dev_reads == [0]*20

class WriteStep(Callback):
    "After the `at`-th step, write each parameter's step count (reading the optimizer's state dict first, where `read`)"
    order = 50
    def __init__(self, at, value, read): self.at,self.value,self.do_read,self.i,self.read = at,value,read,0,None
    def after_step(self):
        if self.i == self.at:
            if self.do_read: self.read = [s.get('step') for s in self.learn.opt.state_dict()['state']]
            for p in self.learn.opt.all_params().itemgot(0): self.learn.opt.state[p]['step'] = self.value
        self.i += 1

@pytest.mark.parametrize('known', [True, False], ids=['verdict_known', 'verdict_late'])
@pytest.mark.parametrize('read', [True, False], ids=['read_then_write', 'write'])
def test_write_after_a_skipped_step_stays(read, known, monkeypatch):
    "A count a callback writes after a step the device skipped is the truth, whether the host knew the verdict then (a CPU) or learns it at the next step (a GPU still checking); a state dict read then is settled."
    from mpx.fused import Verdict
    if not known: monkeypatch.setattr(Verdict, 'known', lambda self: False)
    runs = []
    for on in (False, True):
        w = WriteStep(3, 100, read)
        learn = tiny_learner(lr=1e-2, opt_func=Adam, cbs=[PoisonLoss(at=[3]), w])
        learn.to_bf16()
        learn.mixed_precision.skip_on_device = on
        fit_quiet(learn, 1)
        runs.append((w.read, [s['step'] for s in learn.opt.state_dict()['state']], state_of(learn)))
    (read_h,steps_h,st_h),(read_d,steps_d,st_d) = runs
    assert read_h == read_d and (not read or read_h == [3]*len(read_h))  # three steps taken before the skipped one
    assert steps_h == steps_d == [106]*len(steps_h)
    assert not state_diffs(st_h, st_d)

class SeenAfterStep(Callback):
    "Each parameter's step count and state keys at each step's end"
    order = 50
    def before_fit(self): self.seen = []
    def after_step(self):
        st = self.learn.opt.state
        self.seen.append([(d.get('step'), sorted(d)) for d in (st[p] for p in self.learn.opt.all_params().itemgot(0))])

@pytest.mark.parametrize('known', [True, False], ids=['verdict_known', 'verdict_late'])
def test_visible_state_after_a_skipped_step(known, monkeypatch):
    "After a step the device skipped, `opt.state` is the host path's as soon as the host knows the verdict (on a CPU at once); on a GPU still checking, at the next step."
    from mpx.fused import Verdict
    if not known: monkeypatch.setattr(Verdict, 'known', lambda self: False)
    seen = []
    for on in (False, True):
        probe = SeenAfterStep()
        learn = tiny_learner(lr=1e-2, opt_func=Adam, cbs=[PoisonLoss(at=[0, 4]), probe])
        learn.to_bf16()
        learn.mixed_precision.skip_on_device = on
        fit_quiet(learn, 1)
        seen.append(probe.seen)
    host,dev = seen
    if known: assert dev == host
    else: assert dev[1:4] + dev[5:] == host[1:4] + host[5:] and dev[0] != host[0]  # the skipped steps' seen a step late

def test_stream_key_on_device():
    "Stochastic rounding's key with the skipped steps counted on the device is the host's key of the steps taken."
    s = Stream(seed=7, count=12)
    for skipped in (0, 1, 5):
        s.skipped = torch.tensor(skipped)
        for turn in (0, 1, 3):
            assert int(s.key(turn)) == stream_key(7, 12 - skipped, turn)
    s.skipped = None
    assert s.key(2) == stream_key(7, 12, 2)

def test_guard_puts_back_only_where_skipped():
    "`SkipGuard` on a list bucket (the parameters stepped where they lie) puts back each weight and state tensor."
    from mpx.flat import Bucket, Kind
    ps = [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2, 2))]
    b = Bucket(ps, Kind(), flat=False, group=0)
    b.dicts = [{'grad_avg': torch.zeros(3), 'step': 1}, {'grad_avg': torch.zeros(2, 2), 'step': 1}]
    for skip in (True, False):
        g = SkipGuard(b, 0, 2, torch.tensor(skip))
        with torch.no_grad():
            for p,d in zip(ps, b.dicts): p.add_(1); d['grad_avg'].add_(1)
        g.put_back()
        assert all(torch.equal(p, torch.full_like(p, 1 if skip else 2)) for p in ps)
        assert all(torch.equal(d['grad_avg'], torch.full_like(d['grad_avg'], 0 if skip else 1)) for d in b.dicts)
        with torch.no_grad():
            for p,d in zip(ps, b.dicts): p.fill_(1); d['grad_avg'].zero_()

def test_planted_read_is_counted(monkeypatch):
    "The count is not blind: a read planted in the device path's step shows in every batch."
    def read(self):
        bool(self.skip)  # a host read
        for t,k in zip(self.ts, self.kept): torch.where(self.skip, k, t, out=t)
    monkeypatch.setattr(SkipGuard, 'put_back', read)
    _,dev_reads = fit('amp_bf16', FASTAI['adam'], True)
    assert all(n >= 1 for n in dev_reads), dev_reads

def test_fused_torch_optimizer_takes_the_verdict():
    "A fused torch optimizer is handed the verdict as `GradScaler` hands it: its steps are the host path's, and no batch reads."
    fused_adamw = partial(OptimWrapper, opt=partial(torch.optim.AdamW, fused=True))
    host_reads,dev_reads = check_same('amp_bf16', fused_adamw)
    assert dev_reads == [0]*10, dev_reads
    assert all(n >= 1 for n in host_reads)

class KeptSizes(Callback):
    "The elements of each copy the step's guards keep, after each step"
    order = 50
    def before_fit(self): self.sizes = []
    def after_step(self):
        ws = precision_cb(self.learn).fused_steps.workspace.bufs
        self.sizes.append(max((w.numel() for (_,slot,_),w in ws.items() if slot[0] == 'kept'), default=0))

@pytest.mark.parametrize('mode', ['amp_bf16', 'pure_kahan'])
def test_kept_copies_are_a_window(mode):
    "What a guard keeps is a window's, never a layer's (160,000 weights; a CPU's window: 131,072 elements), and none stays after the fit."
    from mpx.fused import default_chunk
    probe = KeptSizes()
    learn = tiny_learner(lr=1e-2, model=wide_model, opt_func=Adam, cbs=probe)
    ALL_MODES[mode](learn)
    cb = precision_cb(learn)
    cb.skip_on_device = True
    fit_quiet(learn, 1)
    assert 0 < max(probe.sizes) <= default_chunk('cpu'), probe.sizes
    ws = cb.fused_steps.workspace.bufs if cb.fused_steps is not None else {}
    assert not any(slot[0] == 'kept' for (_,slot,_) in ws), 'scratch left between fits'

# ---- fastai's recorder with no wait each batch (`DeviceLosses`)

from contextlib import nullcontext
from fastai.basics import accuracy, AvgLoss, AvgSmoothLoss, CrossEntropyLossFlat, CancelValidException
import fastai.callback.schedule  # noqa: F401 (`lr_find`, `fit_one_cycle`)

def recorded(mode:str|None, losses:bool, device=None) -> tuple:
    "What the recorder holds after `lr_find` then 2 epochs of `fit_one_cycle`, with a metric: values, per-batch losses, smooth loss"
    cbs = [DeviceLosses()] if losses else []
    learn = tiny_learner(lr=1e-2, opt_func=Adam, cbs=cbs, device=device)
    if mode: ALL_MODES[mode](learn)
    with learn.no_bar(): learn.lr_find(num_it=5, show_plot=False)
    learn.metrics = [lambda p,y: (p - y).abs().mean()]
    with learn.no_bar(): learn.fit_one_cycle(2, 1e-2)
    r = learn.recorder
    return (r.values, [float(l) for l in r.losses], float(learn.smooth_loss), [w.clone() for w in learn.model.state_dict().values()]),learn

@pytest.mark.parametrize('mode', [None, 'amp_bf16', 'pure_kahan'])
def test_device_losses_are_fastais(mode):
    "With `DeviceLosses`, the recorder's epoch values, per-batch losses and smooth loss are fastai's bit for bit, and fastai's own objects hold them after the fit."
    (vals,losses,smooth,ws),_ = recorded(mode, False)
    (vals2,losses2,smooth2,ws2),learn = recorded(mode, True)
    assert (vals2, losses2, smooth2) == (vals, losses, smooth)
    assert all(torch.equal(a, b) for a,b in zip(ws, ws2))
    assert (type(learn.recorder.loss), type(learn.recorder.smooth_loss)) == (AvgLoss, AvgSmoothLoss)
    assert learn.device_losses.kept is None and not learn.device_losses.copies

class CancelValidation(Callback):
    def before_validate(self): raise CancelValidException()

class RaiseAt(Callback):
    "Raise inside the second epoch's training batch `at`, before the recorder's turn"
    def __init__(self, at:int): self.at = at
    def after_batch(self):
        if self.training and self.epoch == 1 and self.iter == self.at: raise RuntimeError('planted')

class MidValidate(Callback):
    "`learn.validate()` from the second training batch (a fit in the fit), and the smooth-loss types of every training batch"
    order = 90
    def __init__(self): self.seen = []
    def after_batch(self):
        if not self.training: return
        self.seen.append(type(self.learn.recorder.smooth_loss))
        if self.epoch == 0 and self.iter == 1: self.learn.validate()

def fit_ended(mode:str|None, losses:bool, ends:Callback) -> tuple:
    "The recorder after a 3-epoch fit that `ends` cancels or cuts: its averages' types and fields, values, per-batch losses"
    learn = tiny_learner(lr=1e-2, opt_func=Adam, cbs=[ends] + ([DeviceLosses()] if losses else []))
    if mode: ALL_MODES[mode](learn)
    with pytest.raises(RuntimeError, match='planted') if isinstance(ends, RaiseAt) else nullcontext(): fit_quiet(learn, 3)
    r = learn.recorder
    fields = [{k: float(v) for k,v in vars(m).items() if k in ('total', 'val', 'count')} for m in (r.loss, r.smooth_loss)]
    return (type(r.loss), type(r.smooth_loss)), fields, repr(r.values), [float(l) for l in r.losses]  # repr: a `validate()`'s nan

@pytest.mark.parametrize('mode', [None, 'amp_bf16'])
@pytest.mark.parametrize('ends', ['validation cancelled', 'an exception', 'validate() mid-fit'])
def test_device_losses_end_every_fit(mode, ends):
    "A fit whose validation a callback cancels, that a callback's exception cuts, or in which a callback calls `validate()`, leaves fastai's own averages holding fastai's values; the averages stay on the device after a `validate()`."
    make = {'validation cancelled': CancelValidation, 'an exception': partial(RaiseAt, 2), 'validate() mid-fit': MidValidate}[ends]
    ends_ours = make()
    want,got = fit_ended(mode, False, make()),fit_ended(mode, True, ends_ours)
    assert got[0] == (AvgLoss, AvgSmoothLoss)
    assert got == want
    if ends == 'validate() mid-fit': assert len(ends_ours.seen) > 2 and set(ends_ours.seen) == {_DeviceSmoothLoss}, ends_ours.seen

class LossReads(Callback):
    "The smooth loss `learn.smooth_loss` holds at the progress bar's turn, each training batch"
    order = 60
    def before_fit(self): self.seen = []
    def after_batch(self):
        if self.training: self.seen.append(self.learn.smooth_loss.device.type)

@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
def test_device_losses_do_not_wait_on_cuda():
    "On a GPU, `to_bf16()` with `DeviceLosses` reads nothing to the host inside a training batch; fastai's recorder reads each one."
    def reads(losses):
        probe,counts = LossReads(),BatchReads()
        learn = tiny_learner(lr=1e-2, opt_func=Adam, device='cuda', cbs=[counts, BatchEnd(counts), probe] + ([DeviceLosses()] if losses else []))
        learn.to_bf16()
        fit_quiet(learn, 1)
        return counts.reads,probe.seen
    (plain,_),(ours,seen) = reads(False),reads(True)
    assert all(n >= 1 for n in plain), plain
    assert ours == [0]*len(ours), ours
    assert set(seen) == {'cpu'}  # what a progress bar formats: a value already on the host

@pytest.mark.parametrize('fused', [True, pytest.param('compile', marks=pytest.mark.compiled)])
def test_kahan_stream_unmoved_by_skips(fused):
    "Kahan's steps never tick stochastic rounding's stream, so a step skipped on the device takes nothing off it (it went to -1)."
    learn = tiny_learner(lr=1e-2, opt_func=Adam, cbs=PoisonLoss(at=[2, 5])).to_bf16(pure=True, fused=fused)
    cb = precision_cb(learn)
    cb.skip_on_device = True
    fit_quiet(learn, 1)
    assert cb.skipped_steps == 2 and cb.stream.count == 0 and 'count' not in cb.state_dict()['scaler']
