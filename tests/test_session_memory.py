"""Memory over a session: nothing of a fit outlives it. No cyclic garbage after a fit (ownership runs one way), the fit's
flat buffers freed by reference counting the moment the fit ends, nothing growing over three fits, a dropped learner
giving its tensors back. Measured without `gc.collect()` (the collector is off in each test), as a user's process runs."""
import gc, sys, tempfile, weakref
from pathlib import Path
from contextlib import contextmanager
from functools import partial
import pytest, torch
from fastai.basics import Adam, Lookahead, OptimWrapper, Callback, nn
from mpx.all import *
from mpx.test_utils import tiny_learner, fit_quiet, ALL_MODES, precision_cb
from mpx.lowbit import LowBitState

pytestmark = pytest.mark.filterwarnings("ignore:fp16 is slow on this cpu")

FUSED = [True, False, pytest.param('compile', marks=pytest.mark.compiled)]
OPTS = {'adam': Adam, 'lookahead': lambda *a, **k: Lookahead(Adam(*a, **k)),
        'torch_adamw': partial(OptimWrapper, opt=torch.optim.AdamW)}

def learner(mode:str, fused, opt:str='adam', opt_state:str='fp32'):
    kw = dict(fused=fused) if opt_state == 'fp32' else dict(fused=fused, opt_state=opt_state)
    return ALL_MODES[mode](tiny_learner(opt_func=OPTS[opt], n_trn=2), **kw)

@contextmanager
def no_collector():
    "The cyclic collector off, as if it never got to run: what reference counting alone frees"
    gc.collect()
    gc.disable()
    try: yield
    finally: gc.enable()

def cyclic_garbage(free:bool=True) -> list:
    "The objects only the cyclic collector would free now; then freed (`free`), so that the next look sees only new ones"
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        res = list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    if free and res: gc.collect()
    return res

def ours(objs:list) -> list:
    "What of `objs` is mpx's, or a tensor"
    return [type(o).__name__ for o in objs if type(o).__module__.startswith('mpx') or type(o) in (torch.Tensor, torch.nn.Parameter)]

class Boom(Exception): "A bug in user code"

class RaiseMidFit(Callback):
    "Raise `Boom` after the second training batch"
    order = 20
    def after_batch(self):
        if self.training and self.iter == 1: raise Boom('a bug in a callback')

class GrabBuffers(Callback):
    "Weak references to the step engine's flat buffers and the engine itself, taken mid-fit"
    order = 20
    def __init__(self): self.refs = []
    def before_train(self):
        fs = precision_cb(self.learn).fused_steps
        if fs is None: return
        self.refs.append(('engine', weakref.ref(fs)))
        for b in fs.buckets:
            for k in ('w', 'g', 'x', 'gx', 'c'):
                t = getattr(b, k, None)
                if isinstance(t, torch.Tensor): self.refs.append((f'bucket.{k}', weakref.ref(t)))
            self.refs += [(f'state {k}', weakref.ref(t)) for k,t in b.state_bufs.items()]
    def alive(self) -> list: return [k for k,r in self.refs if r() is not None]

MODES = [m for m in ALL_MODES if m != 'master_fp16_dynamic']  # its fits are master_fp16's, with another scaler

def live_tensor_bytes() -> int:
    "Bytes of every storage a live Python tensor holds, each storage once (the collector's view: cycles not yet freed count)"
    seen = {}
    for o in gc.get_objects():
        if type(o) in (torch.Tensor, torch.nn.Parameter) and o.device.type == 'cpu':
            s = o.untyped_storage()
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())

def mlp(): return nn.Sequential(nn.Linear(1, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))  # 66k parameters

@pytest.mark.parametrize('fused', FUSED)
@pytest.mark.parametrize('mode', MODES)
def test_a_fit_leaves_nothing_behind(mode, fused):
    "Fits in a row: each fit's engine and buffers freed when it returns, no cycle left (an exception too), no bytes added"
    learn = ALL_MODES[mode](tiny_learner(opt_func=Adam, n_trn=2, model=mlp), fused=fused)
    if fused == 'compile': fit_quiet(learn)  # a first fit: the compiler's own one-time garbage (dynamo's tracing) is not the fit's
    with no_collector():
        grab,after = GrabBuffers(),[]
        for i in range(3):
            fit_quiet(learn, cbs=grab)
            if i != 1: after.append(live_tensor_bytes())  # after the first and the third
        if fused is not False: assert grab.refs, 'the fit had no step engine to check'
        if precision_cb(learn).layout_kept:  # the mode keeps its layout between fits: one engine, which each fit takes as it is
            assert len({id(r()) for k,r in grab.refs if k == 'engine'}) == 1, 'a fit built the layout kept again'
        else: assert grab.alive() == [], f'alive after the fits: {grab.alive()}'
        assert ours(cyclic_garbage()) == [], 'fits left reference cycles holding mpx objects or tensors'
        # the step log keeps each step's loss scale (a few bytes a step); one fp32 copy of the weights is 264 kB
        assert after[1] - after[0] < 1024, f'live tensor bytes after the first and the third fit: {after}'
        with pytest.raises(Boom): fit_quiet(learn, cbs=RaiseMidFit())
        assert ours(cyclic_garbage()) == [], 'a fit cut short left reference cycles holding mpx objects or tensors'
        if precision_cb(learn).layout_kept: learn.to_fp32()  # a fit that dies leaves a layout kept as it found it; this ends it
        assert grab.alive() == [], f'alive after the fits: {grab.alive()}'
        assert ours(cyclic_garbage(free=False)) == [], 'the layout ended left reference cycles holding mpx objects or tensors'

@pytest.mark.parametrize('opt', ['lookahead', 'torch_adamw'])
@pytest.mark.parametrize('mode', ['amp_bf16', 'master_fp16', 'pure_kahan', 'pure_stochastic'])
def test_other_optimizers_leave_nothing(mode, opt):
    "`Lookahead`'s sync and a torch optimizer's swapped step hold the engine as an argument, not an attribute: no cycle"
    learn,grab = learner(mode, True, opt),GrabBuffers()
    with no_collector():
        fit_quiet(learn, cbs=grab)
        assert ours(cyclic_garbage()) == []
        if precision_cb(learn).layout_kept: learn.to_fp32()  # the layout kept between fits (pure bf16), ended
        assert grab.refs and grab.alive() == []
        assert ours(cyclic_garbage()) == []

@pytest.mark.parametrize('fused', [True, pytest.param('compile', marks=pytest.mark.compiled)])
@pytest.mark.parametrize('opt_state', ['bf16', '8bit'])
def test_lowbit_state_leaves_nothing(opt_state, fused):
    "Low-bit state's handles point at their bucket weakly: a fit with 8-bit or bf16 state leaves no cycle, its buffers freed"
    learn,grab = ALL_MODES['pure_kahan'](tiny_learner(opt_func=Adam, n_trn=2, model=mlp), fused=fused, opt_state=opt_state),GrabBuffers()
    fit_quiet(learn)
    with no_collector():
        cyclic_garbage()
        fit_quiet(learn, cbs=grab)
        assert ours(cyclic_garbage()) == []
        learn.to_fp32()  # kept between fits until then
        assert any(k.startswith('state') for k,_ in grab.refs) and grab.alive() == []
        assert ours(cyclic_garbage()) == []

def test_live_tensor_bytes_sees_growth():
    "The growth measure can fail: a tensor kept alive in a cycle between two looks is counted"
    with no_collector():
        before = live_tensor_bytes()
        a,b = [torch.zeros(10_000)],[]
        a.append(b); b.append(a)  # a cycle holding 40 kB
        del a, b
        assert live_tensor_bytes() - before >= 40_000

@pytest.mark.parametrize('mode', MODES)
def test_dropped_learner_gives_tensors_back(mode):
    "`del learn` (and fastai's own learner-callback cycle collected) frees the model's weights and the optimizer state"
    learn = learner(mode, True)
    fit_quiet(learn)
    refs = [weakref.ref(p) for p in learn.model.parameters()]
    refs += [weakref.ref(v) for s in learn.opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    del learn
    gc.collect()
    assert [r for r in refs if r() is not None] == []

@pytest.mark.compiled
def test_dropped_compiled_learner_gives_tensors_back():
    "`del learn` of a compiled pure 8-bit learner frees every tensor it made: weights, engine buffers, state; the compiler keeps none"
    learn = learner('pure_kahan', 'compile', opt_state='8bit')
    fit_quiet(learn)
    fit_quiet(learn)  # the layout kept between fits, taken by the second
    refs = [weakref.ref(p) for p in learn.model.parameters()]
    eng = precision_cb(learn).fused_steps
    held = [o for b in eng.buckets for o in (b, b.own or b)]  # the buckets, and their kinds' own buffers (the compensations)
    refs += [weakref.ref(t) for o in held for t in vars(o).values() if isinstance(t, torch.Tensor)]
    del held
    assert len(refs) > 9
    del learn, eng
    gc.collect()
    assert [r for r in refs if r() is not None] == []

class CopyStateDicts(Callback):
    "At each epoch's end (after its last step), replace every state dict with a copy of itself: the same handles, in new dicts"
    order = 20
    def after_epoch(self):
        st = self.learn.opt.state
        for p in list(st): st[p] = dict(st[p])

@pytest.mark.parametrize('fused', [True, pytest.param('compile', marks=pytest.mark.compiled)])
@pytest.mark.parametrize('opt_state', ['bf16', '8bit', '4bit'])
def test_no_lowbit_handle_outlives_its_fit(opt_state, fused):
    "A state dict replaced after the fit's last step is handed back in fp32 too when the layout ends: no low-bit handle is left"
    def run(cbs):
        learn = ALL_MODES['pure_kahan'](tiny_learner(opt_func=Adam, n_trn=2, model=mlp), fused=fused, opt_state=opt_state)
        fit_quiet(learn, cbs=cbs)
        return learn
    learn,ref = run([CopyStateDicts()]),run([])
    learn.path = Path(tempfile.mkdtemp())
    learn.save('s', with_opt=True)  # between fits the dicts hold the kept state's handles: the save streams their fp32 values
    for l in (learn, ref): l.to_fp32()  # the layout kept ends: fastai's fp32 layout
    vals = [v for s in learn.opt.state.values() for v in s.values()]
    assert not [v for v in vals if isinstance(v, LowBitState)], 'low-bit handles left in opt.state after the layout ended'
    got,want = [[v for s in l.opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)] for l in (learn, ref)]
    assert len(got) == len(want) and all(torch.equal(a, b) for a,b in zip(got, want))
    learn.save('s', with_opt=True)  # it pickled a handle, and failed, where one was left

def _ptrs(learn) -> list:
    "Where each gradient and each state tensor of `learn` lies"
    st = [v.data_ptr() for s in learn.opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    ps = list(learn.model.parameters())
    assert all(p.grad is not None for p in ps)  # a fit leaves zeroed gradients, as fastai's loop does
    return [p.grad.data_ptr() for p in ps] + st

def _own_storages(learn) -> bool:
    "Whether each weight of `learn` holds a storage of its own (not a view into a flat buffer)"
    return all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in learn.model.parameters())

@pytest.mark.parametrize('fused', [True, pytest.param('compile', marks=pytest.mark.compiled)])
@pytest.mark.parametrize('mode', ['amp_bf16', 'amp_fp16', 'master_fp16', 'master_bf16'])
def test_next_fit_takes_the_buffers_as_they_are(mode, fused):
    """Where a fit hands back fp32 buffers (gradients or master gradients, state), the next fit steps in them: nothing
    copied, nothing moved (a master fit's set-up once held a second fp32 copy of the gradients). The weights are plain
    torch tensors between fits, each in a storage of its own: a module saved alone writes itself alone"""
    learn = ALL_MODES[mode](tiny_learner(opt_func=Adam, n_trn=2, model=mlp), fused=fused)
    fit_quiet(learn)
    before = _ptrs(learn)
    assert _own_storages(learn), 'a weight between fits is a view into a buffer of the fit'
    fit_quiet(learn)
    assert _ptrs(learn) == before
    assert _own_storages(learn)

def test_save_and_export_leave_no_cycle():
    "A streamed `save` and `export` of a kept layout leave nothing for the cyclic collector (no pickler closure holding storages)"
    learn = learner('pure_kahan', True, opt_state='8bit')
    learn.path = Path(tempfile.mkdtemp())
    fit_quiet(learn)
    cyclic_garbage()
    with no_collector():
        learn.save('s')
        learn.export('e.pkl')
        left = [type(o).__name__ for o in cyclic_garbage()]
    assert not [n for n in left if n in ('_Pending', 'LazyTensor', 'UntypedStorage', 'StreamPickler', 'Pickler')], left
