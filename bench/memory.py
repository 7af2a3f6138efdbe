"""Memory of training with Adam on the CPU, in bytes a parameter: every mode with each `opt_state`, eager and compiled,
beside fastai fp32, fastai + optimi's Kahan AdamW (bf16 model) and fastai + torchao's `AdamW8bit`.

The CPU allocator keeps no statistics (`torch.cuda.max_memory_allocated` is CUDA's), so each arm runs under
`torch.profiler.profile(profile_memory=True)` from the model's creation to the end of its fit (the data is made before,
so it is not counted): the allocation and free events, summed in time order, give the bytes torch holds at any point.
"resident" is that sum at the start of the profiled step (`--at`, the second by default): everything that lives between
steps, whatever holds it (weights, gradients, masters, compensations, optimizer state in the engine's buffers, the
engine's reused workspaces). "peak" is its maximum during that step. "activations" is what the forward leaves alive for
the backward (the sum at the end of the loss less the resident; under AMP it includes autocast's bf16 copies of the
weights). "peak less act." subtracts it from the forward and backward phases' peaks (the step's phases after the
backward hold none); "first-step peak less act." is the same of the first step (which makes the optimizer state, and
compiles): the issue's targets apply to every step's peak. The resident part is also counted storage by storage from
the learner, the engine's buckets and workspaces, as a check. `--explain` profiles the stacks too and prints, for each
arm's profiled and first steps, where its peak falls and the sites (mpx's, fastai's frame and the aten op) of the
allocations made in the step and still held there; `--plot` draws `bench/plots/memory.png` ('wide'), else
`memory_<model>.png`.

Models (`--model`, `MODELS`): 'wide', an MLP of 21.0M parameters, 16.8M of them in one weight, at batch 16; 'deep', 21.0M
in twenty 1024x1024 layers, none over 1.05M (the eager windows: `chunk` elements, a larger parameter in pieces);
'small', the activation-heavy MLP of the earlier table. fastai's Adam; optimi's and torchao's AdamW with fastai's betas,
eps and decoupled weight decay. Run: `PYTHONPATH=. .venv/bin/python bench/memory.py` (`--quick` for the fp32-state arms
alone, `--arms a,b` to pick arms by name, `--model deep`, `--explain`, `--plot`)."""
import argparse, bisect, gc, itertools, time
from _common import *
from torch.profiler import profile, record_function, ProfilerActivity
from mpx.lowbit import param_bytes
from mpx.patches import is_mpx_precision

ADAM_KW = dict(betas=(.9, .99), eps=1e-5, weight_decay=1e-2)  # fastai's Adam defaults (wd decoupled), for the other optimizers
PHASES = ('start', 'fwd', 'bwd', 'end')  # marks in each step: its start, the end of the loss, of the backward, of the batch

# ---- the arms: name -> (what makes the learner train that way, the `param_bytes` mode, opt_state)

def deep_mlp(n_in=1024, width=1024, depth=20, n_out=10) -> nn.Module:
    "`depth` ReLU layers of `width`, then a linear head: parameters of at most `width**2` elements (1M), 21.0M in all"
    layers = [nn.Linear(n_in if i == 0 else width, width) for i in range(depth)]
    return nn.Sequential(*[m for l in layers for m in (l, nn.ReLU())], nn.Linear(width, n_out))

MODELS = {  # name: (the model's maker, its description, the batch size); the input is 1024 wide but in 'small' (256)
    'wide':  (partial(mlp, 1024, 4096), 'MLP 1024->4096->4096->10 (21.0M parameters, 16.8M of them in one 4096x4096 weight)', 16),
    'deep':  (deep_mlp, 'MLP 1024->1024 x20->10 (21.0M parameters, at most 1.05M in one tensor)', 16),
    'small': (partial(mlp, 256, 256), 'MLP 256->256->256->10, the activation-heavy model of the earlier table', 2048),
}

def _mode(name, memory_mode, opt_state='fp32', fused=True, chunk=None, **kw) -> tuple:
    "An mpx arm: `learn.to_bf16(**kw)` (or `to_fp16` with `fp16`) with `opt_state` and `fused`, the engine's `chunk` if given"
    to = kw.pop('to', 'to_bf16')
    def make(l):
        getattr(l, to)(opt_state=opt_state, fused=fused, **kw)
        if chunk: l.add_cb(Chunk(chunk))
        return l
    return make,memory_mode,opt_state

class Chunk(Callback):
    "Set the step engine's `chunk` (most elements a window dequantises or widens at once) for the fit"
    order = 20  # after the precision callback (10), which makes its engine in `before_fit`
    def __init__(self, chunk): self.chunk = chunk
    def before_train(self): first(self.learn.cbs, is_mpx_precision).fused_steps.chunk = self.chunk

class BF16Model(Callback):
    "A bf16 model without mpx: bf16 inputs in, fp32 predictions out (for the loss), as optimi's low-precision recipe trains"
    order = 10
    def before_batch(self): self.learn.xb = tuple(x.bfloat16() for x in self.xb)
    def after_pred(self): self.learn.pred = self.pred.float()

def _optimi(l):
    "fastai + optimi (bench/step.py's `optimi_arm`): a bf16 model stepped by `optimi.AdamW(kahan_sum=True)` through `OptimWrapper`"
    import optimi
    l.model.bfloat16(); l.opt_func = partial(OptimWrapper, opt=partial(optimi.AdamW, kahan_sum=True, **ADAM_KW))
    return l.add_cb(BF16Model())

def _torchao(amp=False):
    "fastai + torchao's `AdamW8bit` through `OptimWrapper` on the fp32 model; mpx's AMP bf16 with `amp`"
    def make(l):
        l.opt_func = torchao_adamw8bit(**ADAM_KW)
        return l.to_bf16() if amp else l
    return make

MODES = {'AMP bf16': ('amp', {}), 'master bf16': ('master', dict(master=True)),
         'pure kahan': ('kahan', dict(pure=True)), 'pure stochastic': ('stochastic', dict(pure=True, update='stochastic'))}

def arms(chunk=1<<22) -> dict:
    "Every arm by name; `default(name)` says whether a plain run measures it"
    res = {'fastai fp32': (lambda l: l, 'fp32', 'fp32')}
    for name,(mm,kw) in MODES.items():
        for st in ('fp32', 'bf16', '8bit', '4bit'):
            res[f'{name} {st}'] = _mode(name, mm, st, **kw)
            if st != 'fp32': res[f'{name} {st} compile'] = _mode(name, mm, st, fused='compile', **kw)
            if st != 'fp32': res[f'{name} {st} chunk {chunk}'] = _mode(name, mm, st, chunk=chunk, **kw)
    res['AMP fp16 fp32'] = _mode('AMP fp16', 'amp', to='to_fp16')
    res['master fp16 fp32'] = _mode('master fp16', 'master', to='to_fp16', loss_scale=512)
    res['fastai + optimi kahan AdamW (bf16 model)'] = (_optimi, None, 'bf16')
    res['fastai + torchao AdamW8bit (fp32 model)'] = (_torchao(), None, '8bit')
    res['fastai + torchao AdamW8bit (mpx AMP bf16)'] = (_torchao(True), None, '8bit')
    return res

def default(name:str) -> bool:
    "The arms of a plain run: bf16 state compiled and the other chunk only where a target is (pure 8-bit)"
    if 'bf16 compile' in name: return False
    return 'chunk' not in name or (name.startswith('pure') and '8bit' in name)

# ---- measuring

class Marks(Callback):
    "A profiler mark at each phase of training steps `at` (0-based): its start, the end of the loss, of the backward, of the batch"
    order = -100  # first at every event: the marks bracket every other callback's work
    def __init__(self, at): self.at = at
    def _mark(self, k):
        if self.iter in self.at:
            with record_function(f'mark:{self.iter}:{k}'): pass
    def before_batch(self):
        self._mark('start')
        if self.iter == max(self.at): self.held = held(self.learn)  # what the learner holds between steps, counted
    def after_loss(self): self._mark('fwd')
    def after_backward(self): self._mark('bwd')
    def after_batch(self): self._mark('end')

def flat_tensors(x) -> list:
    "The plain tensors in `x` (a tensor, a tensor subclass such as torchao's, nested lists, tuples and dicts of them)"
    if isinstance(x, torch.Tensor):
        if hasattr(x, '__tensor_flatten__'): return [t for n in x.__tensor_flatten__()[0] for t in flat_tensors(getattr(x, n))]
        return [x]
    if isinstance(x, dict): x = list(x.values())
    return [t for o in x for t in flat_tensors(o)] if isinstance(x, (list, tuple, L)) else []

ENGINE_PARTS = dict(w='weights', g='grads', x='masters', gx='masters', c='compensations', st='optimizer state', scales='optimizer state')

def held(learn) -> dict:
    "Bytes of each part of what the learner holds between steps, each storage counted once, in the first part holding it"
    ps,opt = list(learn.model.parameters()),learn.opt
    parts = {k: [] for k in ('weights', 'grads', 'masters', 'compensations', 'optimizer state', 'workspaces', 'other')}
    parts['weights'] += ps + list(learn.model.buffers()); parts['grads'] += [p.grad for p in ps]
    cb = first(learn.cbs, is_mpx_precision)
    fs = getattr(cb, 'fused_steps', None)
    if fs is not None:
        for b in fs.buckets:
            for k,v in vars(b).items():
                if k in ENGINE_PARTS: parts[ENGINE_PARTS[k]] += flat_tensors(v)
                elif k not in ('params', 'engine'): parts['other'] += flat_tensors(v)
        parts['workspaces'] += list(fs.workspace.bufs.values())
    inner = opt.opt if isinstance(opt, OptimWrapper) else opt
    parts['optimizer state'] += flat_tensors(list(inner.state.values()))
    parts['other'] += [getattr(learn, k, None) for k in ('pred', 'loss', 'loss_grad')]  # none before the first step (`--at 0`)
    seen,res = set(),{}
    for k,v in parts.items():
        ss = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in v if isinstance(t, torch.Tensor)}
        res[k] = sum(n for p,n in ss.items() if p not in seen and p); seen |= ss.keys()
    return res

def _name(e) -> str:
    "An event's name; '?' where it does not decode (a compiled kernel's frame, profiled with its stack)"
    try: return e.name() if callable(e.name) else e.name
    except UnicodeDecodeError: return '?'

def timeline(prof) -> tuple:
    "The running sum of allocated bytes after each memory event, its times, and the marks' times"
    evs = [(_name(e), e) for e in prof.profiler.kineto_results.events()]
    mem = sorted((e.start_ns(), e.nbytes()) for n,e in evs if n == '[memory]')
    marks = {n[5:]: e.start_ns() for n,e in evs if n.startswith('mark:')}
    ts,tot = [t for t,_ in mem],list(itertools.accumulate(n for _,n in mem))
    return ts,tot,marks

def at(ts, tot, t) -> int:
    "The running sum at time `t`"
    i = bisect.bisect_right(ts, t)
    return tot[i-1] if i else 0

def peak(ts, tot, a, b) -> int:
    "The maximum of the running sum between times `a` and `b` (the sum at `a` included)"
    i,j = bisect.bisect_right(ts, a),bisect.bisect_right(ts, b)
    return max([at(ts, tot, a)] + tot[i:j])

def step_stats(ts, tot, mk, s:int) -> dict:
    "Step `s`'s resident bytes (at its start), activations (at the end of its loss, less the resident), phases' peaks"
    m = lambda k: mk[f'{s}:{k}']
    res = dict(resident=at(ts, tot, m('start')))
    res['act'] = at(ts, tot, m('fwd')) - res['resident']
    res.update({f'peak {k}': peak(ts, tot, m(a), m(k)) for a,k in zip(PHASES, PHASES[1:])})
    res['peak'] = max(res[f'peak {k}'] for k in PHASES[1:])
    res['peak less act'] = max(res['peak fwd'] - res['act'], res['peak bwd'] - res['act'], res['peak end'])
    return res

def measure(make, model='wide', at_step=1, explain=False) -> dict:
    "Profile an arm's fit from the model's creation: resident bytes before step `at_step`, its phases' peaks, the first step's"
    new_model,_,bs = MODELS[model]
    batches = synth_batches((bs, 256 if model == 'small' else 1024), n=max(at_step+1, 2))
    gc.collect()
    marks = Marks({0, at_step})
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=explain) as prof:
        set_seed(0)
        learn = make(learner(new_model(), batches, cbs=marks, opt_func=Adam))
        fit_quiet(learn)
    ts,tot,mk = timeline(prof)
    res = dict(n=sum(p.numel() for p in learn.model.parameters()), **step_stats(ts, tot, mk, at_step))
    first = step_stats(ts, tot, mk, 0)
    res['first peak'],res['first peak less act'] = first['peak'],first['peak less act']
    res['held'] = marks.held
    if explain: res['why'] = {s: why(prof, mk, s) for s in sorted({0, at_step})}
    return res

def _site(stack:tuple) -> str:
    "Where an allocation was made: the innermost frame of mpx, fastai, optimi or torchao, and the outermost aten op"
    py = [f for f in stack if '.py(' in f and any(k in f for k in ('mpx/', 'fastai/', 'optimi/', 'torchao/'))]
    ops = [f for f in stack if f.startswith('aten::')]
    return (py[-1].split('site-packages/')[-1] if py else '?') + (f' {ops[0]}' if ops else '')

def why(prof, mk, s:int, top:int=6) -> tuple:
    "Step `s`'s peak: its time (ms into the step), the phase it falls in, and the largest sites of what it allocated and still held"
    allocs = []
    def walk(e, stack):
        if e.tag.name == 'Allocation': allocs.append((e.start_time_ns, e.typed[1].ptr, e.typed[1].alloc_size, stack)); return
        for c in e.children: walk(c, stack + (_name(e),))
    for e in prof.profiler.kineto_results.experimental_event_tree(): walk(e, ())
    allocs.sort(key=lambda a: a[0])
    t0,t1 = mk[f'{s}:start'],mk[f'{s}:end']
    live,tot,best = {},0,None
    for t,p,n,st in allocs:
        if n > 0: live[p] = (n, st, t)
        else: live.pop(p, None)
        tot += n
        if t0 <= t <= t1 and (best is None or tot > best[0]): best = (tot, t, dict(live))
    if best is None: return 0., '-', []
    _,t,lv = best
    phase = max((k for k in PHASES[:-1] if mk[f'{s}:{k}'] <= t), key=lambda k: mk[f'{s}:{k}'])
    phase = dict(start='forward', fwd='backward', bwd="optimizer's step")[phase]
    sites = {}
    for n,st,ta in lv.values():
        if ta >= t0: sites[_site(st)] = sites.get(_site(st), 0) + n
    return (t-t0)/1e6, phase, sorted(sites.items(), key=lambda kv: -kv[1])[:top]

# ---- reporting

def bp(x, n) -> str: return f"{x/n:.2f}"
def mib(x) -> str: return f"{x/2**20:.1f}"

def report(res:dict, specs:dict):
    parts = list(next(iter(res.values()))['held'])
    table(['arm', 'param_bytes:', 'resident B/param:', 'peak B/param:', 'peak less act. B/param:', 'first-step peak less act. B/param:',
           'peak MiB:', 'activations MiB:', 'fwd / bwd / step peak over resident MiB:'],
          [[k, '-' if specs[k][1] is None else f"{param_bytes(specs[k][1], specs[k][2]):.2f}", bp(r['resident'], r['n']),
            bp(r['peak'], r['n']), bp(r['peak less act'], r['n']), bp(r['first peak less act'], r['n']), mib(r['peak']), mib(r['act']),
            ' / '.join(mib(r[f'peak {p}'] - r['resident']) for p in PHASES[1:])] for k,r in res.items()])
    print("What lives between steps, counted from the learner (B/param; 'unaccounted' is the profiler's resident less the counted):\n")
    table(['arm'] + [f'{p}:' for p in parts] + ['unaccounted:'],
          [[k] + [bp(r['held'][p], r['n']) for p in parts] + [bp(r['resident'] - sum(r['held'].values()), r['n'])] for k,r in res.items()])

def explanations(res:dict):
    "What each arm's peaks hold on top of the resident: the sites of the allocations made in the step and live at its peak"
    for k,r in res.items():
        if 'why' not in r: continue
        for s,(ms,phase,sites) in r['why'].items():
            print(f"- {k}, step {s}: peak {ms:.0f} ms in, in the {phase}; B/param held of the step's own allocations: "
                  + '; '.join(f"{bp(n, r['n'])} {w}" for w,n in sites if n >= .005*r['n']))
    print()

TARGETS = (('pure kahan 8bit', 8.5), ('pure stochastic 8bit', 6.5))

def targets(res:dict):
    "The issue's targets: pure kahan 8-bit at most 8.5 B/param, pure stochastic 8-bit at most 6.5, plus activations, every step's peak"
    for name,lim in TARGETS:
        for k,r in res.items():
            if k == name or k.startswith(name + ' '):
                v,f = r['peak less act'] / r['n'],r['first peak less act'] / r['n']
                print(f"- {k}: peak less activations {v:.2f} B/param, the first step's {f:.2f} (resident {r['resident']/r['n']:.2f}): "
                      f"{'meets' if max(v, f) <= lim else 'misses'} the target of {lim}"
                      + ('' if max(v, f) <= lim or v > lim else ' (the first step only)'))
    print()

def plot(res:dict, specs:dict, model:str):
    "Bars of each arm's bytes a parameter: `param_bytes`, resident, the profiled step's and the first step's peak less activations"
    plt = plt_agg()
    ks = list(res)[::-1]
    fig,ax = plt.subplots(figsize=(9, .28*len(ks) + 1.2))
    y = np.arange(len(ks))
    n = [res[k]['n'] for k in ks]
    ax.barh(y, [res[k]['first peak less act']/m for k,m in zip(ks, n)], color='#f4c7a1', label="first step's peak less act.")
    ax.barh(y, [res[k]['peak less act']/m for k,m in zip(ks, n)], color='#e0823d', label='peak less act.')
    ax.barh(y, [res[k]['resident']/m for k,m in zip(ks, n)], color='#4a7fb5', label='resident')
    pb = [param_bytes(specs[k][1], specs[k][2]) if specs[k][1] is not None else np.nan for k in ks]
    ax.scatter(pb, y, marker='|', s=120, color='k', zorder=3, label='param_bytes')
    for name,lim in TARGETS: ax.axvline(lim, ls=':', color='grey')
    ax.set_yticks(y); ax.set_yticklabels(ks, fontsize=7); ax.set_xlabel('bytes a parameter')
    ax.set_title(f"memory of an Adam step, model '{model}' (dotted: the targets 6.5 and 8.5)", fontsize=9)
    ax.legend(fontsize=7, loc='center left', bbox_to_anchor=(1.01, .5))
    savefig(fig, 'memory' if model == 'wide' else f'memory_{model}')

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--quick', action='store_true', help='the fp32-state arms alone')
    ap.add_argument('--model', default='wide', choices=list(MODELS), help="'wide' (default), 'deep' or 'small' (see MODELS)")
    ap.add_argument('--arms', default='', help="comma-separated arm names (default: all but `default`'s exceptions)")
    ap.add_argument('--chunk', type=int, default=1<<22, help="the engine chunk of the 'chunk' arms (default: a GPU's; the CPU's is 131,072)")
    ap.add_argument('--at', type=int, default=1, help='the profiled step (0-based); the first is profiled too')
    ap.add_argument('--explain', action='store_true', help="print the sites of what each peak holds on top of the resident (profiles the stacks: slower)")
    ap.add_argument('--plot', action='store_true', help="write bench/plots/memory.png ('wide'), memory_<model>.png otherwise")
    a = ap.parse_args(argv)
    specs = arms(a.chunk)
    names = [k for k,v in specs.items() if default(k) and (not a.quick or v[2] == 'fp32')]
    if a.arms: names = [s.strip() for s in a.arms.split(',')]
    _,desc,bs = MODELS[a.model]
    header("memory of training with Adam, bytes a parameter", f"{desc}, batch {bs}; step {a.at} of a fit "
           "profiled (torch.profiler, profile_memory=True) from the model's creation")
    res = {}
    for k in names:
        s = time.perf_counter()
        res[k] = measure(specs[k][0], a.model, a.at, a.explain)
        print(f"# {k}: {time.perf_counter()-s:.0f} s", flush=True)
    print()
    report(res, specs)
    if a.explain: explanations(res)
    targets(res)
    if a.plot: plot(res, specs, a.model)

if __name__ == '__main__':
    s = time.perf_counter(); main(); print(f"# {time.perf_counter()-s:.0f} s")
