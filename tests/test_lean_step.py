"""Never wait, never hold twice (issue 67): a step whose finite check's verdict stays on the device is the host path's
step bit for bit (weights, state, step counts, BatchNorm's statistics, the loss scale, the telemetry), skipped or
not, in every mode, fastai optimizer, store and `fused` setting, and reads nothing to the host inside a batch."""
from functools import partial
import pytest, torch
from fastai.basics import Callback, nn, Adam, SGD, RAdam, QHAdam, Lamb, Larc, ranger, OptimWrapper
from mpx.all import *
from mpx.pure import Stream, stream_key
from mpx.eager import SkipGuard
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

def fit(mode:str, opt_func, on:bool, poison=POISON, n_epoch:int=1, **kwargs):
    "A learner in `mode` after `n_epoch`, its steps' verdicts on the device (`on`) or read by the host"
    reads = BatchReads()
    learn = tiny_learner(lr=1e-2, model=wide_model, opt_func=opt_func, cbs=[PoisonLoss(at=poison), reads, BatchEnd(reads)])
    ALL_MODES[mode](learn, **kwargs)
    precision_cb(learn).skip_on_device = on
    fit_quiet(learn, n_epoch)
    return learn,reads.reads

def telemetry(cb) -> tuple:
    return cb.skipped_steps,cb.total_steps,cb.loss_scale,[float(s) for s in cb.scales],list(map(bool, cb.step_log.skips))

def check_same(mode, opt_func, n_epoch=1, poison=POISON, **kwargs) -> tuple:
    "Assert the device path's fit is the host path's, bit for bit; the reads inside each batch of both"
    host,host_reads = fit(mode, opt_func, False, poison, n_epoch, **kwargs)
    dev,dev_reads = fit(mode, opt_func, True, poison, n_epoch, **kwargs)
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

def test_amp_fp16_dynamic_scale():
    "fp16's dynamic scale is updated on the device: the scales, and the steps they skipped, are the host path's."
    host_reads,dev_reads = check_same('amp_fp16', FASTAI['adam'], n_epoch=2)
    assert dev_reads == [0]*20

class WriteStep(Callback):
    "After the `at`-th step, write each parameter's step count (and read the optimizer's state dict)"
    order = 50
    def __init__(self, at, value): self.at,self.value,self.i,self.read = at,value,0,None
    def after_step(self):
        if self.i == self.at:
            self.read = [s.get('step') for s in self.learn.opt.state_dict()['state']]
            for p in self.learn.opt.all_params().itemgot(0): self.learn.opt.state[p]['step'] = self.value
        self.i += 1

def test_write_after_a_skipped_step_stays():
    "A count a callback writes after a step the device skipped is the truth; a state dict read then is settled."
    runs = []
    for on in (False, True):
        w = WriteStep(3, 100)
        learn = tiny_learner(lr=1e-2, opt_func=Adam, cbs=[PoisonLoss(at=[3]), w])
        learn.to_bf16()
        learn.mixed_precision.skip_on_device = on
        fit_quiet(learn, 1)
        runs.append((w.read, [s['step'] for s in learn.opt.state_dict()['state']], state_of(learn)))
    (read_h,steps_h,st_h),(read_d,steps_d,st_d) = runs
    assert read_h == read_d == [3]*len(read_h)  # three steps taken before the skipped one
    assert steps_h == steps_d == [106]*len(steps_h)
    assert not state_diffs(st_h, st_d)

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
