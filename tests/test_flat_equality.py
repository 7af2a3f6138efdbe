"Flat masters are a storage choice only: for every optimizer, flat and per-tensor masters leave bit-identical weights and optimizer state."
import pytest
from torch import nn
from hypothesis import given, settings, Phase, strategies as st
from fastai.basics import set_seed
import fastai.callback.schedule  # fit_one_cycle
from mpx.all import *
from mpx.test_utils import tiny_learner, tiny_split, state_of, state_diffs, MASTER_MODES, OPTIMIZERS

pytestmark = pytest.mark.filterwarnings('ignore::UserWarning')

def deep_model():
    "Two hidden layers and a BatchNorm: the body group holds two weights (weight decay) and four biases and BatchNorm parameters (none)"
    return nn.Sequential(nn.Linear(1, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))

def learner(opt, mode, flat, path):
    "A seeded quiet `deep_model` learner (two groups, weight decay) in `mode`, with flat or per-tensor masters"
    learn = tiny_learner(model=deep_model, n_trn=4, n_val=1, opt_func=OPTIMIZERS[opt], splitter=tiny_split, lr=1e-2, wd=1e-2, path=path)
    return MASTER_MODES[f'{mode}_flat' if flat else mode](learn)

OPS = {
    'fit': lambda l: l.fit(1),
    'fit_one_cycle': lambda l: l.fit_one_cycle(1, 1e-2),
    'fit_discrim': lambda l: l.fit(1, slice(1e-3, 1e-2), wd=1e-1),
    'freeze': lambda l: l.freeze(),
    'unfreeze': lambda l: l.unfreeze(),
    'save_load': lambda l: (l.save('ck', with_opt=True), l.load('ck', with_opt=True)),
    'save_load_noopt': lambda l: (l.save('ck', with_opt=False), l.load('ck', with_opt=False)),
}

def check_lockstep(opt, mode, ops, tmp_path):
    "Run `ops` on a per-tensor and a flat learner with the same seed before each op; after each op their snapshots are bit-identical"
    ref,flat = learner(opt, mode, False, tmp_path/'ref'),learner(opt, mode, True, tmp_path/'flat')
    for i,op in enumerate(ops):
        for l in (ref, flat): set_seed(i); OPS[op](l)
        if ref.opt is None: continue
        diffs = state_diffs(state_of(flat), state_of(ref))
        assert diffs == [], f'after {ops[:i+1]}, flat vs per-tensor: {diffs[:6]}'

_SEQ = ['fit', 'freeze', 'fit', 'unfreeze', 'fit_discrim', 'save_load', 'fit']

@pytest.mark.parametrize('opt', OPTIMIZERS)
def test_flat_equals_per_tensor(opt, tmp_path):
    "Every optimizer, fp16 masters, weight decay: fit, freeze, fit, unfreeze, fit with discriminative rates, save/load with state, fit give bit-identical results flat and per tensor."
    check_lockstep(opt, 'fp16', _SEQ, tmp_path)

@pytest.mark.parametrize('opt', ['adam', 'lamb', 'ranger', 'torch_adamw_foreach'])
def test_flat_equals_per_tensor_bf16(opt, tmp_path):
    "The same in bf16 master mode (no loss scale), for a plain, a layer-wise, a lookahead and a torch optimizer."
    check_lockstep(opt, 'bf16', _SEQ, tmp_path)

@settings(max_examples=8, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate])  # no shrinking: each example is a few fits
@given(opt=st.sampled_from(list(OPTIMIZERS)), mode=st.sampled_from(['fp16', 'bf16']),
       ops=st.lists(st.sampled_from(list(OPS)), min_size=2, max_size=6).map(lambda o: o + ['fit']))
def test_flat_equals_per_tensor_sequences(opt, mode, ops):
    "Random sequences of fits, freezing and checkpoints, with any optimizer: flat and per-tensor masters stay bit-identical."
    import tempfile, pathlib
    with tempfile.TemporaryDirectory() as d: check_lockstep(opt, mode, ops, pathlib.Path(d))
