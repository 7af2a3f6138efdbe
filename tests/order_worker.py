"""One rank of tests/test_sharded_data.py: `torchrun --standalone --nproc_per_node=2 tests/order_worker.py OUTDIR`. A learner
sharded with `to_fsdp` on 20 samples whose input and target are their index, in batches of 4, unshuffled: it records the
samples each rank trains on and what `get_preds` returns, in OUTDIR/rank{R}.json."""
import json, os, sys
from pathlib import Path
import torch
from torch import nn
from fastai.basics import *
from mpx.all import *
from mpx.distributed import *

N,BS = 20,4

class Seen(Callback):
    "The sample indices of each training batch this rank sees"
    def __init__(self): self.batches = []
    def before_batch(self):
        if self.training: self.batches.append(self.x.view(-1).long().tolist())

def main(out):
    x = torch.arange(N, dtype=torch.float32)[:, None]
    dls = DataLoaders.from_dsets(list(zip(x, x)), list(zip(x, x)), bs=BS, shuffle=False, num_workers=0)
    seen = Seen()
    learn = Learner(dls, nn.Sequential(nn.Linear(1, 8), nn.ReLU(), nn.Linear(8, 1)), loss_func=MSELossFlat(), cbs=seen)
    learn.to_bf16().to_fsdp()
    with learn.no_bar(), learn.no_logging():
        learn.fit(1)
        inps,preds,targs = learn.get_preds(with_input=True)
    res = dict(train=seen.batches, inputs=inps.view(-1).long().tolist(), targets=targs.view(-1).long().tolist(), n_preds=len(preds))
    (Path(out)/f"rank{os.environ['RANK']}.json").write_text(json.dumps(res))

if __name__ == '__main__': main(*sys.argv[1:])
