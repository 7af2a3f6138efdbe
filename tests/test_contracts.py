"""The engine's contracts (issue 47): a new storage kind is one subclass of `Kind`, a new store one of `Store`, and the engine steps
them as its own, eagerly bit for bit as fastai's loop, compiled within its tolerance."""
import pytest, torch
from fastai.optimizer import Adam, SGD
from fastai.callback.core import Callback
from torch import nn
from mpx.all import *
from mpx.flat import Kind, Slots
from mpx.lowbit import Store, DenseStore, LowBitState, where_skipped, flat_part, make_store
from mpx.core import register_store, _stores
from mpx.fused import FusedSteps
from mpx.test_utils import stepped_opt, opt_diffs, tiny_learner, fit_quiet, weights, precision_cb, precision_cbs
from conftest import compiles

pytestmark = pytest.mark.filterwarnings('ignore::UserWarning')

class Copied(Kind):
    "fp32 weights stepped in a buffer of the kind's own (a master's role), copied into the model's after each step"
    in_place = False
    def build(self, b):
        super().build(b)
        b.own = Slots(b, b.w.clone())  # the kind's own buffer
    def to_step(self, b, i, j): return b.part(b.own.buf, i, j),b.part(b.g, i, j)
    def fold(self, b, i, j, x, turn=0): b.part(b.w, i, j).copy_(x)
    def written(self, b, idx):
        for i in idx: b.own.slots[i].copy_(b.params[i].data)
    def value(self, b, i): return b.own.slots[i].clone()
    def assign(self, b, i, x):
        b.own.slots[i].copy_(x)
        b.params[i].data.copy_(x)
    def kernel_io(self, b, a, c, turn=0): return dict(x=b.part(b.own.buf, a, c), w=b.part(b.w, a, c), g=b.part(b.g, a, c)),{}
    @staticmethod
    def kernel_widen(t, s): return t['x'],t['g']
    @staticmethod
    def kernel_fold(t, s, x, nearest=None): return dict(x=x, w=x)

class Cloned(Store):
    "fp32 state held in a buffer a key, stepped in a copy: a store that is not `DenseStore`'s view"
    name,bits = 'cloned',32  # bits: the engine's windows hand it a scratch to step in (None: its state dicts are the buffer's views)
    def bytes(self, dtype) -> float: return 4.
    def new(self, b, k, dtype):
        b.state_bufs[k] = b.zeros(torch.float32)
        b.state_held[k] = b.views(b.state_bufs[k])
    def put(self, b, k, i, v): b.state_held[k][i].copy_(v)
    def value(self, b, k, i): return b.state_held[k][i].clone()
    def zero(self, b, k, a, c): b.part(b.state_bufs[k], a, c).zero_()
    def load_window(self, b, k, i, j, scratch=None): return scratch.copy_(b.part(b.state_bufs[k], i, j))
    def store_window(self, b, k, i, j, x): b.part(b.state_bufs[k], i, j).copy_(x)
    def kernel_io(self, b, k, a, c): return {k: b.part(b.state_bufs[k], a, c)}
    def kernel_load(self, t, k): return t[k]
    def kernel_store(self, t, k, x, keep): return {k: where_skipped(keep, t[k], x)}

def _engine(fused=True):
    "Installs a step engine whose every parameter is `Copied`"
    return lambda o: FusedSteps(o, lambda p: Copied(), fused=fused)

@pytest.mark.parametrize('opt,kw', [(Adam, dict(lr=1e-2, wd=.1)), (SGD, dict(lr=1e-2, mom=.9, wd=.1))])
def test_new_kind_bit_for_bit(opt, kw):
    "A kind written as one subclass, which the engine has never seen, steps as fastai's loop bit for bit, twice-listed weights too."
    assert opt_diffs(stepped_opt(opt, **kw), stepped_opt(opt, _engine(), **kw)) == []
    assert opt_diffs(stepped_opt(opt, dup=True, **kw), stepped_opt(opt, _engine(), dup=True, **kw)) == []

def test_new_kind_holds_its_own_weights():
    "The kind's buffer is what is stepped; the model's weights are its copy, and a write into them is taken."
    m = torch.nn.Linear(4, 3)
    opt = Adam(list(m.parameters()), lr=1e-2)
    fs = FusedSteps(opt, lambda p: Copied())
    b = fs.buckets[0]
    assert b.own.buf is not None and b.own.buf.data_ptr() != b.w.data_ptr()
    for p in m.parameters(): p.grad = torch.ones_like(p)
    opt.step()
    assert torch.equal(b.own.slots[0], m.weight.data)
    with torch.no_grad(): m.weight.fill_(.5)
    opt.step()
    assert torch.equal(b.own.slots[0], m.weight.data) and fs.fp32_of(m.weight)().ne(.5).all()
    fs.undo()

@pytest.mark.compiled
def test_new_kind_compiled():
    "Compiled, the new kind steps as the engine's own in-place kind compiles, bit for bit: one arithmetic, another storage."
    if not compiles(): pytest.skip('torch.compile cannot build a kernel here (no C++ compiler)')
    ref = stepped_opt(Adam, lambda o: FusedSteps(o, fused='compile'), lr=1e-2, wd=.1)
    assert opt_diffs(ref, stepped_opt(Adam, _engine('compile'), lr=1e-2, wd=.1)) == []

def _stepped_linear(engine, n:int=4, opt_func=Adam) -> list:
    "A 64x64 linear layer (its weight past `MIN_LOWBIT`: in the store asked for) after `n` steps of `opt_func` under `engine`"
    torch.manual_seed(0)
    m = torch.nn.Linear(64, 64)
    opt = opt_func(list(m.parameters()), lr=1e-2, wd=.1, **({'mom': .9} if opt_func is SGD else {}))
    fs = engine(opt)
    for _ in range(n):
        m(torch.randn(8, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    fs.undo()
    return [p.detach().clone() for p in m.parameters()]

def test_new_store():
    "A store written as one subclass of `Store`, passed as `opt_state`, keeps the state as `DenseStore` does: the same steps, bit for bit."
    ref = _stepped_linear(lambda o: FusedSteps(o))
    stores = []
    def engine(o):
        fs = FusedSteps(o, opt_state=Cloned())
        stores.extend(type(b.store) for b in fs.buckets)
        return fs
    assert all(map(torch.equal, ref, _stepped_linear(engine))) and Cloned in stores  # the weight's state in it (the bias's: fp32)

class Unbuildable(Cloned):
    "A store whose kernel half fails to compile (a user's bug): its eager half is right"
    name = 'unbuildable'
    def kernel_load(self, t, k): raise RuntimeError('this store has no kernel')

@pytest.mark.compiled
def test_failed_kernel_stays_its_own(monkeypatch):
    """A store whose kernel fails to build steps eagerly, named in the reason; the engine's own stores still compile after it (the
    failure was once remembered by the kind alone: every store's kernels went eager for the rest of the process)"""
    from mpx import compiled
    from conftest import KernelRuns
    monkeypatch.setattr(compiled, '_failed', {})  # the planted store's failure: this case's own
    with KernelRuns() as runs: got = _stepped_linear(lambda o: FusedSteps(o, fused='compile', opt_state=Unbuildable))
    eager = _stepped_linear(lambda o: FusedSteps(o, opt_state=Unbuildable))
    # the weight in the store stepped eagerly, the bias (64 elements: fp32 state) compiled in the same engine: within its tolerance
    assert runs.n > 0 and all(torch.allclose(a, b, atol=1e-5) for a,b in zip(got, eager))
    assert list(compiled._failed.values()) == ["torch.compile failed for Kind with Unbuildable stepping weight_decay, average_grad, "
                                               "average_sqr_grad, step_stat, adam_step (Unsupported: Observed exception)"]
    with KernelRuns() as runs: _stepped_linear(lambda o: FusedSteps(o, fused='compile', opt_state='8bit'))
    assert runs.n > 0

def test_failed_kernel_without_a_message(monkeypatch):
    "A kernel that fails with no message steps eagerly all the same, the reason naming the exception's type (once an `IndexError`)"
    from mpx import compiled
    monkeypatch.setattr(compiled, '_failed', {})
    def fails(*args): raise RuntimeError()
    monkeypatch.setattr(compiled, '_kernel', fails)
    got = _stepped_linear(lambda o: FusedSteps(o, fused='compile'))
    assert all(map(torch.equal, got, _stepped_linear(lambda o: FusedSteps(o))))
    assert ("torch.compile failed for Kind with DenseStore stepping weight_decay, average_grad, average_sqr_grad, step_stat, "
            "adam_step (RuntimeError)") in compiled._failed.values()  # no `compiled` mark: no kernel is built, the case runs anywhere

class NoSecondMoment(Cloned):
    "A store whose kernel half fails on a second moment alone (a user's bug in one step chain): Adam's kernel fails, SGD's builds"
    name = 'no-second-moment'
    def kernel_load(self, t, k):
        if k == 'sqr_avg': raise RuntimeError('no kernel for a second moment')
        return super().kernel_load(t, k)

@pytest.mark.compiled
def test_failed_kernel_is_its_chains(monkeypatch):
    """A kernel that fails to build is remembered with its step chain, as kernels are cached: after Adam's failed over a store, SGD's
    over the same kind and store compiles (its kernel runs as many as over `DenseStore`), and the reason names the failed steps"""
    if not compiles(): pytest.skip('torch.compile cannot build a kernel here (no C++ compiler)')
    from mpx import compiled
    from conftest import KernelRuns
    monkeypatch.setattr(compiled, '_failed', {})
    _stepped_linear(lambda o: FusedSteps(o, fused='compile', opt_state=NoSecondMoment))
    (why,) = compiled._failed.values()
    assert 'with NoSecondMoment stepping weight_decay, average_grad, average_sqr_grad, step_stat, adam_step' in why
    with KernelRuns() as runs: _stepped_linear(lambda o: FusedSteps(o, fused='compile', opt_state=NoSecondMoment), opt_func=SGD)
    with KernelRuns() as dense: _stepped_linear(lambda o: FusedSteps(o, fused='compile'), opt_func=SGD)
    assert runs.n == dense.n > 0 and len(compiled._failed) == 1

class BitsState(Store):
    "A user's store, written outside mpx: bf16 state kept as its bits in int16 buffers (`BF16Store`'s values, another layout)"
    name,bits = 'bf16-bits',16
    def bytes(self, dtype) -> float: return 2.
    def new(self, b, k, dtype):
        b.state_bufs[k] = b.zeros(torch.int16)
        b.state_held[k] = [LowBitState(b, k, i) for i in range(len(b.params))]
    def put(self, b, k, i, v, at=None): flat_part(b.slot(b.state_bufs[k], i), at, v.numel()).copy_(_bits(v))
    def value(self, b, k, i): return b.slot(b.state_bufs[k], i).view(torch.bfloat16).float()
    def zero(self, b, k, a, c): b.part(b.state_bufs[k], a, c).zero_()
    def load_window(self, b, k, i, j, scratch=None): return scratch.copy_(b.part(b.state_bufs[k], i, j).view(torch.bfloat16))
    def store_window(self, b, k, i, j, x): b.part(b.state_bufs[k], i, j).copy_(_bits(x))
    def kernel_io(self, b, k, a, c): return {k: b.part(b.state_bufs[k], a, c)}
    def kernel_load(self, t, k): return t[k].view(torch.bfloat16).float()
    def kernel_store(self, t, k, x, keep): return {k: where_skipped(keep, t[k].view(torch.bfloat16), x).view(torch.int16)}

def _bits(x): return x.to(torch.bfloat16).view(torch.int16)

USER_MODES = {'amp': {}, 'master': dict(master=True), 'pure_kahan': dict(pure=True)}

class StoresSeen(Callback):
    "The stores of the engine's buckets, as a step leaves them"
    def after_step(self): self.seen = {type(b.store) for b in precision_cb(self.learn).fused_steps.buckets}

def _users_fit(mode:str, opt_state, fused) -> tuple:
    "A tiny Adam learner (a 4,096-weight layer: in the store) fitted in `mode` with `opt_state`: it, its weights, its stores in a step"
    model = lambda: nn.Sequential(nn.Linear(1, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    learn = tiny_learner(model=model, opt_func=Adam, lr=1e-2, n_trn=4).to_bf16(opt_state=opt_state, fused=fused, **USER_MODES[mode])
    fit_quiet(learn, 2, cbs=(seen := StoresSeen()))
    return learn,weights(learn),seen.seen

@pytest.mark.parametrize('fused', [True, pytest.param('compile', marks=pytest.mark.compiled)])
@pytest.mark.parametrize('mode', USER_MODES)
def test_users_store_by_name(mode, fused):
    """A store registered by name (`register_store`), no patch of mpx: `to_bf16(opt_state='bf16-bits')` fits with it in AMP,
    master and pure kahan, eagerly and compiled; the state dicts hold its handles, and the fit is `opt_state='bf16'`'s, bit for bit"""
    if fused == 'compile' and not compiles(): pytest.skip('torch.compile cannot build a kernel here (no C++ compiler)')
    register_store('bf16-bits', BitsState)
    try:
        learn,got,seen = _users_fit(mode, 'bf16-bits', fused)
        _,ref,_ = _users_fit(mode, 'bf16', fused)
        assert BitsState in seen  # the 4,096-weight layer's state (the smaller tensors': fp32)
        held = [v for s in learn.opt.state.values() for v in s.values() if isinstance(v, LowBitState)]  # kept between fits
        assert all(isinstance(h.b.store, BitsState) for h in held) and (len(held) == 2 or mode == 'master')
        if mode == 'amp': assert "opt_state='bf16-bits' (12 B/param with Adam)" in repr(precision_cb(learn))  # 8 + 2 states x 2
        assert all(map(torch.equal, got, ref))
    finally: _stores.pop('bf16-bits')

def test_users_store_refused_where_it_cannot_go():
    "An unregistered name and a class that is no store are refused before any state changes, naming what `opt_state` takes"
    learn = tiny_learner()
    with pytest.raises(ValueError, match=r"opt_state='half' is not allowed: opt_state must be one of 'fp32', 'bf16', '8bit', '4bit'"):
        learn.to_bf16(opt_state='half')
    with pytest.raises(TypeError, match="opt_state=<class 'int'> is a type"): learn.to_bf16(opt_state=int)
    with pytest.raises(TypeError, match='opt_state=8 is a int'): learn.to_bf16(opt_state=8)
    with pytest.raises(ValueError, match='needs the step engine'): learn.to_bf16(opt_state=BitsState(), fused=False)
    assert precision_cbs(learn) == []
    with pytest.raises(TypeError, match='is not a Store'):
        register_store('bad', dict)
        try: make_store('bad')
        finally: _stores.pop('bad')

def test_contracts_declared():
    "Every method the engine calls on a kind or a store is declared on the base, with a one-line docstring."
    for name in ('build', 'finish', 'value', 'assign', 'to_step', 'fold', 'written', 'step_writes', 'tick', 'rest', 'checked', 'stepped', 'carried',
                 'restore', 'take', 'merge', 'clear', 'publish', 'kernel_io', 'kernel_widen', 'kernel_fold'):
        assert callable(getattr(Kind, name)) and '\n' not in (getattr(Kind, name).__doc__ or 'x'), name
    for name in ('bytes', 'new', 'put', 'value', 'zero', 'load_window', 'store_window', 'window_writes', 'kernel_key', 'kernel_io',
                 'kernel_shape', 'kernel_load', 'kernel_store'):
        assert callable(getattr(Store, name)) and getattr(Store, name).__doc__, name
    assert issubclass(DenseStore, Store)
    with pytest.raises(NotImplementedError): Kind().take(None, True)

def test_step_phase():
    "The step phase is one state: a step while a backward's gradients are not yet taken is refused, naming the phase."
    from mpx.fused import StepPhase
    from mpx.master import MasterKind
    ps = [torch.nn.Parameter(torch.randn(4, 3))]
    fs = FusedSteps(SGD(ps, lr=.1), lambda p: MasterKind(torch.float16))
    ps[0].grad = torch.ones_like(ps[0])
    fs.before_backward()
    with pytest.raises(RuntimeError, match="came in step phase 'backward'"): fs.opt.step()
    fs.take()
    fs.before_backward()
    with pytest.raises(RuntimeError, match="came in step phase 'accumulating'"): fs.opt.step()
    fs.take()
    fs.opt.step()
    fs.end_step()
    assert fs.phase is StepPhase.READY and fs.grads_in_flight() == {}
    fs.undo()

class PiecesSeen(BitsState):
    "`BitsState`, noting the element ranges its windows were confined to (`b.clip`: a piece of one parameter)"
    def __init__(self): self.clips = set()
    def load_window(self, b, k, i, j, scratch=None):
        if b.clip is not None: self.clips.add(b.clip)
        return super().load_window(b, k, i, j, scratch)

def test_store_in_pieces():
    """A window can be a piece of one parameter: with a small `chunk` the engine hands the store a 64x64 weight's state in
    pieces (within `b.clipped`, which confines `b.part` to the piece), and a store that reads and writes through `b.part`
    steps as the whole parameter does, bit for bit"""
    store = PiecesSeen()
    got = _stepped_linear(lambda o: FusedSteps(o, opt_state=store, chunk=1024))
    whole = _stepped_linear(lambda o: FusedSteps(o, opt_state='bf16'))
    assert len(store.clips) >= 4 and all(map(torch.equal, got, whole)), store.clips

class TensorMax(BitsState):
    "`BitsState` keeping each parameter's largest magnitude of state in `b.store_meta[k]`: per-tensor metadata, written a piece at a time"
    def new(self, b, k, dtype):
        super().new(b, k, dtype)
        b.store_meta[k] = torch.zeros(len(b.params))
    def store_window(self, b, k, i, j, x):
        super().store_window(b, k, i, j, x)
        for p in range(i, j):
            piece = b.part(x, p, p+1, b.lo(i)).to(torch.bfloat16).float().abs().max()  # the values stored: rounded
            first = b.lo(p) == b.offs[p]  # the piece that begins the parameter begins its step's largest
            b.store_meta[k][p] = piece if first else torch.maximum(b.store_meta[k][p], piece)

@pytest.mark.parametrize('chunk', [1024, None])
def test_store_metadata_per_tensor(chunk):
    """A store's own numbers for a whole parameter (`b.store_meta`) stay right when the engine hands it the parameter in pieces:
    each piece begins on the store's block and they come in order, so a per-tensor largest magnitude is the largest over the pieces"""
    store,buckets = TensorMax(),[]
    def engine(o):
        fs = FusedSteps(o, opt_state=store, chunk=chunk)
        buckets.extend(b for b in fs.buckets if b.store is store)
        return fs
    got = _stepped_linear(engine)
    assert all(map(torch.equal, got, _stepped_linear(lambda o: FusedSteps(o, opt_state='bf16'))))
    (b,) = buckets
    for k in ('grad_avg', 'sqr_avg'):
        want = torch.stack([store.value(b, k, i).abs().max() for i in range(len(b.params))])
        assert torch.equal(b.store_meta[k], want) and want.gt(0).all(), (k, b.store_meta[k], want)
