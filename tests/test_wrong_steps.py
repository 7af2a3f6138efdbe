"""What only the engine does, checked against a reference of its own: each parameter group's hyper-parameters (against
fastai's fp32 loop), a skipped step's bookkeeping (against the run without that batch), the stochastic-rounding stream
(against its statistics), the device's loss scale (against the gradients it scaled) and low-bit checkpoints (against
the store's own windows, value by value). Each check has a planted control (`planted.py`) that it catches."""
import tempfile
from pathlib import Path
from functools import partial
import pytest, torch
from fastai.basics import (SGD, Adam, Callback, CancelBatchException, Module, nn,
                           set_seed)
import fastai.callback.schedule  # `fine_tune`
from mpx.all import *
from mpx.test_utils import (ALL_MODES, tiny_learner, fit_quiet, precision_cb, state_of, state_diffs, weights, InjectGrad,
                            STEP_LR_TOL, ramp_learner)
from planted import compiled_group0_hypers, skip_counts_a_step, stream_on_one_base, unscale_by_host_scale, \
    lowbit_values_from_neighbour

FUSED = [True, False, pytest.param('compile', marks=pytest.mark.compiled)]
COMPILED = pytest.param('compile', marks=pytest.mark.compiled)

# ---- each group's hyper-parameters, against fastai's fp32 loop

class GroupMoves(Callback):
    "Each optimizer step's fall of each group's mean weight (fp32 values, as a checkpoint holds them)"
    order = 999
    def __init__(self): self.moves,self.w = [],None
    def _means(self) -> list:
        cb = next((c for c in self.learn.cbs if hasattr(c, 'fp32_value')), None)
        val = (lambda p: p.detach()) if cb is None else cb.fp32_value
        return [float(val(w.weight).double().mean()) for w in self.learn.model.ws]
    def before_step(self): self.w = self._means()
    def after_step(self): self.moves.append([a - b for a,b in zip(self.w, self._means())])

HYPERS = dict(lr=[1e-3, 2e-3, 4e-3], wd=[0., 1e-2, 1e-1], mom=[0., .5, .9])

def group_moves(mode:str|None, fused=True, method:str='fit') -> list:
    "Each step's fall of each group's weights, in `mode` (None: fastai's fp32 loop), each group at its own lr, wd, mom"
    probe = GroupMoves()
    learn = ramp_learner(steps=12, k=3, opt_func=partial(SGD, mom=.9), cbs=probe)
    if mode is not None: ALL_MODES[mode](learn, fused=fused)
    learn.create_opt()
    learn.opt.set_hyper('mom', HYPERS['mom'])
    if method == 'fit': fit_quiet(learn, 1, lr=HYPERS['lr'], wd=HYPERS['wd'])
    else:  # the body frozen one epoch, then all of it at discriminative rates: fastai's `slice`
        learn.freeze_to(-1)
        fit_quiet(learn, 1, method='fine_tune', base_lr=4e-3, freeze_epochs=1, wd=HYPERS['wd'])
    return probe.moves

# a step's movement, measured on values a mode holds to a precision: kahan's compensation is a bf16 number of at most
# half the weight's spacing (2**-9 at 1.0), so 2**-17 apart; stochastic rounding's mean over 4,096 weights of 2**-8
# spacing, five standard errors
FLOOR = dict(pure_kahan=2.**-17, pure_stochastic=5 * 2.**-8 / 4096**.5)

def check_group_moves(got:list, ref:list, tol:float, floor:float=0.):
    "Assert every step moved every group as the reference did, within `tol` relative and `floor` (a frozen group: not at all)"
    assert len(got) == len(ref) and got, f'{len(got)} steps, the reference {len(ref)}'
    for s,(g,r) in enumerate(zip(got, ref)):
        for i,(a,b) in enumerate(zip(g, r)):
            ok = a == b if b == 0 else abs(a - b) <= tol * abs(b) + floor
            assert ok, f'step {s}, group {i}: moved {a:.6g} where fastai moved {b:.6g}'

GROUP_MODES = ['amp_bf16', 'master_bf16', 'pure_kahan', 'pure_stochastic']

@pytest.mark.parametrize('method', ['fit', 'fine_tune'])
@pytest.mark.parametrize('fused', FUSED)
@pytest.mark.parametrize('mode', GROUP_MODES)
def test_each_group_steps_with_its_own_hypers(mode, fused, method):
    "Three groups at different lr, wd and mom (and `fine_tune`'s frozen then discriminative groups) move as in fastai's fp32 loop"
    tol = STEP_LR_TOL.get(mode, (1e-3,))[0]
    check_group_moves(group_moves(mode, fused, method), group_moves(None, method=method), tol, FLOOR.get(mode, 0.))

@pytest.mark.compiled
def test_group_hypers_control():
    "Planted: compiled steps taking group 0's hyper-parameters for every group are caught"
    with compiled_group0_hypers(), pytest.raises(AssertionError, match='group 1'):
        check_group_moves(group_moves('amp_bf16', 'compile'), group_moves(None), 1e-3)

# ---- a skipped step changes nothing but the scale

class DropBatch(Callback):
    "Cancel the training batches in `at` before their forward pass: the run without them"
    def __init__(self, at): self.at = set(at)
    def before_batch(self):
        if self.training and self.train_iter in self.at: raise CancelBatchException()  # counted over the fit

# fp16 with a scale one overflow leaves as it was: hysteresis 2 (AMP), a static scale (master)
SKIP_MODES = {**{m: ALL_MODES[m] for m in GROUP_MODES}, 'amp_fp16': lambda l, **kw: l.to_fp16(init_scale=2.**10, hysteresis=2, **kw),
              'master_fp16': lambda l, **kw: l.to_fp16(loss_scale=512, **kw)}

def skip_runs(mode:str, fused) -> tuple:
    "The state after a fit whose third step overflows (skipped), and after the same fit without that batch"
    def run(cbs):
        learn = SKIP_MODES[mode](tiny_learner(bn=True, opt_func=Adam, lr=1e-2, n_trn=6), fused=fused)
        fit_quiet(learn, 2, cbs=cbs)
        return learn
    a,b = run([InjectGrad(at=[2], micro=True)]),run([DropBatch(at=[2])])
    return a,b

@pytest.mark.filterwarnings("ignore:fp16 is slow")
@pytest.mark.parametrize('fused', FUSED)
@pytest.mark.parametrize('mode', list(SKIP_MODES))
def test_a_skipped_step_is_the_run_without_its_batch(mode, fused):
    "A skipped overflow (bf16: no scale) leaves weights, state, step counts and BatchNorm's statistics as the run without its batch"
    a,b = skip_runs(mode, fused)
    assert precision_cb(a).skipped_steps == 1 and precision_cb(b).skipped_steps == 0
    counts = {s.get('step') for s in a.opt.state.values()}
    assert counts == {precision_cb(a).total_steps - 1}, f'step counts {counts} after {precision_cb(a).total_steps} steps, 1 skipped'
    diffs = state_diffs(state_of(a), state_of(b))
    assert not diffs, f'the skipped step changed {diffs[:3]}'

@pytest.mark.compiled
def test_skip_counts_control():
    "Planted: a step skipped on the device advancing its step counts is caught"
    with skip_counts_a_step(), pytest.raises(AssertionError, match='step counts'):
        test_a_skipped_step_is_the_run_without_its_batch('pure_kahan', 'compile')

# ---- the stochastic-rounding stream: unbiased, and independent between places and steps

def stream_fit(fused, steps:int=20) -> list:
    "Two ramps in two groups (two buckets), each weight brought down 1e-3 a step from 1.0, stochastically rounded"
    learn = ramp_learner(steps=steps, k=2)
    learn.to_bf16(pure=True, update='stochastic', fused=fused)
    fit_quiet(learn)
    return [(1 - w.weight.detach().double().flatten()) / 2.**-8 for w in learn.model.ws]  # the ulps each came down

def check_stream(ks:list, steps:int=20, lr:float=1e-3, z:float=5.):
    "Assert each ramp came down as unbiased independent roundings do, and the two ramps' roundings are uncorrelated"
    p,n = lr / 2.**-8,ks[0].numel()
    for k in ks:
        assert torch.equal(k, k.round()), 'the weights are not bf16 values of the ramp'
        zs = (k.mean() - steps*p) / (steps*p*(1-p)/n)**.5
        assert abs(zs) < z, f'biased: {float(zs):.1f} standard errors off'
        assert abs(k.var() / (steps*p*(1-p)) - 1) < .25, 'the spread is not independent steps\''
    r = float(torch.corrcoef(torch.stack(ks))[0, 1])
    assert abs(r) < z / n**.5, f'the two groups\' roundings correlate ({r:.3f}): their places draw the same bits'

@pytest.mark.parametrize('fused', [True, COMPILED])
def test_the_stream_is_unbiased_and_independent(fused):
    "Stochastic rounding over 8,192 places and 20 steps: unbiased, with binomial spread, uncorrelated between two buckets"
    check_stream(stream_fit(fused))

@pytest.mark.parametrize('fused', [True, COMPILED])
def test_the_stream_control(fused):
    "Planted: the stream keyed on element 0 in every window is caught"
    with stream_on_one_base(), pytest.raises(AssertionError, match='correlate'): check_stream(stream_fit(fused))

@pytest.mark.parametrize('fused', [True, COMPILED])
def test_a_checkpoint_resumes_the_stream(fused):
    "Saved mid-run and loaded into a fresh learner, the stream goes on with the bits the run would have drawn"
    def mk():
        learn = ramp_learner(steps=10, k=2)
        learn.path = path
        return learn.to_bf16(pure=True, update='stochastic', fused=fused)
    path = Path(tempfile.mkdtemp())
    a = mk()
    fit_quiet(a)
    a.save('half')
    fit_quiet(a)
    b = mk()
    b.load('half')
    fit_quiet(b)
    assert not state_diffs(weights(a), weights(b)), 'the resumed stream drew other bits'

# ---- the device's loss scale

class UnscaledGrads(Callback):
    "After the precision callback's check, every stepped gradient of a clean step (a ramp's: the scale divided out) is 1"
    order = 11
    def __init__(self): self.clean,self.bad = 0,[]
    def before_step(self):
        gs = [p.grad for p in self.learn.parameters() if p.grad is not None]
        if not all(g.isfinite().all() for g in gs): return  # an overflow, skipped
        self.clean += 1
        off = max(float((g.float() - 1).abs().max()) for g in gs)
        if off: self.bad.append((self.clean, off))

def unscaled(mode:str, fused) -> UnscaledGrads:
    "A ramp in dynamic fp16 whose scale grows every clean step (and overflows in turn): its gradients after the unscale"
    probe = UnscaledGrads()
    learn = ramp_learner(steps=16, cbs=probe)
    if mode == 'amp_fp16': learn.to_fp16(init_scale=2.**10, growth_interval=1, fused=fused)
    else: learn.to_fp16(loss_scale=2.**10, dynamic=True, growth_interval=1, fused=fused)
    fit_quiet(learn)
    return probe

def check_unscaled(probe:UnscaledGrads):
    assert probe.clean >= 4, f'{probe.clean} clean steps'
    assert not probe.bad, f'unscaled gradients off 1 (step, by): {probe.bad[:4]}: the scale divided out is not the one the loss took'

@pytest.mark.filterwarnings("ignore:fp16 is slow")
@pytest.mark.parametrize('fused', FUSED)
@pytest.mark.parametrize('mode', ['amp_fp16', 'master_fp16'])
def test_the_unscale_divides_by_the_scale_used(mode, fused):
    "With a scale that moves every step, each clean step's unscaled gradients are exactly the gradients (1 on a ramp)"
    check_unscaled(unscaled(mode, fused))

@pytest.mark.filterwarnings("ignore:fp16 is slow")
@pytest.mark.compiled
def test_the_device_scale_control():
    "Planted: a compiled fit unscaling by the host's stale scale is caught"
    with unscale_by_host_scale(), pytest.raises(AssertionError, match='off 1'): check_unscaled(unscaled('amp_fp16', 'compile'))

# ---- low-bit checkpoints, value by value

class Shapes(Module):
    "Four 96x96 layers side by side (one shape), and a 64x128 one and a 4,096 vector (others)"
    def __init__(self):
        self.same = nn.ModuleList(nn.Linear(96, 96, bias=False) for _ in range(4))
        self.other,self.vec = nn.Linear(96, 128, bias=False),nn.Parameter(torch.zeros(4096))
        self.inp,self.out = nn.Linear(1, 96),nn.Linear(128, 1)
    def forward(self, x):
        h = self.inp(x)
        for l in self.same: h = torch.tanh(l(h))
        return self.out(self.other(h)) + self.vec.sum()

def windows(learn) -> list:
    "Each parameter's state tensors read through its store's windows (the step's own reads, not `value`)"
    eng,res = precision_cb(learn).fused_steps,[]
    for p in learn.model.parameters():
        b,i = eng.home[id(p)]
        scratch = torch.empty(b.end(i+1) - b.lo(i))
        res.append({k: b.slot(b.store.load_window(b, k, i, i+1, scratch), i, b.lo(i)).clone() for k in b.state_bufs})
    return res

def loaded(learn) -> list:
    "Each parameter's state tensors as a fresh learner's optimizer holds them after `load` (fp32, no layout yet)"
    return [{k: v.float() for k,v in learn.opt.state[p].items() if torch.is_tensor(v) and v.dim()} for p in learn.model.parameters()]

class SaveMid(Callback):
    "At the first epoch's end: a checkpoint, and the state's windows at that moment"
    order = 90
    def after_epoch(self):
        if self.epoch: return
        self.learn.save('mid')
        self.mid = windows(self.learn)

def lowbit_checkpoints(opt_state:str) -> tuple:
    "The state's windows and what fresh learners load from a checkpoint mid-fit and one between fits"
    path = Path(tempfile.mkdtemp())
    def mk():
        learn = tiny_learner(opt_func=Adam, lr=1e-2, n_trn=3, model=Shapes).to_bf16(pure=True, opt_state=opt_state)
        learn.path = path
        return learn
    a,mid = mk(),SaveMid()
    fit_quiet(a, 2, cbs=mid)
    a.save('end')
    got = []
    for name in ('mid', 'end'):
        c = mk()
        c.load(name)
        got.append(loaded(c))
    return [mid.mid, windows(a)],got

def check_checkpoints(want:list, got:list):
    for what,w,g in zip(('mid-fit', 'between fits'), want, got):
        for i,(ws,gs) in enumerate(zip(w, g)):
            for k,v in ws.items():
                assert torch.equal(gs[k], v), f'{what}: parameter {i}\'s {k} loaded other values than the store held'

@pytest.mark.parametrize('opt_state', ['bf16', '8bit', '4bit'])
def test_lowbit_checkpoints_value_by_value(opt_state):
    "Every state tensor of every parameter (four of one shape side by side) loads as the store held it, mid-fit and between fits"
    check_checkpoints(*lowbit_checkpoints(opt_state))

def test_lowbit_checkpoint_control():
    "Planted: a store reading a parameter's state from its neighbour of the same shape is caught"
    with lowbit_values_from_neighbour(), pytest.raises(AssertionError, match='loaded other values'):
        check_checkpoints(*lowbit_checkpoints('8bit'))
