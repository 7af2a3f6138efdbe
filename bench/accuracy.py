"""Accuracy of low-bit optimizer state: fastai's tabular, collab and text applications and the digits MLP, three seeds each,
with `opt_state` fp32, 8bit and 4bit, beside fastai fp32 and fastai + torchao's `AdamW8bit`.

Each task trains from the same seed (same initial weights, same data order) in every arm, with `fit_one_cycle` and a
constant momentum of 0.9 (fastai's Adam default; torchao's step is compiled for its betas, so a scheduled momentum would
recompile it each batch). The metric is the last epoch's: accuracy in points for the classifiers, the validation loss
(MSE) for the regressions. The difference from fp32 state is paired by seed: each seed's arm less the same seed's
fp32-state run of the same mode (torchao's AdamW8bit less fastai fp32, same hyper-parameters), its mean and range over
seeds. The issue's targets: 8-bit state within 0.5 points (2% of the validation loss) of fp32 state, 4-bit within 1.5
points (the loss's target for 4 bits is taken as 6%, three times 8-bit's, as 1.5 points is three times 0.5).

Tasks (`TASKS`): 'digits', demo/digits.py's MLP 64->256->256->10 on scikit-learn's digits (1437 train, 359 valid);
'tabular', `tabular_learner` with layers 512 and 256 on scikit-learn's diabetes data (target/100, 354 train, 88 valid);
'collab', `collab_learner` (`EmbeddingDotBias`, 32 factors) on 20,000 ratings of 300 items by 400 users from a rank-4
model with noise; 'text', an `AWD_LSTM` classifier (`pretrained=False`, 2 layers of 128, embeddings of 64) on 2,000
sentences of 6 to 14 words, labelled by whether they have more positive words than negative ones. Every weight matrix
of 4,096 elements or more (the ones whose state goes low-bit) is most of each model's parameters.

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
    "`n` sentences of 6 to 14 words, labelled by whether more are positive than negative (ties drawn again)"
    words,texts,labels = np.array(POS + NEG + NEUTRAL),[],[]
    while len(texts) < n:
        ws = words[torch.randint(0, len(words), (int(torch.randint(6, 15, (1,), generator=g)),), generator=g).numpy()]
        p,q = sum(w in POS for w in ws),sum(w in NEG for w in ws)
        if p != q: texts.append(' '.join(ws)); labels.append('pos' if p > q else 'neg')
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
    'text':    (text_learner_, 8, 1e-2, 'accuracy'),
}

# ---- the arms: name -> (what makes the learner train that way, the arm it is compared with)

def _torchao(l):
    l.opt_func = torchao_adamw8bit(**ADAM_KW)
    return l

ARMS = {
    'pure kahan fp32':   (lambda l: l.to_bf16(pure=True), None),
    'pure kahan 8bit':   (lambda l: l.to_bf16(pure=True, opt_state='8bit'), 'pure kahan fp32'),
    'pure kahan 4bit':   (lambda l: l.to_bf16(pure=True, opt_state='4bit'), 'pure kahan fp32'),
    'AMP bf16 fp32':     (lambda l: l.to_bf16(), None),
    'AMP bf16 8bit':     (lambda l: l.to_bf16(opt_state='8bit'), 'AMP bf16 fp32'),
    'AMP bf16 4bit':     (lambda l: l.to_bf16(opt_state='4bit'), 'AMP bf16 fp32'),
    'fastai fp32':       (lambda l: l, None),
    'torchao AdamW8bit': (_torchao, 'fastai fp32'),
}
LIMITS = {'8bit': (.5, .02), '4bit': (1.5, .06), 'AdamW8bit': (.5, .02)}  # accuracy points, relative loss

def run(task:str, arm:str, seed:int) -> float:
    "The last epoch's metric of `task` trained in `arm` from `seed`: accuracy in points, or the validation loss"
    make,epochs,lr,metric = TASKS[task]
    learn = ARMS[arm][0](make(seed))
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(epochs, lr, moms=(.9, .9, .9))
    v = learn.recorder.values[-1]
    return 100*float(v[2]) if metric == 'accuracy' else float(v[1])

# ---- reporting

def verdict(task:str, arm:str, d:float, ref:float) -> str:
    "Whether the mean paired difference `d` from the reference (mean `ref`) meets the arm's target"
    lim = next((v for k,v in LIMITS.items() if arm.endswith(k)), None)
    if lim is None: return '-'
    if TASKS[task][3] == 'accuracy': return f"{'met' if d >= -lim[0] else 'missed'} (>= -{lim[0]:g})"
    return f"{'met' if d/ref <= lim[1] else 'missed'} ({100*d/ref:+.1f}% vs <= {100*lim[1]:g}%)"

def report(res:dict):
    rows = []
    for (task,arm),vs in res.items():
        ref = ARMS[arm][1]
        acc = TASKS[task][3] == 'accuracy'
        m = statistics.mean(vs)
        row = [task, arm, 'accuracy %' if acc else 'valid MSE', f"{m:.2f}" if acc else f"{m:.4f}",
               f"{min(vs):.2f}-{max(vs):.2f}" if acc else f"{min(vs):.4f}-{max(vs):.4f}"]
        if ref is not None and (task, ref) in res:
            ds = [a-b for a,b in zip(vs, res[task, ref])]
            fmt = (lambda x: f"{x:+.2f}") if acc else (lambda x: f"{x:+.4f}")
            d = statistics.mean(ds)
            row += [f"{fmt(d)} ({fmt(min(ds))} to {fmt(max(ds))})", verdict(task, arm, d, statistics.mean(res[task, ref]))]
        else: row += ['-', '-']
        rows.append(row)
    table(['task', 'arm', 'metric', 'mean:', 'range over seeds:', 'paired diff vs reference (range):', 'target'], rows)

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
            print(f"# {task} / {arm}: {' '.join(f'{v:.4g}' for v in res[task, arm])} ({time.perf_counter()-s:.0f} s)", flush=True)
    print()
    report(res)

if __name__ == '__main__':
    s = time.perf_counter(); main(); print(f"# {time.perf_counter()-s:.0f} s")
