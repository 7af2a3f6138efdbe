"""Accuracy of low-bit optimizer state: fastai's tabular, collab and text applications and the digits MLP, three seeds each,
with `opt_state` fp32, 8bit and 4bit, beside fastai fp32 and fastai + torchao's `AdamW8bit`.

Each task trains from the same seed (same initial weights, same data order) in every arm, with `fit_one_cycle` and a
constant momentum of 0.9 (fastai's Adam default; torchao's step is compiled for its betas, so a scheduled momentum would
recompile it each batch). The metric is the last epoch's: accuracy in points for the classifiers, the validation loss
(MSE) for the regressions. The difference from fp32 state is paired by seed: each seed's arm less the same seed's
fp32-state run of the same mode (torchao's AdamW8bit less fastai fp32, same hyper-parameters), its mean and range over
seeds. The fp32-state runs of mpx's modes are paired with fastai fp32 the same way, without a target: how far a change of
precision alone moves each task, the scale the low-bit differences are read against. The issue's targets: 8-bit state
within 0.5 points (2% of the validation loss) of fp32 state, 4-bit within 1.5 points (the loss's target for 4 bits is
taken as 6%, three times 8-bit's, as 1.5 points is three times 0.5).

Tasks (`TASKS`): 'digits', demo/digits.py's MLP 64->256->256->10 on scikit-learn's digits (1437 train, 359 valid);
'tabular', `tabular_learner` with layers 512 and 256 on scikit-learn's diabetes data (target/100, 354 train, 88 valid);
'collab', `collab_learner` (`EmbeddingDotBias`, 32 factors) on 20,000 ratings of 300 items by 400 users from a rank-4
model with noise; 'text', an `AWD_LSTM` classifier (`pretrained=False`, 2 layers of 128, embeddings of 64) on 2,000
sentences of 6 to 14 words, labelled by the sign of their score (+1 a positive word, -1 a negative one, the sign flipped
after 'not'), trained 5 epochs (to about 99.4%: the earlier rule without 'not', or 8 epochs, reach 100% in every arm,
where no arm can differ; 3 epochs stop mid-learning, where the arms' runs part by 2-4 points whatever the state). The weight
matrices of 4,096 elements or more (the ones whose state goes low-bit) are most of each model's parameters.

The validation loss is reported beside the metric for every task, paired the same way (in % of the reference's): for the
classifiers, whose accuracy moves by whole validation samples (0.28 points on digits, 0.25 on text), it is the finer
sign of a difference; the verdict is the metric's.

Run: `PYTHONPATH=. .venv/bin/python bench/accuracy.py` (`--tasks digits,text`, `--arms`, `--seeds 3`, `--quick` for one seed)."""
import argparse, sys, time, statistics
from _common import *
from fastai.callback.schedule import *

sys.path.insert(0, str(Path(__file__).parent.parent/'demo'))
ADAM_KW = dict(betas=(.9, .99), eps=1e-5, weight_decay=1e-2)  # fastai's Adam defaults (wd decoupled), for torchao's AdamW

# ---- the tasks: name -> (learner maker taking a seed, epochs, lr, metric)

def digits_learner(seed:int) -> Learner:
    "demo/digits.py's MLP 64->256->256->10, batches of 64"
    from digits import get_dls, get_mlp
    set_seed(seed, reproducible=True)
    return Learner(get_dls(bs=64), get_mlp(256), loss_func=CrossEntropyLossFlat(), metrics=accuracy)

def tabular_learner_(seed:int) -> Learner:
    "`tabular_learner` (layers 512, 256) on the diabetes data, `sex` and an age band as categories, the last 88 rows valid"
    from sklearn.datasets import load_diabetes
    from fastai.tabular.all import TabularDataLoaders, tabular_learner, Categorify, FillMissing, Normalize
    set_seed(seed, reproducible=True)
    df = load_diabetes(as_frame=True, scaled=False).frame.copy()
    df['sex'],df['age_band'] = df['sex'].astype(int).astype(str),(df['age']//20).astype(int).astype(str)
    df['target'] /= 100
    conts = ['age', 'bmi', 'bp', 's1', 's2', 's3', 's4', 's5', 's6']
    dls = TabularDataLoaders.from_df(df, procs=[Categorify, FillMissing, Normalize], cat_names=['sex', 'age_band'], cont_names=conts,
                                     y_names='target', valid_idx=list(range(len(df)-88, len(df))), bs=32, num_workers=0)
    return tabular_learner(dls, layers=[512, 256], y_range=(0, 3.5))

def collab_learner_(seed:int) -> Learner:
    "`collab_learner` (32 factors, `EmbeddingDotBias`) on 20,000 ratings 1 to 5 from a rank-4 model plus noise (the same data every seed)"
    from fastai.collab import CollabDataLoaders, collab_learner
    g = torch.Generator().manual_seed(42)
    n,users,items = 20_000,400,300
    u,i = torch.randint(0, users, (n,), generator=g),torch.randint(0, items, (n,), generator=g)
    uf,itf = torch.randn(users, 4, generator=g),torch.randn(items, 4, generator=g)
    ub,ib = .5*torch.randn(users, generator=g),.5*torch.randn(items, generator=g)
    r = 3 + .5*(uf[u]*itf[i]).sum(1) + ub[u] + ib[i] + .3*torch.randn(n, generator=g)
    df = pd.DataFrame(dict(user=u, item=i, rating=r.round().clamp(1, 5)))
    set_seed(seed, reproducible=True)
    dls = CollabDataLoaders.from_df(df, bs=128, valid_pct=.2, seed=42, num_workers=0)
    return collab_learner(dls, n_factors=32, y_range=(0, 5.5))

POS,NEG = 'good great fine nice superb excellent'.split(),'bad awful poor dull terrible boring'.split()
NEUTRAL = 'movie film plot actor scene story the a was and'.split()

def sentences(n:int, g:torch.Generator) -> pd.DataFrame:
    "`n` sentences of 6 to 14 words, labelled by the sign of their score: +1 a positive word, -1 a negative one, flipped after 'not' (0 drawn again)"
    words,texts,labels = np.array(POS + NEG + NEUTRAL + ['not']*3),[],[]
    while len(texts) < n:
        ws = words[torch.randint(0, len(words), (int(torch.randint(6, 15, (1,), generator=g)),), generator=g).numpy()]
        sc = sum(((w in POS) - (w in NEG)) * (-1 if k and ws[k-1] == 'not' else 1) for k,w in enumerate(ws))
        if sc != 0: texts.append(' '.join(ws)); labels.append('pos' if sc > 0 else 'neg')
    return pd.DataFrame(dict(text=texts, label=labels, is_valid=[k >= n*4//5 for k in range(n)]))

def text_learner_(seed:int) -> Learner:
    "An `AWD_LSTM` classifier (`pretrained=False`, 2 layers of 128, embeddings of 64) on 2,000 sentences (the same every seed)"
    from fastai.text.all import (DataBlock, TextBlock, CategoryBlock, ColReader, ColSplitter, BaseTokenizer, AWD_LSTM,
                                 text_classifier_learner)
    df = sentences(2000, torch.Generator().manual_seed(42))
    set_seed(seed, reproducible=True)
    tb = TextBlock.from_df('text', tok=BaseTokenizer(), n_workers=0, min_freq=1, seq_len=16)  # no spaCy, no worker processes
    dls = DataBlock(blocks=[tb, CategoryBlock], get_x=ColReader('text'), get_y=ColReader('label'),
                    splitter=ColSplitter('is_valid')).dataloaders(df, bs=64, seq_len=16, num_workers=0)
    cfg = dict(emb_sz=64, n_hid=128, n_layers=2)
    return text_classifier_learner(dls, AWD_LSTM, pretrained=False, config=cfg, seq_len=16, max_len=80, drop_mult=.3,
                                   metrics=accuracy)

TASKS = {  # name: (learner maker, epochs, lr, metric: 'accuracy' (points, higher is better) or 'valid_loss')
    'digits':  (digits_learner, 8, 5e-3, 'accuracy'),
    'tabular': (tabular_learner_, 20, 5e-3, 'valid_loss'),
    'collab':  (collab_learner_, 5, 5e-3, 'valid_loss'),
    'text':    (text_learner_, 5, 1e-2, 'accuracy'),  # 5 epochs: ~99.4%; 8 learn the rule fully (no arm can differ), 3 leave ~91% and seeds apart by 2-4 points
}

# ---- the arms: name -> (what makes the learner train that way, the arm it is compared with)

def _torchao(l):
    l.opt_func = torchao_adamw8bit(**ADAM_KW)
    return l

ARMS = {  # the reference of 'AMP bf16 fp32' and 'pure kahan fp32' is fastai fp32: how far a precision mode alone moves the metric
    'fastai fp32':       (lambda l: l, None),
    'torchao AdamW8bit': (_torchao, 'fastai fp32'),
    'pure kahan fp32':   (lambda l: l.to_bf16(pure=True), 'fastai fp32'),
    'pure kahan 8bit':   (lambda l: l.to_bf16(pure=True, opt_state='8bit'), 'pure kahan fp32'),
    'pure kahan 4bit':   (lambda l: l.to_bf16(pure=True, opt_state='4bit'), 'pure kahan fp32'),
    'AMP bf16 fp32':     (lambda l: l.to_bf16(), 'fastai fp32'),
    'AMP bf16 8bit':     (lambda l: l.to_bf16(opt_state='8bit'), 'AMP bf16 fp32'),
    'AMP bf16 4bit':     (lambda l: l.to_bf16(opt_state='4bit'), 'AMP bf16 fp32'),
}
LIMITS = {'8bit': (.5, .02), '4bit': (1.5, .06), 'AdamW8bit': (.5, .02)}  # accuracy points, relative loss

def run(task:str, arm:str, seed:int) -> tuple:
    "The last epoch's metric of `task` trained in `arm` from `seed` (accuracy in points, or the validation loss), and its validation loss"
    make,epochs,lr,metric = TASKS[task]
    learn = ARMS[arm][0](make(seed))
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(epochs, lr, moms=(.9, .9, .9))
    v = learn.recorder.values[-1]
    if isinstance(learn.opt, OptimWrapper): QUANTISED[task] = quantised_share(learn)
    return (100*float(v[2]) if metric == 'accuracy' else float(v[1])),float(v[1])

QUANTISED = {}  # task: the share of the parameters torchao's AdamW8bit kept 8-bit state for

def quantised_share(learn) -> float:
    "The share of `learn`'s parameters whose optimizer state is a tensor subclass (torchao's 8-bit state); torchao keeps plain fp32 state for a tensor under 4,096 elements or not a multiple of its 256-element block"
    ps = list(learn.model.parameters())
    q = sum(p.numel() for p in ps if any(hasattr(t, '__tensor_flatten__') for t in learn.opt.opt.state.get(p, {}).values()))
    return q / sum(p.numel() for p in ps)

# ---- reporting

def verdict(task:str, arm:str, d:float, rel:float) -> str:
    "Whether the mean paired difference `d` (accuracy points), or `rel` (the loss's, in % of the reference's), meets the arm's target"
    lim = next((v for k,v in LIMITS.items() if arm.endswith(k)), None)
    if lim is None: return '-'
    if TASKS[task][3] == 'accuracy': return f"{'met' if d >= -lim[0] else 'missed'} (>= -{lim[0]:g})"
    return f"{'met' if rel <= 100*lim[1] else 'missed'} (<= +{100*lim[1]:g}%)"

def report(res:dict):
    "Each arm's metric over seeds, its difference from the reference paired by seed and the verdict; the validation loss's too"
    rows = []
    for (task,arm),vl in res.items():
        vs,ls = [v for v,_ in vl],[l for _,l in vl]
        ref = ARMS[arm][1]
        acc = TASKS[task][3] == 'accuracy'
        fmt = (lambda x: f"{x:+.2f}") if acc else (lambda x: f"{x:+.4f}")
        m = statistics.mean(vs)
        row = [task, arm, 'accuracy %' if acc else 'valid MSE', f"{m:.2f}" if acc else f"{m:.4f}",
               f"{min(vs):.2f}-{max(vs):.2f}" if acc else f"{min(vs):.4f}-{max(vs):.4f}"]
        if ref is not None and (task, ref) in res:
            rv,rl = [v for v,_ in res[task, ref]],[l for _,l in res[task, ref]]
            ds = [a-b for a,b in zip(vs, rv)]
            d = statistics.mean(ds)
            dl = [100*(a-b)/b for a,b in zip(ls, rl)]
            row += [f"{fmt(d)} ({fmt(min(ds))} to {fmt(max(ds))})", f"{statistics.mean(dl):+.1f}% ({min(dl):+.1f} to {max(dl):+.1f})",
                    verdict(task, arm, d, statistics.mean(dl))]
        else: row += ['-', '-', '-']
        rows.append(row)
    table(['task', 'arm', 'metric', 'mean:', 'range over seeds:', 'paired diff vs reference (range):',
           'valid loss paired diff (range):', 'target'], rows)

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--tasks', default=','.join(TASKS), help=f'comma-separated, of {list(TASKS)}')
    ap.add_argument('--arms', default=','.join(ARMS), help=f'comma-separated, of {list(ARMS)}')
    ap.add_argument('--seeds', type=int, default=3)
    ap.add_argument('--quick', action='store_true', help='one seed')
    a = ap.parse_args(argv)
    seeds = range(1 if a.quick else a.seeds)
    header("accuracy of low-bit optimizer state", f"seeds {list(seeds)}; fit_one_cycle, momentum 0.9")
    res = {}
    for task in a.tasks.split(','):
        for arm in a.arms.split(','):
            s = time.perf_counter()
            res[task, arm] = [run(task, arm, sd) for sd in seeds]
            print(f"# {task} / {arm}: {' '.join(f'{v:.4g}' for v,_ in res[task, arm])} (valid loss {' '.join(f'{l:.4g}' for _,l in res[task, arm])}; "
                  f"{time.perf_counter()-s:.0f} s)", flush=True)
            if arm.startswith('torchao'): print(f"#   its 8-bit state: {100*QUANTISED[task]:.0f}% of {task}'s parameters", flush=True)
    print()
    report(res)

if __name__ == '__main__':
    s = time.perf_counter(); main(); print(f"# {time.perf_counter()-s:.0f} s")
