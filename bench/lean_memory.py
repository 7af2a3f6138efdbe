"""Never hold twice: the training peak of each mode beside a raw autocast loop, on a language model whose logits are
most of its activations (issue 67).

A random Hugging Face GPT-2 with GPT-2's own vocabulary (50,257 tokens), tied embeddings, 4 layers of 256, and
sequences of 256 (batch 4: 1,024 tokens a step, 206 MB of fp32 logits), trained with fastai's Adam defaults for 6 steps.
Each arm runs in a process of its own, as `bench/session_memory.py` measures: glibc hands freed blocks back
(`MALLOC_MMAP_THRESHOLD_=65536`), the kernel's peak of resident memory is reset before the training, and the figure is
the peak above the process before the model was built (the data made), in MB. No `gc.collect()`.

The raw loops are PyTorch's AMP recipe as written (torch's AdamW with fastai's Adam settings, `zero_grad(set_to_none=True)`):

    for x, y in batches:
        with torch.autocast('cpu', dtype=torch.bfloat16):
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

The arm 'grads kept' zeroes the gradients between steps instead of dropping them, as fastai's `Optimizer.zero_grad`
does (and mpx's engine, whose steps read them in flat buffers). 'mpx AMP bf16 pred read' adds a callback that reads
`learn.pred` right after the loss: the fp32 copy made then is held through the backward, as every precision callback
held it before issue 67 (and as fastai's own does).
Run: `PYTHONPATH=. .venv/bin/python bench/lean_memory.py` (needs transformers: `.venv/bin/python -m pip install -c
constraints-apps.txt transformers`, or run it with `.venv-apps/bin/python`); `--arms a,b` picks arms by a part of their
names, `--steps n`, `--seq n`, `--bs n`; `--device cuda` measures a GPU's `max_memory_allocated` instead."""
import argparse, json, os, subprocess, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
import session_memory as sm

VOCAB = 50257  # GPT-2's own

def _mpx(**kw): return lambda l: l.to_bf16(**kw)

class _ReadPred:
    "A callback reading `learn.pred` after the loss (its fp32 copy then held through the backward)"
    def __new__(cls):
        from fastai.basics import Callback
        class ReadPred(Callback):
            order = 11
            def after_loss(self): self.pred.dtype  # noqa: B018 (the read)
        return ReadPred()

ARMS = {
    'raw fp32 loop': 'raw',
    'raw autocast bf16 loop': 'raw',
    'raw autocast bf16 loop grads kept': 'raw',  # `zero_grad(set_to_none=False)`, as fastai's `Optimizer.zero_grad` keeps them
    'fastai fp32': lambda l: l,
    'mpx AMP bf16': _mpx(),
    'mpx AMP bf16 pred read': lambda l: l.to_bf16().add_cb(_ReadPred()),
    'mpx master bf16': _mpx(master=True),
    'mpx pure kahan': _mpx(pure=True),
    'mpx pure kahan 8bit': _mpx(pure=True, opt_state='8bit'),
}

def _setup(seq:int, bs:int, steps:int):
    "The data, the process's memory once made, and a random GPT-2 with GPT-2's vocabulary"
    import torch
    torch.set_num_threads(int(os.environ.get('THREADS', '1')))
    sm._gpt2_classes()  # transformers imported before the measure
    dls = sm._gpt2_data(VOCAB, seq, bs, steps)
    base = sm._now()
    model = sm._gpt2_lm(vocab_size=VOCAB, n_positions=seq)
    return dls,base,model

def _raw(name:str, dls, model):
    "PyTorch's AMP recipe (or its fp32 loop) over the training batches"
    import torch, torch.nn.functional as F
    model.to(sm.DEVICE).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(.9, .99), eps=1e-5, weight_decay=1e-2)
    on = 'autocast' in name
    sm._reset_peak()
    for x,y in dls.train:
        with torch.autocast(sm.DEVICE, dtype=torch.bfloat16, enabled=on):
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none='kept' not in name)
    return sm._peak()

def run_one(name:str, seq:int, bs:int, steps:int) -> dict:
    "The arm's training peak, in this process, above the process before the model"
    dls,base,model = _setup(seq, bs, steps)
    if ARMS[name] == 'raw': peak = _raw(name, dls, model)
    else:
        import fastai.callback.schedule, mpx.all  # noqa: F401
        from fastai.basics import Learner, CrossEntropyLossFlat, Adam
        from mpx.test_learners import _quiet
        learn = _quiet(Learner(dls, model, loss_func=CrossEntropyLossFlat(), opt_func=Adam, lr=1e-3))
        if sm.DEVICE == 'cuda': learn.model.cuda()
        learn = ARMS[name](learn)
        sm._reset_peak()
        with learn.no_bar(), learn.no_logging(): learn.fit(1)
        peak = sm._peak()
    n = sum(p.numel() for p in model.parameters())
    return dict(arm=name, params=n, peak_mb=round((peak - base) / 2**20, 1))

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--arms', default='', help='comma-separated parts of arm names (default: every arm)')
    ap.add_argument('--seq', type=int, default=256)
    ap.add_argument('--bs', type=int, default=4)
    ap.add_argument('--steps', type=int, default=6)
    ap.add_argument('--device', default='cpu', choices=['cpu', 'cuda'])
    ap.add_argument('--one', default='', help=argparse.SUPPRESS)
    a = ap.parse_args()
    sm.DEVICE = a.device
    if a.one: return print(json.dumps(run_one(a.one, a.seq, a.bs, a.steps)))
    picks = [s.strip() for s in a.arms.split(',') if s.strip()]
    names = [n for n in ARMS if not picks or any(s == n or (s not in ARMS and s in n) for s in picks)]
    env = {**os.environ, 'MALLOC_MMAP_THRESHOLD_': '65536', 'PYTHONWARNINGS': 'ignore'}
    import torch, fastai
    print(f"# Training peak beside a raw loop (bench/lean_memory.py): torch {torch.__version__}, fastai {fastai.__version__}, "
          f"device {a.device}; GPT-2 (vocabulary {VOCAB}, 4 layers of 256), batch {a.bs}x{a.seq}, {a.steps} steps")
    rows = []
    for n in names:
        r = subprocess.run([sys.executable, __file__, '--one', n, '--seq', str(a.seq), '--bs', str(a.bs), '--steps', str(a.steps),
                            '--device', a.device], env=env, capture_output=True, text=True)
        if r.returncode: print(f"{n}: failed\n{r.stderr[-2000:]}"); continue
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(f"  {n}: {rows[-1]['peak_mb']} MB", flush=True)
    raw = {r['arm']: r['peak_mb'] for r in rows}
    ref = raw.get('raw autocast bf16 loop')
    print(f"\n| arm | training peak, MB | vs the raw autocast loop |\n|---|---:|---:|")
    for r in rows:
        vs = f"{r['peak_mb'] / ref:.2f}x" if ref else ''
        print(f"| {r['arm']} | {r['peak_mb']:.0f} | {vs} |")
    if rows: print(f"\n{rows[0]['params'] / 1e6:.1f}M parameters")

if __name__ == '__main__': main()
