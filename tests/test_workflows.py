"""Workflow matrix: sequences of fastai calls x master modes x optimizers x clients leave what fp32 leaves: the same structure, weights
and optimizer state within a stated tolerance of fp32's, and every save/load, export and precision switch on the way changes nothing."""
import functools
from contextlib import nullcontext
import pytest, torch
from torch import Tensor
from fastai.basics import Callback, OptimWrapper, Lookahead, load_learner
from fastai.callback.core import CancelFitException, CancelEpochException, CancelBatchException
from fastai.callback.tracker import SaveModelCallback
from fastai.callback.training import GradientAccumulation
import fastai.callback.schedule  # lr_find, fit_one_cycle, fine_tune
from mpx.all import *
from mpx.test_utils import (tiny_learner, tiny_split, tabular_app_learner, collab_app_learner, text_app_learner, tied_learner, sparse_learner,
                            gan_learner, MASTER_MODES, ALL_MODES, OPTIMIZERS, learner_problems, state_of, assert_same_state, rel_err,
                            ramp_learner, StepLrs, check_step_lrs, step_lr_tol)
from planted import masters_rounded_on_save, lr_scaled, lr_frozen

pytestmark = pytest.mark.filterwarnings('ignore::UserWarning')  # load_learner's pickle warning, fastai's freeze warnings
SEQ_MODES = {**MASTER_MODES, 'pure_kahan': ALL_MODES['pure_kahan'], 'pure_stochastic': ALL_MODES['pure_stochastic']}

def tiny(opt='adam'):
    "`tiny_learner` with BatchNorm, two parameter groups, weight decay and 4 training batches of 16"
    return tiny_learner(bn=True, splitter=tiny_split, opt_func=OPTIMIZERS[opt], lr=1e-2, wd=1e-2, n_trn=4, n_val=1)
CLIENTS = dict(tiny=tiny, tabular=lambda opt='adam': tabular_app_learner(opt_func=OPTIMIZERS[opt], lr=1e-2),
               collab=lambda opt='adam': collab_app_learner(opt_func=OPTIMIZERS[opt], lr=1e-2),
               text=lambda opt='adam': text_app_learner(opt_func=OPTIMIZERS[opt], lr=1e-2),
               tied=lambda opt='adam': tied_learner(across=True, opt_func=OPTIMIZERS[opt], lr=1e-2, n_trn=4, n_val=1),  # a weight in two groups
               sparse=lambda opt='adam': sparse_learner(),  # an nn.Embedding(sparse=True), fastai's SGD with momentum
               gan=lambda opt='adam': gan_learner(wgan=False))  # fastai's GANLearner; a clipping WGAN is refused in master modes

# ---- what a learner between fits must show, and what fp32 decides

def _entry(k, v):
    "An optimizer-state value as fp32 training would leave it: step counts exactly, tensors by shape and dtype"
    if k == 'step' or isinstance(v, (bool, int, str)): return float(v) if isinstance(v, Tensor) else v
    if isinstance(v, float) or (isinstance(v, Tensor) and v.dim() == 0): return 'scalar'
    return ('tensor', tuple(v.shape), v.dtype) if isinstance(v, Tensor) else type(v).__name__

def _opt_state(opt) -> dict: return opt.opt.state if isinstance(opt, OptimWrapper) else opt.state

def summary(learn) -> dict:
    "What fp32 decides after a sequence: trainable set, hyper-parameters, and per parameter its optimizer-state keys, flags and step counts"
    ps,opt = list(learn.model.parameters()),learn.opt
    res = dict(requires_grad=[p.requires_grad for p in ps], n_groups=len(opt.param_lists), hypers=[dict(h) for h in opt.hypers],
               flags=[{k: v for k,v in opt.state.get(p, {}).items() if k in ('do_wd', 'force_train')} for p in ps],
               # a frozen parameter's state only where it trains: fp32 fastai keeps stepping a parameter frozen again after `unfreeze`
               # (its zeroed gradient is not None), a master is built without a gradient
               state=[{k: _entry(k, v) for k,v in opt.state.get(p, {}).items()} for p in ps if p.requires_grad])
    if isinstance(opt, OptimWrapper): res['torch_state'] = [{k: _entry(k, v) for k,v in opt.opt.state.get(p, {}).items()} for p in ps if p.requires_grad]
    if isinstance(opt, Lookahead): res['lookahead_count'] = opt.count
    return res

def values(learn) -> dict:
    """The numbers fp32 decides, loosely: `params` (the parameters), `weights` (the parameters and float buffers), and per optimizer-state
    key the trained parameters'"""
    ps,bs = learn.model.parameters(),learn.model.buffers()
    res = dict(params=[p.detach().float().clone() for p in ps])
    res['weights'] = res['params'] + [b.float().clone() for b in bs if b.is_floating_point()]
    st = _opt_state(learn.opt) if learn.opt is not None else {}
    for p in learn.model.parameters():
        for k,v in st.get(p, {}).items():
            if p.requires_grad and isinstance(v, Tensor) and v.dim(): res.setdefault(k, []).append(v.detach().float().to_dense().clone())
    return res

# How far from fp32 a mode may end: its weights' `rel_err` (1: no training at all), and for each optimizer-state key the median over the
# parameters of each tensor's relative error (1: the state lost). Half precision's rounding grows through Adam, which steps a parameter
# with a near-zero gradient (the bias before a BatchNorm, AWD_LSTM's on these random sentences) by its rounding noise: the largest seen
# over the matrices are weights .12 (fp16), .17 (bf16, pure) and state .23 (fp16, pure), .65 (bf16: the text application).
TOLERANCE = dict(fp16=(.25, .5), bf16=(.35, .9), pure_kahan=(.35, .5), pure_stochastic=(.35, .5))
def tolerance(mode:str) -> tuple: return TOLERANCE[mode if mode.startswith('pure') else mode[:4]]
# The weights above are mostly BatchNorm's running statistics on the tiny model, which a schedule frozen at the fit's first lr hardly
# moves (.10 from fp32): the parameters alone are measured apart. The largest seen over these matrices is .62 (bf16, QHAdam through
# `lrfind_onecycle`; fp16 .60), the frozen schedule .92; a 5% error in the lr is within them (`test_step_lr_is_the_schedules` sees it).
PARAMS_TOLERANCE = .75

def far_from_fp32(got:dict, ref:dict, start:list, mode:str) -> list:
    "Where the `values` a mode left are further from fp32's than `tolerance(mode)` allows (`start`: the weights before the sequence)"
    tw,ts = tolerance(mode)
    e = rel_err(got['weights'], ref['weights'], start)
    res = [f'weights {e:.3g} from fp32 (relative to its change), more than {tw}'] if e > tw else []
    n = len(ref['params'])
    if (e := rel_err(got['params'], ref['params'], start[:n])) > PARAMS_TOLERANCE:
        res.append(f'parameters {e:.3g} from fp32 (relative to their change), more than {PARAMS_TOLERANCE}')
    for k in ref:
        if k in ('weights', 'params'): continue
        if len(got.get(k, [])) != len(ref[k]): res.append(f'{k}: {len(got.get(k, []))} tensors, fp32 {len(ref[k])}'); continue
        errs = sorted(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a,b in zip(got[k], ref[k]))
        if errs[len(errs)//2] > ts: res.append(f'{k}: median relative error {errs[len(errs)//2]:.3g} from fp32, more than {ts}')
    return res

def _diff(got, ref) -> str:
    "The first entry where two `summary` values differ"
    if isinstance(got, list) and isinstance(ref, list) and len(got) == len(ref):
        i = next(i for i,(a,b) in enumerate(zip(got, ref)) if a != b)
        return f'[{i}] {got[i]} vs fp32 {ref[i]}'
    return f'{got} vs fp32 {ref}'

def _model_of(s:dict) -> dict: return {k: s[k] for k in ('weights', 'buffers', 'requires_grad')}

class FitCheck(Callback):
    "Last of all `after_fit`s: record the `learner_problems` every fit leaves"
    order = 100
    def __init__(self): self.found = []
    def after_fit(self):
        if any(getattr(c, '_outer', None) is not None for c in self.learn.cbs): return  # a nested validate: its fit goes on
        self.found += [f'after_fit at step {self.learn.train_iter}: {p}' for p in learner_problems(self.learn)]

# ---- the sequences: each takes a learner and the mode (None: fp32) and returns the learner to check. Where a sequence saves, loads,
# exports or switches precision, it checks on the way, in fp32 too, that the step changed nothing (or gave back exactly what was saved)

def _lr_find(learn):
    """`lr_find`, which saves the learner and loads it back: the model after it is the one before, bit for bit; in pure bf16, which keeps no
    fp32 copy, as its first fit rounds it to its storage (within bf16's rounding)"""
    before = _model_of(state_of(learn))
    learn.lr_find(num_it=10, show_plot=False, suggest_funcs=None)
    after = _model_of(state_of(learn))
    if not isinstance(getattr(learn, 'mixed_precision', None), PureBF16):
        return assert_same_state(before, after, 'the model after lr_find (which saves and reloads it)')
    assert before['requires_grad'] == after['requires_grad']
    for a,b in zip(after['weights'] + after['buffers'], before['weights'] + before['buffers']):
        assert ((a - b).abs() <= b.abs() * 2**-8).all(), f'lr_find moved a weight by {(a - b).abs().max():.3g}, more than bf16 rounds it'

def lrfind_onecycle(learn, mode): _lr_find(learn); learn.fit_one_cycle(1, 1e-2); return learn
def lrfind_finetune(learn, mode): _lr_find(learn); learn.fine_tune(1, freeze_epochs=1); return learn
def fit_fit(learn, mode): learn.fit(1); learn.fit(1); return learn
def create_opt(learn, mode): learn.fit(1); learn.create_opt(); learn.fit(1); return learn
def reset_opt(learn, mode): learn.fit(1); learn.fit(1, reset_opt=True); return learn
def validate_first(learn, mode): learn.validate(); learn.get_preds(); learn.fit(1); learn.validate(); return learn

class _UnfreezeAt(Callback):
    "Gradual unfreezing from a callback: `unfreeze()` at the start of epoch 1"
    order = 5
    def before_epoch(self):
        if self.epoch == 1: self.learn.unfreeze()
def unfreeze_cb(learn, mode): learn.freeze(); learn.fit(2, cbs=_UnfreezeAt()); learn.fit(1); return learn

class _ValidateEachEpoch(Callback):
    "Calls `validate()` from `after_epoch`: a nested fastai call inside the fit"
    order = 11
    def after_epoch(self):
        if not getattr(self, 'busy', False): self.busy = True; self.learn.validate(); self.busy = False
def nested_validate(learn, mode): learn.fit(2, cbs=_ValidateEachEpoch()); learn.fit(1); return learn

def _saved(learn, file, with_opt=True):
    "`learn.save`, asserting it changed nothing (mid-fit too: the masters, the half weights, the optimizer's state)"
    before = state_of(learn)
    learn.save(file, with_opt=with_opt)
    assert_same_state(before, state_of(learn), f'the learner after save({file!r})')

def _loads_back(learn, file, with_opt=True):
    "`learn.load` of what the learner holds: it must change nothing, bit for bit (masters rounded on the way show here)"
    before = state_of(learn)
    learn.load(file, with_opt=with_opt)
    assert_same_state(before, state_of(learn), f'the learner after load({file!r}) of what it held')

class _AccumulateAndSave(Callback):
    "Saves the learner after every batch, inside `GradientAccumulation`'s windows too"
    order = 11
    def after_batch(self): _saved(self.learn, 'acc')
def accumulate_save(learn, mode):
    learn.fit(2, cbs=[GradientAccumulation(48), _AccumulateAndSave()])
    _loads_back(learn, 'acc')  # the last save: after the last batch
    return learn

def _save_load(learn, with_opt):
    learn.fit(1); learn.freeze()
    _saved(learn, 'ck', with_opt); _loads_back(learn, 'ck', with_opt)
    learn.unfreeze(); learn.fit(1)
    return learn
def save_load_opt(learn, mode): return _save_load(learn, True)
def save_load_noopt(learn, mode): return _save_load(learn, False)

def freeze_discrim(learn, mode):
    learn.freeze(); learn.fit(1, slice(1e-3, 1e-2))
    learn.unfreeze(); learn.fit(1, slice(1e-3, 1e-2))
    learn.freeze_to(-1); learn.fit(1, slice(1e-3, 1e-2))
    return learn

def save_model_cb(learn, mode):
    learn.fit(2, cbs=SaveModelCallback(every_epoch=True, with_opt=True))
    _loads_back(learn, 'model_1')  # saved mid-fit, at the end of the last epoch
    learn.fit(1)
    return learn

def _exported(learn, cpu):
    "Fit, export (the exporter's state unchanged), `load_learner`: the loaded model is the exporter's, bit for bit"
    learn.fit(1)
    before = state_of(learn)
    learn.export('ex.pkl')
    assert_same_state(before, state_of(learn), 'the learner after export')
    new = load_learner(learn.path/'ex.pkl', cpu=cpu)
    assert_same_state(_model_of(before), _model_of(state_of(new)), 'the model load_learner loads')
    return new

def export_cpu(learn, mode):
    "Export, `load_learner(cpu=True)` predicts in fp32 with no precision callback; the exporting learner trains on"
    new = _exported(learn, cpu=True)
    assert not [c for c in new.cbs if isinstance(c, (MixedPrecision, MasterPrecision))], 'load_learner(cpu=True) kept a precision callback'
    dtypes = set()
    hooks = [m.register_forward_hook(lambda m,i,o: dtypes.update({o.dtype} if isinstance(o, Tensor) else set())) for m in new.model.modules()]
    try: preds,_ = new.get_preds(dl=learn.dls.valid)
    finally:
        for h in hooks: h.remove()
    assert preds.dtype == torch.float32 and dtypes <= {torch.float32, torch.int64, torch.bool}, f'load_learner(cpu=True) predicts in {dtypes}'
    learn.fit(1)
    return learn

def export_nocpu(learn, mode):
    "`load_learner(cpu=False)` keeps the mode and trains on the exporter's data"
    new = _exported(learn, cpu=False)
    new.dls = learn.dls; new.add_cb(FitCheck())
    new.fit(1)
    return new

def switch(learn, mode):
    "The mode, fp16 masters, bf16 autocast, fp32, the mode again, a fit after each (fp32 all along for the reference); no value changes"
    for f in [mode, MASTER_MODES['fp16'], lambda l: l.to_bf16(), lambda l: l.to_fp32(), mode]:
        before = state_of(learn)
        if mode is not None: f(learn)
        assert_same_state(before, state_of(learn), 'the learner after a precision switch')
        learn.fit(1)
    return learn

SEQUENCES = {f.__name__: f for f in [lrfind_onecycle, lrfind_finetune, fit_fit, save_load_opt, save_load_noopt, freeze_discrim, save_model_cb,
                                      export_cpu, export_nocpu, create_opt, reset_opt, switch, validate_first, nested_validate, accumulate_save,
                                      unfreeze_cb]}

def run(client, seq, mode, opt, path):
    "Run `seq` on a fresh `client` learner with `opt` in `mode` (a `SEQ_MODES` key; None: fp32): problems, `summary`, `values`, start"
    learn = CLIENTS[client](opt)
    start = values(learn)['weights']
    learn.path = path; learn.add_cb(FitCheck())
    if mode is not None: SEQ_MODES[mode](learn)
    learn = SEQUENCES[seq](learn, None if mode is None else SEQ_MODES[mode])
    return learn.fit_check.found + learner_problems(learn),summary(learn),values(learn),start

@functools.cache
def reference(client, seq, opt, path):
    "`run` in fp32, once per client, sequence and optimizer: its `summary` and `values`"
    path.mkdir(parents=True, exist_ok=True)
    found,ref,vals,_ = run(client, seq, None, opt, path)
    assert found == [], f'the fp32 reference itself shows {found}'
    return ref,vals

def check_like_fp32(client, seq, mode, opt, tmp_path):
    "Run `seq` in `mode`: no exception, no `learner_problems` after any fit, fp32's `summary`, its `values` within `tolerance(mode)`"
    found,got,vals,start = run(client, seq, mode, opt, tmp_path)
    assert found == [], f'{found}'
    ref,ref_vals = reference(client, seq, opt, tmp_path.parent/f'ref-{client}-{seq}-{opt}')
    for k in ref: assert got.get(k) == ref[k], f'{k} differs from fp32: {_diff(got.get(k), ref[k])}'
    assert not (far := far_from_fp32(vals, ref_vals, start, mode)), far

@pytest.mark.parametrize('mode', ['fp16', 'fp16_dynamic', 'bf16'])
@pytest.mark.parametrize('seq', SEQUENCES)
def test_sequence(seq, mode, tmp_path):
    "Every sequence of fastai calls in every master mode (tiny model with BatchNorm, two groups, Adam with weight decay) leaves what fp32 leaves."
    check_like_fp32('tiny', seq, mode, 'adam', tmp_path)

# Each optimizer meets several modes and each sequence every mode: diagonals of the product, not the whole of it
_OPT_SEQS = ['save_load_opt', 'freeze_discrim', 'lrfind_onecycle']  # fit_fit: in test_state_lives
_OPT_CELLS = [(o, s, list(MASTER_MODES)[(i+j) % len(MASTER_MODES)]) for i,o in enumerate(OPTIMIZERS) for j,s in enumerate(_OPT_SEQS)]

@pytest.mark.parametrize('opt,seq,mode', _OPT_CELLS, ids=['-'.join(c) for c in _OPT_CELLS])
def test_optimizer_sequence(opt, seq, mode, tmp_path):
    "fastai's optimizers and torch's through OptimWrapper go through the sequences in master modes as they do in fp32."
    check_like_fp32('tiny', seq, mode, opt, tmp_path)

_APP_CELLS = [('tabular', 'lrfind_onecycle', 'fp16'), ('tabular', 'lrfind_finetune', 'bf16'), ('tabular', 'save_load_opt', 'fp16_dynamic'),
              ('tabular', 'export_cpu', 'fp16'), ('tabular', 'freeze_discrim', 'fp16'), ('tabular', 'save_model_cb', 'bf16'),
              ('collab', 'lrfind_onecycle', 'bf16'), ('collab', 'fit_fit', 'fp16'), ('collab', 'save_load_opt', 'fp16'),
              ('collab', 'export_cpu', 'bf16'), ('collab', 'switch', 'fp16_dynamic'),
              ('tabular', 'validate_first', 'fp16'), ('collab', 'nested_validate', 'bf16'), ('text', 'nested_validate', 'bf16'),
              ('tabular', 'accumulate_save', 'fp16'),
              ('text', 'lrfind_finetune', 'fp16'), ('text', 'fit_fit', 'bf16'), ('text', 'save_load_opt', 'bf16'),
              ('text', 'export_cpu', 'fp16'), ('text', 'freeze_discrim', 'fp16_dynamic'), ('text', 'export_nocpu', 'bf16'),
              ('tabular', 'unfreeze_cb', 'fp16'), ('text', 'unfreeze_cb', 'bf16'), ('collab', 'create_opt', 'fp16_dynamic'),
              ('tied', 'lrfind_onecycle', 'fp16'), ('tied', 'save_load_opt', 'bf16'), ('tied', 'unfreeze_cb', 'fp16_dynamic'),
              ('tied', 'export_cpu', 'bf16'), ('sparse', 'fit_fit', 'fp16'), ('sparse', 'save_model_cb', 'bf16'),
              ('sparse', 'create_opt', 'fp16'), ('gan', 'fit_fit', 'fp16_dynamic'), ('gan', 'accumulate_save', 'bf16'),
              ('gan', 'nested_validate', 'fp16'), ('gan', 'fit_fit', 'bf16')]

@pytest.mark.parametrize('client,seq,mode', _APP_CELLS, ids=['-'.join(c) for c in _APP_CELLS])
def test_app_sequence(client, seq, mode, tmp_path):
    "fastai's own applications (tabular with embeddings and BatchNorm, collab, AWD_LSTM text) go through the sequences in master modes as in fp32."
    check_like_fp32(client, seq, mode, 'adam', tmp_path)

@pytest.mark.parametrize('seq', ['save_load_opt', 'save_model_cb'])
def test_rounded_masters_are_caught(seq, tmp_path):
    "Negative control: masters rounded through fp16 on their way into a checkpoint (between fits, and mid-fit) fail the sequence."
    with masters_rounded_on_save(), pytest.raises(AssertionError, match=r"after load\('\w+'\) of what it held differs"):
        check_like_fp32('tiny', seq, 'fp16', 'adam', tmp_path)

@pytest.mark.parametrize('mode', ['fp16', 'bf16'])
def test_frozen_schedule_is_caught(mode, tmp_path):
    "Negative control: the engine stepping with the fit's first lr all along (one-cycle's 4e-4, not up to 1e-2) ends too far from fp32."
    reference('tiny', 'lrfind_onecycle', 'adam', tmp_path.parent/'ref-tiny-lrfind_onecycle-adam')
    with lr_frozen(), pytest.raises(AssertionError, match='parameters 0.9'): check_like_fp32('tiny', 'lrfind_onecycle', mode, 'adam', tmp_path)

# ---- the learning rate each step used: what fastai's schedules set, after an lr_find, in every mode (a step 5% long is within the
# weights' tolerance above on this small model: Adam steps its near-zero-gradient parameters by their rounding noise)

def ramp_lrs(mode, fused, path) -> StepLrs:
    "`lr_find`, `fit_one_cycle` and `fit` on a `ramp_learner` in `mode` (None: fp32): each step's lr, set and used, in the two fits"
    probe = StepLrs()
    learn = ramp_learner(lr=1e-2)
    learn.path = path
    if mode is not None: SEQ_MODES[mode](learn, fused=fused)
    learn.lr_find(num_it=5, show_plot=False, suggest_funcs=None)
    learn.fit_one_cycle(1, 1e-2, cbs=probe)
    learn.fit(1, 3e-3, cbs=probe)
    return probe

@functools.cache
def _fp32_lrs(path) -> list: return ramp_lrs(None, None, path).asked

def check_ramp_lrs(mode, fused, tmp_path):
    "Each step of `ramp_lrs` used the lr fastai set, which is what fastai sets in fp32"
    check_step_lrs(ramp_lrs(mode, fused, tmp_path), *step_lr_tol(mode), asked=_fp32_lrs(tmp_path.parent/'ref-ramp'))

@pytest.mark.parametrize('fused', [True, False])
@pytest.mark.parametrize('mode', SEQ_MODES)
def test_step_lr_is_the_schedules(mode, fused, tmp_path):
    "Every step of a one-cycle fit after an lr_find, and of a fit, moves the fp32 weights by the lr fastai's schedule set: plain SGD by hand."
    check_ramp_lrs(mode, fused, tmp_path)

@pytest.mark.parametrize('bug', [lambda: lr_scaled(1.05), lambda: lr_scaled(.5), lr_frozen], ids=['lr_x1.05', 'lr_x0.5', 'lr_frozen'])
@pytest.mark.parametrize('mode', ['fp16', 'pure_stochastic'])
def test_wrong_step_lr_is_caught(mode, bug, tmp_path):
    "Negative control: the engine stepping with 1.05 or 0.5 times fastai's lr, or with the fit's first lr all along, fails the check."
    _fp32_lrs(tmp_path.parent/'ref-ramp')
    with bug(), pytest.raises(AssertionError, match='where fastai set|times the lrs fastai set'): check_ramp_lrs(mode, True, tmp_path)

# ---- optimizer state lives across fits and checkpoints

def _steps(learn) -> list:
    "Each model parameter's step count: fastai's `state['step']`, torch's `state['step']`, or None where the optimizer keeps none"
    st = learn.opt.opt.state if isinstance(learn.opt, OptimWrapper) else learn.opt.state
    return [float(st[p]['step']) if 'step' in st.get(p, {}) else None for p in learn.model.parameters()]

@pytest.mark.parametrize('mode', ['fp16', 'bf16'])
@pytest.mark.parametrize('opt', OPTIMIZERS)
def test_state_lives(opt, mode, tmp_path):
    "Optimizer state carries across fits and a with_opt checkpoint: step counts add up (4 per fit), every parameter keeps its state entries."
    learn = tiny(opt); learn.path = tmp_path
    MASTER_MODES[mode](learn)
    learn.fit(1); learn.fit(1)
    _saved(learn, 'ck'); _loads_back(learn, 'ck')
    learn.fit(1)
    assert (found := learner_problems(learn)) == [], f'{found}'
    steps = _steps(learn)
    if opt not in ('sgd', 'larc'): assert steps == [12.]*len(steps), steps
    if opt == 'ranger': assert learn.opt.count == 12
    st = learn.opt.opt.state if isinstance(learn.opt, OptimWrapper) else learn.opt.state
    assert all(any(isinstance(v, Tensor) and v.dim() > 0 for v in st[p].values()) for p in learn.model.parameters()), 'a parameter lost its optimizer state'

# ---- fits that die

class Boom(Callback):
    "Raise `exc` at the `at`-th time `event` runs; keep the model's trainable weights as the masters hold them when it raises"
    def __init__(self, event, exc, order=0, at=3): self.event,self.exc,self.order,self.at,self.n = event,exc,order,at,0
    def _hit(self, event):
        if event != self.event: return
        self.n += 1
        if self.n == self.at: raise self.exc(f'Boom at {event}')  # fastai re-raises an exception with its message: give it one

_EVENTS = ['before_fit', 'before_epoch', 'before_train', 'before_batch', 'after_pred', 'after_loss', 'before_backward', 'after_backward',
           'before_step', 'after_step', 'after_batch', 'after_train', 'before_validate', 'after_validate', 'after_epoch', 'after_fit']
for _e in _EVENTS: setattr(Boom, _e, lambda self, _e=_e: self._hit(_e))

_FAILS = [('before_fit', RuntimeError, 11, 1), ('before_batch', RuntimeError, 0, 3), ('after_pred', RuntimeError, 0, 3),
          ('after_loss', KeyboardInterrupt, 0, 3), ('after_backward', RuntimeError, 11, 3), ('before_step', KeyboardInterrupt, 11, 3),
          ('after_step', RuntimeError, 9, 3), ('after_step', RuntimeError, 11, 3), ('after_batch', CancelFitException, 0, 3),
          ('after_backward', CancelBatchException, 11, 3), ('after_batch', CancelEpochException, 0, 3), ('before_validate', KeyboardInterrupt, 0, 1),
          ('after_epoch', RuntimeError, 11, 1), ('after_fit', RuntimeError, 0, 1)]
_FAIL_IDS = [f'{e}-{x.__name__}-order{o}' for e,x,o,_ in _FAILS]

def _rounded_through(learn, dtype) -> bool:
    "Whether every model weight is exactly representable in `dtype`: the masters were lost"
    return all(torch.equal(p, p.to(dtype).float()) for p in learn.model.parameters() if p.dtype == torch.float32)

def _die_then_fit(learn, event, exc, order, at):
    "Fit with a `Boom`; the problems it leaves; another fit; the problems that leaves"
    learn.add_cb(FitCheck())
    with pytest.raises(exc) if not issubclass(exc, (CancelFitException, CancelEpochException, CancelBatchException)) else nullcontext():
        learn.fit(1, cbs=Boom(event, exc, order, at))
    after_fail = learner_problems(learn)
    learn.fit(1)
    return after_fail,learn.fit_check.found + learner_problems(learn)

@functools.cache
def _failed_ref(event, exc, order, at):
    "The `summary` and `values` fp32 leaves after `_die_then_fit`, and the weights it started from"
    ref = tiny(); start = values(ref)['weights']
    _die_then_fit(ref, event, exc, order, at)
    return summary(ref),values(ref),start

@pytest.mark.parametrize('mode', ['fp16', 'bf16'])
@pytest.mark.parametrize('event,exc,order,at', _FAILS, ids=_FAIL_IDS)
def test_failed_fit(event, exc, order, at, mode):
    "A fit that dies at any event (error, Ctrl-C, Cancel*) leaves an fp32 model from the masters and the optimizer on it; the next fit ends like fp32's."
    learn = MASTER_MODES[mode](tiny())
    after_fail,after_next = _die_then_fit(learn, event, exc, order, at)
    assert after_fail == [], f'after the failed fit: {after_fail}'
    assert not _rounded_through(learn, torch.float16 if mode.startswith('fp16') else torch.bfloat16), 'the fp32 masters were lost'
    assert after_next == [], f'after the next fit: {after_next}'
    (ref,ref_vals,start),got = _failed_ref(event, exc, order, at),summary(learn)
    for k in ref: assert got.get(k) == ref[k], f'{k} differs from fp32: {_diff(got.get(k), ref[k])}'
    assert not (far := far_from_fp32(values(learn), ref_vals, start, mode)), far

@pytest.mark.parametrize('client,mode', [('tabular', 'fp16'), ('text', 'bf16')])
def test_app_failed_fit(client, mode):
    "A Ctrl-C after a step of a real application leaves an fp32 model and the optimizer on it; the next fit ends like fp32's."
    ref = CLIENTS[client]()
    start = values(ref)['weights']
    _die_then_fit(ref, 'after_step', KeyboardInterrupt, 11, 2)
    learn = MASTER_MODES[mode](CLIENTS[client]())
    after_fail,after_next = _die_then_fit(learn, 'after_step', KeyboardInterrupt, 11, 2)
    assert after_fail == [], f'after the failed fit: {after_fail}'
    assert after_next == [], f'after the next fit: {after_next}'
    assert summary(learn) == summary(ref)
    assert not (far := far_from_fp32(values(learn), values(ref), start, mode)), far
