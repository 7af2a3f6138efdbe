"Tests for mpx.advisor: numerics, the decision rule, 'changes nothing' on any model (fastai's applications, models deepcopy cannot copy)."
import math, random, re, warnings
from copy import deepcopy
from pathlib import Path
import numpy as np
import pytest, torch
from torch import nn
from fastai.basics import Learner, Adam, first, set_seed, partial, pd, noop
from fastai.callback.progress import ProgressCallback
from fastai.test_utils import synth_learner
from mpx.all import *
import mpx.advisor as advisor, mpx.memory as memory
from mpx.advisor import *
from mpx.hardware import cpu_hardware, cuda_hardware
from mpx.test_utils import tiny_learner, fit_quiet, precision_cbs, tabular_app_learner, collab_app_learner, text_app_learner
from test_hardware import cpuinfo_flags, said_against_thresholds

# ---- known numerics ---------------------------------------------------------------------------------------------

V100 = cuda_hardware('Tesla V100 (mock)', (7,0), False)   # only fp16 fast: the numerics alone decide between fp16 and fp32
A100 = cuda_hardware('A100 (mock)', (8,0), True)          # both fast

@pytest.fixture
def mock_hw(monkeypatch):
    "Make the report see `hw`, whatever this machine is"
    def use(hw): monkeypatch.setattr(advisor, 'detect_hardware', lambda device=None: hw)
    return use

@pytest.fixture
def fast_probes(monkeypatch):
    "This CPU's probes read 2x fp32's speed in both dtypes for every family: a timed report times every safe mode"
    import mpx.hardware
    monkeypatch.setattr(mpx.hardware, '_speeds', {(dt, f): 2. for dt in (torch.bfloat16, torch.float16) for f in mpx.hardware._FAMILIES})

def scaled_learner(factor=1e6):
    "A tiny learner whose first layer's activations reach about `factor`"
    learn = tiny_learner()
    with torch.no_grad(): learn.model[0].weight.mul_(factor)
    return learn

def test_overflow_named(mock_hw):
    "A layer scaled past 65504 rules fp16 out and is named; without the scaling fp16 is recommended."
    mock_hw(V100)
    assert tiny_learner().precision_report().recommended == 'fp16'
    r = scaled_learner().precision_report()
    assert r.recommended == 'fp32' and '0' in r.at_risk and 'activations' in r.at_risk['0']
    assert any(re.fullmatch(r"fp16: activations of `0` reach [\d.]+e\d > 65504.*", s) for s in r.reasons), r.reasons
    assert r.to_frame().loc['0', 'max |activation|'] > 65504
    mock_hw(A100)
    assert scaled_learner().precision_report().recommended == 'bf16'  # bf16 has fp32's range

def test_exact_numerics():
    "A 1x1 layer of weight 1e5 on ones, MSE against zeros: activations 1e5 and gradients 2e5/4 exactly."
    lin = nn.Linear(1, 1)
    with torch.no_grad(): lin.weight.fill_(1e5); lin.bias.zero_()
    mods,under = module_numerics(nn.Sequential(lin), (torch.ones(4,1),), (torch.zeros(4,1),), nn.MSELoss())
    assert [(m.name, m.act_max, m.grad_max, m.n_grad) for m in mods[1:]] == [('0', 1e5, 5e4, 4), ('(model)', 1e5, 5e4, 4)]
    safe,at_risk,why = assess_numerics(mods, under)
    assert safe == dict(bf16=True, fp16=False) and list(at_risk) == ['0']

def test_underflow_named(mock_hw):
    "Gradients made tiny (loss x 1e-12) underflow fp16 at 2**16: the share is reported and the modules named."
    mock_hw(V100)
    learn = tiny_learner()
    lf = learn.loss_func
    learn.loss_func = lambda p,y: lf(p, y)*1e-12
    r = learn.precision_report()
    assert r.underflow > .5 and r.recommended == 'fp32'
    assert {'0', '2'} <= set(r.at_risk) and all('underflow' in r.at_risk[n] for n in ('0', '2'))
    assert any(s.startswith('fp16: ') and 'underflow to zero at the loss scale 2**16' in s and '`0`' in s for s in r.reasons)
    learn.loss_func = lambda p,y: lf(p, y)*1e-6  # small, but 2**16 lifts it into fp16's range
    r = learn.precision_report()
    assert r.underflow == 0 and r.recommended == 'fp16' and not r.at_risk

def test_recommendation_this_machine():
    "Without timings, a numerically safe learner on this CPU gets what its flags (read here) allow."
    flags = cpuinfo_flags()
    bf16,fp16 = flags & {'avx512_bf16', 'amx_bf16', 'bf16', 'sve_bf16'},flags & {'avx512_fp16', 'amx_fp16'}
    expected = 'bf16' if bf16 else 'fp16' if fp16 else 'fp32'
    r = tiny_learner().precision_report()
    assert r.recommended == expected and r.hardware.device == 'cpu', r
    if 'amx_bf16' in flags: assert any('AMX-BF16' in s for s in r.reasons)
    elif 'avx512_bf16' in flags: assert any('AVX512-BF16' in s for s in r.reasons)
    print(r)

def test_timed_decision(mock_hw, monkeypatch):
    "With `time=True` the measured speed decides among the safe modes: >= 1.1x fp32, fp16 only if 1.1x bf16 too."
    mock_hw(A100)
    def fake(times): monkeypatch.setattr(advisor, 'time_steps', lambda model, xb, yb, loss_func, modes, n=5: {m: times[m] for m in modes})
    for times,rec in [(dict(fp32=1., bf16=.5, fp16=.4), 'fp16'), (dict(fp32=1., bf16=.5, fp16=.48), 'bf16'),
                      (dict(fp32=1., bf16=.95, fp16=.93), 'fp32'), (dict(fp32=1., bf16=2., fp16=.5), 'fp16')]:
        fake(times)
        r = tiny_learner().precision_report(time=True)
        assert r.recommended == rec, (times, r.reasons)
        assert r.speedups == {m: 1/t for m,t in times.items()}
        assert any(f"measured {1/times['bf16']:.2f}x fp32's speed" in s for s in r.reasons)
    fake(dict(fp32=1., bf16=.5, fp16=.1))
    r = scaled_learner().precision_report(time=True)  # fp16 unsafe: not timed, and not chosen however fast
    assert r.recommended == 'bf16' and set(r.timings) == {'fp32', 'bf16'}

def test_real_timings():
    "Real timed steps on this machine: fp32 and each mode its probes did not measure slow, each median positive, the rest said untimed."
    r = tiny_learner().precision_report(time=True, n_steps=2)
    slow = set(r.hardware.measured_slow)
    assert set(r.timings) == {'fp32', 'bf16', 'fp16'} - slow and all(t > 0 for t in r.timings.values())
    assert r.speedups['fp32'] == 1 and "step time (one thread's CPU time): fp32" in str(r)
    for m in slow:
        assert any(s.startswith(f'{m}: slow for') and s.endswith('; so not timed') for s in r.reasons), r.reasons
        assert not any(s.startswith(f'{m}: measured') for s in r.reasons), r.reasons
    assert not said_against_thresholds(r.reasons), r.reasons

def test_report_views():
    "str/repr for the console, an HTML table for notebooks, a DataFrame of the modules."
    r = scaled_learner().precision_report()
    s = str(r)
    assert s.splitlines()[0] == f'recommended: {r.recommended}' and repr(r) == s
    assert f'hardware: {r.hardware}' in s and "at risk in 16 bits: '0'" in s
    h = r._repr_html_()
    assert '<table' in h and f'recommended: {r.recommended}' in h and '65504' in h
    df = r.to_frame()
    assert list(df.index) == ['(input)', '0', '1', '2', '(model)']
    assert {'type', 'max |activation|', 'max |gradient|', 'fp16 underflow', 'at risk'} <= set(df.columns)

# ---- changes nothing --------------------------------------------------------------------------------------------

def _autocast_state(): return (torch.is_autocast_enabled('cpu'), torch.get_autocast_dtype('cpu'), torch.is_autocast_cache_enabled())

def state(learn):
    "Everything the report must leave as it was, copied"
    dl = learn.dls.train
    return dict(
        weights={k: v.clone() for k,v in learn.model.state_dict().items()},
        grads=[None if p.grad is None else p.grad.clone() for p in learn.model.parameters()],
        dtypes=[p.dtype for p in learn.model.parameters()], training=[m.training for m in learn.model.modules()],
        opt=learn.opt, opt_state=None if learn.opt is None else _flat(learn.opt.state_dict()),
        cbs=list(learn.cbs), torch_rng=torch.get_rng_state(), py_rng=random.getstate(), np_rng=np.random.get_state(),
        autocast=_autocast_state(), dl_attrs=dict(vars(dl)), dl_rng=dl.rng.getstate(), loss_func=learn.loss_func)

def _flat(o):
    "A nested state dict as a flat list of (path, value), tensors cloned"
    if isinstance(o, dict): return [(f'{k}/{p}', v) for k,x in o.items() for p,v in _flat(x)]
    if isinstance(o, (list, tuple)): return [(f'{i}/{p}', v) for i,x in enumerate(o) for p,v in _flat(x)]
    return [('', o.clone() if isinstance(o, torch.Tensor) else o)]

def _same(a, b):
    if isinstance(a, torch.Tensor): return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray): return np.array_equal(a, b)
    if isinstance(a, dict): return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)): return len(a) == len(b) and all(_same(x, y) for x,y in zip(a, b))
    return a is b or a == b

def assert_unchanged(before, after):
    for k in before:
        if k in ('opt', 'cbs', 'loss_func'): assert _same_ids(before[k], after[k]), k
        elif k == 'dl_attrs': assert before[k].keys() == after[k].keys() and all(before[k][n] is after[k][n] for n in before[k]), k
        else: assert _same(before[k], after[k]), k

def _same_ids(a, b): return [id(x) for x in a] == [id(x) for x in b] if isinstance(a, list) else a is b

def make(setup):
    learn = tiny_learner()
    if 'fp16' in setup: learn.to_fp16()
    if 'fit' in setup: learn.fit(1)
    if 'eval' in setup: learn.model.eval()
    return learn

@pytest.mark.parametrize('time', [False, True])
@pytest.mark.parametrize('setup', ['fresh', 'fp16', 'fit', 'fit_fp16', 'fit_eval'])
def test_changes_nothing(setup, time):
    "Weights, grads, optimizer and its state, callbacks, train/eval modes, RNGs, autocast and the DataLoader: bitwise as before."
    learn = make(setup)
    before = state(learn)
    learn.precision_report(time=time)
    assert_unchanged(before, state(learn))

def test_next_batch_unchanged():
    "After a report, the DataLoader yields the batches it would have yielded without one."
    a,b = tiny_learner(),tiny_learner()
    a.precision_report(time=True)
    for (xa,ya),(xb,yb) in zip(a.dls.train, b.dls.train): assert torch.equal(xa, xb) and torch.equal(ya, yb)

def test_inside_autocast_and_no_grad():
    "Called inside autocast and no_grad (e.g. from a callback), the numerics are still fp32 and both states survive."
    learn = tiny_learner()
    ref = learn.precision_report()
    with torch.autocast('cpu', dtype=torch.bfloat16), torch.no_grad():
        inside = _autocast_state()
        r = learn.precision_report()
        assert _autocast_state() == inside and not torch.is_grad_enabled()
    assert r.modules == ref.modules

def test_model_hooks_and_dropout_untouched():
    "Forward hooks callbacks put on the model do not see the advisor's pass; dropout and BatchNorm run on the copy."
    set_seed(0)
    model = nn.Sequential(nn.Linear(1, 16), nn.BatchNorm1d(16), nn.Dropout(.5), nn.ReLU(), nn.Linear(16, 1))
    learn = synth_learner(model=model)
    calls = []
    learn.model.register_forward_hook(lambda m,i,o: calls.append(1))
    before = state(learn)
    r = learn.precision_report(time=True, n_steps=1)
    assert calls == [] and r.to_frame().loc['2', 'type'] == 'Dropout'
    assert_unchanged(before, state(learn))

def test_half_model(mock_hw):
    "A model left in half precision (mid-fit in the master-weights mode, say) is examined in fp32: its fp32 copy's report; it stays half."
    mock_hw(A100)
    learn,ref = tiny_learner(),tiny_learner()
    learn.model.half(); ref.model.half().float()  # the same weights, rounded alike
    before = state(learn)
    r,r32 = learn.precision_report(),ref.precision_report()
    assert r.modules == r32.modules and r.modules[1].act_max > 0 and r.underflow == r32.underflow
    assert r.recommended == r32.recommended == 'bf16' and r.reasons == r32.reasons  # both modes fast on an A100, bf16 first
    assert_unchanged(before, state(learn))

# ---- applying it, and the slow-mode warning ---------------------------------------------------------------------

@pytest.mark.parametrize('hw,mode', [(A100, 'bf16'), (V100, 'fp16'), (cpu_hardware({'avx2'}), 'fp32')])
def test_to_auto_precision(mock_hw, hw, mode):
    "to_auto_precision applies the recommendation through to_bf16/to_fp16/to_fp32 and returns the learner."
    mock_hw(hw)
    learn = tiny_learner().to_bf16()  # a callback already there is replaced, or removed for fp32
    with warnings.catch_warnings(): warnings.simplefilter('ignore'); assert learn.to_auto_precision() is learn
    cbs = [c for c in learn.cbs if isinstance(c, MixedPrecision)]
    assert [str(c.amp_mode) for c in cbs] == ([] if mode == 'fp32' else [mode])


# ---- any model: fastai's applications, models deepcopy cannot copy, errors -----------------------------------

def lm_app_learner(seed:int=0, n:int=64, bs:int=8):
    "A quiet seeded `language_model_learner` on `AWD_LSTM` (`pretrained=False`, one layer of 8) on `n` random sentences"
    from fastai.text.all import DataBlock, TextBlock, ColReader, RandomSplitter, BaseTokenizer, AWD_LSTM, awd_lstm_lm_config
    from fastai.text.all import language_model_learner
    set_seed(seed, reproducible=True)
    words = np.array('good bad fine awful great poor nice dull movie film plot actor'.split())
    texts = [' '.join(words[torch.randint(0, len(words), (int(k),)).numpy()]) for k in torch.randint(4, 10, (n,))]
    tb = TextBlock.from_df('text', is_lm=True, tok=BaseTokenizer(), n_workers=0, min_freq=1, seq_len=8)
    db = DataBlock(blocks=tb, get_x=ColReader('text'), splitter=RandomSplitter(.25, seed=seed))
    dls = db.dataloaders(pd.DataFrame(dict(text=texts)), bs=bs, seq_len=8, num_workers=0)
    learn = language_model_learner(dls, AWD_LSTM, pretrained=False, config=dict(awd_lstm_lm_config, emb_sz=8, n_hid=8, n_layers=1))
    learn.remove_cb(ProgressCallback); learn.logger = noop
    return learn

APPS = dict(tabular=tabular_app_learner, collab=collab_app_learner, collab_nn=partial(collab_app_learner, use_nn=True),
            text=text_app_learner, lm=lm_app_learner)

@pytest.mark.parametrize('app', ['tiny', 'tabular', 'collab', 'text'])
def test_auto_is_the_reports_pick(app):
    "to_auto_precision() applies what precision_report() with the same arguments recommends, on this machine, on fastai's applications."
    learn = tiny_learner() if app == 'tiny' else APPS[app]()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # 16-bit modes are slow on some CPUs: a warning
        pick = learn.precision_report().recommended
        learn.to_auto_precision()
    applied = [str(c.amp_mode) for c in precision_cbs(learn)]
    assert applied == ([] if pick == 'fp32' else [pick]), (pick, applied)

def module_attrs(model):
    "Every module's attributes (the objects themselves) and the contents of its dicts and lists: what `fp32_trial` puts back"
    return [(k, v, list(v.items()) if isinstance(v, dict) else list(v) if isinstance(v, list) else None)
            for m in model.modules() for k,v in vars(m).items()]

def assert_same_attrs(a, b):
    assert len(a) == len(b)
    for (k,v,c),(k2,v2,c2) in zip(a, b):
        assert k == k2 and v is v2, k
        assert c is None or len(c) == len(c2) and all(_same_item(x, y) for x,y in zip(c, c2)), k

def _same_item(x, y): return x is y if not isinstance(x, tuple) else len(x) == len(y) and all(p is q for p,q in zip(x, y))

@pytest.mark.parametrize('app', list(APPS))
def test_applications(app):
    "On every fastai application (AWD_LSTM's WeightDropout included), fresh and after a fit: a report, and nothing changed."
    learn = APPS[app]()
    if app in ('text', 'lm'):
        with pytest.raises(RuntimeError, match='deepcopy'): deepcopy(learn.model)  # WeightDropout: what the advisor crashed on
    for fit in (False, True):
        if fit:
            with learn.no_bar(), learn.no_logging(): learn.fit(1)
        before,attrs = state(learn),module_attrs(learn.model)
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')  # 16-bit modes are slow on some CPUs: a warning
            r = learn.precision_report(time=fit, n_steps=1)
        assert r.recommended in {'fp32', 'bf16', 'fp16'} and r.modules[-1].name == '(model)' and r.modules[-1].act_max > 0
        assert r.recommended not in r.cannot_run and not set(r.timings or {}) & set(r.cannot_run)
        assert_unchanged(before, state(learn))
        assert_same_attrs(attrs, module_attrs(learn.model))
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        assert learn.to_auto_precision() is learn
        fit_quiet(learn)  # what it chose trains here

class Locked(nn.Module):
    "A model holding a lock: `copy.deepcopy` cannot copy it"
    def __init__(self):
        super().__init__()
        import threading
        self.body,self.lock = nn.Sequential(nn.Linear(1, 8), nn.ReLU(), nn.Linear(8, 1)),threading.Lock()
    def forward(self, x):
        with self.lock: return self.body(x)

class Cached(nn.Module):
    "A model keeping a tensor computed from its weight (graph attached), as `WeightDropout` and old weight norm do: not deep-copyable"
    def __init__(self): super().__init__(); self.lin,self.w,self.calls = nn.Linear(1, 1),None,0
    def forward(self, x):
        self.w = self.lin.weight*2; self.calls += 1
        return x@self.w.t() + self.lin.bias

def weight_normed():
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        return nn.Sequential(nn.utils.weight_norm(nn.Linear(1, 8)), nn.ReLU(), nn.Linear(8, 1))

@pytest.mark.parametrize('model', [Locked, Cached, weight_normed])
def test_model_deepcopy_cannot_copy(model, fast_probes):
    "Models `copy.deepcopy` fails on get a report, and keep their weights, attributes and train/eval modes."
    learn = tiny_learner(model=model)
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    learn.model(learn.dls.valid.one_batch()[0])  # a forward with gradients leaves a tensor computed from the weights (Cached, weight norm)
    with pytest.raises((RuntimeError, TypeError), match='deepcopy|pickle'): deepcopy(learn.model)
    learn.model.eval()
    before,attrs = state(learn),module_attrs(learn.model)
    r = learn.precision_report(time=True, n_steps=1)
    assert set(r.timings) == {'fp32', 'bf16', 'fp16'} - set(r.cannot_run)  # numerically safe: each mode that runs here is timed
    assert r.recommended == timed_rule(r), (r.recommended, r.speedups)
    assert_unchanged(before, state(learn))
    assert_same_attrs(attrs, module_attrs(learn.model))

def timed_rule(r, min_speedup=1.1) -> str:
    "The documented rule, restated: of the timed 16-bit modes those `min_speedup`x fp32 or faster; fp16 over bf16 only if `min_speedup`x it"
    ok = [m for m in ('bf16', 'fp16') if r.speedups.get(m, 0) >= min_speedup]
    if not ok: return 'fp32'
    return 'fp16' if ok == ['fp16'] or len(ok) == 2 and r.speedups['fp16'] >= min_speedup * r.speedups['bf16'] else 'bf16'

def test_half_rnn_with_hidden_state():
    "An RNN keeping its hidden state as a plain attribute, its weights half: examined in fp32, its state put back bit for bit."
    class RNN(nn.Module):
        def __init__(self): super().__init__(); self.rnn,self.hidden = nn.LSTM(1, 4, batch_first=True),None
        def forward(self, x):
            out,h = self.rnn(x[:, None], self.hidden)
            self.hidden = tuple(t.detach() for t in h)
            return out[:, -1, :1]
    learn = tiny_learner(model=RNN)
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    hidden = tuple(t.clone() for t in learn.model.hidden)
    learn.model.half(); learn.model.hidden = tuple(t.half() for t in learn.model.hidden)
    ptrs,before = [p.data_ptr() for p in learn.model.parameters()],state(learn)
    learn.precision_report()
    assert_unchanged(before, state(learn))
    assert [p.data_ptr() for p in learn.model.parameters()] == ptrs
    assert all(t.dtype == torch.float16 and torch.equal(t, h.half()) for t,h in zip(learn.model.hidden, hidden))

def test_shared_weights_stay_shared():
    "Tied weights (as a language model's encoder and decoder) are one tensor in the trial and after it."
    lin = nn.Linear(4, 4, bias=False)
    model = nn.Sequential(nn.Linear(1, 4), lin, nn.ReLU(), nn.Linear(4, 4, bias=False), nn.Linear(4, 1))
    model[3].weight = lin.weight
    with fp32_trial(model) as m:
        assert m[3].weight is m[1].weight
        with torch.no_grad(): m[1].weight.add_(1.)
        assert torch.equal(m[3].weight, m[1].weight)
    assert model[3].weight is lin.weight and model[3].weight.data_ptr() == lin.weight.data_ptr()

class Boom(nn.Module):
    def __init__(self): super().__init__(); self.lin = nn.Linear(1, 1)
    def forward(self, x): raise ValueError('boom in forward')

def test_failure_names_mpx():
    "A model that fails on the batch gets an error naming mpx, the model and the cause; the learner is as it was."
    learn = tiny_learner(model=Boom)
    before,attrs = state(learn),module_attrs(learn.model)
    with pytest.raises(RuntimeError, match=r"mpx's precision_report: .* of Boom .*\(ValueError: boom in forward\)") as e:
        learn.precision_report()
    assert isinstance(e.value.__cause__, ValueError)
    assert_unchanged(before, state(learn))
    assert_same_attrs(attrs, module_attrs(learn.model))
    with pytest.raises(RuntimeError, match="mpx"): learn.to_auto_precision()

def test_report_covers_fp8():
    "The report says what `to_fp8()` would convert and whether fp8 would gain, and on a CPU that it is emulated; it never recommends fp8."
    from mpx.test_utils import tabular_app_learner
    rep = tabular_app_learner().precision_report()
    lins = [n for n,m in tabular_app_learner().model.named_modules() if isinstance(m, nn.Linear)]
    assert list(rep.fp8.layer) == lins and rep.fp8.rows.gt(0).all() and set(rep.fp8.gain) <= {'loses', 'about even', 'gains'}
    assert not rep.fp8_real and 'emulated on this device (slow; never recommended)' in str(rep)
    assert rep.recommended in ('fp32', 'bf16', 'fp16')


# ---- a mode that cannot run the model here ----------------------------------------------------------------------

NO_KERNEL = {  # what a device says when it has no kernel for an op in a dtype, and one error that is not about kernels
    'onednn': (RuntimeError, "could not create a primitive descriptor for the LSTM forward propagation primitive."),
    'aten': (RuntimeError, '"addmm_impl_cpu_" not implemented for {}'),
    'other': (TypeError, "unsupported operand type(s) for @: 'Tensor' and 'NoneType'")}

class Fails(nn.Module):
    "Passes its input on, but under autocast to one of `dtypes` raises the error `kind` of `NO_KERNEL`, as an fp16 LSTM on a Zen 4 CPU"
    def __init__(self, dtypes, kind='onednn'): super().__init__(); self.dtypes,self.kind = dtypes,kind
    def forward(self, x):
        dt = x.device.type
        if torch.is_autocast_enabled(dt) and (d := torch.get_autocast_dtype(dt)) in self.dtypes:
            exc,msg = NO_KERNEL[self.kind]
            raise exc(msg.format("'Half'" if d == torch.float16 else "'BFloat16'"))
        return x

def failing_learner(modes, kind='onednn'):
    dtypes = tuple(AMPMode(m).dtype for m in modes)
    return tiny_learner(model=lambda: nn.Sequential(nn.Linear(1, 8), Fails(dtypes, kind), nn.ReLU(), nn.Linear(8, 1)))

FAST = dict(fp32=1., bf16=.5, fp16=.4)  # fp16 fastest, then bf16: a mode that runs and is timed wins on these

@pytest.mark.parametrize('kind', list(NO_KERNEL))
@pytest.mark.parametrize('time', [False, True])
@pytest.mark.parametrize('failing', [('fp16',), ('bf16',), ('bf16', 'fp16')])
def test_mode_that_cannot_run(mock_hw, monkeypatch, failing, time, kind):
    "A 16-bit mode whose step fails here is reported with the module, never timed or recommended; `to_auto_precision` picks one that runs."
    mock_hw(A100)  # both modes fast: without timings the flags alone would pick bf16
    timed = []
    def fake(model, xb, yb, loss_func, modes, n=5): timed.append(modes); return {m: FAST[m] for m in modes}
    monkeypatch.setattr(advisor, 'time_steps', fake)
    expected = next(m for m in (('fp16', 'bf16') if time else ('bf16', 'fp16')) + ('fp32',) if m not in failing)
    learn = failing_learner(failing, kind)
    before = state(learn)
    r = learn.precision_report(time=time)
    assert_unchanged(before, state(learn))
    assert r.recommended == expected and sorted(r.cannot_run) == sorted(failing), r
    assert timed == ([('fp32', *(m for m in ('bf16', 'fp16') if m not in failing))] if time else [])
    for m in failing:
        f = r.cannot_run[m]
        assert (f.module, f.kind, f.no_kernel) == ('1', 'Fails', kind != 'other') and str(f) in r.reasons
        what = f"no {m} kernel on this CPU for" if kind != 'other' else 'a training step fails on this CPU in'
        assert str(f).startswith(f"{m}: {what} `1` (Fails): {m} cannot train this model here ({NO_KERNEL[kind][0].__name__}: ")
    assert r.at_risk == {'1': f"no {failing[0]} kernel here" if kind != 'other' else f"fails in {failing[0]}"}
    assert learn.to_auto_precision(time=time) is learn
    assert [str(c.amp_mode) for c in precision_cbs(learn)] == ([] if expected == 'fp32' else [expected])
    assert fit_quiet(learn).recorder.losses  # the mode it chose trains

def test_failure_outside_a_module(mock_hw):
    "A step that fails outside any module's forward (in the loss here) is reported without a module, and the report still comes."
    mock_hw(A100)
    learn = tiny_learner()
    lf = learn.loss_func
    def loss(p, y):
        if torch.is_autocast_enabled('cpu') and torch.get_autocast_dtype('cpu') == torch.bfloat16:
            raise RuntimeError("\"mse_cpu\" not implemented for 'BFloat16'")
        return lf(p, y)
    learn.loss_func = loss
    r = learn.precision_report()
    assert r.recommended == 'fp16' and list(r.cannot_run) == ['bf16'] and r.cannot_run['bf16'].module is None and not r.at_risk
    assert str(r.cannot_run['bf16']).startswith("bf16: no bf16 kernel on this CPU: bf16 cannot train this model here (RuntimeError: ")

def _lstm_runs(mode:str) -> bool:
    "Whether a training step of a bare LSTM runs here under autocast to `mode`: probed now, whatever this CPU is"
    lstm,h = nn.LSTM(1, 4, batch_first=True),torch.zeros(1, 2, 4)  # as `LSTMModel` calls it, with an fp32 hidden state
    try:
        with torch.autocast('cpu', dtype=AMPMode(mode).dtype): out = lstm(torch.randn(2, 1, 1), (h, h))[0]
        out.float().sum().backward(); return True
    except Exception: return False

class LSTMModel(nn.Module):
    "An LSTM keeping its hidden state between calls, as fastai's `AWD_LSTM` does, and a linear head"
    def __init__(self): super().__init__(); self.rnn,self.head,self.hidden = nn.LSTM(1, 4, batch_first=True),nn.Linear(4, 1),None
    def forward(self, x):
        out,h = self.rnn(x[:, None], self.hidden)
        self.hidden = tuple(t.detach() for t in h)
        return self.head(out[:, -1])

def test_real_lstm_on_this_cpu(fast_probes):
    "A real LSTM: the report finds exactly the 16-bit modes in which this CPU has no LSTM kernel (probed here), and times the others."
    runs = {m: _lstm_runs(m) for m in ('bf16', 'fp16')}
    learn = tiny_learner(model=LSTMModel)
    fit_quiet(learn)  # the model now holds a hidden state
    before,attrs = state(learn),module_attrs(learn.model)
    with warnings.catch_warnings(): warnings.simplefilter('ignore'); r = learn.precision_report(time=True, n_steps=1)
    assert_unchanged(before, state(learn))
    assert_same_attrs(attrs, module_attrs(learn.model))
    assert set(r.cannot_run) == {m for m,ok in runs.items() if not ok}, (runs, r.reasons)
    assert set(r.timings) == {'fp32'} | {m for m,ok in runs.items() if ok}
    assert all(f.module == 'rnn' and f.kind == 'LSTM' for f in r.cannot_run.values()), r.cannot_run
    assert r.recommended not in r.cannot_run
    with warnings.catch_warnings(): warnings.simplefilter('ignore'); learn.to_auto_precision()
    fit_quiet(learn)

class KeepsLast(nn.Module):
    "Adds `x @ h` to its output, `h` being its last output, kept in the dtype it came out in: outside autocast `h` must be fp32"
    def __init__(self): super().__init__(); self.lin,self.h = nn.Linear(1, 1),None
    def forward(self, x):
        out = self.lin(x) if self.h is None else self.lin(x) + x @ self.h
        self.h = out.detach()[:1, :1]
        return out

def test_timed_modes_start_alike(fast_probes):
    "Each timed step starts from the model's state before the first: a bf16 step's kept tensor never reaches an fp32 step."
    learn = tiny_learner(model=KeepsLast)
    fit_quiet(learn)
    h = learn.model.h
    r = learn.precision_report(time=True, n_steps=2)
    assert set(r.timings) == {'fp32', 'bf16', 'fp16'} and not r.cannot_run
    assert learn.model.h is h

# ---- memory over a session --------------------------------------------------------------------------------------

def mlp_learner(width=256):
    "A tiny learner on an MLP wide enough for low-bit state (tensors of 4,096 elements or more)"
    model = lambda: nn.Sequential(nn.Linear(1, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))
    return tiny_learner(model=model, opt_func=Adam)

def test_memory_predicted_for_every_mode():
    "`report.memory` has a row for each mode's call, ordered as their memory is, counted on this model's own terms."
    learn = mlp_learner()
    r = learn.precision_report()
    df,P = r.memory,sum(p.numel() for p in learn.model.parameters())
    assert list(df.index) == list(memory._MEMORY_MODES)
    peak = df['peak']
    assert (peak["to_bf16(pure=True, update='stochastic', opt_state='8bit')"] < peak["to_bf16(pure=True, opt_state='8bit')"]
            < peak['to_bf16(pure=True)'] < peak['to_bf16(master=True)'])
    assert peak["to_bf16(opt_state='8bit')"] < peak['to_bf16()'] and (df['peak'] >= df['fit']).all()
    rt = memory._RUNTIME_CPU_BYTES  # the process's own, on a CPU
    assert df.loc['to_fp32()', 'fit'] == 16 * P + rt and df.loc['to_bf16(master=True)', 'between'] == 16 * P + rt  # fastai's layout
    assert df.loc['to_bf16(pure=True)', 'between'] == df.loc['to_bf16(pure=True)', 'fit'] == 6 * P + 8 * P + rt  # kept between fits
    assert 'memory, predicted session peak' in str(r) and 'here for the learner' in str(r) and df['fits'].all()

def test_memory_says_what_does_not_fit(monkeypatch):
    "With little room on the device, the report names the modes too large for it; with none known, it says only the peaks."
    learn = mlp_learner()
    full = learn.precision_report().memory
    room = full.loc["to_bf16(pure=True, update='stochastic', opt_state='8bit')", 'peak'] + 1
    monkeypatch.setattr(advisor, 'device_free', lambda dev: room - memory._held(learn))
    r = learn.precision_report()
    assert r.room == room and r.memory['fits'].tolist()[:7] == [False] * 6 + [True], r.memory['fits']
    assert 'too large: fp32, AMP, AMP 8-bit state, master, pure kahan, pure kahan 8-bit state' in str(r)
    monkeypatch.setattr(advisor, 'device_free', lambda dev: None)
    r = learn.precision_report()
    assert r.room is None and r.memory['fits'].isna().all() and 'here for the learner' not in str(r)

def test_memory_terms_follow_the_learner():
    "Frozen parameters are fixed bytes, not trained ones; the optimizer's state count is its own (SGD with momentum: one)."
    from fastai.basics import SGD
    learn = mlp_learner()
    t0 = learn.precision_report().memory.loc['to_fp32()', 'fit']
    learn.model[2].weight.requires_grad_(False)
    learn.opt_func = partial(SGD, mom=.9)
    df = learn.precision_report().memory
    n = 256 * 256
    P = sum(p.numel() for p in learn.model.parameters())
    rt = memory._RUNTIME_CPU_BYTES
    assert t0 == 16 * P + rt and df.loc['to_fp32()', 'fit'] == 12 * (P - n) + 4 * n + rt  # Adam's two states to one; a frozen weight

def test_slow_family_is_not_tried(mock_hw, monkeypatch):
    """On a CPU whose flags call fp16 fast (AVX512-FP16 and AMX, faked) and whose fp16 convolutions measure slow (faked: 0.04x),
    the report on a model with convolutions counts fp16 slow and says why, runs no fp16 trial step (the step that took 19 s on
    such a Xeon), and picks bf16; on an MLP the same measures leave fp16 fast and tried"""
    import mpx.hardware
    amx = cpu_hardware({'avx512f', 'avx512_fp16', 'amx_tile', 'amx_fp16', 'amx_bf16'}, name='A Xeon with AMX (faked)')
    mock_hw(amx)
    monkeypatch.setattr(mpx.hardware, '_speeds', {(torch.float16, 'conv'): .04, (torch.float16, 'matmul'): 3.1,
                                                  (torch.bfloat16, 'conv'): 1.9, (torch.bfloat16, 'matmul'): 2.5})
    tried = []
    monkeypatch.setattr(advisor, 'mode_failure', lambda model, xb, yb, loss_func, mode: tried.append(mode))
    times = dict(fp32=1e-3, bf16=.5e-3, fp16=.4e-3)  # a step of the pick, timed on a CPU: faster than fp32
    monkeypatch.setattr(advisor, 'time_steps', lambda model, xb, yb, loss_func, modes, n=5: {m: times[m] for m in modes})
    conv = lambda: nn.Sequential(nn.Unflatten(1, (1, 1, 1)), nn.Conv2d(1, 4, 1), nn.Flatten(), nn.Linear(4, 1))
    r = tiny_learner(model=conv).precision_report()
    assert (r.hardware.fp16_fast, r.hardware.bf16_fast, tried, r.recommended) == (False, True, ['bf16'], 'bf16')
    assert "fp16: fast for matmuls (Linear: 3.1x), slow for convolutions (Conv2d: 0.04x)" in ' '.join(r.reasons), r.reasons
    tried.clear()
    r = tiny_learner().precision_report()
    assert r.hardware.fp16_fast and sorted(tried) == ['bf16', 'fp16']

# ---- advice that holds on a busy machine (issue 70) -------------------------------------------------------------

AMX_BF16 = cpu_hardware({'avx512f', 'avx512_bf16', 'amx_tile', 'amx_bf16'}, name='A Xeon with AMX-BF16 (faked)')

@pytest.fixture
def amx_cpu(mock_hw, monkeypatch):
    "A CPU whose flags and probes call bf16 fast (2.5x on matmuls) and fp16 slow (0.04x): a Sapphire Rapids, faked"
    import mpx.hardware
    mock_hw(AMX_BF16)
    monkeypatch.setattr(mpx.hardware, '_speeds', {(torch.bfloat16, 'matmul'): 2.5, (torch.float16, 'matmul'): .04})

def fake_steps(monkeypatch, times:dict) -> list:
    "Make `time_steps` answer `times`; the modes of each call go to the list returned"
    calls = []
    def steps(model, xb, yb, loss_func, modes, n=5): calls.append(modes); return {m: times[m] for m in modes}
    monkeypatch.setattr(advisor, 'time_steps', steps)
    return calls

def test_timed_report_skips_what_probes_ruled_out(amx_cpu, monkeypatch):
    "With `time=True`, a mode its probes measured slow (fp16 here) gets no trial step and no timed step, and its line says so."
    calls,tried = fake_steps(monkeypatch, dict(fp32=1e-3, bf16=.5e-3)),[]
    monkeypatch.setattr(advisor, 'mode_failure', lambda model, xb, yb, loss_func, mode: tried.append(mode))
    r = tiny_learner().precision_report(time=True)
    assert calls == [('fp32', 'bf16')] and tried == ['bf16'] and r.recommended == 'bf16', (calls, tried, r.reasons)
    assert r.reasons[2] == 'fp16: slow for matmuls (Linear: 0.04x) against fp32, measured on this CPU; so not timed', r.reasons
    assert not said_against_thresholds(r.reasons)

@pytest.mark.parametrize('bf16_step,pick', [(1.17e-3, 'fp32'), (1e-3, 'bf16'), (.6e-3, 'bf16')])
def test_untimed_pick_is_timed_on_a_cpu(amx_cpu, monkeypatch, capsys, bf16_step, pick):
    """Without `time=True`, a CPU's pick is timed against fp32 on the model: a tabular learner whose bf16 step measures 17% slower
    (as on a Xeon with AMX) gets fp32, and `to_auto_precision()` applies it saying why; no slower, bf16, with its ratio."""
    calls = fake_steps(monkeypatch, dict(fp32=1e-3, bf16=bf16_step))
    learn = tabular_app_learner()
    r = learn.precision_report()
    assert calls == [('fp32', 'bf16')] and r.recommended == pick and set(r.timings) == {'fp32', 'bf16'}, (calls, r.reasons)
    assert ('slower than fp32' in r.reasons[0]) == (pick == 'fp32'), r.reasons[0]
    if pick == 'bf16': assert f"{1e-3/bf16_step:.2f}x fp32's speed on this model" in r.reasons[0], r.reasons[0]
    with warnings.catch_warnings(): warnings.simplefilter('ignore'); learn.to_auto_precision()
    said = capsys.readouterr().out
    assert said.startswith(f'to_auto_precision: {pick}, as precision_report() recommends ({r.reasons[0]})'), said
    assert [str(c.amp_mode) for c in precision_cbs(learn)] == ([] if pick == 'fp32' else [pick])

def test_untimed_gpu_pick_is_not_timed(mock_hw, monkeypatch):
    "On a GPU an untimed report trusts the hardware: no step is timed (`time=True` times them)."
    mock_hw(A100)
    calls = fake_steps(monkeypatch, dict(fp32=1., bf16=2., fp16=2.))
    r = tiny_learner().precision_report()
    assert calls == [] and r.recommended == 'bf16' and r.timings is None

def test_unmeasurable_probe_leaves_the_flags(mock_hw, monkeypatch):
    "Probes whose readings disagree (a busy machine) measure nothing: no verdict flips, the flags' stands, and the line says so."
    import mpx.hardware
    mock_hw(AMX_BF16)
    monkeypatch.setattr(mpx.hardware, '_speeds', {})
    monkeypatch.setattr(mpx.hardware, '_spreads', {})
    readings = iter([[.3, 1.4, .5, 1.2, .9, .4, 1.3, .8, 1.1], [.04, .03, .05]])  # bf16: a wall clock under load; fp16: truly slow
    monkeypatch.setattr(mpx.hardware, '_paired_ratios', lambda f32, half: next(readings))
    fake_steps(monkeypatch, dict(fp32=1e-3, bf16=.5e-3))
    r = tiny_learner().precision_report()
    assert r.hardware.bf16_fast and r.recommended == 'bf16' and r.hardware.measured_slow == ('fp16',), r.reasons
    assert r.reasons[1] == (AMX_BF16.notes[0] + "; not measurable for matmuls (Linear: readings from 0.5x to 1.2x, a busy machine) "
                            "against fp32, measured on this CPU"), r.reasons[1]
