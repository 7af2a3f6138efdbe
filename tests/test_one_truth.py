"""One truth between fits: a layout kept (pure bf16, low-bit state) is the learner's state, and every path around it (a
submodule's load, a buffer no state dict holds, torch.save's keywords, Lookahead's slow weights, a failed load, an error
before the precision callback's `before_fit`) goes through it or leaves it whole; compiled and eager steps keep the same
values. Each case is compared with the same learner handing fastai's fp32 layout back after each fit (`keeps_layout=False`)."""
import gc, copy, pickle, tempfile
from pathlib import Path
from functools import partial
import pytest, torch
from torch.utils._python_dispatch import TorchDispatchMode
from fastai.basics import SGD, Adam, Callback, OptimWrapper, nn, set_seed, load_learner, ranger, Module
import fastai.callback.schedule  # `lr_find`
from mpx.all import *
import mpx.plumbing
from mpx.memory import _peak_bytes
from mpx.test_utils import tiny_learner, fit_quiet, ALL_MODES, precision_cb, state_of, state_diffs, weights, raised
from test_kept_layout import learner, fit_both, fitted_pair, assert_same, ARMS

pytestmark = pytest.mark.filterwarnings("ignore:load_learner")

# ---- compiled kernels keep the compensation over every store

def ramp(mode:str, opt_state:str, fused) -> torch.Tensor:
    "The fp32 value of a 96x96 weight (low-bit state) after 40 SGD steps each far below half its bf16 spacing"
    set_seed(0)
    learn = tiny_learner(opt_func=SGD, lr=1e-5, n_trn=40, model=lambda: nn.Sequential(nn.Linear(1, 96), nn.ReLU(),
                                                                                       nn.Linear(96, 96), nn.Linear(96, 1)))
    ALL_MODES[mode](learn, fused=fused, opt_state=opt_state)
    w0 = learn.model[2].weight.detach().float().clone()
    fit_quiet(learn)
    return precision_cb(learn).fp32_value(learn.model[2].weight).clone(),w0

STEPS_BELOW_SPACING = [('pure_kahan', s) for s in ('fp32', 'bf16', '8bit', '4bit')] + [
    ('pure_stochastic', '8bit'), ('master_bf16', '8bit'), ('amp_bf16', '4bit')]

@pytest.mark.compiled
@pytest.mark.parametrize('mode,opt_state', STEPS_BELOW_SPACING)
def test_compiled_keeps_what_eager_keeps(mode, opt_state):
    "40 steps below half a bf16 spacing move a weight's fp32 value compiled as eagerly (within 1e-7), over every store"
    (eager,w0),(comp,_) = ramp(mode, opt_state, True),ramp(mode, opt_state, 'compile')
    if mode != 'pure_stochastic':  # the steps moved it, and not to a bf16 number: the compensation (or master) holds them
        assert (eager - w0).abs().max() > 1e-6 and not torch.equal(eager, eager.bfloat16().float())
    assert (comp - eager).abs().max() <= 1e-7, f'compiled off eager by {(comp - eager).abs().max():.3g}'

# ---- loads of a submodule

SUBMODULES = {'the model': lambda m: m, 'a Linear': lambda m: m[2], 'a BatchNorm': lambda m: m[3],
              'a slice': lambda m: m[2:4]}

@pytest.mark.parametrize('mode,opt_state,fused', ARMS)
def test_every_module_loads_into_the_layout(mode, opt_state, fused):
    "`load_state_dict` of any submodule between fits holds each fp32 value as a fit beginning from it does"
    a,b,_ = fitted_pair(mode, opt_state, fused)
    eng = precision_cb(a).fused_steps
    for i,(what,sub) in enumerate(SUBMODULES.items()):
        torch.manual_seed(i)
        sd = {k: v + 1e-3 * torch.randn_like(v) if v.is_floating_point() else v
              for k,v in sub(b.model).state_dict().items()}  # fp32 values, none a bf16 number
        for l in (a, b): sub(l.model).load_state_dict(sd)
        fit_both(a, b, seed=i)  # `a` holds each value split as a fit does, `b` its fp32 value, which its fit splits
        assert_same(a, b, f'the fit after {what} loaded')
    assert precision_cb(a).fused_steps is eng

# ---- export: every buffer, persistent or not

class ScaledHead(Module):
    "A model with a buffer no state dict holds, not a bf16 number"
    def __init__(self):
        self.body,self.head = nn.Sequential(nn.Linear(1, 96), nn.ReLU(), nn.Linear(96, 96)),nn.Linear(96, 1)
        self.register_buffer('scale', torch.tensor([1.000244]), persistent=False)
    def forward(self, x): return self.head(self.body(x)) * self.scale

@pytest.mark.parametrize('mode,opt_state', [('pure_kahan', 'fp32'), ('pure_stochastic', '8bit')])
def test_export_writes_every_buffer_fp32(mode, opt_state):
    "`export` of a layout kept writes a non-persistent buffer as its fp32 value, on the CPU and on the learner's device"
    learn = ALL_MODES[mode](tiny_learner(opt_func=Adam, lr=1e-2, n_trn=4, model=ScaledHead), opt_state=opt_state)
    learn.path = Path(tempfile.mkdtemp())
    fit_quiet(learn)
    assert learn.model.scale.dtype == torch.bfloat16 and precision_cb(learn).layout_kept
    learn.export('e.pkl')
    for cpu in (True, False):
        got = load_learner(learn.path/'e.pkl', cpu=cpu).model.scale
        assert got.dtype == torch.float32 and got.item() == torch.tensor(1.000244).item(), (cpu, got)

# ---- save: torch.save's keywords

@pytest.mark.parametrize('kwargs', [dict(pickle_protocol=4), dict(pickle_module=pickle),
                                    dict(_use_new_zipfile_serialization=False)])
def test_save_takes_torch_save_keywords(kwargs):
    "`learn.save(name, **torch_save_kwargs)` of a layout kept writes what the reference writes, keeping the layout"
    a,b,path = fitted_pair('pure_kahan', '8bit', True)
    eng = precision_cb(a).fused_steps
    a.save('a', **kwargs)
    b.save('b', **kwargs)
    sa,sb = [torch.load(path/'models'/f'{n}.pth', weights_only=False) for n in 'ab']
    assert not state_diffs(dict(sa['model']), dict(sb['model'])) and not state_diffs(sa['opt']['state'], sb['opt']['state'])
    assert precision_cb(a).fused_steps is eng
    a.load('a')
    assert_same(a, b, 'loaded back')

# ---- Lookahead's slow weights through a streamed load

@pytest.mark.parametrize('opt_state', ['fp32', '8bit'])  # compiled, Lookahead steps eagerly (its sync is outside the kernel)
def test_ranger_after_a_streamed_load_and_lr_find(opt_state):
    "ranger's slow weights (fastcore `L`s) come back from a streamed `load` and `lr_find` as tensors: the next fits match"
    a,b,_ = fitted_pair('pure_kahan', opt_state, True, opt_func=ranger, n_trn=6)
    a.save('r')
    fit_both(a, b, seed=2)
    for l in (a, b): l.load('r')
    slow = a.opt.slow_weights
    assert slow is not None and all(isinstance(t, torch.Tensor) for pg in slow for t in pg)
    fit_both(a, b, seed=3)
    assert_same(a, b, 'the fit after a load')
    for l in (a, b): set_seed(4); l.lr_find(num_it=3, show_plot=False)
    fit_both(a, b, seed=5)
    assert_same(a, b, 'the fit after lr_find')
    a.to_fp32()

# ---- a streamed load leaves nothing for the cyclic collector

def test_streamed_load_leaves_no_cycle():
    "A streamed `load` (so every `lr_find`) frees its reader and records by reference counting alone"
    a,_,path = fitted_pair('pure_kahan', '8bit', True)
    a.save('c')
    gc.collect()
    gc.disable()
    try:
        a.load('c')
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        left = [type(o).__name__ for o in gc.garbage if type(o).__module__.startswith(('mpx', 'torch'))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not left, left

# ---- failures that leave the layout as it was

class RaiseBeforeFit(Callback):
    "Raise in `before_fit`, ahead of the precision callback"
    order = 5
    def before_fit(self): raise RuntimeError('a callback ordered before the precision callback failed')

@pytest.mark.parametrize('mode,opt_state,fused', ARMS)
def test_error_before_the_callback_keeps_the_layout(mode, opt_state, fused):
    "An exception in an earlier callback's `before_fit` leaves the layout kept as it was: no rebuild, the next fit as the reference's"
    a,b,_ = fitted_pair(mode, opt_state, fused)
    eng = precision_cb(a).fused_steps
    raised(lambda: fit_quiet(a, cbs=RaiseBeforeFit()), RuntimeError, 'ordered before')
    assert precision_cb(a).fused_steps is eng and precision_cb(a).layout_kept
    assert_same(a, b, 'after the failed fit')
    fit_both(a, b, seed=2)
    assert precision_cb(a).fused_steps is eng
    assert_same(a, b, 'the fit after')

def test_failed_loads_keep_the_layout():
    "A missing, truncated or mismatched checkpoint raises as fastai's load does, the layout kept whole (no fp32 copy made)"
    a,b,path = fitted_pair('pure_kahan', '8bit', True)
    eng = precision_cb(a).fused_steps
    a.save('good')
    data = (path/'models/good.pth').read_bytes()
    (path/'models/cut.pth').write_bytes(data[:len(data)//2])
    other = tiny_learner(opt_func=Adam, n_trn=4, model=lambda: nn.Sequential(nn.Linear(1, 8), nn.Linear(8, 1)))
    other.path = path
    other.save('other')
    made = []
    cb = precision_cb(a)
    cb._finish = lambda: made.append('the layout ended')  # the fp32 layout would be made here
    try:
        raised(lambda: a.load('missing'), FileNotFoundError)
        raised(lambda: a.load('cut'), RuntimeError)
        raised(lambda: a.load('other'), RuntimeError, 'Missing key(s) in state_dict')
    finally: del cb._finish
    assert not made and cb.fused_steps is eng and a.model[0].weight.dtype == torch.bfloat16
    assert_same(a, b, 'after the failed loads')
    a.load('good')
    b.load('good')
    assert_same(a, b, 'loaded')

# ---- a model cast by hand between fits

@pytest.mark.parametrize('mode,opt_state,fused', ARMS)
@pytest.mark.parametrize('cast', ['float'])
def test_a_cast_by_hand_is_taken_back(mode, opt_state, fused, cast):
    "`learn.model.float()` between fits loses nothing: each value and compensation is still held, the next fit as the reference's"
    a,b,_ = fitted_pair(mode, opt_state, fused)
    eng,before = precision_cb(a).fused_steps,state_of(a)
    getattr(a.model, cast)()
    if cast == 'float': assert not state_diffs(before, state_of(a)), 'the cast lost values'  # fp32 values, read as they are
    fit_both(a, b, seed=2)
    assert precision_cb(a).fused_steps is eng
    assert_same(a, b, f'the fit after model.{cast}()')

def test_a_buffer_cast_by_hand_is_taken_back():
    "A halved buffer cast back to fp32 by hand keeps its exact fp32 value: `export` writes it"
    learn = ALL_MODES['pure_kahan'](tiny_learner(opt_func=Adam, lr=1e-2, n_trn=4, model=ScaledHead))
    learn.path = Path(tempfile.mkdtemp())
    fit_quiet(learn)
    learn.model.float()
    assert precision_cb(learn).fp32_value(learn.model.scale).item() == torch.tensor(1.000244).item()
    fit_quiet(learn)
    assert learn.model.scale.dtype == torch.bfloat16
    learn.export('e.pkl')
    assert load_learner(learn.path/'e.pkl').model.scale.item() == torch.tensor(1.000244).item()

@pytest.mark.parametrize('mode,opt_state,fused', ARMS[:2] + ARMS[3:4])
def test_a_lossy_cast_by_hand_is_refused(mode, opt_state, fused):
    "`learn.model.half()` between fits, which rounds values, gets the mode's own message at the next fit; `to_fp32()` still works"
    a,_,_ = fitted_pair(mode, opt_state, fused)
    eng = precision_cb(a).fused_steps
    a.model.half()
    raised(lambda: fit_quiet(a), ValueError, 'by hand since (model.half()?)')
    raised(lambda: a.get_preds(), ValueError, 'by hand since (model.half()?)')
    assert precision_cb(a).fused_steps is eng
    a.to_fp32()
    assert {p.dtype for p in a.model.parameters()} == {torch.float32}
    fit_quiet(a)

# ---- torch optimizers' own load

@pytest.mark.parametrize('mode', ['pure_kahan', 'pure_stochastic'])
@pytest.mark.parametrize('topt', ['SGD', 'AdamW'])
def test_torch_optimizer_load_state_dict_keeps_fp32_state(topt, mode):
    "`learn.opt.load_state_dict` of a torch optimizer (fastai's `TextLearner.load` calls it) keeps its state fp32 on a bf16 layout"
    kw = dict(momentum=.9) if topt == 'SGD' else {}
    opt_func = partial(OptimWrapper, opt=partial(getattr(torch.optim, topt), **kw))
    a,b,_ = fitted_pair(mode, 'fp32', True, opt_func=opt_func)
    sd = copy.deepcopy(b.opt.state_dict())  # torch's own state dict holds the live tensors
    fit_both(a, b, seed=2)  # away from it, then back
    for l in (a, b): l.opt.load_state_dict(copy.deepcopy(sd))  # torch keeps the tensors it is given, where it can
    floats = {v.dtype for s in a.opt.opt.state.values() for v in s.values() if torch.is_tensor(v) and v.is_floating_point() and v.dim()}
    assert floats == {torch.float32}, floats
    fit_both(a, b, seed=3)
    assert_same(a, b, 'resumed')

# ---- copies and pickles

def copied(l, how:str):
    if how == 'deepcopy': return copy.deepcopy(l)
    return pickle.loads(pickle.dumps(l))

@pytest.mark.parametrize('mode,opt_state,fused', ARMS)
@pytest.mark.parametrize('how', ['deepcopy', 'pickle'])
def test_a_copied_learner_is_the_fp32_learner(mode, opt_state, fused, how):
    "`deepcopy`/`pickle` of a learner with a layout kept gives it in fastai's fp32 layout, every value exact: it fits on as the reference"
    a,b,_ = fitted_pair(mode, opt_state, fused)
    before = state_of(a)
    c = copied(a, how)
    assert precision_cb(c).fused_steps is None and {p.dtype for p in c.model.parameters()} == {torch.float32}
    assert not state_diffs(before, state_of(c)), 'the copy lost values'
    assert not state_diffs(before, state_of(a)), 'copying changed the original'
    fit_both(c, b, seed=2)
    assert_same(c, b, 'the copy after its fit')
    c.to_fp32()
    assert not state_diffs(state_of(c), state_of(b)), 'the copy to fp32'

@pytest.mark.parametrize('mode,opt_state,fused', ARMS)
def test_every_copy_of_the_model_is_fp32(mode, opt_state, fused):
    "`deepcopy`, `pickle` and `torch.save` of the model, of a parameter and of a buffer give fp32 values, exact; the layout stays"
    a,_,path = fitted_pair(mode, opt_state, fused)
    eng,want = precision_cb(a).fused_steps,weights(a)
    torch.save(a.model, path/'m.pth')
    copies = [copy.deepcopy(a.model), pickle.loads(pickle.dumps(a.model)), torch.load(path/'m.pth', weights_only=False)]
    for m in copies: assert not state_diffs([p.detach() for p in m.parameters()], want)
    w = a.model[2].weight
    for got in (copy.deepcopy(w), pickle.loads(pickle.dumps(w))):
        assert isinstance(got, nn.Parameter) and torch.equal(got.detach(), precision_cb(a).fp32_value(w))
    assert precision_cb(a).fused_steps is eng and a.model[2].weight is w

@pytest.mark.parametrize('opt_state', ['8bit', '4bit', 'bf16'])
def test_low_bit_state_copies_and_pickles_as_fp32(opt_state):
    "`deepcopy(opt.state[p])` is a snapshot of fp32 values (not handles that follow the next fit); pickle and torch.save write fp32"
    a,b,path = fitted_pair('pure_kahan', opt_state, True)
    w = a.model[2].weight
    want = {k: (v.float() if hasattr(v, 'float') else v) for k,v in a.opt.state[w].items()}
    snap = copy.deepcopy(a.opt.state[w])
    torch.save(a.opt.state[w], path/'s.pth')
    loaded = [pickle.loads(pickle.dumps(a.opt.state[w])), torch.load(path/'s.pth', weights_only=True)]
    fit_quiet(a)  # the live state moves on
    for got in [snap, *loaded]:
        for k,v in want.items():
            assert type(got[k]) is type(v) and (not torch.is_tensor(v) or torch.equal(got[k], v)), k

# ---- a set-up that fails part way

class FailAt(TorchDispatchMode):
    "Count the ops dispatched inside; raise `KeyboardInterrupt` (Ctrl-C, an out-of-memory error) at op number `at`"
    def __init__(self, at:int|None=None): super().__init__(); self.at,self.n = at,0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        if self.n == self.at: raise KeyboardInterrupt(f'injected at op {self.n}: {func}')
        return func(*args, **(kwargs or {}))

def set_up_under(learn, mode:FailAt):
    "The precision callback's next set-up (`_begin_fit`) runs under `mode`"
    cb = precision_cb(learn)
    begin = type(cb)._begin_fit
    def run():
        with mode: begin(cb)
    cb._begin_fit = run
    return cb

SET_UP = [('master_bf16', 'fp32'), ('master_fp16', 'fp32'), ('pure_kahan', 'fp32'), ('pure_stochastic', '8bit'),
          ('pure_kahan', '4bit')]

@pytest.mark.parametrize('rebuild', [False, True], ids=['first fit', 'a rebuild'])
@pytest.mark.parametrize('mode,opt_state', SET_UP)
def test_a_set_up_that_fails_anywhere_loses_nothing(mode, opt_state, rebuild, one_thread):
    "An exception at any op of the set-up (each in turn) leaves every weight and state value as it was, fp32; the next fit works"
    def prepared():
        l = learner(mode, opt_state)
        if rebuild: fit_quiet(l)
        l.create_opt()  # the fit's (rebuild: another optimizer, so the layout kept is ended and built again)
        return l
    counter = FailAt()
    l = prepared()
    set_up_under(l, counter)
    fit_quiet(l)
    assert counter.n > 20, counter.n
    for at in range(1, counter.n + 1):
        l = prepared()
        before = state_of(l)
        cb = set_up_under(l, FailAt(at))
        with pytest.raises(KeyboardInterrupt): fit_quiet(l)
        del cb._begin_fit
        assert cb.fused_steps is None and cb.fit_state is None, at
        assert {p.dtype for p in l.model.parameters()} == {torch.float32}, at
        assert not state_diffs(before, state_of(l)), f'op {at} of {counter.n}: {state_diffs(before, state_of(l))[:2]}'
    fit_quiet(l)  # the next fit sets up whole

# ---- loads that stream on every model

@pytest.mark.parametrize('mode,opt_state,fused', ARMS)
def test_a_load_in_pieces_is_the_whole_load(mode, opt_state, fused, monkeypatch):
    "A streamed `load` a piece at a time (512 elements) into weights, compensations and low-bit state gives the reference's state"
    monkeypatch.setattr(mpx.plumbing, 'LOAD_PIECE', 512)
    a,b,path = fitted_pair(mode, opt_state, fused)
    a.save('a')
    fit_both(a, b, seed=2)  # away from the checkpoint, then back
    for l in (a, b): l.load('a')
    assert_same(a, b, 'loaded in pieces')
    fit_both(a, b, seed=3)
    assert_same(a, b, 'resumed')

def test_load_streams_after_fit_one_cycle():
    "After `fit_one_cycle` (NumPy numbers in the hypers) the load streams: the layout kept stays, no fp32 copy of it is made"
    a,b,path = fitted_pair('pure_kahan', '8bit', True)
    for l in (a, b): set_seed(2); fit_quiet(l, method='fit_one_cycle')
    a.save('c')
    cb = precision_cb(a)
    eng = cb.fused_steps
    a.load('c')
    assert cb.fused_steps is eng and cb.layout_kept, 'the load fell back to fastai\'s, through the fp32 layout'

    b.load('c')
    assert_same(a, b, 'loaded')

class TiedLM(Module):
    "A transformer layer between an embedding and an output layer tied to it (GPT-2's tying), and a non-persistent buffer"
    def __init__(self, vocab:int=16384, d:int=32):
        self.emb,self.head = nn.Embedding(vocab, d),nn.Linear(d, vocab, bias=False)
        self.body = nn.TransformerEncoderLayer(d, 2, 64, dropout=0., batch_first=True)
        self.head.weight = self.emb.weight
        self.register_buffer('scale', torch.tensor(1.000244), persistent=False)
    def forward(self, x):
        ids = (x.abs() * 500).long().clamp(max=self.emb.num_embeddings - 1).view(-1, 1)  # a token a sample
        return self.head(self.body(self.emb(ids))).mean((1, 2))[:, None] * self.scale

def wide_mlp(): return nn.Sequential(nn.Linear(1, 512), nn.ReLU(), nn.Linear(512, 1024), nn.Linear(1024, 1))

@pytest.mark.parametrize('model', [wide_mlp, TiedLM], ids=['mlp', 'tied transformer'])
@pytest.mark.parametrize('opt_state', ['fp32', '8bit'])
def test_a_load_peaks_below_the_fit(model, opt_state):
    "A streamed `load` (model and optimizer) allocates at its peak no more than a fit does, on models of 0.5M parameters"
    learn = ALL_MODES['pure_kahan'](tiny_learner(opt_func=Adam, n_trn=2, model=model), opt_state=opt_state)
    learn.path = Path(tempfile.mkdtemp())
    fit_quiet(learn)
    learn.save('x')
    fit,load = _peak_bytes(lambda: fit_quiet(learn), 'cpu'),_peak_bytes(lambda: learn.load('x'), 'cpu')
    n = sum(p.numel() for p in learn.model.parameters())
    assert load <= fit, f'the load peaks at +{load / n:.2f} B/param, the fit at +{fit / n:.2f}'
