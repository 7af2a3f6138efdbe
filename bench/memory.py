"""Peak memory of one training step: fp32 vs mpx bf16 AMP, mpx fp16 AMP and mpx master fp16 (per-tensor and flat), on the CPU.

The CPU allocator keeps no statistics (`torch.cuda.max_memory_allocated` is CUDA's), so the second step of a fit runs
under `torch.profiler.profile(profile_memory=True)`: its allocation and free events, summed in time order, give the
peak the step allocates on top of what lived before it; that (weights, gradients, masters, optimizer state, the last
step's outputs) is counted storage by storage. MLP with Adam, fastai's default. Run: `.venv/bin/python bench/memory.py`."""
import time
from _common import *
from torch.profiler import profile, ProfilerActivity

N_IN,HIDDEN,BS = 256,256,2048

MODES = {'fp32': lambda l: l, **MPX_MODES}
PARTS = ['weights', 'grads', 'masters', 'optimizer state', 'other']

def tensors(x) -> list:
    "The tensors in `x` (a tensor, or nested lists, tuples and dicts of them)"
    if isinstance(x, torch.Tensor): return [x]
    if isinstance(x, dict): x = list(x.values())
    return [t for o in x for t in tensors(o)] if isinstance(x, (list, tuple, L)) else []

def live(learn) -> dict:
    "Bytes of each part of what lives between steps, each storage counted once, in the first part holding it"
    model_ps = list(learn.model.parameters())
    masters = [p for p in learn.parameters() if all(p is not q for q in model_ps)]
    parts = dict(weights=model_ps + list(learn.model.buffers()), grads=[p.grad for p in model_ps], masters=masters + [m.grad for m in masters],
                 **{'optimizer state': list(learn.opt.state.values()), 'other': [learn.pred, learn.loss, learn.loss_grad]})
    seen,res = set(),{}
    for k,v in parts.items():
        ss = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors(v)}
        res[k] = sum(n for p,n in ss.items() if p not in seen); seen |= ss.keys()
    return res

def peak_allocated(prof) -> int:
    "The peak of the bytes allocated minus freed, in time order, over the profiled events"
    evs = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == '[memory]')
    tot,peak = 0,0
    for _,n in evs: tot += n; peak = max(peak, tot)
    return peak

class PeakMemory(Callback):
    "Profile the memory of training step `at`: `live` before it in `before`, the peak it allocates on top in `step_peak`"
    order = -100  # first in before_batch, so the whole step is profiled
    def __init__(self, at=1): self.at = at
    def before_batch(self):
        if self.iter != self.at: return
        self.before,self.prof = live(self.learn),profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.prof.start()
    def after_batch(self):
        if self.iter == self.at: self.prof.stop(); self.step_peak = peak_allocated(self.prof)

def measure(make) -> dict:
    "The parts living before the second step of a fit in mode `make`, and the step's own peak, in bytes"
    learn = make(learner(mlp(N_IN, HIDDEN), synth_batches((BS, N_IN), n=2), cbs=PeakMemory(), opt_func=Adam))
    pm = fit_quiet(learn).peak_memory
    return {**pm.before, 'step': pm.step_peak}

def mb(n) -> str: return f"{n/2**20:.2f}"

def plot(res):
    plt = plt_agg()
    fig,ax = plt.subplots(figsize=(8, 3.8))
    bottom = [0.]*len(res)
    for k in PARTS + ['step']:
        v = [r[k]/2**20 for r in res.values()]
        ax.bar(list(res), v, bottom=bottom, label='step allocations (peak)' if k == 'step' else k)
        bottom = [a+b for a,b in zip(bottom, v)]
    ax.set(ylabel='MiB', title=f"Peak memory of a training step: MLP {N_IN}->{HIDDEN}->{HIDDEN}->10, batch {BS}, Adam (CPU profiler)")
    ax.tick_params(axis='x', labelsize=8); ax.legend(fontsize=7)
    savefig(fig, 'memory')

def main():
    header("peak memory of a training step", f"MLP {N_IN}->{HIDDEN}->{HIDDEN}->10, batch {BS}, fastai Adam; the second step of a fit, profiled (torch.profiler, profile_memory=True)")
    res = {k: measure(f) for k,f in MODES.items()}
    total = {k: sum(r.values()) for k,r in res.items()}
    table(['mode'] + [f'{p} MiB:' for p in PARTS] + ['step allocations MiB:', 'peak MiB:', 'vs fp32:'],
          [[k] + [mb(r[p]) for p in PARTS] + [mb(r['step']), mb(total[k]), f"{total[k]/total['fp32']:.2f}x"] for k,r in res.items()])
    plot(res)

if __name__ == '__main__':
    s = time.perf_counter(); main(); print(f"# {time.perf_counter()-s:.0f} s")
