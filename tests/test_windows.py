"""The eager step in windows (issue 35's peak memory): a step worked a window at a time, a large parameter cut into
pieces, gives what a step of the whole bucket gives, bit for bit, in every mode, state kind and fastai optimizer; pieces
are cut where every step function is elementwise, and never where one is not (Lamb's norms)."""
import pytest, torch
from torch import nn
from fastai.basics import Callback, first
from mpx.all import *
from mpx.flat import Bucket
from mpx.patches import is_mpx_precision
from mpx.test_utils import tiny_learner, ALL_MODES, OPTIMIZERS, fit_quiet, state_diffs, weights

pytestmark = pytest.mark.filterwarnings('ignore::UserWarning')
MODES = {k: ALL_MODES[k] for k in ('amp_bf16', 'amp_fp16', 'master_bf16', 'pure_kahan', 'pure_stochastic')}
STATES = ['fp32', 'bf16', '8bit', '4bit']
OPTS = ['sgd', 'adam', 'radam', 'qhadam', 'lamb', 'ranger']

def big(): return nn.Sequential(nn.Linear(1, 5000), nn.ReLU(), nn.Linear(5000, 1))  # 5,000 weights a layer: low-bit state

class Chunk(Callback):
    "The engine's `chunk` for the fit"
    order = 100
    def __init__(self, chunk): self.chunk = chunk
    def before_train(self): first(self.learn.cbs, is_mpx_precision).fused_steps.chunk = self.chunk

@pytest.fixture
def pieces(monkeypatch):
    "How many pieces of a parameter the windows stepped"
    n,clipped = [0],Bucket.clipped
    def counted(self, lo, hi): n[0] += 1; return clipped(self, lo, hi)
    monkeypatch.setattr(Bucket, 'clipped', counted)
    return n

def fitted(mode, opt_state, opt, chunk) -> dict:
    learn = tiny_learner(model=big, opt_func=OPTIMIZERS[opt], lr=1e-2, n_trn=4, cbs=Chunk(chunk))
    fit_quiet(MODES[mode](learn, opt_state=opt_state), 2)
    return dict(weights=weights(learn), opt=learn.opt.state_dict())

@pytest.mark.parametrize('opt', OPTS)
@pytest.mark.parametrize('opt_state', STATES)
@pytest.mark.parametrize('mode', list(MODES))
def test_pieces_bit_for_bit(mode, opt_state, opt, pieces):
    "Windows of 512 elements (4,096 where nothing is widened: each weight in pieces) against one window: the same weights and state, bit for bit."
    if mode == 'amp_fp16' and opt_state not in ('fp32', '8bit'): pytest.skip('fp16 AMP runs with two state kinds: its CPU kernels are slow')
    whole = fitted(mode, opt_state, opt, 1<<22)
    assert pieces[0] == 0
    cut = fitted(mode, opt_state, opt, 512)
    assert (pieces[0] > 0) == (opt != 'lamb'), pieces[0]  # 10,000 weights: windows in every mode, pieces where elementwise
    assert state_diffs(whole, cut) == []

def test_pieces_differ_when_wrong(pieces, monkeypatch):
    "The check can fail: a piece that read the `step` its first piece had already counted would debias differently."
    from mpx import eager
    whole = fitted('pure_kahan', '8bit', 'adam', 1<<22)
    monkeypatch.setattr(eager, '_as_before', lambda b, i, d: None)
    assert state_diffs(whole, fitted("pure_kahan", "8bit", "adam", 512)) != []

def test_default_chunk_cpu():
    "On a CPU a window holds 131,072 elements by default (cache-sized; see `default_chunk`)."
    learn = tiny_learner(model=big, opt_func=OPTIMIZERS['adam'], n_trn=4)
    learn.to_bf16(pure=True, opt_state='8bit')
    class Seen(Callback):
        order = 100
        def before_train(self): self.chunk = first(self.learn.cbs, is_mpx_precision).fused_steps.chunk
    fit_quiet(learn, 1, cbs=(s := Seen()))
    assert s.chunk == 131072
