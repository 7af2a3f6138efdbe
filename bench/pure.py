"""Pure bf16 (`PureBF16`): the 1e-4 ramp, accuracy on the digits CNN and a small AWD_LSTM language model, resident bytes per
parameter and the optimizer step's peak, and step time against AMP bf16. Run from the repo root: `.venv/bin/python bench/pure.py`.

Every mode trains its own copy of one seeded model on the same data order. Accuracy runs use 2 threads (`BENCH_THREADS`),
timings the one thread of `_common`."""
import argparse, random, sys
from pathlib import Path
sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent/'demo')]
from _common import *
from fastai.callback.schedule import *
from fastai.text.all import get_language_model, AWD_LSTM, awd_lstm_lm_config, LMDataLoader, Perplexity
from fastai.callback.rnn import ModelResetter, RNNCallback
from mpx.pure import *
from mpx.learner import *

MODES = {  # name: the callback that makes a learner train in that mode (None: fp32)
    'fp32': lambda: None, 'AMP bf16': lambda: MixedPrecision('bf16'), 'master bf16': lambda: MasterPrecision('bf16'),
    'pure kahan': lambda: PureBF16('kahan'), 'pure stochastic': lambda: PureBF16('stochastic')}

def cpu_flags() -> str:
    "The CPU's bf16-relevant features from /proc/cpuinfo"
    try: fl = set(next(l for l in open('/proc/cpuinfo') if l.startswith('flags')).split())
    except (OSError, StopIteration): return 'unknown'
    return ', '.join(f for f in ('avx2', 'avx512f', 'avx512_bf16', 'amx_bf16', 'amx_tile') if f in fl) or 'none of avx2/avx512/amx'

# ---- the 1e-4 ramp

class One(Module):
    "One weight of 1.0; its output `w*x` in fp32"
    def __init__(self): self.w = nn.Parameter(torch.ones(1))
    def forward(self, x): return (self.w * x.to(self.w.dtype)).float()

class Track(Callback):
    "The weight's value after each step: `w + c` under `PureBF16`"
    order = 100
    def before_fit(self): self.vals = []
    def after_step(self):
        bw = getattr(self.learn.cbs.filter(lambda c: isinstance(c, PureBF16)).attrgot('bf16_weights'), 'items', [None])
        p = self.model.w
        self.vals.append(float(bw[0].value_of(p) if bw and bw[0] is not None else p.detach()))

def ramp(mode, opt, n=1000):
    "`n` steps of lr 1e-4 on a weight of 1.0 whose gradient is 1, in `mode` ('fp32', 'plain bf16', 'kahan', 'stochastic'): the trajectory"
    xs = torch.ones(n, 1)
    dls = DataLoaders(DataLoader(list(zip(xs, xs)), bs=1), DataLoader(list(zip(xs[:1], xs[:1])), bs=1))
    model = One()
    if mode == 'plain bf16': model.bfloat16()
    cbs = [Track(), NoValidate()] + ([PureBF16(mode)] if mode in ('kahan', 'stochastic') else [])
    opt_func = partial(SGD, mom=0.) if opt == 'SGD' else partial(Adam, eps=1e-12)
    learn = Learner(dls, model, loss_func=lambda p,y: p.mean(), opt_func=opt_func, lr=1e-4, wd=0., cbs=cbs)
    fit_quiet(learn)
    return learn.track.vals

def ramp_table(plot=True):
    rows,trajs = [],{}
    for opt in ('SGD', 'Adam'):
        for mode in ('fp32', 'plain bf16', 'kahan', 'stochastic'):
            trajs[opt, mode] = v = ramp(mode, opt)
            rows.append([opt, mode, f'{v[-1]:.4f}'])
    print('## The 1e-4 ramp: a weight of 1.0 stepped by 1e-4 1000 times (fp32 arithmetic reaches 0.9000)\n')
    table(['optimizer', 'weights', 'final weight:'], rows)
    if not plot: return
    plt = plt_agg()
    fig,axs = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax,opt in zip(axs, ('SGD', 'Adam')):
        for mode in ('fp32', 'plain bf16', 'kahan', 'stochastic'): ax.plot(trajs[opt, mode], label=mode, lw=1.2, ls='--' if mode == 'fp32' else '-')
        ax.set(title=f'{opt}, lr 1e-4, gradient 1', xlabel='step'); ax.grid(alpha=.3)
    axs[0].set_ylabel('weight'); axs[0].legend()
    savefig(fig, 'pure_ramp')

# ---- accuracy

def digits_learner(cb, seed):
    from digits import get_dls, get_model
    set_seed(seed); model = get_model(); set_seed(seed)
    return Learner(get_dls(bs=64), model, loss_func=CrossEntropyLossFlat(), opt_func=Adam, metrics=accuracy, cbs=L(cb))

def corpus(n_tok=60_000, vocab=64, seed=0) -> list:
    "A token stream from a random Markov chain in which each token has 4 equally likely successors: the best perplexity is 4"
    g = torch.Generator().manual_seed(seed)
    nxt = torch.randint(2, vocab, (vocab, 4), generator=g)
    toks,b = [],2
    choice = torch.randint(0, 4, (n_tok,), generator=g)
    for i in range(n_tok): b = int(nxt[b, choice[i]]); toks.append(b)
    return torch.tensor(toks), vocab

def lm_learner(cb, seed):
    toks,vocab = corpus()
    n = len(toks) * 9 // 10
    set_seed(seed)
    dls = DataLoaders(LMDataLoader([toks[:n]], bs=32, seq_len=32, shuffle=True), LMDataLoader([toks[n:]], bs=32, seq_len=32))
    cfg = {**awd_lstm_lm_config, 'emb_sz': 64, 'n_hid': 128, 'n_layers': 2}
    model = get_language_model(AWD_LSTM, vocab, config=cfg)
    return Learner(dls, model, loss_func=CrossEntropyLossFlat(), opt_func=Adam, metrics=[accuracy, Perplexity()], cbs=[ModelResetter(), RNNCallback()] + L(cb))

def accuracy_table(seeds=(0, 1)):
    print(f'## Accuracy (validation, mean of seeds {list(seeds)}; fit_one_cycle with Adam)\n')
    for task,make,epochs,lr in (('digits CNN', digits_learner, 6, 1e-2), ('AWD_LSTM LM', lm_learner, 6, 2e-2)):
        rows = []
        res = {}
        for name,cb in MODES.items():
            vals = []
            for s in seeds:
                learn = make(cb(), s)
                with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(epochs, lr)
                with learn.no_bar(): vals.append([float(v) for v in learn.validate()[1:]])
            res[name] = [sum(v[i] for v in vals) / len(vals) for i in range(len(vals[0]))]
        for name,r in res.items():
            acc = f'{100*r[0]:.2f}'; d = f'{100*(r[0] - res["fp32"][0]):+.2f}'
            ppl = f'{r[1]:.3f} ({100*(r[1]/res["fp32"][1] - 1):+.2f}%)' if len(r) > 1 else ''
            rows.append([task, name, acc, d, ppl])
        table(['task', 'mode', 'accuracy %:', 'vs fp32 (points):', 'perplexity (vs fp32):'], rows)

# ---- memory

def _tensors(learn) -> list:
    "Every tensor a fit keeps between steps: weights, gradients, optimizer state, the precision callback's own"
    ts = [t for p in learn.model.parameters() for t in (p.data, p.grad) if t is not None] + list(learn.model.buffers())
    opt = learn.opt
    owners = [opt] if 'state' in vars(opt) else [opt.opt]
    if isinstance(opt, OptimWrapper): owners.append(opt.opt)
    for o in owners: ts += [v for st in o.state.values() for v in st.values() if isinstance(v, Tensor)]
    if getattr(opt, 'slow_weights', None) is not None: ts += [s for pg in opt.slow_weights for s in pg]
    for c in learn.cbs:
        if isinstance(c, MasterPrecision) and c.masters is not None: ts += [t for b in c.masters.bufs for t in (b.data, b.grad)]
        if isinstance(c, PureBF16) and c.bf16_weights is not None: ts += list(c.bf16_weights.comp.values()) + list(c.bf16_weights.fp32_kept.values())
    return ts

def nbytes(ts) -> int:
    "Bytes of the storages under `ts`, each counted once"
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in ts}.values())

class MemProbe(Callback):
    "Resident bytes between steps, and the optimizer step's transient peak (torch's profiler, CPU allocations)"
    order = 100
    def before_fit(self): self.resident,self.peak = 0,0
    def after_step(self): self.resident = nbytes(_tensors(self.learn))
    def before_step(self):
        if self.train_iter != 3: return
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True); self.prof.__enter__()
    def after_batch(self):
        if getattr(self, 'prof', None) is None: return
        self.prof.__exit__(None, None, None)
        evs = sorted(self.prof.events(), key=lambda e: e.time_range.start)
        run = peak = 0
        for e in evs: run += e.self_cpu_memory_usage; peak = max(peak, run)
        self.peak,self.prof = peak,None

def memory_table(opt_name='Adam', opt_func=Adam):
    batches = synth_batches((64, 512), n=6)
    rows = []
    for name,cb in MODES.items():
        set_seed(0); model = mlp(512, 1024)
        n = sum(p.numel() for p in model.parameters())
        learn = learner(model, batches, cbs=[MemProbe()] + L(cb()), opt_func=opt_func)
        fit_quiet(learn)
        rows.append([name, f'{learn.mem_probe.resident / n:.2f}', f'{learn.mem_probe.peak / 2**20:.2f}'])
    print(f'## Memory with {opt_name}: MLP 512-1024-1024-10 ({n:,} parameters)\n')
    table(['mode', 'resident bytes/param between steps:', 'optimizer step peak (MiB):'], rows)

# ---- step time

def speed_table(rounds=7):
    batches = synth_batches((256, 512), n=16)
    runs,learns = {},{}
    for name in ('fp32', 'AMP bf16', 'master bf16', 'pure kahan', 'pure stochastic'):
        set_seed(0)
        learns[name] = learner(mlp(512, 2048), batches, cbs=L(MODES[name]()), opt_func=Adam)
        runs[name] = learner_step(learns[name])
    res = interleaved(runs, rounds)
    print(f'## Step time: MLP 512-2048-2048-10, batch 256, Adam, {rounds} rounds\n')
    table(['mode', 'compute dtype', 'ms/step:', 'speed-up vs AMP bf16:'],
          [[k, dtype_of(learns[k]), f'{1e3*med(v):.2f}', f'{ratio(res["AMP bf16"], v):.2f}x'] for k,v in res.items()])

if __name__ == '__main__':
    ap = argparse.ArgumentParser()
    ap.add_argument('--only', default='ramp,accuracy,memory,speed')
    args = ap.parse_args()
    header('Pure bf16', f'CPU flags: {cpu_flags()}')
    parts = args.only.split(',')
    if 'ramp' in parts: ramp_table()
    if 'memory' in parts: memory_table(); memory_table('SGD with momentum', partial(SGD, mom=.9))
    if 'speed' in parts: speed_table()
    if 'accuracy' in parts:
        torch.set_num_threads(int(os.environ.get('BENCH_THREADS', 2)))
        accuracy_table()
