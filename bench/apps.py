"""fastai's applications in every mode: `vision_learner`'s resnet18 and a random GPT-2, each mode's speed against fp32 and
against AMP bf16, and its validation loss and accuracy after a few epochs beside fp32's.

The models: `vision_learner(dls, resnet18, pretrained=False)` (fastai's head, 10 classes for speed, 4 for the task:
11.7M parameters) on generated 64x64 images, batches of 32; transformers' `GPT2LMHeadModel` from `bench/session_memory.py`'s
`GPT2Config` with an 8k vocabulary (`GPT2_VOCAB`; random init, tied embeddings, 4 layers of 256: 5.3M parameters),
sequences of 32, batches of 16. Every arm builds its own copy of one seeded model; fastai's Adam.

Speed: prebatched random batches (4 an epoch), no validation. Each round fits every arm one epoch and times its second
half's batches (forward, backward, step, the callbacks; `_common.StepTimer`), round after round on one thread with the
thread's clock; the ratios are medians of the rounds' paired ratios (`_common`). A first epoch of each arm warms it up
(the compiled arms compile there). fp16's kernels are slow on a CPU without AVX512-FP16 (17-40x fp32 here), so its arm
times one batch an epoch for fewer rounds (`--fp16-rounds`), paired with fp32's same rounds.

Accuracy: `fit_one_cycle(5, 3e-3)` from each seed in every arm (same weights, same data order), the validation loss and
accuracy after the last epoch (the only one validated): their mean and range over seeds, and each arm's differences
from fp32 paired by seed (the data is the same for every seed). The resnet's task: noise images N(0, .5) with one 8x8
square brighter by 1 somewhere in one quadrant, the class the quadrant (256 training images, 256 validation). The
GPT-2's: sequences over the vocabulary's first 128 tokens, each next token a fixed random table's entry for the one
before, or with probability .1 a uniformly random one (128 training sequences, 64 validation), so the loss can fall
from ln(8192) toward the table's entropy. A compiled arm whose eager twin computes the same update (`COMPILED_TWIN`) is
left out (`--with-compiled` keeps it). The fp16 arm runs the schedule's first `--fp16-epochs` from seed 0 only, beside
fp32 cut at the same epoch.

Run: `PYTHONPATH=. .venv-apps/bin/python bench/apps.py` (`--models resnet,gpt2`, `--parts speed,accuracy`, `--rounds`,
`--fp16-rounds`, `--fp16-epochs`, `--seeds`, `--arms` substrings; `--quick` for a smoke run under a minute). It needs
the apps' stack (torchvision, transformers): `make apptest` builds `.venv-apps`."""
import argparse, gc, math, statistics, sys, time
from _common import *
from fastai.callback.schedule import *
from fastai.data.core import TfmdDL
from mpx.test_learners import _ExportableDS
from session_memory import _gpt2_lm, GPT2

MODES = {  # name: what makes a learner train in that mode
    'fp32':                         lambda l: l,
    'AMP bf16':                     lambda l: l.to_bf16(),
    'AMP bf16 compile':             lambda l: l.to_bf16(fused='compile'),
    'AMP fp16':                     lambda l: l.to_fp16(),
    'master bf16':                  lambda l: l.to_bf16(master=True),
    'pure kahan':                   lambda l: l.to_bf16(pure=True),
    'pure kahan compile':           lambda l: l.to_bf16(pure=True, fused='compile'),
    'pure kahan 8bit':              lambda l: l.to_bf16(pure=True, opt_state='8bit'),
    'pure stochastic 8bit compile': lambda l: l.to_bf16(pure=True, update='stochastic', opt_state='8bit', fused='compile'),
}
SLOW = 'AMP fp16'  # the arm given fewer rounds and epochs: no fast fp16 kernels on this CPU
# session_memory.py's GPT-2 has 32k tokens; at 8k its layers do 60% of a step's matmul work (GPT-2 small's share is ~70%), at 32k
# 28%, and its task ends past the phase where runs part (32k: fp32 alone ranged 1.49-2.02 in loss over three seeds)
GPT2_VOCAB = 8192

class Sizes:
    "The sizes of a run: the full one, or `--quick`'s"
    def __init__(self, quick:bool):
        self.px,self.img_bs,self.tok_bs = (32, 8, 4) if quick else (64, 32, 16)
        self.vocab = 4096 if quick else GPT2_VOCAB
        self.n_speed = 2 if quick else 4  # batches an epoch of the timed arms
        self.n_train,self.epochs = (2, 1) if quick else (8, 5)  # batches an epoch and epochs of the tasks
        self.valid_images,self.valid_seqs = (16, 8) if quick else (256, 64)

# ---- data

def quadrant_images(n:int, px:int, seed:int) -> tuple:
    "`n` noise images with an 8x8 (`px//8`) square brighter by 1 in one quadrant; the quadrant's index as the class"
    g = torch.Generator().manual_seed(seed)
    x,y,s = .5 * torch.randn(n, 3, px, px, generator=g),torch.randint(0, 4, (n,), generator=g),px // 8
    r,c = (torch.randint(0, px//2 - s, (2, n), generator=g) + torch.stack([y // 2, y % 2]) * (px//2)).tolist()
    for i in range(n): x[i, :, r[i]:r[i]+s, c[i]:c[i]+s] += 1
    return x,y

USED,NOISE = 128,.1  # the GPT-2 task's tokens and the share of next tokens drawn at random
LR = 3e-3  # both tasks' `fit_one_cycle`

def table_tokens(n:int, seq:int, seed:int) -> tuple:
    "`n` sequences of `seq` tokens below `USED`: each next one a fixed random table's entry, or with probability `NOISE` a random token"
    table = torch.randint(0, USED, (USED,), generator=torch.Generator().manual_seed(0))  # the same table for every seed
    g = torch.Generator().manual_seed(seed)
    x = torch.empty(n, seq + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, USED, (n,), generator=g)
    for t in range(seq):
        drawn = torch.rand(n, generator=g) < NOISE
        x[:, t+1] = torch.where(drawn, torch.randint(0, USED, (n,), generator=g), table[x[:, t]])
    return x[:, :-1],x[:, 1:]

def best_loss() -> tuple:
    "The GPT-2 task's best validation loss (the table's entropy, in nats) and best accuracy"
    hit,miss = 1 - NOISE + NOISE/USED,NOISE/USED
    return -hit * math.log(hit) - (USED - 1) * miss * math.log(miss),hit

def task_dls(train:tuple, valid:tuple, bs:int) -> DataLoaders:
    "Shuffled training batches and validation batches of tensors (x, y)"
    return DataLoaders(TfmdDL(_ExportableDS(*train), bs=bs, shuffle=True), TfmdDL(_ExportableDS(*valid), bs=2*bs))

# ---- the models, on speed's random batches or on their tasks

def resnet_learner(dls, n_out:int, cbs=None, seed:int=0) -> Learner:
    "`vision_learner`'s resnet18 with `n_out` classes on `dls`, its weights from `seed`"
    from fastai.vision.learner import vision_learner
    from torchvision.models import resnet18
    set_seed(seed)
    return vision_learner(dls, resnet18, n_out=n_out, pretrained=False, loss_func=CrossEntropyLossFlat(), opt_func=Adam,
                          metrics=accuracy, cbs=cbs)

def gpt2_learner(dls, vocab:int, cbs=None, seed:int=0) -> Learner:
    "A random GPT-2 of `vocab` tokens on `dls`, its weights from `seed`"
    set_seed(seed)
    return Learner(dls, _gpt2_lm(vocab_size=vocab), loss_func=CrossEntropyLossFlat(), opt_func=Adam, metrics=accuracy, cbs=cbs)

def speed_learner(model:str, sz:Sizes, n:int) -> Learner:
    "`model`'s learner on `n` prebatched random batches, timing its steps, without validation"
    cbs = [NoValidate(), StepTimer(), DtypeProbe()]
    if model == 'resnet': return resnet_learner(prebatched_dls(synth_batches((sz.img_bs, 3, sz.px, sz.px), n=n)), 10, cbs)
    g = torch.Generator().manual_seed(0)
    toks = [torch.randint(0, sz.vocab, (sz.tok_bs, GPT2['n_positions'] + 1), generator=g) for _ in range(n)]
    return gpt2_learner(prebatched_dls([(t[:, :-1], t[:, 1:]) for t in toks]), sz.vocab, cbs)

def task_learner(model:str, sz:Sizes, seed:int=0) -> Learner:
    "`model`'s learner on its task from `seed` (its weights and data order)"
    set_seed(seed)  # the training DataLoader draws its shuffling's seed when it is made
    if model == 'resnet':
        n = sz.n_train * sz.img_bs
        dls = task_dls(quadrant_images(n, sz.px, 1), quadrant_images(sz.valid_images, sz.px, 2), sz.img_bs)
        return resnet_learner(dls, 4, seed=seed)
    seq = GPT2['n_positions']
    dls = task_dls(table_tokens(sz.n_train * sz.tok_bs, seq, 1), table_tokens(sz.valid_seqs, seq, 2), sz.tok_bs)
    return gpt2_learner(dls, sz.vocab, seed=seed)

MODELS = {
    'resnet': "vision_learner(resnet18, pretrained=False)",
    'gpt2': f"GPT2LMHeadModel ({GPT2['n_layer']} layers of {GPT2['n_embd']}, {GPT2_VOCAB} tokens, tied embeddings)",
}

# ---- speed

def timed_rounds(runs:dict, rounds:dict) -> dict:
    "Call every function of `runs` once (warm-up), then round after round, each while it has rounds left (`rounds[name]`)"
    for f in runs.values(): f()
    res = {k: [] for k in runs}
    for r in range(max(rounds.values())):
        for k,f in runs.items():
            if r < rounds[k]: res[k].append(f())
    return res

def speed(model:str, arms:list, sz:Sizes, rounds:int, slow_rounds:int) -> list:
    "Rows of `model`'s speed table: each arm's median seconds a batch and its paired ratios to fp32 and AMP bf16"
    learns = {a: MODES[a](speed_learner(model, sz, 1 if a == SLOW else sz.n_speed)) for a in arms}
    res = timed_rounds({a: learner_step(l) for a,l in learns.items()}, {a: slow_rounds if a == SLOW else rounds for a in arms})
    dtypes = {a: dtype_of(l) for a,l in learns.items()}
    del learns
    gc.collect()
    vs = lambda a,ref: f"{ratio(res[a], res[ref]):.2f}x" if ref in res else '-'
    return [[model, a, dtypes[a], f"{1e3 * med(res[a]):.0f}", vs(a, 'fp32'), vs(a, 'AMP bf16'), len(res[a])] for a in arms]

# ---- accuracy

COMPILED_TWIN = {'AMP bf16 compile': 'AMP bf16', 'pure kahan compile': 'pure kahan'}  # left out of the tasks unless asked

class Epochs(Callback):
    "Validate only after epoch `n`, then end the fit: `fit_one_cycle`'s schedule cut there"
    order = Recorder.order + 1  # after the `Recorder` has the epoch's values
    def __init__(self, n:int): self.n = n
    def before_validate(self):
        if self.epoch + 1 < self.n: raise CancelValidException()
    def after_epoch(self):
        if self.epoch + 1 >= self.n: raise CancelFitException()

def trained(model:str, arm:str, sz:Sizes, seed:int, epochs:int) -> tuple:
    "The validation loss and accuracy of `model` after `epochs` of `fit_one_cycle(sz.epochs)` on its task in `arm` from `seed`"
    learn = task_learner(model, sz, seed)
    learn = MODES[arm](learn).add_cb(Epochs(epochs))
    set_seed(seed)  # the same data order in every arm, whatever the set-up drew
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(sz.epochs, LR)
    return tuple(float(v) for v in learn.recorder.values[-1][1:3])

def accuracy_rows(model:str, arms:list, sz:Sizes, seeds:list, slow_epochs:int) -> list:
    "Rows of `model`'s task table: each arm's mean validation loss and accuracy over `seeds`, and its differences from fp32 paired by seed"
    res = {}
    for a in arms:
        t = time.perf_counter()
        res[a] = [trained(model, a, sz, s, sz.epochs) for s in seeds] if a != SLOW else [trained(model, a, sz, seeds[0], slow_epochs)]
        print(f"# {model} / {a}: " + ', '.join(f"{l:.4f} / {100*acc:.2f}%" for l,acc in res[a]) + f" ({time.perf_counter() - t:.0f} s)",
              file=sys.stderr, flush=True)
    rows = [[model, a, len(v), *_scores(v, res['fp32'])] for a,v in res.items() if a != SLOW]
    if SLOW in res and slow_epochs < sz.epochs:  # fp16 against fp32 cut after as many epochs, seed 0
        ref = [trained(model, 'fp32', sz, seeds[0], slow_epochs)]
        rows += [[model, f'fp32, epoch {slow_epochs} of {sz.epochs}', 1, *_scores(ref, ref)],
                 [model, f'{SLOW}, epoch {slow_epochs} of {sz.epochs}', 1, *_scores(res[SLOW], ref)]]
    elif SLOW in res: rows.append([model, SLOW, 1, *_scores(res[SLOW], res['fp32'][:1])])
    return rows

def _span(d:list, f:str) -> str:
    "The mean of `d`, and its range where it has more than one value"
    return f"{statistics.mean(d):{f}}" + (f" ({min(d):{f}} to {max(d):{f}})" if len(d) > 1 else '')

def _scores(v:list, ref:list) -> list:
    "Valid loss and accuracy % (mean, range over seeds), and their changes from `ref`'s paired by seed (in %, in points)"
    dl,da = [100 * (l / r[0] - 1) for (l,_),r in zip(v, ref)],[100 * (acc - r[1]) for (_,acc),r in zip(v, ref)]
    same = v is ref
    return [_span([l for l,_ in v], '.4f'), '-' if same else _span(dl, '+.1f') + '%', _span([100 * acc for _,acc in v], '.2f'),
            '-' if same else _span(da, '+.2f')]

# ---- main

def missing_stack() -> str|None:
    "Why the apps' stack cannot run here (torchvision and transformers must import), or None"
    try: import torchvision.models, transformers  # noqa: F401
    except Exception as e: return f"{type(e).__name__}: {e}"  # torchvision beside torch's CPU wheel: a RuntimeError

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--models', default='resnet,gpt2', help=f'comma-separated, of {list(MODELS)}')
    ap.add_argument('--parts', default='speed,accuracy', help='comma-separated: speed, accuracy')
    ap.add_argument('--arms', default='', help='comma-separated substrings of arm names (fp32 always runs: the reference)')
    ap.add_argument('--rounds', type=int, default=5, help='timed rounds of every arm but fp16')
    ap.add_argument('--fp16-rounds', type=int, default=2, help="timed rounds of fp16's arm (one batch each)")
    ap.add_argument('--fp16-epochs', type=int, default=1, help="epochs of fp16's arm on the tasks, seed 0 (the others: 5)")
    ap.add_argument('--seeds', type=int, default=3, help='seeds of the tasks (each arm trains from each)')
    ap.add_argument('--with-compiled', action='store_true', help='the tasks in the compiled arms too (the eager twin by default)')
    ap.add_argument('--quick', action='store_true', help='a smoke run: 32px images, a 4k vocabulary, small batches, one round, one epoch')
    a = ap.parse_args(argv)
    if why := missing_stack():  # `make bench` runs every script in .venv, which has neither
        return print(f"# bench/apps.py needs the apps' stack (.venv-apps/bin/python, which make apptest builds): here {why}")
    sz = Sizes(a.quick)
    rounds,slow_rounds = (1, 1) if a.quick else (a.rounds, a.fp16_rounds)
    arms = [m for m in MODES if m == 'fp32' or not a.arms or any(s.strip() in m for s in a.arms.split(','))]
    import transformers
    transformers.logging.set_verbosity_error()  # GPT2Config's default bos/eos ids (50256) lie outside the vocabulary: said once here
    header("fastai's applications in every mode (bench/apps.py)",
           f"resnet18: {sz.px}x{sz.px} images, batches of {sz.img_bs}; GPT-2: {sz.vocab} tokens, sequences of {GPT2['n_positions']}, "
           f"batches of {sz.tok_bs}; Adam",
           f"speed: {sz.n_speed} batches an epoch, the second half timed, {rounds} rounds ({SLOW}: 1 batch, {slow_rounds} rounds)",
           f"accuracy: fit_one_cycle({sz.epochs}, {LR:g}), {sz.n_train} batches an epoch "
           f"({SLOW}: its first {min(a.fp16_epochs, sz.epochs)}, seed 0)")
    models = a.models.split(',')
    if 'speed' in a.parts:
        rows = []
        for m in models:
            t = time.perf_counter()
            rows += speed(m, arms, sz, rounds, slow_rounds)
            print(f"# speed of {m}: {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
        print('## Speed: median ms a training batch (forward, backward, step), paired ratios (below 1 is faster)\n')
        table(['model', 'mode', 'compute dtype', 'ms a batch:', 'x fp32:', 'x AMP bf16:', 'rounds:'], rows)
    if 'accuracy' in a.parts:
        rows = []
        seeds = list(range(1 if a.quick else a.seeds))
        task_arms = [m for m in arms if a.with_compiled or m not in COMPILED_TWIN]
        for m in models: rows += accuracy_rows(m, task_arms, sz, seeds, a.fp16_epochs)
        loss,acc = best_loss()
        print(f"## Accuracy after fit_one_cycle({sz.epochs}, {LR:g}), seeds {seeds} (GPT-2's best possible: loss {loss:.3f}, "
              f"accuracy {100*acc:.1f}%)\n")
        table(['model', 'mode', 'seeds:', 'valid loss (range):', 'vs fp32:', 'accuracy % (range):', 'vs fp32, points:'], rows)

if __name__ == '__main__':
    s = time.perf_counter(); main(); print(f"# {time.perf_counter()-s:.0f} s")
