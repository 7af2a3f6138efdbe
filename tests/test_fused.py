"""Fused optimizer steps (mpx.fused) on optimizers alone: bit-equal to fastai's loop on CPU for every fastai optimizer, the engine installed
and undone, the bf16 kinds. In a learner, through freeze/unfreeze and schedules, and their op counts: `test_fused_modes.py`."""
import pytest, torch
from functools import partial
from torch import nn
from fastcore.foundation import L
from fastai.optimizer import *
from mpx.fused import *
from mpx.flat import Kind
from mpx.test_utils import CountOps, stepped_opt, opt_diffs
from mpx.pure import split_kahan, fold_kahan, widen_kahan, round_stochastic, stream_key, KahanKind, StochasticKind, FrozenKind, Stream

pytestmark = pytest.mark.usefixtures('one_thread')

def _look(ps, **kw): return Lookahead(Adam(ps, **kw), k=3)
def _ranger(ps, **kw): return ranger(ps, k=3, **kw)

OPTS = {  # name: (opt_func, hyper-parameters)
    'sgd':         (SGD, dict(lr=.1)),
    'sgd_wd':      (SGD, dict(lr=.1, wd=.1)),
    'sgd_mom_wd':  (SGD, dict(lr=.1, mom=.9, wd=.1)),
    'sgd_l2':      (SGD, dict(lr=.1, mom=.9, wd=.1, decouple_wd=False)),
    'rmsprop':     (RMSProp, dict(lr=1e-2, wd=.1)),
    'rmsprop_mom': (RMSProp, dict(lr=1e-2, mom=.9, wd=.1, decouple_wd=False)),
    'adam':        (Adam, dict(lr=1e-2, wd=0.)),
    'adamw':       (Adam, dict(lr=1e-2, wd=.1)),
    'adam_l2':     (Adam, dict(lr=1e-2, wd=.1, decouple_wd=False)),
    'radam':       (RAdam, dict(lr=1e-2, wd=.1)),
    'radam_sadam': (RAdam, dict(lr=1e-2, beta=5.)),
    'qhadam':      (QHAdam, dict(lr=1e-2, wd=.1)),
    'larc':        (Larc, dict(lr=.1, wd=.1)),
    'larc_noclip': (Larc, dict(lr=.1, clip=False)),
    'lars_nomom':  (Larc, dict(lr=.1, mom=0., wd=.1, decouple_wd=False)),
    'lamb':        (Lamb, dict(lr=1e-2, wd=.1)),
    'lookahead':   (_look, dict(lr=1e-2)),
    'ranger':      (_ranger, dict(lr=1e-2)),
}

def engine(chunk:int=1<<22):
    "Installs the step engine on an optimizer (for `stepped_opt`), asserting it takes the fused path"
    def install(opt):
        fs = FusedSteps(opt, chunk=chunk)
        assert fs.own_step, fs.reason
        return fs
    return install

@pytest.mark.parametrize('name', list(OPTS))
def test_bit_equal(name):
    "Every fastai optimizer: the fused step gives fastai's loop's weights and state bit for bit (a frozen weight, a bias missing gradients)"
    f,kw = OPTS[name]
    loop,fused = stepped_opt(f, n=10, frozen=True, **kw),stepped_opt(f, engine(), n=10, frozen=True, **kw)
    assert opt_diffs(loop, fused) == []

def test_cases_covered():
    "The matrix reaches what it claims: both RAdam branches, a bias stepped fewer times than its layer, a weight never stepped"
    m,opt = stepped_opt(RAdam, engine(), n=10, frozen=True, lr=1e-2)
    assert m[2].weight in opt.state  # an entry for every parameter, as fastai's all_params makes them
    r = lambda sq, st: 2/(1-sq) - 1 - 2*st*sq**st/(1-sq**st)  # RAdam's SMA length: rectified where above 5
    assert r(.99, 1) <= 5 < r(.99, 10)
    assert opt.state[m[3].bias]['step'] < opt.state[m[3].weight]['step'] == 10
    assert 'step' not in opt.state[m[2].weight]

def test_detects_difference():
    "The comparison can fail: one step with another lr shows"
    (ma,oa),(mb,ob) = stepped_opt(Adam, lr=1e-2),stepped_opt(Adam, engine(), lr=1e-2)
    ob.hypers[1]['lr'] = 2e-2
    mb(torch.ones(2, 4)).sum().backward(); ob.step()
    assert opt_diffs((ma,oa), (mb,ob))

def test_undo_and_refusals():
    "`undo` is idempotent and leaves fastai's step; a torch optimizer stepped in place is left alone, with a reason; users' step functions are the engine's"
    opt = ranger(list(nn.Linear(2, 2).parameters()), lr=1e-3)
    fs = FusedSteps(opt)
    assert vars(opt)['step'] is not None and 'step' in vars(opt.opt)
    fs.undo(); fs.undo()
    assert 'step' not in vars(opt) and 'step' not in vars(opt.opt)
    ow = OptimWrapper(list(nn.Linear(2, 2).parameters()), opt=torch.optim.Adam, lr=1e-3)
    fs = FusedSteps(ow)
    assert not fs.own_step and 'OptimWrapper' in fs.reason and 'step' not in vars(ow)
    def mine(p, lr, **kwargs): p.data.add_(p.grad, alpha=-lr)
    assert why_not_fused(Optimizer(list(nn.Linear(2, 2).parameters()), [weight_decay, mine], lr=1e-3)) is None  # fastai's loop, in the engine

def test_changed_cbs_fall_back():
    "Step functions changed after install (a user's own added): that step runs fastai's loop, same results"
    def mine(p, **kwargs): pass
    def add_mine(opt): opt.cbs = L(opt.cbs) + L([mine])
    def fused_then_mine(opt): fs = FusedSteps(opt); add_mine(opt); return fs
    assert opt_diffs(stepped_opt(Adam, add_mine, n=2, lr=1e-2), stepped_opt(Adam, fused_then_mine, n=2, lr=1e-2)) == []

def test_widen_kahan():
    "Bulk widen: `w.float() + c.float()` per tensor, or `w.float()` without compensations"
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(s, generator=g).bfloat16() for s in ((3, 4), (5,), (2, 2, 2))]
    cs = [(torch.randn(w.shape, generator=g)*1e-3).bfloat16() for w in ws]
    xs = [torch.empty(w.shape) for w in ws]
    widen_kahan(xs, ws, cs)
    assert all(torch.equal(x, w.float() + c.float()) for x,w,c in zip(xs, ws, cs))
    widen_kahan(xs, ws)
    assert all(torch.equal(x, w.float()) for x,w in zip(xs, ws))

def test_fold_kahan_bit_equal():
    "Bulk Kahan fold gives `split_kahan`'s canonical pair exactly, including ties, zeros, tiny and huge values"
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(4096, generator=g) * s for s in (1., 1e-3, 1e3, 1e-30)]
    xs.append(torch.tensor([0., -0., 1 + 2**-8, 1 + 3*2**-9, -(1 + 2**-8 + 2**-16), 3e38, -3e38, 1e-40, 2**-126]))
    xs.append(xs[0].bfloat16().float() + xs[1].bfloat16().float() * 2**-8)  # sums of two bf16s, where the split is exact
    ws,cs = [torch.empty(x.shape, dtype=torch.bfloat16) for x in xs],[torch.empty(x.shape, dtype=torch.bfloat16) for x in xs]
    fold_kahan(xs, ws, cs)
    for x,w,c in zip(xs, ws, cs):
        sw,sc = split_kahan(x)
        assert torch.equal(w.view(torch.int16), sw.view(torch.int16)) and torch.equal(c.view(torch.int16), sc.view(torch.int16))

def test_round_stochastic():
    "Stochastic rounding: unbiased (the mean of many roundings is the value), only the two bf16 neighbours, the same bits from the same key"
    vals = torch.tensor([1 + 2**-9, -3 + 5*2**-12, 1e-3 + 1e-6, 0.3, 1.])
    x = vals.repeat(1 << 15)
    w = round_stochastic(x, stream_key(1234, 0)).bfloat16()
    got = w.float().view(-1, len(vals))
    n = got.shape[0]
    # each column: value v between bf16 neighbours a <= |v| < b; the estimate of P(up) has standard error <= 0.5/sqrt(n)
    for j,v in enumerate(vals.tolist()):
        col = got[:, j].abs()
        a = col.min().item(); b = col.max().item()
        assert len(set(col.tolist())) <= 2 and a <= abs(v) <= b
        if a != b: assert abs((col.double().mean().item() - abs(v)) / (b - a)) < 4 * .5 / n**.5, (v, col.mean().item())
    assert torch.equal(round_stochastic(x, stream_key(1234, 0)), w.float())
    assert not torch.equal(round_stochastic(x, stream_key(99, 0)), w.float())

_KINDS = {'kahan': KahanKind, 'stochastic': lambda: StochasticKind(Stream(7))}

def _bf16_twin(update, opt_func, fused, chunk=1<<22, frozen=False, n=7):
    "bf16 weights stepped `n` times by the engine with a pure-bf16 kind (`frozen`: the first layer kept exact), fused or by fastai's loop"
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 5), nn.Linear(5, 2))
    plain,kept = Kind(),FrozenKind()
    kind = _KINDS[update]()
    opt = opt_func([list(m[:2].parameters()), list(m[2:].parameters())], lr=1e-2)
    halves = {id(p) for i in (0, 2, 3) for p in m[i].parameters()}
    fs = FusedSteps(opt, lambda p: (kept if frozen and p in set(m[0].parameters()) else kind) if id(p) in halves else plain,
                    fused=fused, chunk=chunk)
    g = torch.Generator().manual_seed(3)
    for i in range(n):
        x = torch.randn(16, 4, generator=g)
        with torch.autocast('cpu', dtype=torch.bfloat16): m(x).float().pow(2).mean().backward()
        if i % 3 == 1: m[3].bias.grad = None
        opt.step(); opt.zero_grad()
    dtypes = {p.dtype for p in m.parameters()}
    fs.undo()
    return (m, opt),dtypes

@pytest.mark.parametrize('update', ['kahan', 'stochastic'])
@pytest.mark.parametrize('opt_func', [Adam, partial(ranger, k=3), Lamb], ids=['adam', 'ranger', 'lamb'])
def test_bf16_kinds_fused_equal_loop(update, opt_func):
    """The pure-bf16 kinds: fused and fastai's loop give the same weights and state bit for bit, in one window or in windows of a
    few elements, and the results do not depend on the windows (stochastic rounding's bits come from each element's index)"""
    (a,dt),(b,_),(c,_),(d,_) = [_bf16_twin(update, opt_func, f, chunk) for f,chunk in ((False, 1<<22), (True, 1<<22), (False, 40), (True, 40))]
    assert dt == {torch.bfloat16, torch.float32}  # the Linear layers in bf16 during the steps, BatchNorm fp32
    assert opt_diffs(a, b) == [] and opt_diffs(c, d) == []
    assert opt_diffs(a, d) == []
    assert {p.dtype for p in a[0].parameters()} == {torch.float32}

def test_kept_kind_steps_exactly():
    "A weight kept exact (frozen when the fit began) is stepped in fp32 and rounded to nearest, the same fused or not"
    (a,_),(b,_) = _bf16_twin('kahan', Adam, False, frozen=True),_bf16_twin('kahan', Adam, True, frozen=True)
    assert opt_diffs(a, b) == []

@pytest.mark.parametrize('update', ['kahan', 'stochastic'])
def test_bf16_kinds_ops(update):
    "Adam through a pure-bf16 kind: the ops of a step do not grow with the tensors"
    def ops(n):
        ps = [nn.Parameter(torch.randn(8)) for _ in range(n)]
        kind = _KINDS[update]()
        opt = Adam(ps, lr=1e-3)
        FusedSteps(opt, lambda p: kind)
        for p in ps: p.grad = torch.randn(8).bfloat16()
        opt.step()
        with CountOps() as c: opt.step()
        return c.n
    assert ops(10) == ops(100) <= (30 if update == 'kahan' else 40)  # stochastic: the counter-based hash, a dozen integer ops

def test_lookahead_sync_holds_nothing_after_the_fit():
    "`Lookahead`'s slow weights sit in the engine's flat buffers during a fit; once it ends (`undo`) the sync holds none of them"
    m = nn.Linear(4, 3)
    opt = _look(list(m.parameters()), lr=1e-2)
    fs = FusedSteps(opt)
    for _ in range(4):
        for p in m.parameters(): p.grad = torch.ones_like(p)
        opt.step()
    assert fs.lookahead.slow, 'the slow weights were never adopted: this case checks nothing'
    fs.undo()
    assert fs.lookahead.slow == {}
