"""Fused optimizer steps in every precision mode give what fastai's per-parameter loop gives, bit for bit on the CPU:
weights, buffers and every optimizer-state tensor, through freeze -> fit -> unfreeze -> fit_one_cycle(slice(...)) -> freeze -> fit
with a bias that misses some gradients; and the ops a step dispatches do not grow with the parameter tensors, at the steps of
RAdam's two branches and of Lookahead's sync too. (`test_fused.py` tests the engine alone, on optimizers without a learner.)"""
import functools
import pytest, torch
import fastai.callback.schedule  # noqa: F401 (fit_one_cycle)
from fastai.optimizer import RMSProp
from mpx.all import *
from fastai.basics import Callback
from mpx.test_utils import tiny_learner, tiny_split, ALL_MODES, OPTIMIZERS, state_of, state_diffs, precision_cb, fit_quiet

pytestmark = [pytest.mark.filterwarnings('ignore::UserWarning'), pytest.mark.usefixtures('one_thread')]
OPTS = {**{k: OPTIMIZERS[k] for k in ('sgd', 'adam', 'radam', 'qhadam', 'lamb', 'larc', 'ranger')}, 'rmsprop': RMSProp}

class _DropGrad(Callback):
    "The last layer's bias gets no gradient in every third batch, before the mode takes or unscales the gradients"
    order = 5
    def after_backward(self):
        if self.iter % 3 == 1: self.learn.model[-1].bias.grad = None

def run(mode, opt, fused, probe=None):
    """freeze -> fit -> unfreeze -> fit_one_cycle with discriminative lrs -> freeze -> fit (frozen weights keep zeroed gradients: fastai
    steps them), `wd_bn_bias=False`, a bias missing some gradients, in `mode` with or without fused steps"""
    learn = tiny_learner(bn=True, splitter=tiny_split, opt_func=OPTS[opt], lr=1e-2, wd=1e-2, wd_bn_bias=False, n_trn=4, n_val=1,
                         cbs=[_DropGrad()] + ([probe] if probe else []))
    ALL_MODES[mode](learn, fused=fused)
    learn.freeze(); fit_quiet(learn, 1)
    learn.unfreeze(); fit_quiet(learn, 1, 'fit_one_cycle', lr_max=slice(1e-3, 1e-2))
    learn.freeze(); fit_quiet(learn, 1)
    return state_of(learn),precision_cb(learn).total_steps

CELLS = [(m, o) for m in ALL_MODES for o in OPTS if m in ('amp_bf16', 'master_fp16', 'pure_kahan') or o in ('adam', 'ranger', 'lamb')]

class _Loop(Callback):
    "Whether fastai's own `Optimizer.step` ran each step (no engine step installed on the optimizer)"
    order = 11
    def before_fit(self): self.own = []
    def before_step(self): self.own.append('step' not in vars(self.learn.opt))

@pytest.mark.parametrize('mode,opt', CELLS, ids=[f'{m}-{o}' for m,o in CELLS])
def test_fused_equals_loop(mode, opt):
    """Every mode with fused steps ends bit-identical to the same mode with fastai's loop: in AMP fastai's own `Optimizer.step`
    (no engine); in the master and pure modes, which fastai cannot step (its masters are GPU-only), the engine's per-parameter loop
    of fastai's step functions (`test_workflows` compares those with fp32 fastai, and their lr with a hand-written SGD)."""
    (fused,n1),(loop,n2) = run(mode, opt, True),run(mode, opt, False, probe := _Loop())
    assert n1 == n2 == 12
    if mode.startswith('amp'): assert probe.own and all(probe.own), "the loop side ran the engine's step: the engine against itself"
    assert not state_diffs(loop, fused), state_diffs(loop, fused)[:3]

@pytest.mark.parametrize('mode', ALL_MODES)
def test_fused_installed_and_removed(mode):
    """`fused=True` installs the engine's steps for the fit only; `fused=False` leaves fastai's own where the parameters are stepped in
    place (AMP), and runs fastai's loop on the masters or widened weights otherwise; nothing outlives the fit."""
    for fused in (True, False):
        learn = tiny_learner(opt_func=OPTS['adam'])
        ALL_MODES[mode](learn, fused=fused)
        seen = []
        class Probe(Callback):
            order = 11
            def before_step(self): seen.append('step' in vars(self.learn.opt) or 'zero_grad' in vars(self.learn.opt))
        fit_quiet(learn, 1, cbs=Probe())
        assert set(seen) == {fused or not mode.startswith('amp')}
        kept = mode.startswith('pure')  # pure bf16 keeps its layout, and its steps, between fits
        assert ('step' in vars(learn.opt) or 'zero_grad' in vars(learn.opt)) == kept
        learn.to_fp32()
        assert 'step' not in vars(learn.opt) and 'zero_grad' not in vars(learn.opt)

# ---- per-step work does not grow with the number of parameter tensors

from mpx.test_utils import CountOps

class OpsFrom(Callback):
    "First of all at `after_backward`: starts counting aten ops; `OpsTo` stops at the end of `after_step`"
    order = -100
    def __init__(self): self.counts,self.mode = [],None
    def after_backward(self): self.mode = CountOps().__enter__()
class OpsTo(Callback):
    order = 100
    def __init__(self, start): self.start = start
    def after_step(self):
        self.start.mode.__exit__(None, None, None); self.start.counts.append(self.start.mode.n)

def step_ops(mode, n_layers, opt, n_trn=2) -> list:
    "Aten ops of each optimizer step, from `after_backward` to the end of `after_step`, on a chain of `n_layers` Linear(4, 4)"
    model = lambda: torch.nn.Sequential(torch.nn.Linear(1, 4), *[torch.nn.Linear(4, 4) for _ in range(n_layers)], torch.nn.Linear(4, 1))
    learn = tiny_learner(model=model, opt_func=OPTS[opt], n_trn=n_trn)
    if mode: ALL_MODES[mode](learn)
    start = OpsFrom()
    fit_quiet(learn, 1, cbs=[start, OpsTo(start)])
    return start.counts

# every mode with SGD and Adam; RAdam's two branches and ranger's Lookahead sync (both from step 6) in a mode of each storage
OPS_CELLS = [(m, o, 2) for m in ALL_MODES for o in ('sgd', 'adam')] + [(m, o, 6) for m in ('amp_bf16', 'master_fp16', 'pure_kahan')
                                                                      for o in ('radam', 'ranger')]

@pytest.mark.parametrize('mode,opt,n', OPS_CELLS, ids=[f'{m}-{o}' for m,o,_ in OPS_CELLS])
def test_step_ops_do_not_grow(mode, opt, n):
    """At each step after the first (which builds the flat buffers) every mode dispatches as many aten ops at 100 parameter tensors as at
    10, from `after_backward` to the end of `after_step`."""
    few,many = step_ops(mode, 4, opt, n),step_ops(mode, 49, opt, n)
    assert len(few) == n and few[1:] == many[1:], (few, many)

@pytest.mark.parametrize('opt', ['sgd', 'adam', 'ranger'])
def test_fastai_loop_grows(opt):
    "The contrast: an fp32 learner (fastai's per-parameter loop) dispatches at least 4 more ops per step for each added tensor."
    assert step_ops(None, 49, opt)[-1] - step_ops(None, 4, opt)[-1] >= 4 * 2*45
