"""Each public module works imported alone: a fresh interpreter imports only it (with fastai's basics), uses its public calls on
a learner built by hand, and loads no mpx module the arrows of DESIGN.md do not allow. The interpreters run in parallel."""
import json, os, subprocess, sys, textwrap
from concurrent.futures import ThreadPoolExecutor
import pytest

# DESIGN.md's arrows: `learner -> (amp, master, pure, fp8, advisor) -> callback -> (fused, plumbing, scaler, hardware, patches) -> core`;
# the step engine's pieces (flat, eager, compiled, foreign, lowbit) sit beside fused, and `warn` beside core
TIERS = dict(core=0, warn=0, hardware=1, scaler=1, fused=1, flat=1, eager=1, compiled=1, foreign=1, lowbit=1, plumbing=1, patches=1, progress=1, parallel=1, callback=2, distributed=4, amp=3, master=3, pure=3, fp8=3, advisor=3,
             learner=4, test_learners=5, test_utils=6, all=5, trial=1, memory=1, checkpoint=1)  # trial, memory: the advisor's parts; checkpoint: the callback's
MODE_MODULES = {'amp', 'master', 'pure', 'fp8'}  # no mode imports another mode
EXTRA = dict(advisor={'fp8'})  # the advisor is no mode: its report says what `to_fp8()` would convert (`fp8_table`, `real_fp8`)

def allowed(mod:str) -> set:
    "The mpx modules importing `mod` alone may load: itself, and those its tier's arrows reach"
    t = TIERS[mod]
    below = {m for m,u in TIERS.items() if u < t or (u == t and t == 1)}  # the modules under `callback` are not ordered among themselves
    return below | {mod} | EXTRA.get(mod, set())

# What runs after `import mpx.<mod>`: fastai's basics, a learner built by hand (`mpx.test_utils` would import `mpx.learner`)
HELPERS = '''
import sys, tempfile, warnings
warnings.simplefilter('ignore')  # bf16/fp16 are slow on some CPUs, fp8 is emulated on CPUs: warnings, not failures here
import torch
from torch import nn
from fastai.basics import *
from fastai.test_utils import synth_learner
import fastai.callback.fp16 as fastai_fp16

def learner():
    "fastai's `synth_learner` (y = 2x+3) on an MLP whose middle layer can take fp8, quiet, in a fresh directory"
    set_seed(0)
    model = nn.Sequential(nn.Linear(1, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    learn = synth_learner(model=model, path=tempfile.mkdtemp())
    learn.logger = noop
    for c in [c for c in learn.cbs if type(c).__name__ == 'ProgressCallback']: learn.remove_cb(c)
    return learn

def fit(learn, n=1): learn.fit(n); return learn
def precision(learn): return [c for c in learn.cbs if 'Precision' in type(c).__name__]
def not_loaded(name): assert name not in sys.modules, f"{name} was imported"
'''

USES = dict(
    parallel='''
from mpx.parallel import *
import torch.distributed as dist
assert not is_sharded(nn.Linear(2, 2))
assert compress_grads(nn.Linear(2, 2), torch.bfloat16) is None  # no DDP model: nothing to compress
learn = learner(); learn.save('p'); learn.load('p')  # a plain model's checkpoint: fastai's own
''',
    distributed='''
from mpx.distributed import *
from torch.distributed.fsdp import MixedPrecisionPolicy
from mpx.amp import MixedPrecision
p = fsdp_policy(MixedPrecision('bf16'))
assert p.param_dtype is torch.bfloat16 and p.reduce_dtype is torch.float32, p
assert fsdp_policy(None).param_dtype is None
learn = learner(); assert hasattr(learn, 'to_fsdp')
''',
    progress='''
from mpx.progress import *
learn = learner(); learn.quiet_progress(True)
assert type(learn.progress).__name__ == 'QuietProgress'
fit(learn)
''',
    core='''
from mpx.core import *
assert 'fastai.learner' not in LOADED_FIRST  # core knows nothing of fastai's Learner
assert AMPMode('BF16') is AMPMode.BF16 and AMPMode(torch.float16) is AMPMode.FP16 and AMPMode.BF16.dtype is torch.bfloat16
''',
    hardware='''
from mpx.hardware import *
hw = detect_hardware('cpu')
assert hw.device == 'cpu' and isinstance(hw.bf16_fast, bool), hw
assert slow_reason(cpu_hardware({'avx2'}), 'bf16') and warn_if_slow(cpu_hardware({'avx2'}), 'fp16') in (True, False)
''',
    scaler='''
from mpx.scaler import *
s = LossScaler(init_scale=8., growth_interval=1)
assert float(s.scale_loss(torch.tensor(1.))) == 8.
ok = s.unscale_and_check([torch.tensor([8., float('inf')])])  # unscales, checks, updates
assert not ok and s.scale == 4. and s.skipped_updates == 1, s
t = LossScaler(); t.load_state_dict(s.state_dict()); assert t.scale == 4.
''',
    fused='''
from mpx.fused import *
a,b = learner(),learner()
from mpx.core import Fused
a.create_opt(); steps = FusedSteps(a.opt)
assert steps.own_step and steps.fused is Fused.FLAT, steps
fit(a); fit(b)  # fastai's loop in `b`: the same weights, bit for bit
assert all(torch.equal(p, q) for p,q in zip(a.model.parameters(), b.model.parameters()))
steps.undo()
''',
    flat='''
from mpx.flat import *
ps = [nn.Parameter(torch.randn(s)) for s in (3, 70)]
b = Bucket(ps, Kind(), flat=True, group=0)
assert b.offs == [0, 64] and all(p.data_ptr() == b.w.data_ptr() + 4*o for p,o in zip(ps, b.offs))
''',
    eager='''
from mpx.eager import *
from fastai.optimizer import Adam, Lamb, weight_decay, lamb_step
assert [w[0] for w in plan(Adam([nn.Parameter(torch.zeros(2))], lr=1e-3).cbs)] == ['run']*5
assert plan([lamb_step])[0][0] == 'param' and plan([lambda p, **kw: None]) is None
''',
    compiled='''
from mpx.compiled import *
from mpx.flat import Bucket, Kind
ps = [nn.Parameter(torch.zeros(2)) for _ in range(2)]
b = Bucket(ps, Kind(), flat=True, group=0); b.dicts = [{'step': 3}, {}]
assert DeviceSteps(b).t.tolist() == [3., 0.]
''',
    foreign='''
from mpx.foreign import *
from mpx.fused import FusedSteps
from mpx.pure import KahanKind
from fastai.optimizer import OptimWrapper
learn = learner(); learn.opt_func = partial(OptimWrapper, opt=torch.optim.SGD); learn.create_opt()
kind = KahanKind()
steps = FusedSteps(learn.opt, lambda p: kind)
assert not steps.own_step and 'step' in vars(learn.opt)  # a torch optimizer steps the widened weights, swapped in
steps.undo(); assert 'step' not in vars(learn.opt)
''',
    lowbit='''
from mpx.lowbit import *
x = torch.randn(512)
c,s = quantize(x, dynamic_map(), 256)
assert torch.equal(quantize(dequantize(c, s, dynamic_map(), 256), dynamic_map(), 256)[0], c)
assert state_bytes('8bit') < state_bytes('bf16') < state_bytes('fp32') == 4.
''',
    warn='''
from mpx.warn import *
with warnings.catch_warnings(record=True) as ws:
    warnings.simplefilter('always'); warn_user('here')
assert ws[0].filename == '<string>' and str(ws[0].message) == 'here', ws[0]
''',
    plumbing='''
from mpx.plumbing import *
import mpx.plumbing
assert all(hasattr(mpx.plumbing, n) for n in mpx.plumbing.__all__) and 'FitState' in mpx.plumbing.__all__
''',
    patches='''
from mpx.patches import *
learn = learner()
learn.add_cb(fastai_fp16.MixedPrecision())
try: learn.add_cb(fastai_fp16.MixedPrecision()); raise AssertionError('a second precision callback was added')
except ValueError as e: assert 'already has the precision callback' in str(e)
learn._set_precision()  # what every `to_*` switch ends with (mpx.learner, mpx.fp8)
assert precision(learn) == []
fit(learn).save('ck', with_opt=True); learn.load('ck', with_opt=True)
''',
    callback='''
from mpx.callback import *
learn = learner()
learn.add_cb(PrecisionCallback('bf16'))
assert precision(fit(learn))[0].total_steps > 0
''',
    amp='''
from mpx.amp import *
for mode in ('bf16', 'fp16'):
    learn = learner()
    learn.add_cb(MixedPrecision(mode))
    assert fit(learn).mixed_precision.total_steps > 0 and learn.mixed_precision.amp_mode == mode
''',
    master='''
from mpx.master import *
learn = learner()
learn.add_cb(MasterPrecision(loss_scale=512))
assert fit(learn).master_precision.total_steps > 0
assert {p.dtype for p in learn.model.parameters()} == {torch.float32}
learn.save('ck', with_opt=True); learn.load('ck', with_opt=True)
''',
    pure='''
from mpx.pure import *
learn = learner()
learn.add_cb(PureBF16())
assert fit(learn).mixed_precision.total_steps > 0 and {p.dtype for p in learn.model.parameters()} == {torch.bfloat16}  # kept
learn.remove_cb(learn.mixed_precision)  # ends the layout kept between fits
assert {p.dtype for p in learn.model.parameters()} == {torch.float32}
''',
    fp8='''
from mpx.fp8 import *
learn = learner().to_fp8()
assert type(learn.mixed_precision) is FP8Precision and learn.mixed_precision.fp8_layers == ['2']
assert fit(learn).mixed_precision.total_steps > 0
not_loaded('mpx.learner')
''',
    advisor='''
from mpx.advisor import *
import mpx.advisor
learn = learner()
assert learn.precision_report().recommended in ('fp32', 'bf16', 'fp16')
mpx.advisor.detect_hardware = lambda device=None: cuda_hardware('A100 (mock)', (8,0), True)  # bf16 fast: recommended
assert learn.precision_report().recommended == 'bf16'
not_loaded('mpx.learner')
learn.to_auto_precision()
got = [type(c).__module__ + '.' + type(c).__name__ for c in precision(learn)]
assert got == ['mpx.amp.MixedPrecision'], got  # not fastai's
fit(learn)
''',
    learner='''
from mpx.learner import *
learn = learner()
assert type(fit(learn.to_fp16()).mixed_precision).__name__ == 'MixedPrecision'
assert type(fit(learn.to_bf16(pure=True)).mixed_precision).__name__ == 'PureBF16'
try: learn.to_fp16(pure=True); raise AssertionError('to_fp16(pure=True) was accepted')
except ValueError as e: assert 'pure training' in str(e)
assert precision(fit(learn.to_fp32())) == []
''',
    trial='''
from mpx.trial import *
learn = learner()
xb,yb = learn.dls.one_batch()
with fp32_trial(learn.model) as m: assert set(time_steps(m, (xb,), (yb,), learn.loss_func, n=1)) >= {'fp32'}
''',
    checkpoint='''
from mpx.checkpoint import *
class Host(CheckpointState):
    "The least a callback mixing it in gives it: a model, no fit under way"
    fused_steps = fit_state = _outer = None
    def __init__(self, model): self.model = model
h = Host(nn.Linear(2, 3))
assert not h.layout_kept and torch.equal(h.fp32_value(h.model.weight), h.model.weight.detach())
assert h.load_fp32_model_state({'weight': torch.zeros(3, 2), 'bias': torch.ones(3)}) and h.model.bias.sum() == 3
''',
    memory='''
from mpx.memory import *
learn = learner()
xb,yb = learn.dls.one_batch()
t = memory_terms(learn.model, (xb,), (yb,), learn.loss_func)
assert t.params == 321 and session_peaks(t, 'amp')['peak'] > 0 and len(memory_frame(t)) > 5
''',
    test_learners='''
from mpx.test_learners import *
learn = fit_quiet(tiny_learner().to_bf16())
assert learn.mixed_precision.total_steps > 0
''',
    test_utils='''
from mpx.test_utils import *
learn = fit_quiet(tiny_learner().to_bf16())
assert learn.mixed_precision.total_steps > 0
''',
    all='''
from mpx.all import *
import mpx.all
assert all(n in globals() for n in mpx.all.__all__)
learn = fit(learner().to_bf16())
assert isinstance(learn.mixed_precision, MixedPrecision) and isinstance(learn.precision_report(), PrecisionReport)
fit(learn.to_fp8()); fit(learn.to_auto_precision())
''',
)

def script(mod:str) -> str:
    "Import `mpx.<mod>` first and print which mpx modules that loaded, then use it"
    name = 'mpx.all' if mod == 'all' else f'mpx.{mod}'
    head = (f"import sys, json\nimport {name}\nLOADED_FIRST = set(sys.modules)\n"
            "print('LOADED', json.dumps(sorted(n[4:] for n in LOADED_FIRST if n.startswith('mpx.'))))\n")
    return head + HELPERS + textwrap.dedent(USES[mod])

def run(mod:str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS='ignore')
    return subprocess.run([sys.executable, '-c', script(mod)], capture_output=True, text=True, timeout=300, env=env)

@pytest.fixture(scope='module')
def runs(request):
    "The interpreters of the modules this session tests, started together (a few at a time)"
    mods = [it.callspec.params['mod'] for it in request.session.items
            if it.module.__name__ == __name__ and hasattr(it, 'callspec') and 'mod' in it.callspec.params]
    with ThreadPoolExecutor(max(2, min(4, os.cpu_count() or 2))) as ex: yield {m: ex.submit(run, m) for m in dict.fromkeys(mods)}

def test_every_module_listed():
    "Every module of the package has its check here, and a tier."
    import mpx
    from pathlib import Path
    mods = {p.stem for p in Path(mpx.__file__).parent.glob('*.py')} - {'__init__', '_modidx'}
    assert mods == set(USES) == set(TIERS)

def test_allowed():
    "The arrows as the checks read them: a mode may not load another mode, `core` loads nothing of mpx, `learner` loads the modes."
    assert allowed('core') == {'core'} and not (allowed('amp') & (MODE_MODULES - {'amp'})) and 'fp8' not in allowed('pure')
    assert allowed('learner') >= MODE_MODULES | {'advisor', 'callback'} and 'learner' not in allowed('advisor')

@pytest.mark.parametrize('mod', list(USES))
def test_alone(runs, mod):
    "`import mpx.<mod>` alone: its public calls work, and it loads only the mpx modules its arrows reach."
    r = runs[mod].result()
    assert r.returncode == 0, f"mpx.{mod} alone failed:\n{r.stderr[-3000:]}"
    loaded = set(json.loads(next(l for l in r.stdout.splitlines() if l.startswith('LOADED '))[7:]))
    assert loaded <= allowed(mod), f"import mpx.{mod} loaded {sorted(loaded - allowed(mod))}, against DESIGN.md's arrows"
