"""Robustness 6 (issue 68): a store's edges. Its identity for compiled kernels (`Store.kernel_key`), its registration (mpx's
own names kept), a store with eager methods only under `fused='compile'`, and the pieces a checkpoint loads into it."""
import warnings
import pytest, torch
from fastai.basics import Adam, nn, Callback, CancelFitException
from mpx.all import *
from mpx.core import register_store, _stores
from mpx.lowbit import Store, QuantStore, make_store, where_skipped
from mpx.test_utils import tiny_learner, fit_quiet, weights, precision_cb, PoisonLoss
from conftest import compiles

def wide():
    "A 4,096-weight layer: its state goes into the store"
    return nn.Sequential(nn.Linear(1, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))

def fit(opt_state, fused=True, mode='amp', n_epoch=2):
    "Weights after `n_epoch` of a seeded learner with `opt_state`"
    learn = tiny_learner(lr=1e-2, model=wide, opt_func=Adam)
    learn.to_bf16(opt_state=opt_state, fused=fused, **({'pure': True} if mode == 'pure' else {}))
    fit_quiet(learn, n_epoch)
    return learn,weights(learn)

def test_own_names_cannot_be_replaced():
    "`register_store` refuses mpx's own names (every learner would hold another format under them), before anything changes."
    class Mine(QuantStore):
        def __init__(self): super().__init__(8)
    for name in ('fp32', 'bf16', '8bit', '4bit'):
        with pytest.raises(ValueError, match=f"'{name}' is mpx's own format"): register_store(name, Mine)
    assert type(make_store('8bit')) is QuantStore and make_store('8bit').bits == 8
    register_store('mine', Mine)  # a name of its own: taken, and again (a notebook's cell run twice)
    try:
        register_store('mine', Mine)
        assert type(make_store('mine')) is Mine
    finally: _stores.pop('mine')

class Doubled(QuantStore):
    "8-bit codes of twice each value (a store of another rule, with 8-bit's repr): its kernel must be its own"
    def __init__(self): super().__init__(8)
    def _enc(self, k, x): return super()._enc(k, x) * 2
    def _dec(self, k, x): return super()._dec(k, x / 2)

@pytest.mark.compiled
def test_kernels_keyed_by_the_store():
    "A subclass with its parent's repr, compiled after the parent in one process, runs its own kernel: its compiled fit is its eager one's."
    if not compiles(): pytest.skip('torch.compile cannot build a kernel here (no C++ compiler)')
    assert repr(Doubled()) == repr(QuantStore(8)) and Doubled().kernel_key() != QuantStore(8).kernel_key()
    fit('8bit', 'compile')  # the parent's kernel, made first
    _,compiled = fit(Doubled, 'compile')
    _,eager = fit(Doubled, True)
    _,parents = fit('8bit', True)
    err = lambda a, b: max(float((x - y).abs().max() / y.abs().max()) for x,y in zip(a, b))
    assert err(compiled, eager) < 1e-3 < err(compiled, parents) + 1, (err(compiled, eager), err(compiled, parents))

class EagerOnly(Store):
    "fp32 state in a buffer a key, stepped in a copy: the eager methods only"
    name,bits = 'eager-only',32
    def bytes(self, dtype) -> float: return 4.
    def new(self, b, k, dtype):
        b.state_bufs[k] = b.zeros(torch.float32)
        b.state_held[k] = b.views(b.state_bufs[k])
    def put(self, b, k, i, v, at=None): b.state_held[k][i].view(-1)[at or 0:(at or 0) + v.numel()].copy_(v.reshape(-1))
    def value(self, b, k, i): return b.state_held[k][i].clone()
    def zero(self, b, k, a, c): b.part(b.state_bufs[k], a, c).zero_()
    def load_window(self, b, k, i, j, scratch=None): return scratch.copy_(b.part(b.state_bufs[k], i, j))
    def store_window(self, b, k, i, j, x): b.part(b.state_bufs[k], i, j).copy_(x)

@pytest.mark.parametrize('mode', ['amp', 'pure'])
def test_eager_only_store_under_compile(mode):
    "A store with the eager methods only, under `fused='compile'`, steps eagerly and says why once (the other buckets compiled): the eager fit's weights, within the compiled step's tolerance."
    with warnings.catch_warnings(record=True) as ws:  # every warning kept: torch's of compiling the other buckets too
        warnings.simplefilter('always')
        learn,got = fit(EagerOnly, 'compile', mode)
    assert sum('EagerOnly has no kernel methods' in str(w.message) for w in ws) == 1
    _,ref = fit(EagerOnly, True, mode)
    assert max(float((a - b).abs().max() / b.abs().max()) for a,b in zip(got, ref)) < 1e-4

class Blocks96(EagerOnly):
    "`EagerOnly` whose state comes in blocks of 96 elements: a piece handed to `put` must begin on one (131,072 is no multiple)"
    name,block = 'blocks-96',96
    def put(self, b, k, i, v, at=None):
        if at is not None and at % self.block: raise ValueError(f"a piece at element {at}: not on a block of {self.block}")
        super().put(b, k, i, v, at)

def test_load_in_pieces_on_the_blocks(tmp_path):
    "A checkpoint loads a 160,000-element state into a store of 96-element blocks (its layout kept after a fit) a piece at a time, each piece on a block: the state exact."
    def learner():
        learn = tiny_learner(lr=1e-2, opt_func=Adam, path=tmp_path,
                             model=lambda: nn.Sequential(nn.Linear(1, 400), nn.ReLU(), nn.Linear(400, 400), nn.ReLU(), nn.Linear(400, 1)))
        return learn.to_bf16(opt_state=Blocks96)
    a = learner()
    fit_quiet(a, 1)
    a.save('ck', with_opt=True)
    saved = [{k: v.clone() for k,v in s.items() if isinstance(v, torch.Tensor)} for s in a.opt.state_dict()['state']]
    b = learner()
    fit_quiet(b, 1, lr=1e-3)  # its layout kept between fits: the load goes into the store
    b.load('ck', with_opt=True)
    loaded = [{k: v for k,v in s.items() if isinstance(v, torch.Tensor)} for s in b.opt.state_dict()['state']]
    assert [s.keys() for s in loaded] == [s.keys() for s in saved] and any(v.numel() == 160_000 for s in saved for v in s.values())
    assert all(torch.equal(s[k], t[k]) for s,t in zip(saved, loaded) for k in s)

class Stop(Callback):
    "Ends a fit before its first batch: the layout built (the state loaded into its stores), nothing stepped"
    order = 99
    def before_train(self): raise CancelFitException()

def _codes(learn) -> list:
    "The codes and block scales of each low-bit bucket of the learner's layout"
    fs = precision_cb(learn).fused_steps
    return [(b.state_bufs[k].clone(), b.store_meta[k].clone()) for b in fs.buckets if b.store.bits in (4, 8) for k in sorted(b.state_bufs)]

RESUMES = [(m, s, True) for m in ('amp', 'pure') for s in ('8bit', '4bit')] + [pytest.param('pure', '8bit', 'compile', marks=pytest.mark.compiled)]

@pytest.mark.parametrize('mode,opt_state,fused', RESUMES)
def test_lowbit_resume_is_exact(mode, opt_state, fused, tmp_path):
    "Low-bit state saved (as fp32 values) and loaded, into a kept layout or a fresh learner, gives back every code and block scale."
    if fused == 'compile' and not compiles(): pytest.skip('torch.compile cannot build a kernel here (no C++ compiler)')
    def learner():
        learn = tiny_learner(lr=1e-2, opt_func=Adam, path=tmp_path,
                             model=lambda: nn.Sequential(nn.Linear(1, 400), nn.ReLU(), nn.Linear(400, 400), nn.ReLU(), nn.Linear(400, 1)))
        return learn.to_bf16(opt_state=opt_state, fused=fused, **({'pure': True} if mode == 'pure' else {}))
    a = learner()
    fit_quiet(a, 2)
    a.save('ck', with_opt=True)
    ref = _codes(a)
    kept,fresh = learner(),learner()
    fit_quiet(kept, 1, lr=1e-3)  # a layout kept between fits: the load goes into its stores, a piece at a time
    kept.load('ck', with_opt=True)
    fresh.load('ck', with_opt=True)  # fp32 state in fastai's dicts, coded at the next fit's start
    fit_quiet(fresh, 1, cbs=Stop())
    for got in (_codes(kept), _codes(fresh)):
        assert len(got) == len(ref) == 2 and all(torch.equal(c, d) and torch.equal(s, t) for (c,s),(d,t) in zip(ref, got))

class NoWrites(EagerOnly):
    "`EagerOnly` with the kernel methods, and no `window_writes`: what a step writes, unsaid"
    def kernel_io(self, b, k, a, c): return {k: b.part(b.state_bufs[k], a, c)}
    def kernel_load(self, t, k): return t[k]
    def kernel_store(self, t, k, x, keep): return {k: where_skipped(keep, t[k], x)}

def test_failed_kernel_falls_back_unguarded(monkeypatch):
    "A compiled step whose kernel fails to build steps eagerly; over a store that does not say what a step writes it reads the verdict first and steps with no guard: the eager fit's weights, bit for bit."
    import mpx.compiled as compiled
    def fails(*args, **kwargs): raise RuntimeError('a kernel that does not build (planted)')
    monkeypatch.setattr(compiled, '_kernel', fails)
    monkeypatch.setattr(compiled, '_failed', {})  # what fails here is forgotten after
    learn = tiny_learner(lr=1e-2, model=wide, opt_func=Adam, cbs=PoisonLoss(at=[0, 3])).to_bf16(opt_state=NoWrites, fused='compile')
    precision_cb(learn).skip_on_device = True  # the verdict on the device, as a compiled step keeps it
    with warnings.catch_warnings(record=True) as ws:  # every warning kept: torch's of compiling the finite check too
        warnings.simplefilter('always')
        fit_quiet(learn, 1)
    assert any('planted' in str(w.message) for w in ws)
    ref = fit_quiet(tiny_learner(lr=1e-2, model=wide, opt_func=Adam, cbs=PoisonLoss(at=[0, 3])).to_bf16(opt_state=NoWrites), 1)
    assert all(map(torch.equal, weights(learn), weights(ref))) and precision_cb(learn).skipped_steps == 2

class FailsAt(QuantStore):
    "8-bit state whose `put` raises at the `armed`-th call from now (None: never)"
    name = 'fails-at'
    armed = None
    def put(self, b, k, i, v, at=None):
        if FailsAt.armed is not None:
            FailsAt.armed -= 1
            if FailsAt.armed == 0: raise RuntimeError('a put that fails part-way')
        super().put(b, k, i, v, at)

def _opt_state(learn) -> list:
    "Each parameter's optimizer state as fastai's `state_dict` gives it (fp32 values, step counts), and the hypers"
    sd = learn.opt.state_dict()
    return [{k: v.clone() if isinstance(v, torch.Tensor) else v for k,v in s.items()} for s in sd['state']],sd['hypers']

def _same_state(a, b) -> bool:
    (sa,ha),(sb,hb) = a,b
    same = lambda x,y: torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
    return ha == hb and len(sa) == len(sb) and all(s.keys() == t.keys() and all(same(s[k], t[k]) for k in s) for s,t in zip(sa, sb))

@pytest.mark.parametrize('fail_at', [1, 2, 3, 4])
def test_failed_put_loads_nothing(fail_at, tmp_path):
    "`learn.load` into a kept layout whose store's `put` raises at any call loads no optimizer state (fastai warns it could not): each state tensor, step count and hyper as before the load; the same load without the failure gives the checkpoint's."
    def learner():
        learn = tiny_learner(lr=1e-2, opt_func=Adam, path=tmp_path, model=lambda: nn.Sequential(
            nn.Linear(1, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)))
        return learn.to_bf16(opt_state=FailsAt)
    a = learner()
    fit_quiet(a, 2)
    a.save('ck', with_opt=True)
    saved = _opt_state(a)
    b = learner()
    fit_quiet(b, 1, lr=1e-3)  # its layout kept between fits: the load goes into the store, two weights of two keys each
    before = _opt_state(b)
    assert not _same_state(before, saved)
    FailsAt.armed = fail_at
    try:
        with pytest.warns(UserWarning, match='Could not load the optimizer state'): b.load('ck', with_opt=True)
        assert FailsAt.armed == 0, 'the put never failed'
    finally: FailsAt.armed = None
    assert _same_state(_opt_state(b), before), 'a failed load wrote part of the optimizer state'
    b.load('ck', with_opt=True)
    assert _same_state(_opt_state(b), saved)
