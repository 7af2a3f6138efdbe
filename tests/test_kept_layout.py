"""A layout kept between fits (pure bf16; low-bit state): the next fit takes it as it is and goes on bit for bit as a learner
that hands fastai's fp32 layout back after each fit; `save` and `load` stream it a tensor at a time, in fastai's fp32 layout;
`get_preds`, `validate`, `summary`, `lr_find`, `export` and `model.load_state_dict` work between fits; `to_fp32()` ends it."""
import tempfile, weakref
from pathlib import Path
import pytest, torch
from functools import partial
from fastai.basics import Adam, Callback, nn, set_seed, load_learner
import fastai.callback.hook, fastai.callback.schedule  # `Learner.summary`, `lr_find`
from mpx.all import *
from mpx.test_utils import tiny_learner, fit_quiet, ALL_MODES, precision_cb, state_of, state_diffs, weights
from mpx.lowbit import LowBitState

pytestmark = pytest.mark.filterwarnings("ignore:load_learner")

ARMS = [('pure_kahan', 'fp32', True), ('pure_stochastic', '8bit', True), ('pure_kahan', '4bit', True), ('amp_bf16', '8bit', True),
        pytest.param('pure_kahan', '8bit', 'compile', marks=pytest.mark.compiled)]

def model(): return nn.Sequential(nn.Linear(1, 96), nn.ReLU(), nn.Linear(96, 96), nn.BatchNorm1d(96), nn.Linear(96, 1))  # 96x96: low-bit

def learner(mode:str, opt_state:str, fused=True, kept:bool=True, path:Path|None=None, opt_func=Adam, n_trn:int=4):
    "A learner of `mode`; `kept=False`: the reference, handing fastai's fp32 layout back after each fit and building it again"
    kw = dict(fused=fused) if opt_state == 'fp32' else dict(fused=fused, opt_state=opt_state)
    learn = ALL_MODES[mode](tiny_learner(opt_func=opt_func, lr=1e-2, n_trn=n_trn, model=model), **kw)
    if not kept: precision_cb(learn).keeps_layout = False
    learn.path = path or Path(tempfile.mkdtemp())
    return learn

def fit_both(*ls, seed:int=1):
    for l in ls: set_seed(seed); fit_quiet(l)

def fitted_pair(mode:str, opt_state:str, fused, **kwargs) -> tuple:
    "A learner keeping its layout and its reference (`learner`'s `kwargs`), one fit each, saving to one temporary path"
    path = Path(tempfile.mkdtemp())
    a,b = learner(mode, opt_state, fused, path=path, **kwargs),learner(mode, opt_state, fused, kept=False, path=path, **kwargs)
    fit_both(a, b)
    return a,b,path

def assert_same(a, b, what:str):
    diffs = state_diffs(state_of(a), state_of(b))
    assert not diffs, f'{what}: {diffs[:3]}'

@pytest.mark.parametrize('mode,opt_state,fused', ARMS)
def test_next_fit_takes_the_layout_kept(mode, opt_state, fused):
    "Between fits the layout stays (bf16 weights, low-bit handles); the next fit takes it and matches a rebuilt layout bit for bit"
    a,b = learner(mode, opt_state, fused),learner(mode, opt_state, fused, kept=False)
    fit_both(a, b)
    ca = precision_cb(a)
    assert ca.layout_kept and not precision_cb(b).layout_kept and precision_cb(b).fused_steps is None
    eng = ca.fused_steps
    if mode.startswith('pure'): assert a.model[0].weight.dtype == torch.bfloat16 and b.model[0].weight.dtype == torch.float32
    lowbit = lambda l: any(isinstance(v, LowBitState) for s in l.opt.state.values() for v in s.values())
    assert lowbit(a) == (opt_state != 'fp32') and not lowbit(b)
    assert_same(a, b, 'between fits')
    fit_both(a, b, seed=2)
    assert ca.fused_steps is eng, 'the next fit built the layout kept again'
    assert_same(a, b, 'after the next fit')
    ref = weakref.ref(eng)
    del eng
    a.to_fp32()  # ends the layout kept: fastai's fp32 layout, the engine freed
    assert ref() is None and {p.dtype for p in a.model.parameters()} == {torch.float32} and not lowbit(a)

@pytest.mark.parametrize('mode,opt_state,fused', ARMS)
def test_save_and_load_stream_the_layout_kept(mode, opt_state, fused):
    "`save` between fits writes the checkpoint a rebuilt layout writes, without ending the layout; `load` into it resumes bit for bit"
    a,b,path = fitted_pair(mode, opt_state, fused)
    eng = precision_cb(a).fused_steps
    a.save('a'); b.save('b')
    assert precision_cb(a).fused_steps is eng and precision_cb(a).layout_kept, 'the save ended the layout kept'
    sa,sb = [torch.load(path/'models'/f'{n}.pth', weights_only=False) for n in 'ab']
    assert not state_diffs(dict(sa['model']), dict(sb['model'])) and not state_diffs(sa['opt']['state'], sb['opt']['state'])
    assert {v.dtype for v in sa['model'].values() if v.is_floating_point()} == {torch.float32} and sa['opt']['mpx'] == sb['opt']['mpx']
    plain = tiny_learner(opt_func=Adam, lr=1e-2, n_trn=4, model=model); plain.path = path
    plain.load('a')  # plain fastai loads it
    assert not state_diffs(weights(plain), weights(a))
    fit_both(a, b, seed=3)  # away from the checkpoint, then back
    a.load('a'); b.load('a')
    assert precision_cb(a).fused_steps is eng, 'the load ended the layout kept'
    assert_same(a, b, 'loaded')
    fit_both(a, b, seed=4)
    assert_same(a, b, 'resumed')

class SaveAndExportMidFit(Callback):
    "At the end of the fit's first epoch: a checkpoint and an export, as a checkpointing callback would write them"
    order = 90
    def after_epoch(self):
        if self.epoch != 0: return
        self.learn.save('mid')
        self.learn.export('mid.pkl')

@pytest.mark.parametrize('mode', ['pure_kahan', 'pure_stochastic', 'master_bf16', 'master_fp16'])
def test_export_writes_the_fp32_model(mode):
    "`export` between fits and mid-fit writes the fp32 model (what `save` writes at that moment), never the half one"
    opt_state = '8bit' if mode == 'pure_stochastic' else 'fp32'
    a = learner(mode, opt_state)
    fit_quiet(a, 2, cbs=SaveAndExportMidFit())
    mid = torch.load(a.path/'models/mid.pth', weights_only=False)['model']
    got = load_learner(a.path/'mid.pkl').model.state_dict()
    assert {v.dtype for v in got.values() if v.is_floating_point()} == {torch.float32}
    assert not state_diffs(dict(got), dict(mid)), 'the export mid-fit is not the fp32 model the checkpoint holds'
    want,eng = weights(a),precision_cb(a).fused_steps
    a.export('end.pkl')
    assert not state_diffs([p.detach() for p in load_learner(a.path/'end.pkl').model.parameters()], want)
    assert precision_cb(a).fused_steps is eng and not state_diffs(weights(a), want)  # a layout kept stays as it was

def test_export_makes_one_fp32_tensor_at_a_time():
    "`export` of a layout kept makes each fp32 value as it writes it and frees it before the next: never the whole fp32 model"
    a = learner('pure_kahan', '8bit')
    fit_quiet(a)
    cb,made,most = precision_cb(a),[],[0]
    fp32_of = cb._fp32_of
    def tracked(t):
        f = fp32_of(t)
        if f is None: return None
        def make():
            v = f()
            made.append(weakref.ref(v))
            most[0] = max(most[0], sum(r() is not None for r in made))
            return v
        return make
    cb._fp32_of = tracked
    try: a.export('streamed.pkl')
    finally: del cb._fp32_of
    assert len(made) >= 4 and most[0] == 1, (len(made), most[0])
    got = load_learner(a.path/'streamed.pkl').model
    assert not state_diffs([p.detach() for p in got.parameters()], weights(a)) and isinstance(got[0].weight, nn.Parameter)

@pytest.mark.parametrize('mode,opt_state', [('pure_kahan', '8bit'), ('amp_bf16', '4bit')])
def test_calls_between_fits(mode, opt_state):
    "`get_preds`, `validate`, `summary` keep the layout and give the rebuilt layout's results; `lr_find` and a fit go on bit for bit"
    a,b = learner(mode, opt_state),learner(mode, opt_state, kept=False)
    fit_both(a, b)
    eng = precision_cb(a).fused_steps
    pa,pb = a.get_preds()[0],b.get_preds()[0]
    assert torch.equal(pa, pb) and a.validate() == b.validate()
    for l in (a, b): assert 'Total params' in l.summary()  # both: it draws a batch from the training data
    assert precision_cb(a).fused_steps is eng
    for l in (a, b): set_seed(5); l.lr_find(num_it=4, show_plot=False)
    assert_same(a, b, 'after lr_find')
    fit_both(a, b, seed=6)
    assert_same(a, b, 'the fit after lr_find')

def test_trained_weights_changed_rebuilds():
    "Other weights trained (a freeze) or a new optimizer: the layout kept is ended and built again, as the reference builds it"
    a,b = learner('pure_kahan', '8bit'),learner('pure_kahan', '8bit', kept=False)
    fit_both(a, b)
    eng = precision_cb(a).fused_steps
    for l in (a, b): l.model[0].weight.requires_grad_(False)  # now kept aside in fp32, not compensated
    fit_both(a, b, seed=7)
    assert precision_cb(a).fused_steps is not eng
    assert_same(a, b, 'after a freeze')
    for l in (a, b): l.model[0].weight.requires_grad_(True); l.create_opt()
    fit_both(a, b, seed=8)
    assert_same(a, b, 'after unfreezing, with a new optimizer')

@pytest.mark.parametrize('update', ['kahan', 'stochastic'])
def test_model_load_state_dict_between_fits(update):
    "`learn.model.load_state_dict(fp32 weights)` between fits holds each value as a fit beginning from it does (its compensation too)"
    mode = f'pure_{update}'
    a,b = learner(mode, 'fp32'),learner(mode, 'fp32', kept=False)
    fit_both(a, b)
    sd = {k: v + 1e-3 * torch.randn_like(v) if v.is_floating_point() else v for k,v in b.model.state_dict().items()}  # fp32 values
    for l in (a, b): l.model.load_state_dict(sd)
    assert precision_cb(a).layout_kept  # `a` holds each value split (as a fit does), `b` the fp32 values, which its next fit splits
    fit_both(a, b, seed=9)
    assert_same(a, b, 'the fit after')

def test_torch_optimizer_load_into_the_layout_kept():
    "A torch optimizer's `load_state_dict` casts its state to its parameters' dtype: its load goes through fastai's, in fp32"
    from fastai.basics import OptimWrapper
    a,b,_ = fitted_pair('pure_kahan', 'fp32', True, opt_func=partial(OptimWrapper, opt=torch.optim.AdamW))
    a.save('t')
    for l in (a, b): l.load('t')
    assert {v.dtype for s in a.opt.opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()} == {torch.float32}
    fit_both(a, b, seed=10)
    assert_same(a, b, 'resumed with a torch optimizer')

@pytest.mark.parametrize('mode,opt_state,fused', ARMS[1:])  # the low-bit arms
def test_state_read_between_fits_is_fp32(mode, opt_state, fused):
    "Low-bit state read between fits (`opt.state[p][k]`) reads as the reference's fp32 tensors; the reads change nothing"
    a,b = learner(mode, opt_state, fused),learner(mode, opt_state, fused, kept=False)
    fit_both(a, b)
    before = state_of(a)
    for pa,pb in zip(a.model.parameters(), b.model.parameters()):
        for k,vb in b.opt.state[pb].items():
            va = a.opt.state[pa][k]
            if not torch.is_tensor(vb): continue
            assert va.dtype == torch.float32 and tuple(va.shape) == tuple(vb.shape)
            assert torch.equal(va * 1, vb) and torch.equal(va.clone(), vb) and torch.equal(torch.zeros_like(vb) + va, vb), k
            assert torch.equal(va.abs().max(), vb.abs().max()), k
    with pytest.raises(AttributeError, match='cannot `zero_` in place'):
        for s in a.opt.state.values():
            for v in s.values():
                if isinstance(v, LowBitState): v.zero_()
    assert not state_diffs(before, state_of(a)), 'a read changed the state'
    fit_both(a, b, seed=2)
    assert_same(a, b, 'after the next fit')

@pytest.mark.parametrize('mode,opt_state,fused', ARMS)
def test_opt_load_state_dict_keeps_no_fp32_copy(mode, opt_state, fused):
    "`opt.load_state_dict` of fastai's fp32 state into a kept layout (fastai's `TextLearner.load` calls it) puts each tensor into its store"
    a,b,path = fitted_pair(mode, opt_state, fused)
    a.save('a')
    fit_both(a, b, seed=3)  # away from the checkpoint, then back
    for l in (a, b): l.opt.load_state_dict(torch.load(path/'models/a.pth', weights_only=False)['opt'])
    sd = torch.load(path/'models/a.pth', weights_only=False)['opt']
    refs = [weakref.ref(v) for s in sd['state'] for v in s.values() if isinstance(v, torch.Tensor) and v.numel() >= 96 * 96]
    a.opt.load_state_dict(sd)
    del sd
    assert refs and [r for r in refs if r() is not None] == [], 'the loaded fp32 state is still held'
    assert precision_cb(a).layout_kept
    fit_both(a, b, seed=4)
    assert_same(a, b, 'resumed')
