"mpx under fastai's `distrib_ctx`: 2 processes on CPU with gloo over loopback, launched by torchrun, both modes."
import json, math
import pytest, torch
from mpx.all import *
from mpx.test_utils import tiny_learner, fit_quiet
import dist_worker
from torchrun import launch

DIST_MODES = list(dist_worker.DIST_MODES)

@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    "Per mode: the two ranks' results, and a 1-process run on the same global batch"
    out = tmp_path_factory.mktemp('dist')
    launch('dist_worker.py', out/'two', *DIST_MODES)
    dist_worker.main(str(out/'one'), *DIST_MODES)
    read = lambda d,r: json.loads((d/f'rank{r}.json').read_text())
    return {m: (read(out/'two'/m, 0), read(out/'two'/m, 1), read(out/'one'/m, 0)) for m in DIST_MODES}

@pytest.mark.parametrize('mode', DIST_MODES)
def test_ranks_agree_at_every_step(runs, mode):
    "Every rank has the same loss scale and skips at every step, and bit-identical weights."
    r0,r1,_ = runs[mode]
    assert r0['scales'] == r1['scales'] and r0['skips'] == r1['skips'] and r0['weights'] == r1['weights']
    assert len(r0['scales']) == 8

@pytest.mark.parametrize('mode', DIST_MODES)
def test_overflow_on_one_rank_skips_everywhere(runs, mode):
    "An inf (fp16) or a nan (bf16, AMP and master) in rank 1's gradients makes both ranks skip that step and name the same parameter."
    r0,r1,_ = runs[mode]
    assert r0['skips'] == r1['skips'] == [False]*3 + [True] + [False]*4
    assert r0['last_overflow'] == r1['last_overflow'] == '0.weight'
    assert all(map(math.isfinite, r0['weights'] + r1['weights'])), 'the skipped step reached the weights'

@pytest.mark.parametrize('mode', DIST_MODES)
def test_matches_one_process(runs, mode):
    "Two processes on half batches match one process on the whole batch, step for step and within tolerance."
    r0,_,one = runs[mode]
    assert r0['scales'] == one['scales'] and r0['skips'] == one['skips']
    assert torch.allclose(torch.tensor(r0['weights']), torch.tensor(one['weights']), atol=1e-3 if 'bf16' in mode else 1e-4)

@pytest.mark.parametrize('mode', DIST_MODES)
def test_checkpoint_written_once_loaded_everywhere(runs, mode):
    "Only rank 0 writes the checkpoint; every rank loads the same loss scale, step log and weights from it."
    r0,r1,_ = runs[mode]
    assert (r0['saves'], r1['saves'], r0['files']) == (1, 0, ['ck.pth'])
    for r in (r0, r1): assert r['loaded'] == dict(loss_scale=r0['loss_scale'], scales=r0['scales'], weights=r0['weights'])

def test_accelerate_mixed_precision_refused():
    "Accelerate's own mixed precision next to an mpx callback fails before anything changes; without it the learner trains."
    import fastai.distributed
    for to in (lambda l: l.to_bf16(), lambda l: l.to_bf16(master=True)):
        learn = to(tiny_learner(lr=1e-2)).to_distributed(mixed_precision='bf16', cpu=True)
        w = [p.detach().clone() for p in learn.model.parameters()]
        with pytest.raises(ValueError, match="runs Accelerate with mixed_precision='bf16', and an mpx callback applies mixed precision too"): fit_quiet(learn)
        assert all(torch.equal(a, b) for a,b in zip(w, learn.model.parameters())) and {p.dtype for p in learn.model.parameters()} == {torch.float32}
        learn.remove_cb(fastai.distributed.DistributedTrainer)
        fit_quiet(learn)
