"""Fused optimizer steps in every precision mode give what fastai's per-parameter loop gives, bit for bit on the CPU:
weights, buffers and every optimizer-state tensor, through freeze -> fit -> unfreeze -> fit_one_cycle(slice(...))."""
import functools
import pytest, torch
import fastai.callback.schedule  # noqa: F401 (fit_one_cycle)
from fastai.optimizer import RMSProp
from mpx.all import *
from fastai.basics import Callback
from mpx.test_utils import tiny_learner, tiny_split, ALL_MODES, OPTIMIZERS, state_of, state_diffs, precision_cb, fit_quiet

pytestmark = pytest.mark.filterwarnings('ignore::UserWarning')
OPTS = {**{k: OPTIMIZERS[k] for k in ('sgd', 'adam', 'radam', 'qhadam', 'lamb', 'larc', 'ranger')}, 'rmsprop': RMSProp}

def run(mode, opt, fused):
    "freeze -> fit -> unfreeze -> fit_one_cycle with discriminative lrs, `wd_bn_bias=False`, in `mode` with or without fused steps"
    learn = tiny_learner(bn=True, splitter=tiny_split, opt_func=OPTS[opt], lr=1e-2, wd=1e-2, wd_bn_bias=False, n_trn=4, n_val=1)
    ALL_MODES[mode](learn, fused=fused)
    learn.freeze(); fit_quiet(learn, 1)
    learn.unfreeze(); fit_quiet(learn, 1, 'fit_one_cycle', lr_max=slice(1e-3, 1e-2))
    return state_of(learn),precision_cb(learn).total_steps

CELLS = [(m, o) for m in ALL_MODES for o in OPTS if m in ('amp_bf16', 'master_fp16_flat', 'pure_kahan') or o in ('adam', 'ranger', 'lamb')]

@pytest.mark.parametrize('mode,opt', CELLS, ids=[f'{m}-{o}' for m,o in CELLS])
def test_fused_equals_loop(mode, opt):
    "Every mode with fused steps ends bit-identical to the same mode with fastai's loop."
    (fused,n1),(loop,n2) = run(mode, opt, True),run(mode, opt, False)
    assert n1 == n2 == 8
    assert not state_diffs(loop, fused), state_diffs(loop, fused)[:3]

@pytest.mark.parametrize('mode', ALL_MODES)
def test_fused_installed_and_removed(mode):
    "`fused=True` installs multi-tensor steps for the fit only; `fused=False` leaves fastai's; neither outlives the fit."
    for fused in (True, False):
        learn = tiny_learner(opt_func=OPTS['adam'])
        ALL_MODES[mode](learn, fused=fused)
        seen = []
        class Probe(Callback):
            order = 11
            def before_step(self): seen.append('step' in vars(self.learn.opt) or 'zero_grad' in vars(self.learn.opt))
        fit_quiet(learn, 1, cbs=Probe())
        assert set(seen) == {fused}
        assert 'step' not in vars(learn.opt) and 'zero_grad' not in vars(learn.opt)
