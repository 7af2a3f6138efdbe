"Fused optimizer steps (mpx.fused): bit-equal to fastai's loop on CPU for every fastai optimizer, op counts that stay flat, bf16 kernels"
import pytest, torch
from functools import partial
from torch import nn
from fastcore.foundation import L
from fastai.callback.core import Callback
import fastai.callback.schedule
from fastai.optimizer import *
from mpx.fused import *
from mpx.flat import Kind
from mpx.test_utils import CountOps, count_step_ops
from mpx.pure import split_kahan, fold_kahan, widen_kahan, round_stochastic, stream_key, KahanKind, StochasticKind, KeptKind
from mpx.test_utils import tiny_learner, tiny_split

@pytest.fixture(autouse=True)
def _one_thread():
    "One intra-op thread: tiny tensors, and OpenMP's spinning on a busy 2-core machine made BatchNorm 100x slower"
    n = torch.get_num_threads(); torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

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

def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 5), nn.Linear(5, 3), nn.Linear(3, 2))

def _stepped(opt_func, fused:bool, n:int=10, chunk:int=1<<22, **kw):
    "Model and optimizer after `n` steps: two groups, `do_wd` off for norms and biases, a bias missing some batches, a frozen layer"
    m = _model()
    opt = opt_func([list(m[:2].parameters()), list(m[2:].parameters())], **kw)
    for p in (m[0].bias, m[1].weight, m[1].bias, m[2].bias): opt.state[p]['do_wd'] = False
    m[4].weight.requires_grad_(False)  # never a gradient: never stepped
    fs = FusedSteps(opt, chunk=chunk) if fused else None
    if fused: assert fs.native, fs.reason
    g = torch.Generator().manual_seed(1)
    for i in range(n):
        m(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
        if i % 3 == 1: m[3].bias.grad = None
        opt.step(); opt.zero_grad()
    return m,opt,fs

def _diffs(a, b) -> list:
    "Where two (model, optimizer) pairs differ: weights bit for bit, every state value (type, dtype, value), Lookahead's slow weights"
    (ma,oa),(mb,ob) = a,b
    res = [f'weight {i}' for i,(p,q) in enumerate(zip(ma.parameters(), mb.parameters())) if not torch.equal(p, q)]
    sa,sb = oa.state_dict(),ob.state_dict()
    for i,(s,t) in enumerate(zip(sa['state'], sb['state'])):
        if s.keys() != t.keys(): res.append(f'keys {i}: {sorted(s)} {sorted(t)}'); continue
        for k in s:
            u,v = s[k],t[k]
            if type(u) is not type(v): res.append(f'{k} {i}: {type(u)} {type(v)}')
            elif torch.is_tensor(u) and (u.dtype != v.dtype or not torch.equal(u, v)): res.append(f'{k} {i}')
            elif not torch.is_tensor(u) and u != v: res.append(f'{k} {i}: {u} {v}')
    if 'slow_weights' in sa:
        if sa['count'] != sb['count']: res.append('count')
        slow = [[s for pg in sd['slow_weights'] for s in pg] for sd in (sa, sb)]
        res += [f'slow {i}' for i,(s,t) in enumerate(zip(*slow)) if not torch.equal(s, t)]
    return res

@pytest.mark.parametrize('name', list(OPTS))
def test_bit_equal(name):
    "Every fastai optimizer: the fused step gives fastai's loop's weights and state bit for bit"
    f,kw = OPTS[name]
    (ma,oa,_),(mb,ob,_) = _stepped(f, False, **kw),_stepped(f, True, **kw)
    assert _diffs((ma,oa), (mb,ob)) == []

def test_cases_covered():
    "The matrix reaches what it claims: both RAdam branches, a bias stepped fewer times than its layer, a weight never stepped"
    m,opt,_ = _stepped(RAdam, True, lr=1e-2)
    assert m[4].weight in opt.state  # an entry for every parameter, as fastai's all_params makes them
    r = lambda sq, st: 2/(1-sq) - 1 - 2*st*sq**st/(1-sq**st)  # RAdam's SMA length: rectified where above 5
    assert r(.99, 1) <= 5 < r(.99, 10)
    assert opt.state[m[3].bias]['step'] < opt.state[m[3].weight]['step'] == 10
    assert 'step' not in opt.state[m[4].weight]

def test_detects_difference():
    "The comparison can fail: one step with another lr shows"
    (ma,oa,_),(mb,ob,_) = _stepped(Adam, False, lr=1e-2),_stepped(Adam, True, lr=1e-2)
    ob.hypers[1]['lr'] = 2e-2
    mb(torch.ones(2, 4)).sum().backward(); ob.step()
    assert _diffs((ma,oa), (mb,ob))

class _Fuse(Callback):
    "What a precision mode does with fused steps: install at the start of a fit, undo at its end"
    order = 50
    def before_fit(self): self.fs = FusedSteps(self.learn.opt); assert self.fs.native, self.fs.reason
    def after_fit(self): self.fs.undo()

class _DropGrad(Callback):
    "The last layer's bias gets no gradient in every third batch"
    order = 40
    def after_backward(self):
        if self.iter % 3 == 1: self.learn.model[-1].bias.grad = None

@pytest.mark.parametrize('opt_func', [Adam, partial(SGD, mom=.9, wd=.1), ranger, Lamb, Larc, QHAdam, partial(RMSProp, mom=.9), RAdam],
                         ids=['adam', 'sgd', 'ranger', 'lamb', 'larc', 'qhadam', 'rmsprop', 'radam'])
def test_learner_workflow(opt_func):
    "freeze -> fit -> unfreeze -> fit_one_cycle(slice) -> freeze -> fit with wd_bn_bias=False and train_bn: fastai's results bit for bit"
    res = []
    for fused in (False, True):
        cbs = [_DropGrad()] + [_Fuse()]*fused
        learn = tiny_learner(cbs=cbs, bn=True, opt_func=opt_func, splitter=tiny_split, wd_bn_bias=False, n_trn=4, wd=.1)
        learn.freeze(); learn.fit(1, 1e-2)
        learn.unfreeze(); learn.fit_one_cycle(2, slice(1e-3, 1e-2))
        learn.freeze(); learn.fit(1, 1e-2)  # frozen weights keep zeroed gradients: fastai steps them, so must we
        assert 'step' not in vars(learn.opt)
        res.append((learn.model, learn.opt))
    assert _diffs(*res) == []
    assert any(not s['do_wd'] for s in res[1][1].state_dict()['state'] if 'do_wd' in s)

def test_undo_and_refusals():
    "`undo` is idempotent and leaves fastai's step; a torch optimizer stepped in place is left alone, with a reason; users' step functions are the engine's"
    opt = ranger(list(nn.Linear(2, 2).parameters()), lr=1e-3)
    fs = FusedSteps(opt)
    assert vars(opt)['step'] is not None and 'step' in vars(opt.opt)
    fs.undo(); fs.undo()
    assert 'step' not in vars(opt) and 'step' not in vars(opt.opt)
    ow = OptimWrapper(list(nn.Linear(2, 2).parameters()), opt=torch.optim.Adam, lr=1e-3)
    fs = FusedSteps(ow)
    assert not fs.native and 'OptimWrapper' in fs.reason and 'step' not in vars(ow)
    def mine(p, lr, **kwargs): p.data.add_(p.grad, alpha=-lr)
    assert why_not_fused(Optimizer(list(nn.Linear(2, 2).parameters()), [weight_decay, mine], lr=1e-3)) is None  # fastai's loop, in the engine

def test_changed_cbs_fall_back():
    "Step functions changed after install (a user's own added): that step runs fastai's loop, same results"
    def mine(p, **kwargs): pass
    res = []
    for fused in (False, True):
        m = _model(); opt = Adam(list(m.parameters()), lr=1e-2)
        if fused: FusedSteps(opt)
        opt.cbs = L(opt.cbs) + L([mine])
        m(torch.ones(2, 4)).sum().backward(); opt.step()
        res.append((m, opt))
    assert _diffs(*res) == []

def _chain_ops(opt_func, n, fused, steps):
    "Ops of the `steps`-th step of `opt_func` on `n` chained `Linear(4, 4)` layers"
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])
    opt = opt_func(list(m.parameters()), lr=1e-3)
    if fused: FusedSteps(opt)
    m(torch.randn(2, 4)).sum().backward()
    for _ in range(steps - 1): opt.step()
    return count_step_ops(opt)

@pytest.mark.parametrize('name,opt_func,steps', [('sgd', partial(SGD, mom=.9), 2), ('adam', Adam, 2), ('radam', RAdam, 10),
                                                  ('radam_early', RAdam, 2), ('ranger', ranger, 6), ('ranger', ranger, 5)])
def test_op_counts(name, opt_func, steps):
    "Ops a step dispatches: fastai's loop grows linearly with the tensors, the fused step does not (10 vs 100 layers)"
    loop = [_chain_ops(opt_func, n, False, steps) for n in (10, 100)]
    fused = [_chain_ops(opt_func, n, True, steps) for n in (10, 100)]
    assert fused[0] == fused[1] and fused[1] <= 16, fused  # three are fastai's `p.grad.data` (a `detach`: metadata, no kernel)
    assert loop[1] >= 9*loop[0] and loop[0] >= 5*20, loop

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

_KINDS = {'kahan': KahanKind, 'stochastic': lambda: StochasticKind(dict(seed=7, count=0))}

def _bf16_twin(update, opt_func, fused, chunk=1<<22, frozen=False, n=7):
    "bf16 weights stepped `n` times by the engine with a pure-bf16 kind (`frozen`: the first layer kept exact), fused or by fastai's loop"
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 5), nn.Linear(5, 2))
    plain,kept = Kind(),KeptKind()
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
    assert _diffs(a, b) == [] and _diffs(c, d) == []
    assert _diffs(a, d) == []
    assert {p.dtype for p in a[0].parameters()} == {torch.float32}

def test_kept_kind_steps_exactly():
    "A weight kept exact (frozen when the fit began) is stepped in fp32 and rounded to nearest, the same fused or not"
    (a,_),(b,_) = _bf16_twin('kahan', Adam, False, frozen=True),_bf16_twin('kahan', Adam, True, frozen=True)
    assert _diffs(a, b) == []

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
