"MasterPrecision matrix: the engine against fastai's loop (fused=False), skips, accumulation, freezing, checkpoints, scaler policy (host syncs: `test_syncs.py`)."
import math
from functools import partial
import pytest, torch
from torch import nn
from hypothesis import given, settings, strategies as st
from fastai.basics import Module, Callback, SGD, Adam, load_learner, set_seed
from fastai.callback.training import GradientAccumulation, GradientClip
from fastai.callback.tracker import SaveModelCallback
import fastai.callback.schedule  # lr_find
from mpx.all import *
from mpx.test_utils import tiny_learner, fit_quiet, weights, replay, InjectGrad, Snapshot, same_state, check_skips_change_nothing, GradNormProbe

class Multi(Module):
    "A regression over parameters of the given `shapes` (every one used), with a BatchNorm; seeded; module level so it pickles"
    def __init__(self, shapes, seed=0): set_seed(seed); self.ps,self.bn = nn.ParameterList([nn.Parameter(torch.randn(s)*.1) for s in shapes]),nn.BatchNorm1d(1)
    def forward(self, x): return self.bn(sum(p.sum()*x for p in self.ps) + x)

def multi_splitter(k):
    "Split `Multi`'s parameters into `k` groups (the last one holding the BatchNorm)"
    def split(m): ps = list(m.ps); n = max(1, len(ps)//k); return [ps[i:i+n] for i in range(0, len(ps), n)] + [list(m.bn.parameters())]
    return split

@settings(max_examples=12, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(1, 5), min_size=1, max_size=3), min_size=1, max_size=6),
       k=st.integers(1, 3), adam=st.booleans(), wd=st.sampled_from([0., 1e-2]))
def test_fused_equals_loop(shapes, k, adam, wd):
    """The engine's multi-tensor steps and its per-parameter loop of fastai's step functions (`fused=False`: fastai's own master mode is
    GPU-only) give bit-identical weights on random shapes, groups, optimizers, weight decay."""
    res = []
    for fused in (False, True):
        learn = tiny_learner(lr=1e-2, model=Multi(shapes), splitter=multi_splitter(k), opt_func=Adam if adam else partial(SGD, mom=.9), wd=wd, cbs=MasterPrecision(fused=fused))
        res.append(weights(fit_quiet(learn)))
    for a,b in zip(*res): assert torch.equal(a, b)

@pytest.mark.parametrize('fused', [False, True])
@pytest.mark.parametrize('value', [math.inf, math.nan, -math.inf])
@pytest.mark.parametrize('acc', [False, True])
@pytest.mark.parametrize('clip', [False, True])
def test_skipped_steps_change_nothing(fused, value, acc, clip):
    "A step whose gradients hold inf or nan leaves weights, masters and optimizer state bit-identical, with accumulation and clipping too."
    snap,inj = Snapshot(),InjectGrad(at=[2, 5], value=value, names=('2.bias',), micro=True)
    cbs = [MasterPrecision(fused=fused, dynamic=True), inj, snap] + ([GradientAccumulation(n_acc=32)] if acc else []) + ([GradientClip(max_norm=.1)] if clip else [])
    mp = fit_quiet(tiny_learner(lr=1e-2, cbs=cbs)).master_precision
    skipped = [1, 2] if acc else [2, 5]
    assert mp.total_steps == (5 if acc else 10)
    check_skips_change_nothing(mp, snap, skipped)
    assert mp.scales == [512.*.5**sum(s < i for s in skipped) for i in range(mp.total_steps)]

def test_accumulation_is_fp32():
    "With GradientAccumulation the master gradient is the exact fp32 sum of the micro-batches' half gradients, unscaled once."
    class Rec(Callback):
        order = MasterPrecision.order-1
        def before_fit(self): self.halves,self.master = [],[]  # not `half`: a Learner method (fastai warns of the shadow)
        def after_backward(self): self.halves.append(self.model[2].bias.grad.clone())
    class Check(Callback):
        order = MasterPrecision.order+1
        def before_step(self): self.learn.rec.master.append(list(self.learn.parameters())[-1].grad.clone())
    rec = Rec()
    fit_quiet(tiny_learner(lr=1e-2, cbs=[MasterPrecision(), GradientAccumulation(n_acc=32), rec, Check()]))
    assert rec.halves[0].dtype == torch.float16 and len(rec.master) == 5
    for i,m in enumerate(rec.master):
        assert m.dtype == torch.float32
        assert torch.equal(m, (rec.halves[2*i].float() + rec.halves[2*i+1].float()) / 512.)

@pytest.mark.parametrize('fused', [False, True])
def test_frozen_groups(fused):
    "A frozen group gets no optimizer state and keeps its exact fp32 weights; unfreezing trains it; discriminative lrs hold."
    learn = tiny_learner(lr=1e-2, model=Multi([[3], [4], [2, 2]]), splitter=multi_splitter(3), cbs=MasterPrecision(fused=fused))
    learn.create_opt(); learn.freeze()
    frozen = [p for pg in learn.opt.param_lists[:-1] for p in pg if not p.requires_grad]
    before = [p.detach().clone() for p in frozen]
    fit_quiet(learn, lr=1e-2)
    assert all(torch.equal(a, b) for a,b in zip(before, frozen)) and all(not learn.opt.state.get(p) for p in frozen)
    assert {p.dtype for p in learn.model.parameters()} == {torch.float32}
    learn.unfreeze()
    fit_quiet(learn, lr=slice(1e-3, 1e-2))
    assert not any(torch.equal(a, b) for a,b in zip(before, frozen)) and all(learn.opt.state.get(p) for p in frozen)
    assert learn.opt.hypers[0]['lr'] < learn.opt.hypers[-1]['lr']

@pytest.mark.parametrize('growth_interval,at', [(1, [0, 3, 4]), (2, [1, 2, 3, 8]), (3, [5]), (4, []), (2, [0, 1, 2, 3, 4, 5])])
def test_dynamic_policy_matches_gradscaler(growth_interval, at):
    "Dynamic master scaling follows torch.amp.GradScaler's policy on the same overflow sequence (DeepSpeed-style sequences)."
    inj = InjectGrad(at=at, names=('0.weight',), micro=True)
    mp = fit_quiet(tiny_learner(lr=1e-2, cbs=[MasterPrecision(loss_scale=2.**8, dynamic=True, growth_interval=growth_interval), inj]), 2).master_precision
    assert set(at) <= {i for i,s in enumerate(mp.step_log.skips) if s}  # a fast-growing scale also overflows by itself
    assert mp.scales == replay(mp.step_log.skips, init_scale=2.**8, growth_interval=growth_interval)

def test_min_scale_floor():
    "The dynamic scale never falls below min_scale, however many steps overflow in a row."
    inj = InjectGrad(at=range(10), micro=True)
    with pytest.warns(UserWarning, match='10 optimizer steps in a row had inf/nan gradients at loss scale 2'):  # mpx's word on it
        mp = fit_quiet(tiny_learner(lr=1e-2, cbs=[MasterPrecision(loss_scale=8., dynamic=True, min_scale=2.), inj])).master_precision
    assert mp.scales == [8., 4., 2., 2., 2., 2., 2., 2., 2., 2.] and mp.skipped_steps == 10

def test_static_scale_still_skips():
    "A static scale never moves, but an overflowing step is still skipped (fastai v1 stepped anyway)."
    snap,inj = Snapshot(),InjectGrad(at=[4], micro=True)
    mp = fit_quiet(tiny_learner(lr=1e-2, cbs=[MasterPrecision(), inj, snap])).master_precision
    assert set(mp.scales) == {512.} and mp.skipped_steps == 1
    assert same_state(snap.snaps[4], snap.snaps[5])

def test_gradient_clip_clips_masters():
    "GradientClip clips the unscaled fp32 master gradients: their norm after it is max_norm."
    norm = GradNormProbe(GradientClip.order+1)  # the norm of the masters' gradients
    fit_quiet(tiny_learner(lr=1e-2, cbs=[MasterPrecision(), GradientClip(max_norm=1e-3), norm]))
    assert len(norm.norms) == 10 and all(abs(n - 1e-3) < 1e-6 for n in norm.norms)

def test_matches_fp32_training():
    "Master-mode training follows fp32 training within fp16's precision, bf16 too."
    ref = weights(fit_quiet(tiny_learner(lr=1e-2), 2))
    for mode,eps in (('fp16', 2e-2), ('bf16', 5e-2)):
        for a,b in zip(ref, weights(fit_quiet(tiny_learner(lr=1e-2, cbs=MasterPrecision(mode)), 2))): assert torch.allclose(a, b, atol=eps, rtol=eps), mode

def rounded_through_half(learn) -> list:
    "Each parameter tensor's share of weights fp16 represents exactly (a trained fp32 weight is one of them once in thousands)"
    return [float((p.half().float() == p).float().mean()) for p in learn.model.parameters()]

def test_masters_not_rounded():
    "After the fit every weight of every tensor is its fp32 master, which fp16 cannot represent: nothing went through half on the way out."
    learn = fit_quiet(tiny_learner(lr=1e-2, cbs=MasterPrecision()), 2)
    assert all(r == 0 for r in rounded_through_half(learn)), rounded_through_half(learn)
    with torch.no_grad(): learn.model[0].weight.copy_(learn.model[0].weight.half().float())  # the check can fail: one tensor rounded
    assert rounded_through_half(learn)[0] == 1

@pytest.mark.parametrize('fused', [False, True])
def test_save_model_callback(tmp_path, fused):
    "SaveModelCallback's mid-fit checkpoints hold fp32 masters, load in plain fastai, and the end-of-fit reload works."
    learn = tiny_learner(lr=1e-2, path=tmp_path, cbs=MasterPrecision(fused=fused))
    fit_quiet(learn, 3, cbs=SaveModelCallback(monitor='valid_loss', fname='best', with_opt=True, every_epoch=True))
    plain = tiny_learner(lr=1e-2, path=tmp_path)
    plain.create_opt(); plain.load('best_1', with_opt=True)
    assert {p.dtype for p in plain.model.parameters()} == {torch.float32}
    assert any((p.half().float() != p).any() for p in plain.model.parameters())

def test_export_and_lr_find(tmp_path):
    "A learner with MasterPrecision exports, loads and trains again; lr_find leaves the weights as they were."
    learn = tiny_learner(lr=1e-2, path=tmp_path, cbs=MasterPrecision(dynamic=True, loss_scale=64.))
    fit_quiet(learn)
    w = weights(learn)
    with learn.no_bar(), learn.no_logging(): learn.lr_find(num_it=15, show_plot=False)
    assert all(torch.equal(a, b) for a,b in zip(w, weights(learn)))
    learn.export('m.pkl')
    new = load_learner(tmp_path/'m.pkl', cpu=False)
    assert new.master_precision.loss_scale == learn.master_precision.loss_scale
    new.dls = learn.dls
    fit_quiet(new)

def test_bad_model_fails_before_changing_anything():
    "An fp64 model or a group spanning devices fails with a clear error and nothing is changed."
    learn = tiny_learner(lr=1e-2, model=nn.Sequential(nn.Linear(1, 1)).double(), cbs=MasterPrecision())
    with pytest.raises(ValueError, match="parameter '0.weight' is torch.float64"): fit_quiet(learn)
    assert {p.dtype for p in learn.model.parameters()} == {torch.float64} and 'parameters' not in learn.__dict__

def test_cancel_batch_after_check():
    "A callback after MasterPrecision that cancels a batch after the check leaves the scaler consistent; later steps train."
    from fastai.callback.core import CancelBatchException
    class CancelAt(Callback):
        order = MasterPrecision.order+1
        def before_fit(self): self.i = 0
        def before_step(self):
            self.i += 1
            if self.i == 3: raise CancelBatchException()
    mp = fit_quiet(tiny_learner(lr=1e-2, cbs=[MasterPrecision(loss_scale=8., dynamic=True, growth_interval=2), CancelAt()])).master_precision
    assert mp.total_steps == 10 and mp.scales == [8., 8., 16., 16., 32., 32., 64., 64., 128., 128.]

class LoadAt(Callback):
    "At training batch `at`, `learn.model.load_state_dict(weights)`, or of the model's own weights then (`weights=None`: exact in half)"
    order = 60
    def __init__(self, weights, at): self.weights,self.at,self.n = weights,at,0
    def before_batch(self):
        if not self.training or self.n != self.at: return
        if self.weights is None: self.weights = {k: v.float().clone() for k,v in self.learn.model.state_dict().items()}
        self.learn.model.load_state_dict(self.weights)
    def after_batch(self):
        if self.training: self.n += 1

COMPILE = pytest.param('compile', marks=pytest.mark.compiled)

@pytest.mark.parametrize('fused', [False, True, COMPILE])
@pytest.mark.parametrize('exact', [True, False], ids=['half_exact', 'any_fp32'])
@pytest.mark.parametrize('mode', ['fp16', 'bf16'])
def test_load_state_dict_mid_fit_is_a_fresh_start(mode, exact, fused):
    """`learn.model.load_state_dict(w)` at the start of a fit's second epoch: that epoch is, bit for bit, one fit from `w` (stateless SGD,
    a fixed learning rate, the data unshuffled). `w` exact in half (the model's own weights then), or any fp32 weights."""
    def learner(cbs=None):
        learn = tiny_learner(n_trn=4, lr=1e-2, opt_func=partial(SGD, mom=0.), cbs=cbs)
        learn.dls.train.shuffle = False
        return learn.to_fp16(loss_scale=512, fused=fused) if mode == 'fp16' else learn.to_bf16(master=True, fused=fused)
    g = torch.Generator().manual_seed(1)
    given = None if exact else {k: v + .3*torch.randn(v.shape, generator=g) for k,v in tiny_learner().model.state_dict().items()}
    load = LoadAt(given, at=4)
    got = weights(fit_quiet(learner(load), 2))
    fresh = learner()
    fresh.model.load_state_dict(load.weights)
    assert all(torch.equal(a, b) for a,b in zip(got, weights(fit_quiet(fresh))))

def test_model_copied_mid_fit_holds_no_fit():
    "A copy of the half model made mid-fit (an EMA's) carries no part of the fit: its load hook does nothing, the masters stay as they are."
    import copy, pickle
    class Copy(Callback):
        order = 60
        def after_step(self):
            if hasattr(self, 'ok'): return
            cb,m = self.learn.master_precision,copy.deepcopy(self.learn.model)
            masters = [t.clone() for t in cb.masters.masters]
            m.load_state_dict({k: torch.zeros_like(v) for k,v in m.state_dict().items()})
            self.ok = all(torch.equal(a, b) for a,b in zip(masters, cb.masters.masters)) and len(pickle.dumps(m)) < 5000
    learn = tiny_learner(cbs=Copy()).to_bf16(master=True)
    assert fit_quiet(learn).copy.ok
