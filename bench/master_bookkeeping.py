"""Per-step bookkeeping of the master-weights mode: mpx's `MasterPrecision` against fastai 2.8's legacy helpers.

One step's bookkeeping is: half gradients into the fp32 masters, unscale, overflow check, masters back into the
half model. The optimizer step itself is left out (it is the same in both). Rounds are interleaved and the medians
compared; host syncs are counted with `CountSyncs`. Run: `.venv/bin/python bench/master_bookkeeping.py`."""
import platform, statistics, time
import torch
from torch import nn
from fastai.basics import Learner, MSELossFlat, SGD
from fastai.test_utils import synth_dbunch
from fastai.callback.fp16 import get_master, to_master_grads, grad_overflow, to_model_params
from mpx.all import *
from mpx.test_utils import CountSyncs

SCALE = 512.

def make_learner(n, numel):
    "A learner whose model is `n` fp32 parameter tensors of `numel` elements"
    model = nn.ParameterList([nn.Parameter(torch.randn(numel)) for _ in range(n)])
    learn = Learner(synth_dbunch(), model, loss_func=MSELossFlat(), opt_func=SGD)
    learn.create_opt()
    return learn

def grad_source(params):
    "A function giving every (half) parameter a finite half gradient, as a backward pass would, from tensors made once"
    grads = [torch.randn_like(p) for p in params]
    def give():
        for p,g in zip(params, grads): p.grad = g
    return give

def mpx_setup(n, numel, flat):
    learn = make_learner(n, numel)
    cb = MasterPrecision(loss_scale=SCALE)  # mpx's masters are always flat: `flat` is fastai's alone
    learn.add_cb(cb); cb._begin_fit()
    give = grad_source(list(learn.model.parameters()))
    def step():
        give(); cb.after_backward(); cb.before_step(); cb.after_step()
        learn.opt.zero_grad()  # fastai zeroes the optimizer's (master) gradients after every step
    return step

def fastai_setup(n, numel, flat):
    learn = make_learner(n, numel)
    model_pgs,master_pgs = get_master(learn.opt, flat)
    for p in learn.model.parameters(): p.data = p.data.half()
    give = grad_source([p for pg in model_pgs for p in pg])
    def step():  # NonNativeMixedPrecision's before_step and after_step, without clipping
        give()
        if grad_overflow(model_pgs): return
        to_master_grads(model_pgs, master_pgs, flat)
        for pg in master_pgs:
            for p in pg: p.grad.div_(SCALE)
        learn.model.zero_grad()
        to_model_params(model_pgs, master_pgs, flat)
        for pg in master_pgs:
            for p in pg: p.grad.zero_()  # what fastai's opt.zero_grad does to the masters
    return step

def timed(step, k):
    t = time.perf_counter()
    for _ in range(k): step()
    return (time.perf_counter() - t) / k

def syncs(step):
    with CountSyncs() as c: step()
    return c.n

def main(sizes=(10, 100, 1000), numel=1024, rounds=7, k=5):
    print(f"# master-mode bookkeeping per step: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"# {numel} elements per tensor, {rounds} interleaved rounds of {k} steps, medians\n")
    print("| tensors | flat | fastai ms/step | mpx ms/step | mpx speed-up | fastai syncs/step | mpx syncs/step |")
    print("|---:|:---:|---:|---:|---:|---:|---:|")
    for n in sizes:
        for flat in (False, True):
            steps = dict(fastai=fastai_setup(n, numel, flat), mpx=mpx_setup(n, numel, flat))
            for s in steps.values(): s()  # warm up
            times = {name: [] for name in steps}
            for _ in range(rounds):
                for name,s in steps.items(): times[name].append(timed(s, k))
            f,m = (statistics.median(times[name]) for name in ('fastai', 'mpx'))
            print(f"| {n} | {flat} | {f*1e3:.3f} | {m*1e3:.3f} | {f/m:.1f}x | {syncs(steps['fastai'])} | {syncs(steps['mpx'])} |")

if __name__ == '__main__': main()
