"""The third pass of tests that catch a wrong number (issue 69), each against a reference of its own: loads in pieces (against
the checkpoint's values, element by element), a set-up's commits (against the values before it), the device's count of skipped
steps (against the run without those batches), a registered store's own `kernel_options` (against the eager step), a cast by
hand taken back (against the values before the cast) and the stream a checkpoint resumes (against the run that never left it).
Each check has a planted control (`planted.py`) that it catches."""
import copy, pickle, tempfile
from pathlib import Path
import pytest, torch
from fastai.basics import Adam, Module, nn, set_seed
import fastai.callback.schedule  # `lr_find`
from mpx.all import *
import mpx.core
from mpx.flat import Bucket
from mpx.lowbit import BF16Store, probe_casts
from mpx.test_utils import tiny_learner, fit_quiet, ALL_MODES, precision_cb, state_of, state_diffs, weights, InjectGrad
from test_wrong_steps import DropBatch
from test_kept_layout import fitted_pair
from test_one_truth import ramp
from planted import (load_skips_last_piece, set_up_commits_each_bucket, device_skips_counted_once, store_options_ignored,
                     take_back_drops_last_compensation, loaded_piece_nibbles_swapped, loaded_stream_afresh)

pytestmark = pytest.mark.filterwarnings("ignore:bf16 is slow", "ignore:fp16 is slow", "ignore:load_learner")
COMPILED = pytest.param('compile', marks=pytest.mark.compiled)

def opt_state_kw(opt_state:str) -> dict: return {} if opt_state == 'fp32' else dict(opt_state=opt_state)

# ---- loads in pieces, against the checkpoint's values

PIECE = 1 << 17  # `mpx.plumbing.LOAD_PIECE`: 131,072 elements
SHAPES = {'below': (PIECE - 1,), 'below_2d': (1, PIECE - 1), 'at': (PIECE,), 'at_2d': (256, 512), 'above': (PIECE + 1,),
          'above_2d': (3, 43_691), 'two_and_one': (2*PIECE + 1,), 'two_and_one_2d': (5, 52_429)}

class Pieces(Module):
    "Parameters at and around the streamed load's piece size, 1-D and 2-D (`SHAPES`), and a small head"
    def __init__(self):
        self.big = nn.ParameterDict({k: nn.Parameter(torch.randn(s) * .1) for k,s in SHAPES.items()})
        self.head = nn.Linear(1, 1)
    def forward(self, x):
        sq = sum((p.float() ** 2).sum() for p in self.big.values())  # each element a gradient of its own
        return self.head(x) + 1e-3 * sq

def pieces_learner(mode:str, opt_state:str, path:Path):
    return ALL_MODES[mode](tiny_learner(opt_func=Adam, lr=1e-2, n_trn=2, model=Pieces, path=path), **opt_state_kw(opt_state))

def loaded_values(learn) -> tuple:
    "Each parameter's fp32 value by name, and each state tensor (fp32) by parameter index, as the learner holds them now"
    cb = precision_cb(learn)
    model = {n: cb.fp32_value(p).clone() for n,p in learn.model.named_parameters()}
    opt = [{k: (v.float() if hasattr(v, 'float') else v) for k,v in s.items()} for s in learn.opt.state_dict()['state']]
    return model,opt

def check_loaded(learn, file:Path, before:dict):
    "Assert every value the learner holds is the checkpoint's, element by element (and that the load had values to change)"
    saved = torch.load(file, weights_only=False)
    model,opt = loaded_values(learn)
    for n,v in saved['model'].items():
        if n.startswith('big.'):  # the fit since the save moved every element, up to the last partial piece's
            assert bool((before[n].flatten()[-1:] != v.flatten()[-1:]).all()), f'{n}: the fit since the save left it as saved'
        bad = (model[n] != v).nonzero()
        assert not len(bad), f'{n} {tuple(v.shape)}: {len(bad)} elements not the checkpoint\'s, the first at {bad[0].tolist()}'
    for i,(got,want) in enumerate(zip(opt, saved['opt']['state'])):
        for k,v in want.items():
            if not (torch.is_tensor(v) and v.dim()): continue
            bad = (got[k] != v).flatten().nonzero()
            where = f'state {k} of parameter {i} {tuple(v.shape)}'
            assert not len(bad), f"{where}: {len(bad)} elements not the checkpoint's, the first at {bad[0].item()}"

# every kind (Kahan, stochastic, AMP's in place) and store (fp32, bf16, 8-bit, 4-bit); each keeps its layout between fits
LOADS = [('pure_kahan', 'fp32'), ('pure_kahan', '4bit'), ('pure_stochastic', '8bit'), ('pure_stochastic', '4bit'),
         ('amp_bf16', 'bf16'), ('amp_bf16', '4bit')]

def load_in_pieces(mode:str, opt_state:str):
    "A checkpoint of a learner (its layout kept), the learner moved away by a fit, loaded back: checked value by value"
    path = Path(tempfile.mkdtemp())
    learn = pieces_learner(mode, opt_state, path)
    fit_quiet(learn)
    learn.save('x')
    fit_quiet(learn)
    assert precision_cb(learn).layout_kept
    before = loaded_values(learn)[0]
    learn.load('x')  # streamed, a piece at a time
    check_loaded(learn, path/'models/x.pth', before)

@pytest.mark.parametrize('mode,opt_state', LOADS)
def test_a_load_in_pieces_is_the_checkpoint(mode, opt_state, one_thread):
    "A streamed `load` of tensors of 131,071 / 131,072 / 131,073 / 262,145 elements (1-D, 2-D) holds the checkpoint's values, every one"
    load_in_pieces(mode, opt_state)

def test_load_pieces_control(one_thread):
    "Planted: a streamed load that never reads the last partial piece of a tensor is caught"
    with load_skips_last_piece(), pytest.raises(AssertionError, match="not the checkpoint's"): load_in_pieces('pure_kahan', 'fp32')

def test_load_nibbles_control(one_thread):
    "Planted: a loaded piece's 4-bit codes packed in the other nibble order is caught"
    with loaded_piece_nibbles_swapped(), pytest.raises(AssertionError, match="state .* not the checkpoint's"):
        load_in_pieces('amp_bf16', '4bit')

# ---- a set-up that fails at a bucket's commit, against the values before it

def buckets_model():
    "Small and large tensors (a 96x96 weight: low-bit state), a BatchNorm, over two parameter groups: several buckets"
    return nn.Sequential(nn.Linear(1, 96), nn.ReLU(), nn.Linear(96, 96), nn.BatchNorm1d(96), nn.Linear(96, 1))

def buckets_learner(mode:str, opt_state:str):
    split = lambda m: [list(m[:4].parameters()), list(m[4:].parameters())]
    learn = tiny_learner(opt_func=Adam, lr=1e-2, n_trn=2, model=buckets_model, splitter=split)
    return ALL_MODES[mode](learn, **opt_state_kw(opt_state))

class FailAtCommit:
    "`Bucket.commit` counted (`install`); the `at`-th raises (an out-of-memory error at that bucket) before it commits"
    real = Bucket.commit
    def __init__(self, at:int|None=None): self.at,self.n = at,0
    def install(self, monkeypatch):
        def commit(b):
            self.n += 1
            if self.n == self.at: raise RuntimeError(f'injected at the commit of bucket {self.n}')
            return FailAtCommit.real(b)
        monkeypatch.setattr(Bucket, 'commit', commit)

def set_up_fails_at_each_bucket(mode:str, opt_state:str, rebuild:bool, monkeypatch):
    "Assert a set-up failing at the commit of each bucket after the first leaves every value and dtype as before, and the next fit works"
    def prepared():
        learn = buckets_learner(mode, opt_state)
        if rebuild: fit_quiet(learn)
        learn.create_opt()  # the fit's (after a fit: another optimizer, so the layout kept is built again)
        return learn
    learn,counter = prepared(),FailAtCommit()
    counter.install(monkeypatch)
    fit_quiet(learn)
    monkeypatch.setattr(Bucket, 'commit', FailAtCommit.real)
    assert counter.n >= 3, f'{counter.n} buckets'
    for at in range(2, counter.n + 1):
        learn = prepared()
        before = state_of(learn)
        FailAtCommit(at).install(monkeypatch)
        with pytest.raises(RuntimeError, match='injected'): fit_quiet(learn)
        monkeypatch.setattr(Bucket, 'commit', FailAtCommit.real)
        cb = precision_cb(learn)
        assert cb.fused_steps is None, at
        dtypes = {p.dtype for p in learn.model.parameters()}
        assert dtypes == {torch.float32}, f'failed at bucket {at} of {counter.n}: the model left in {dtypes}'
        diffs = state_diffs(before, state_of(learn))
        assert not diffs, f'failed at bucket {at} of {counter.n}: {diffs[:2]}'
    fit_quiet(learn)  # the next fit sets up whole

COMMITS = [('pure_kahan', 'fp32'), ('pure_kahan', '8bit'), ('pure_stochastic', '4bit'), ('master_bf16', '8bit')]

@pytest.mark.parametrize('rebuild', [False, True], ids=['first fit', 'a rebuild'])
@pytest.mark.parametrize('mode,opt_state', COMMITS)
def test_a_set_up_failing_at_any_bucket_undoes_the_others(mode, opt_state, rebuild, monkeypatch, one_thread):
    "A set-up whose commit fails at each bucket after the first in turn undoes the buckets before: every value exact, fp32"
    set_up_fails_at_each_bucket(mode, opt_state, rebuild, monkeypatch)

def test_commits_control(monkeypatch, one_thread):
    "Planted: a set-up committing each bucket for good as it goes is caught"
    with set_up_commits_each_bucket(), pytest.raises(AssertionError, match='failed at bucket'):
        set_up_fails_at_each_bucket('pure_kahan', 'fp32', False, monkeypatch)

# ---- skips counted on the device, against the run without those batches

def skip_pair(skips:list, fused) -> tuple:
    "Pure stochastic fits whose steps in `skips` overflow, each skip left on the device (no host read), and the fits without those batches"
    def run(cbs):
        learn = ALL_MODES['pure_stochastic'](tiny_learner(bn=True, opt_func=Adam, lr=1e-2, n_trn=6), fused=fused)
        precision_cb(learn).skip_on_device = True  # as on a GPU: a step's verdict stays on the device
        fit_quiet(learn, 2, cbs=cbs)
        return learn
    return run([InjectGrad(at=skips, micro=True)]),run([DropBatch(at=skips)])

def check_skips(a, b, n:int):
    ca,cb = precision_cb(a),precision_cb(b)
    assert ca.skipped_steps == n and cb.skipped_steps == 0, (ca.skipped_steps, cb.skipped_steps)
    counts = {s.get('step') for s in a.opt.state.values()}
    assert counts == {ca.total_steps - n}, f'step counts {counts} after {ca.total_steps} steps, {n} skipped'
    assert ca.stream.count == cb.stream.count, f'the stream counted {ca.stream.count} steps, the run without the batches {cb.stream.count}'
    diffs = state_diffs(state_of(a), state_of(b))
    assert not diffs, f'the skipped steps changed {diffs[:3]}'

SKIPS = {'two in a row': [2, 3], 'three in a row': [1, 2, 3], 'two apart': [1, 4], 'two, two epochs': [4, 7]}

@pytest.mark.parametrize('skips', list(SKIPS))
def test_skips_on_the_device_are_the_run_without_them(skips, one_thread):
    "Two and three steps skipped on the device between host reads: counts, stream and state as the run without their batches"
    check_skips(*skip_pair(SKIPS[skips], True), len(SKIPS[skips]))

@pytest.mark.compiled
def test_skips_on_the_device_compiled(one_thread):
    "The same, compiled: two steps in a row skipped in the kernel"
    check_skips(*skip_pair([2, 3], 'compile'), 2)

def test_device_skips_control(one_thread):
    "Planted: the device counting whether a step was skipped since the host read, not how many, is caught"
    with device_skips_counted_once(), pytest.raises(AssertionError, match='the stream counted|changed'):
        check_skips(*skip_pair([2, 3], True), 2)

# ---- a registered store's own inductor options, against the eager step

class CastBF16(BF16Store):
    "bf16 state whose kernels round through conversions: right only where inductor keeps them, which its own `kernel_options` ask"
    name = 'cast-bf16'
    kernel_options = {'emulate_precision_casts': True}  # its own dict (not `BF16Store`'s)
    def __repr__(self): return f"{type(self).__name__}()"
    def kernel_nearest(self, x): return x.to(torch.bfloat16).float()

class CastBF16Bare(CastBF16):
    "`CastBF16` without its options: inductor drops its round trips"
    name,kernel_options = 'cast-bf16-bare',{}

@pytest.fixture
def cast_stores(monkeypatch):
    "`CastBF16` registered under its name, for the test only"
    if not probe_casts('cpu'): pytest.skip(f"torch {torch.__version__}'s inductor drops the round trips even with the option")
    monkeypatch.setitem(mpx.core._stores, CastBF16.name, CastBF16)

def compiled_off_eager(opt_state) -> float:
    "How far a compiled ramp (40 steps below half a bf16 spacing, the weight's state in `opt_state`) ends from the eager one"
    (eager,w0),(comp,_) = ramp('pure_kahan', CastBF16, True),ramp('pure_kahan', opt_state, 'compile')
    assert (eager - w0).abs().max() > 1e-6 and not torch.equal(eager, eager.bfloat16().float())  # the compensation holds the steps
    return float((comp - eager).abs().max())

@pytest.mark.compiled
@pytest.mark.parametrize('given', ['registered name', 'class', 'instance'])
def test_a_registered_store_compiles_with_its_options(given, cast_stores, one_thread):
    "A store's own `kernel_options` reach its compiled step (given by name, class or instance): the eager step's values within 1e-7"
    opt_state = {'registered name': 'cast-bf16', 'class': CastBF16, 'instance': CastBF16()}[given]
    off = compiled_off_eager(opt_state)
    assert off <= 1e-7, f'compiled off eager by {off:.3g}: the store\'s own kernel options did not reach inductor'

@pytest.mark.compiled
def test_the_store_options_matter(cast_stores, one_thread):
    "Control: the same store without its options compiles to other values (inductor drops the round trips: no compensation)"
    assert compiled_off_eager(CastBF16Bare) > 1e-6

@pytest.mark.compiled
def test_store_options_control(cast_stores, one_thread):
    "Planted: a store's own `kernel_options` ignored under compile is caught"
    with store_options_ignored(), pytest.raises(AssertionError, match='kernel options'):
        test_a_registered_store_compiles_with_its_options('class', None, None)

# ---- a cast by hand taken back, against the values before it

def comp_of_last(learn) -> torch.Tensor:
    "The compensation of the last parameter of the model"
    fs = precision_cb(learn).fused_steps
    b,i = fs.home[id(list(learn.model.parameters())[-1])]
    return b.own.slots[i]

def after_cast(learn, path:Path, how:str) -> list:
    "The fp32 values of the model's parameters read through `how`, after `model.float()` by hand"
    learn.model.float()
    names = [k for k,_ in learn.model.named_parameters()]
    if how == 'fp32_value': return weights(learn)
    if how == 'deepcopy': return [p.detach() for p in copy.deepcopy(learn.model).parameters()]
    if how == 'pickle': return [p.detach() for p in pickle.loads(pickle.dumps(learn.model)).parameters()]
    if how == 'save':
        learn.save('cast')
        sd = torch.load(path/'models/cast.pth', weights_only=False)['model']
        return [sd[k] for k in names]
    learn.to_fp32()  # 'to_fp32'
    return [p.detach().clone() for p in learn.model.parameters()]

def check_take_back(how:str, opt_state:str='fp32'):
    a,_,path = fitted_pair('pure_kahan', opt_state, True)
    assert comp_of_last(a).ne(0).any(), 'the last parameter has no compensation to lose'
    want = weights(a)  # the fp32 values (w + c), before the cast
    got = after_cast(a, path, how)
    assert len(got) == len(want)
    for i,(g,w) in enumerate(zip(got, want)):
        assert g.dtype == torch.float32 and torch.equal(g, w), f'parameter {i} after model.float() and {how}: not its fp32 value'

@pytest.mark.parametrize('how', ['fp32_value', 'deepcopy', 'pickle', 'save', 'to_fp32'])
def test_a_cast_by_hand_keeps_every_compensation(how, one_thread):
    "`model.float()` between fits, then its fp32 values read, a copy, a pickle, a save or `to_fp32()`: every weight's w + c exact"
    check_take_back(how)

def test_take_back_control(one_thread):
    "Planted: a cast by hand taken back losing the last parameter's compensation is caught"
    with take_back_drops_last_compensation(), pytest.raises(AssertionError, match='not its fp32 value'): check_take_back('deepcopy')

# ---- a checkpoint resumes the stream, against the run that never left it

def stream_learner(opt_state:str='fp32', path=None):
    learn = tiny_learner(opt_func=Adam, lr=1e-2, n_trn=4, path=path or Path(tempfile.mkdtemp()))
    return learn.to_bf16(pure=True, update='stochastic', **opt_state_kw(opt_state))

def fit_seeded(*ls, seed:int):
    "Fit each of `ls` from seed `seed`, its loader's shuffle too (`set_seed` leaves a `DataLoader`'s own generator as it is)"
    for l in ls:
        set_seed(seed)
        l.dls.train.rng.seed(seed)
        fit_quiet(l)

def check_resumed(a, b):
    assert a.pure_bf16.stream.count == b.pure_bf16.stream.count, (a.pure_bf16.stream.count, b.pure_bf16.stream.count)
    diffs = state_diffs(weights(a), weights(b))
    assert not diffs, f'the resumed stream drew other bits: {diffs[:2]}'

def load_resumes(opt_state:str):
    "Saved, moved away by a fit, loaded back into its kept layout and fitted on: as the learner that went on from the save"
    a,b = stream_learner(opt_state),stream_learner(opt_state)
    fit_seeded(a, b, seed=1)
    a.save('s')
    fit_seeded(a, seed=2)
    a.load('s')
    assert precision_cb(a).layout_kept
    fit_seeded(a, b, seed=3)
    check_resumed(a, b)

@pytest.mark.parametrize('opt_state', ['fp32', '8bit'])
def test_a_load_into_the_kept_layout_resumes_the_stream(opt_state, one_thread):
    "A checkpoint loaded into a kept layout goes on with the stream it saved: the fit after is the one the saved learner would make"
    load_resumes(opt_state)

def test_lr_find_resumes_the_stream(one_thread):
    "`lr_find` between fits (its checkpoint saved and loaded) leaves the stream where it was: the next fit as without it"
    a,b = stream_learner(),stream_learner()
    fit_seeded(a, b, seed=1)
    count = a.pure_bf16.stream.count
    with a.no_bar(), a.no_logging(): a.lr_find(num_it=3, show_plot=False, suggest_funcs=())
    assert a.pure_bf16.stream.count == count, f'lr_find left the stream at {a.pure_bf16.stream.count}, not {count}'
    fit_seeded(a, b, seed=3)
    check_resumed(a, b)

def test_stream_resume_control(one_thread):
    "Planted: a loaded checkpoint starting the stream afresh is caught"
    with loaded_stream_afresh(), pytest.raises(AssertionError): load_resumes('fp32')
