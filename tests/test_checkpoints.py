"Nothing lost across checkpoints: the loss scale and the fp32 masters survive save/load, resume is bit-exact, plain fastai interoperates."
import random, subprocess, sys
from pathlib import Path
import pytest, torch
from fastai.basics import Callback, set_seed, load_learner
from fastai.callback.tracker import SaveModelCallback
import fastai.callback.schedule  # fine_tune, lr_find
from mpx.all import *
from mpx.test_utils import tiny_learner, fit_quiet, weights, precision_cb

TESTS = Path(__file__).parent
CKPT_MODES = dict(  # the fp16 modes with a scale that moves in these fits, but the legacy static one
    amp_fp16    = lambda l: l.to_fp16(init_scale=2.**8, growth_interval=3),
    amp_bf16    = lambda l: l.to_bf16(),
    master      = lambda l: l.to_fp16(loss_scale=8.),  # fastai v1's static scale: it stays
    master_dynamic = lambda l: l.to_fp16(loss_scale=8., dynamic=True, growth_interval=3),
    master_bf16 = lambda l: l.to_bf16(master=True),
)

class SeedEpochs(Callback):
    "Seed every epoch by its index (the DataLoader shuffles with its own `rng`), so a resumed run sees the same batches"
    def before_epoch(self): set_seed(100 + self.epoch, reproducible=True); self.dls.train.rng = random.Random(100 + self.epoch)

def learner(mode, path): return CKPT_MODES[mode](tiny_learner(lr=1e-2, path=path, cbs=SeedEpochs()))

def first_half(mode, path):
    "Train the first epoch of two and save with the optimizer state"
    learn = fit_quiet(learner(mode, path), 2, cbs=CancelAfter(1))
    learn.save('half', with_opt=True)
    return learn

class CancelAfter(Callback):
    "Stop the fit after `n` epochs (as an interrupted run would)"
    order = 100
    def __init__(self, n): self.n = n
    def after_epoch(self):
        if self.epoch + 1 >= self.n:
            from fastai.callback.core import CancelFitException
            raise CancelFitException()

def second_half(mode, path):
    "A new learner: load the checkpoint, train the second epoch"
    learn = learner(mode, path)
    learn.load('half', with_opt=True)
    return fit_quiet(learn, 2, start_epoch=1)

@pytest.mark.parametrize('mode', CKPT_MODES)
def test_resume_is_bit_exact(mode, tmp_path):
    "Train, save, load into a new learner, train on: bit-identical weights and the same scales as an uninterrupted run."
    whole = fit_quiet(learner(mode, tmp_path), 2)
    first_half(mode, tmp_path)
    resumed = second_half(mode, tmp_path)
    for a,b in zip(weights(whole), weights(resumed)): assert torch.equal(a, b)
    assert precision_cb(resumed).scales == precision_cb(whole).scales
    assert (precision_cb(resumed).loss_scale, precision_cb(resumed).total_steps) == (precision_cb(whole).loss_scale, 20)
    if mode in ('amp_fp16', 'master_dynamic'): assert len(set(precision_cb(whole).scales)) > 2  # the scale moved, so restoring it mattered
    if mode == 'master': assert set(precision_cb(whole).scales) == {8.}

@pytest.mark.parametrize('mode', ['amp_fp16', 'master_dynamic'])
def test_resume_in_a_new_process(mode, tmp_path):
    "The first half runs in another process; resuming here still matches the uninterrupted run bit for bit."
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); from test_checkpoints import first_half; first_half({mode!r}, {str(tmp_path)!r})"
    subprocess.run([sys.executable, '-c', code], check=True, cwd=TESTS, capture_output=True, timeout=120)
    resumed = second_half(mode, tmp_path)
    whole = fit_quiet(learner(mode, tmp_path), 2)
    for a,b in zip(weights(whole), weights(resumed)): assert torch.equal(a, b)
    assert precision_cb(resumed).scales == precision_cb(whole).scales

PLAIN = '''
import sys, warnings
warnings.simplefilter('error', UserWarning)
from functools import partial
from fastai.basics import *
set_seed(0)
learn = Learner(DataLoaders.from_dsets([(torch.randn(1), torch.randn(1))]*32, [(torch.randn(1), torch.randn(1))]*16, bs=16), nn.Sequential(nn.Linear(1,8), nn.ReLU(), nn.Linear(8,1)), loss_func=MSELossFlat(), opt_func=partial(SGD, mom=.9), path={path!r})
learn.create_opt()
{action}
assert 'mpx' not in sys.modules
'''

def plain_fastai(path, action):
    "Run `action` on a plain fastai learner in a process that never imports mpx"
    subprocess.run([sys.executable, '-c', PLAIN.format(path=str(path), action=action)], check=True, capture_output=True, timeout=120)

@pytest.mark.parametrize('mode', ['amp_fp16', 'master_dynamic'])
def test_mpx_checkpoint_loads_in_plain_fastai(mode, tmp_path):
    "A checkpoint written under mpx (mid-fit too) loads with its optimizer state in fastai without mpx, with the fp32 weights."
    learn = learner(mode, tmp_path)
    fit_quiet(learn, 2, cbs=SaveModelCallback(monitor='valid_loss', fname='ep', with_opt=True, every_epoch=True))
    learn.save('end', with_opt=True)
    w = torch.cat([p.flatten() for p in learn.model.parameters()])
    plain_fastai(tmp_path, f"learn.load('end'); assert torch.equal(torch.cat([p.flatten() for p in learn.model.parameters()]), torch.tensor({w.tolist()}))\nlearn.load('ep_0'); learn.fit(1)")

def test_plain_checkpoint_loads_under_mpx(tmp_path):
    "A checkpoint written by plain fastai loads under mpx with its optimizer state; the scale starts afresh."
    plain_fastai(tmp_path, "learn.fit(1); learn.save('plain', with_opt=True)")
    for mode in ('amp_fp16', 'master_dynamic'):
        init = 2.**8 if mode == 'amp_fp16' else 8.
        learn = fit_quiet(learner(mode, tmp_path))
        assert precision_cb(learn).loss_scale > init
        learn.load('plain', with_opt=True)
        assert precision_cb(learn).loss_scale == init
        fit_quiet(learn)

def test_load_before_first_fit(tmp_path):
    "A checkpoint loaded into a fresh learner before its first fit sets the scale that fit starts at."
    learn = fit_quiet(learner('amp_fp16', tmp_path))
    learn.save('ck')
    new = learner('amp_fp16', tmp_path)
    new.load('ck')
    assert new.mixed_precision.loss_scale == learn.mixed_precision.loss_scale != 2.**8
    fit_quiet(new)
    assert new.mixed_precision.scales[10] == learn.mixed_precision.loss_scale

def test_fine_tune_and_save_model_callback(tmp_path):
    "fine_tune keeps the scale across its phases, and SaveModelCallback's checkpoint carries the scale of its epoch."
    learn = learner('amp_fp16', tmp_path)
    with learn.no_bar(), learn.no_logging(): learn.fine_tune(2, freeze_epochs=1, cbs=SaveModelCallback(fname='best', every_epoch=True, with_opt=True))
    mp = learn.mixed_precision
    new = learner('amp_fp16', tmp_path)
    new.load('best_0')
    assert new.mixed_precision.scales == mp.scales[:20] and new.mixed_precision.total_steps == 20

def test_lr_find_restores_the_scale(tmp_path):
    "lr_find's trial steps leave the loss scale and the telemetry as they were."
    for mode in ('amp_fp16', 'master_dynamic'):
        learn = fit_quiet(learner(mode, tmp_path))
        before = (precision_cb(learn).loss_scale, precision_cb(learn).total_steps, precision_cb(learn).scales)
        with learn.no_bar(), learn.no_logging(): learn.lr_find(num_it=20, show_plot=False)
        assert (precision_cb(learn).loss_scale, precision_cb(learn).total_steps, precision_cb(learn).scales) == before
