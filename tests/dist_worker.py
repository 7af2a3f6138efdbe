"""One rank of a distributed mpx run, launched by tests/test_distributed.py:
`torchrun --standalone --nproc_per_node=2 tests/dist_worker.py OUTDIR MODE...` (or with no torchrun, as one process).
For each mode, trains a tiny regression under `learn.distrib_ctx()` on CPU with gloo and writes this rank's results to
OUTDIR/MODE/rank{R}.json."""
import json, sys, os
from pathlib import Path
import torch
from torch import nn
from fastai.basics import *
from fastai.distributed import *
from mpx.all import *

# fastai 2.8's DistributedDL broadcasts the shuffled indices through CUDA (it was written for NCCL); with gloo on a CPU
# there is no CUDA, so broadcast a CPU tensor instead. This is the only change, and it is fastai's data loader's, not mpx's.
def _cpu_broadcast(self, t, rank):
    t = torch.tensor(t, dtype=torch.long); torch.distributed.broadcast(t, rank); return t.tolist()
DistributedDL._broadcast = _cpu_broadcast

DIST_MODES = dict(amp_fp16=lambda l: l.to_fp16(init_scale=2.**8, growth_interval=2), amp_bf16=lambda l: l.to_bf16(),
             master=lambda l: l.to_fp16(loss_scale=2.**8, dynamic=True, growth_interval=2),
             master_bf16=lambda l: l.to_bf16(master=True))

class InjectOnRank(Callback):
    "Make the first weight's gradient `value` (inf or nan) during backward on rank `rank` only, at the steps in `at`: before DDP all-reduces it, as a real overflow"
    order = 9
    def __init__(self, rank, at, value=float('inf')): self.rank,self.at,self.value,self.i = rank,set(at),value,0
    def before_fit(self):
        if rank_distrib() == self.rank: self.hook = first(get_model(self.model).parameters()).register_hook(lambda g: torch.full_like(g, self.value) if self.i in self.at else g)
    def after_backward(self): self.i += 1

def learner(mode, path, world):
    "32 samples, one global batch an epoch: 32/world per rank"
    set_seed(0, reproducible=True)
    x = torch.randn(32, 1); y = 2*x + 3
    # num_workers=0: fastai forks loader workers by default, and a fork beside gloo's threads can deadlock
    dls = DataLoaders.from_dsets(list(zip(x, y)), list(zip(x, y)), bs=32 // world, shuffle=False, num_workers=0)
    learn = Learner(dls, nn.Sequential(nn.Linear(1, 8), nn.ReLU(), nn.Linear(8, 1)), loss_func=MSELossFlat(), lr=1e-2, path=path)
    return DIST_MODES[mode](learn)

def run(mode, out):
    out,world,rank = Path(out)/mode,max(num_distrib(), 1),rank_distrib()
    out.mkdir(parents=True, exist_ok=True)
    learn = learner(mode, out, world)
    learn.add_cb(InjectOnRank(rank=world - 1, at=[3], value=float('nan' if 'bf16' in mode else 'inf')))  # bf16: no loss scale, yet a nan must be skipped too
    with learn.distrib_ctx(sync_bn=False, cpu=True), learn.no_bar(), learn.no_logging(): learn.fit(8)
    cb = next(c for c in learn.cbs if isinstance(c, (MixedPrecision, MasterPrecision)))
    saves,torch_save = [],torch.save
    torch.save = lambda *a, **k: (saves.append(1), torch_save(*a, **k))[1]
    learn.save('ck')                                 # fastai writes on rank 0 only
    torch.save = torch_save
    if world > 1: torch.distributed.barrier()
    new = learner(mode, out, world); new.load('ck')  # every rank loads it
    ncb = next(c for c in new.cbs if isinstance(c, (MixedPrecision, MasterPrecision)))
    res = dict(scales=cb.scales, skips=cb.step_log.skips, loss_scale=cb.loss_scale, last_overflow=cb.last_overflow and cb.last_overflow.param,
               weights=torch.cat([p.detach().flatten() for p in learn.model.parameters()]).tolist(),
               loaded=dict(loss_scale=ncb.loss_scale, scales=ncb.scales, weights=torch.cat([p.detach().flatten() for p in new.model.parameters()]).tolist()),
               saves=len(saves), files=sorted(p.name for p in (out/'models').glob('*')))
    (out/f'rank{rank}.json').write_text(json.dumps(res))

def main(out, *modes):
    for mode in modes: run(mode, out)

if __name__ == '__main__': main(*sys.argv[1:])
