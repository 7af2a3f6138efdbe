"""The advisor's numbers against references of their own (issue 69): each operator family's measured speed against the timings
its probes took (a clock that moves by known amounts) and against a direct timing of the same op with torch, and the memory
terms against a hand count on a model mixing tensors below and above `MIN_LOWBIT` and against the bytes the step engine holds.
Each check has a planted control (`planted.py`) that it catches."""
import functools, math, statistics, time
from types import SimpleNamespace
import pytest, torch
from torch import nn
from fastai.basics import Adam
import mpx.hardware, mpx.memory
from mpx.hardware import Hardware
from mpx.memory import memory_terms, session_peaks
from mpx.test_utils import tiny_learner, fit_quiet, ALL_MODES, precision_cb
from planted import conv_speed_inverted, memory_state_all_lowbit

pytestmark = pytest.mark.filterwarnings("ignore:bf16 is slow", "ignore:fp16 is slow")

# ---- each family's speed, against the time its probes took

MS = 1e-3
TIMES = {('matmul', torch.float32): MS, ('matmul', torch.bfloat16): MS / 2, ('matmul', torch.float16): 10 * MS,
         ('conv', torch.float32): 2 * MS, ('conv', torch.bfloat16): 40 * MS, ('conv', torch.float16): MS / 2,
         ('recurrent', torch.float32): 3 * MS, ('recurrent', torch.bfloat16): 6 * MS, ('recurrent', torch.float16): 3 * MS}

class Clocked:
    "The advisor's probes made to take `TIMES` on a clock of their own: the timings its speeds must be made of"
    def __init__(self, monkeypatch):
        self.now = 0.
        monkeypatch.setattr(mpx.hardware, '_probe', self.probe)
        clock = lambda: self.now  # whichever clock the advisor reads: wall or CPU time
        monkeypatch.setattr(mpx.hardware, 'time', SimpleNamespace(perf_counter=clock, thread_time=clock, process_time=clock))
        monkeypatch.setattr(mpx.hardware, '_speeds', {})  # none measured before
    def probe(self, family:str, dtype):
        def run(): self.now += TIMES[family, dtype]
        return run

def want_speed(family:str, mode:str) -> float:
    dtype = dict(bf16=torch.bfloat16, fp16=torch.float16)[mode]
    return TIMES[family, torch.float32] / TIMES[family, dtype]

@pytest.mark.parametrize('mode', ['bf16', 'fp16'])
@pytest.mark.parametrize('family', ['matmul', 'conv', 'recurrent'])
def test_op_speed_is_fp32_time_over_the_dtype_time(family, mode, monkeypatch):
    "Each family's speed in each 16-bit dtype is fp32's probe time over the dtype's: above 1 faster, below 1 slower"
    Clocked(monkeypatch)
    got = mpx.hardware.op_speed(family, mode)
    want = want_speed(family, mode)
    assert got == pytest.approx(want, rel=1e-9), f'{family} in {mode}: {got:.3g}x, the probes took {want:.3g}x'

def hardware_fast() -> Hardware:
    "A CPU whose flags call both 16-bit dtypes fast (faked): only the measures can say slow"
    return Hardware('cpu', 'a CPU (faked)', True, True, ('amx_bf16', 'amx_fp16'), ('bf16: AMX (faked)', 'fp16: AMX (faked)'))

def check_measured(monkeypatch):
    "Assert `measured` on matmuls and convolutions calls each dtype fast or slow as its timed speeds say, naming them"
    Clocked(monkeypatch)
    hw = mpx.hardware.measured(hardware_fast(), {'matmul': 'Linear', 'conv': 'Conv2d'})
    assert not hw.bf16_fast, 'bf16: convolutions 20x slower than fp32 called fast'
    assert 'slow for convolutions (Conv2d: 0.05x)' in hw.notes[0] and 'matmuls (Linear: 2x)' in hw.notes[0], hw.notes[0]
    assert not hw.fp16_fast, 'fp16: matmuls 10x slower than fp32 called fast'
    assert 'fast for convolutions (Conv2d: 4x)' in hw.notes[1] and 'slow for matmuls (Linear: 0.1x)' in hw.notes[1], hw.notes[1]

def test_measured_calls_each_dtype_as_timed(monkeypatch):
    "A dtype slow on one of the model's families is slow, and the note names each family's measured speed"
    check_measured(monkeypatch)

def test_measured_keeps_the_flags_where_every_family_is_fast(monkeypatch):
    "Fast on every family measured (convolutions 4x in fp16), the flags' verdict and note stand"
    Clocked(monkeypatch)
    hw = mpx.hardware.measured(hardware_fast(), {'conv': 'Conv2d'})
    assert hw.fp16_fast and hw.notes[1] == 'fp16: AMX (faked)', hw
    assert not hw.bf16_fast and 'Conv2d: 0.05x' in hw.notes[0], hw

def test_conv_speed_control(monkeypatch):
    "Planted: the measured speed of convolutions inverted (1/r) is caught"
    with conv_speed_inverted(), pytest.raises(AssertionError, match='convolutions'): check_measured(monkeypatch)

# ---- against a direct timing of the same op with torch

def direct_speed(family:str, dtype) -> float:
    "fp32's time over `dtype`'s of the probe's op (`_probe`'s sizes), timed here with torch: one thread's CPU time, the median of 5 pairs"
    def op(dt):
        torch.manual_seed(0)
        if family == 'conv': m,x = nn.Conv2d(16, 16, 3, padding=1).to(dt),torch.randn(8, 16, 32, 32, dtype=dt, requires_grad=True)
        else: m,x = nn.Linear(256, 256).to(dt),torch.randn(64, 256, dtype=dt, requires_grad=True)
        def run(): m(x).float().sum().backward()
        run()  # warm-up
        return run
    def cpu_time(run, n:int=3) -> float:
        t0 = time.thread_time()
        for _ in range(n): run()
        return time.thread_time() - t0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU time on one thread: what other processes on the machine do not change
    try:
        f32,half = op(torch.float32),op(dtype)
        return statistics.median(cpu_time(f32) / cpu_time(half) for _ in range(5))
    finally: torch.set_num_threads(threads)

@pytest.mark.parametrize('family', ['matmul', 'conv'])
def test_op_speed_against_a_direct_timing(family, monkeypatch):
    "The advisor's bf16 speed of a family, timed anew, within 4x of a direct timing of the same op (this CPU: far from 1 either way)"
    monkeypatch.setattr(mpx.hardware, '_speeds', {})
    got,ref = mpx.hardware.op_speed(family, 'bf16'),direct_speed(family, torch.bfloat16)
    if math.isnan(got): pytest.skip(f"the advisor's readings of bf16 {family} disagreed (a busy machine): it measured nothing")
    if .5 < ref < 2: pytest.skip(f'bf16 {family} measures {ref:.2f}x fp32 here: too close to 1 to tell a ratio from its inverse')
    assert abs(math.log(got / ref)) < math.log(4), f'{family}: the advisor measured {got:.3g}x fp32, a direct timing {ref:.3g}x'

# ---- the memory terms, against a hand count and against the bytes the engine holds

def mixed_model():
    "Tensors below and at `MIN_LOWBIT` (4,096): a 64x64 weight (low-bit), a 60x64 one (not), biases, a BatchNorm's"
    return nn.Sequential(nn.Linear(1, 64), nn.ReLU(), nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Linear(64, 60), nn.ReLU(),
                         nn.Linear(60, 1))

# by hand: every trained element, those in tensors of 4,096 or more, the BatchNorm's buffers (two of 64 fp32, an int64 count)
P,LOW,FIXED = (64 + 64) + (4096 + 64) + (64 + 64) + (3840 + 60) + (60 + 1),4096,2 * 64 * 4 + 8
STATE_BYTES = {'fp32': 4, 'bf16': 2, '8bit': 1 + 4 / 256, '4bit': .5 + 4 / 128}  # a code and its share of a block's fp32 scale
WEIGHT_BYTES = dict(amp=8, master=12, kahan=6, stochastic=4)  # weights, gradients, masters, compensations

@functools.cache
def terms():
    learn = tiny_learner(model=mixed_model, opt_func=Adam)
    xb,yb = learn.dls.one_batch()
    return memory_terms(learn.model, (xb,), (yb,), learn.loss_func, Adam)

def test_memory_terms_by_hand(one_thread):
    "The terms count 8,477 trained elements, 4,096 of them in tensors large enough for low-bit state, Adam's two states"
    t = terms()
    assert (t.params, t.lowbit, t.largest, t.fixed, t.n_state) == (P, LOW, LOW, FIXED, 2), t

def hand_fit(mode:str, opt_state:str) -> float:
    "A fit's bytes by hand: the mode's bytes a weight, two Adam states (low-bit in tensors of 4,096 or more only), the fixed, the process's"
    state = 2 * (STATE_BYTES[opt_state] * LOW + 4 * (P - LOW))
    return WEIGHT_BYTES[mode] * P + state + FIXED + terms().runtime

FITS = [('kahan', '8bit'), ('kahan', '4bit'), ('stochastic', '8bit'), ('amp', 'bf16'), ('master', 'fp32')]

@pytest.mark.parametrize('mode,opt_state', FITS)
def test_session_peaks_fit_by_hand(mode, opt_state, one_thread):
    "A fit's predicted bytes are the hand count's: small tensors' state stays fp32 under every low-bit `opt_state`"
    got = session_peaks(terms(), mode, opt_state)['fit']
    want = hand_fit(mode, opt_state)
    assert got == pytest.approx(want, abs=1e-6), f'{mode}, {opt_state}: predicted {got:.0f} B, by hand {want:.0f}'

def held_state(opt_state:str) -> int:
    "Bytes of optimizer state the step engine holds after a pure kahan fit of the mixed model with Adam (flat buffers and block scales)"
    learn = ALL_MODES['pure_kahan'](tiny_learner(model=mixed_model, opt_func=Adam, n_trn=2), opt_state=opt_state)
    fit_quiet(learn)
    fs = precision_cb(learn).fused_steps
    return sum(t.nbytes for b in fs.buckets for t in [*b.state_bufs.values(), *b.store_meta.values()])

@functools.cache
def held_fp32() -> int: return held_state('fp32')

@pytest.mark.parametrize('opt_state', ['bf16', '8bit', '4bit'])
def test_state_prediction_against_the_engine(opt_state, one_thread):
    "What a low-bit `opt_state` saves on fp32 state, predicted, is what the step engine's buffers save after a fit"
    t = terms()
    predicted = session_peaks(t, 'kahan', 'fp32')['fit'] - session_peaks(t, 'kahan', opt_state)['fit']
    held = held_fp32() - held_state(opt_state)
    assert predicted == pytest.approx(held, rel=.02), f'{opt_state}: predicted to save {predicted:.0f} B, the engine saves {held}'

def test_memory_state_control(one_thread):
    "Planted: the prediction holding every tensor's state low-bit is caught"
    with memory_state_all_lowbit(), pytest.raises(AssertionError, match='by hand'): test_session_peaks_fit_by_hand('kahan', '8bit', None)
