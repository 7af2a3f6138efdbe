"""Why the compiled step has twins of fastai's step functions: fastai's own functions compiled into the kernel, against
mpx's kernel, one Adam step (decoupled weight decay) over 4M fp32 elements, timed side by side in interleaved rounds on
one thread.

- `mpx`: the engine's kernels for the chain (`mpx.compiled._kernel`: the run's scalars, then the elementwise step).
- `fastai's functions`: one compiled function calling fastai's `weight_decay`, `average_grad`, `average_sqr_grad`,
  `step_stat` and `adam_step` as fastai's loop calls them (on copies, written back), the step count a 0-dim tensor on
  the device as the compiled step keeps it. They compile whole (`radam_step` does not: it branches on the count), but
  inductor computes their scalar expressions (`debias`'s `mom**step`) again for every element.

    PYTHONPATH=. .venv/bin/python bench/derived_step.py
"""
import statistics, sys
from functools import partial
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).parent))
from _common import clock, header
from fastai.optimizer import weight_decay, average_grad, average_sqr_grad, step_stat, adam_step, _update
from mpx.compiled import _kernel, _static_chain, _hypers, _state_keys
from mpx.flat import Kind
from mpx.lowbit import DenseStore

N,ROUNDS = 4_000_000,15
CHAIN = (weight_decay, partial(average_grad, dampening=True), average_sqr_grad, step_stat, adam_step)  # fastai's Adam
HYPER = dict(lr=1e-3, mom=.9, sqr_mom=.99, eps=1e-5, wd=1e-2)

class Item:
    "A run as fastai's step functions see a parameter"
    def __init__(self, data, grad): self.data,self.grad = data,grad

def fastais(tensors:dict, hyper:dict):
    "fastai's functions on the run, as its loop calls them, the results written back"
    param = Item(tensors['w'].clone(), tensors['g'].clone())
    state = dict(grad_avg=tensors['grad_avg'].clone(), sqr_avg=tensors['sqr_avg'].clone(), step=tensors['steps'][0].clone(), do_wd=True)
    for step_fn in CHAIN: state = _update(state, step_fn(param, **{**state, **hyper}))
    tensors['w'].copy_(param.data)
    for key in ('grad_avg', 'sqr_avg'): tensors[key].copy_(state[key])
    tensors['steps'].copy_(state['step'])  # `step_stat`'s `step += 1`, on a copy

def run_tensors() -> dict:
    torch.manual_seed(0)
    return dict(w=torch.randn(N), g=torch.randn(N), grad_avg=torch.randn(N), sqr_avg=torch.rand(N), steps=torch.zeros(1))

def main():
    header("fastai's step functions compiled as they are, against mpx's kernels (Adam, one step, 4M fp32 elements)",
           'a ratio: the time of the kernel of fastai\'s functions over mpx\'s (above 1: fastai\'s is slower)')
    chain = _static_chain(CHAIN, HYPER)
    scalars = {k: torch.tensor(v) for k,v in _hypers(chain, HYPER).items()} | {'found': torch.tensor(0.)}
    ours_t,theirs_t = run_tensors(),run_tensors()
    scalar_fn,step_fn = _kernel(Kind(), DenseStore(), chain, _state_keys(chain))
    theirs = torch.compile(fastais, dynamic=True, fullgraph=True)
    def ours(): step_fn(ours_t, scalars, scalar_fn(scalars, ours_t['steps']), {})
    def fastai_fns(): theirs(theirs_t, HYPER)
    times = {ours: [], fastai_fns: []}
    for _ in range(2): ours(); fastai_fns()  # compiled, warm
    for _ in range(ROUNDS):
        for fn in (ours, fastai_fns):
            start = clock(); fn(); times[fn].append(clock() - start)
    ratios = [t / o for o,t in zip(times[ours], times[fastai_fns])]
    gap = float((ours_t['w'] - theirs_t['w']).abs().max())
    print(f"mpx's kernels:        {statistics.median(times[ours])*1e3:6.2f} ms a step")
    print(f"fastai's functions:   {statistics.median(times[fastai_fns])*1e3:6.2f} ms a step")
    print(f"ratio (median of {ROUNDS} paired rounds): {statistics.median(ratios):.2f}x; largest weight difference after "
          f"{ROUNDS + 2} steps: {gap:.1e}")

if __name__ == '__main__': main()
