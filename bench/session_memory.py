"""Memory over a user's session of calls, in bytes a parameter: every mode beside plain fastai fp32, fastai + optimi's
Kahan AdamW (bf16 model) and fastai + torchao's `AdamW8bit`.

Each arm runs in a process of its own on a 34M-parameter MLP (64-4096-4096-4096-1, Adam, batch 16), through the calls a
user makes: `lr_find(num_it=8)`, `fit_one_cycle(1)`, `fit(1)`, `fit(1)`, `validate()`, `get_preds()`,
`save(with_opt=True)`, `load`, `export()`, then `del learn; gc.collect()`. glibc is told to hand freed blocks back (`MALLOC_MMAP_THRESHOLD_=65536`), so
the resident memory follows live memory; no `gc.collect()` is called. Before each call the kernel's peak of resident
memory is reset (`/proc/self/clear_refs`), so each call's peak is its own. Figures are bytes a parameter above the process
before the model was built (the user's fp32 model included): each call's peak, and what stays resident after it.
Run: `PYTHONPATH=. .venv/bin/python bench/session_memory.py` (`--arms a,b` picks arms by name, `--small` a 1M-parameter
model for a quick look; `--one NAME` runs one arm in this process and prints its row as JSON). `--model gpt2`, a random
GPT-2 with tied embeddings, needs transformers: `.venv/bin/python -m pip install -c constraints.txt transformers`;
`--model resnet`, fastai's `vision_learner` on a resnet18, needs torchvision: run both in the apps' stack
(`.venv-apps/bin/python`, which `make apptest` builds). An arm whose optimizer package is missing is left out, said so.
`--device cuda` measures the GPU's memory instead, on a machine with one: `torch.cuda.max_memory_allocated()` reset before
each call and `memory_allocated()` after it, above what was allocated before the model was built (the model is moved to the
device before the mode is set, so 'built' is the fp32 model's 4 B a parameter)."""
import argparse, json, os, shutil, subprocess, sys, tempfile, time
from pathlib import Path

ADAM_KW = dict(betas=(.9, .99), eps=1e-5, weight_decay=1e-2)  # fastai's Adam defaults (wd decoupled), for the other optimizers
CALLS = ('lr_find', 'fit_one_cycle', 'fit 2', 'fit 3', 'validate', 'get_preds', 'save', 'load', 'export')
TRAINING = CALLS[:6]  # the calls of the "training" peak: lr_find to get_preds

def _mpx(**kw):
    def make(l): return l.to_bf16(**kw) if not kw.pop('fp16', False) else l.to_fp16(**kw)
    return make

ARMS = {
    'fastai fp32': lambda l: l,
    'fastai + optimi kahan AdamW (bf16 model)': 'optimi',
    'fastai + torchao AdamW8bit': 'torchao',
    'mpx AMP bf16': _mpx(),
    'mpx AMP bf16 compile': _mpx(fused='compile'),
    'mpx AMP bf16 fused=False': _mpx(fused=False),
    'mpx AMP bf16 8bit': _mpx(opt_state='8bit'),
    'mpx master bf16': _mpx(master=True),
    'mpx master bf16 compile': _mpx(master=True, fused='compile'),
    'mpx pure kahan': _mpx(pure=True),
    'mpx pure kahan 8bit': _mpx(pure=True, opt_state='8bit'),
    'mpx pure kahan 8bit compile': _mpx(pure=True, opt_state='8bit', fused='compile'),
    'mpx pure stochastic 8bit': _mpx(pure=True, update='stochastic', opt_state='8bit'),
}

PREDICTED = {  # arm -> the call in `precision_report().memory` that predicts its training peak
    'fastai fp32': 'to_fp32()', 'mpx AMP bf16': 'to_bf16()', 'mpx AMP bf16 8bit': "to_bf16(opt_state='8bit')",
    'mpx master bf16': 'to_bf16(master=True)', 'mpx pure kahan': 'to_bf16(pure=True)',
    'mpx pure kahan 8bit': "to_bf16(pure=True, opt_state='8bit')",
    'mpx pure stochastic 8bit': "to_bf16(pure=True, update='stochastic', opt_state='8bit')",
    'mpx AMP bf16 compile': "to_bf16(fused='compile')", 'mpx master bf16 compile': "to_bf16(master=True, fused='compile')",
    'mpx pure kahan 8bit compile': "to_bf16(pure=True, opt_state='8bit', fused='compile')",
}

DEVICE = 'cpu'  # `--device`: where the arms train and whose memory is measured

def _status(key:str) -> int:
    "`VmHWM` or `VmRSS` of this process, in bytes"
    for l in open('/proc/self/status'):
        if l.startswith(key + ':'): return int(l.split()[1]) * 1024
    raise KeyError(key)

def _reset_peak():
    "Start the peak again from the current memory: the kernel's peak resident set, or the CUDA allocator's peak"
    if DEVICE == 'cuda':
        import torch
        torch.cuda.reset_peak_memory_stats()
    else: open('/proc/self/clear_refs', 'w').write('5')

def _now() -> int:
    "The memory now: resident bytes, or the bytes the CUDA allocator has handed out"
    if DEVICE != 'cuda': return _status('VmRSS')
    import torch
    return torch.cuda.memory_allocated()

def _peak() -> int:
    "The memory's peak since `_reset_peak`"
    if DEVICE != 'cuda': return _status('VmHWM')
    import torch
    return torch.cuda.max_memory_allocated()

def _mlp_data(n_in:int, n_out:int, bs:int, n:int):
    "Synthetic regression data that `export` can empty: `n` training batches of `bs`, two validation ones"
    from fastai.basics import torch
    from mpx.test_learners import _ExportableDS
    from fastai.data.core import TfmdDL, DataLoaders
    def ds(k): x = torch.randn(bs*k, n_in); return _ExportableDS(x, x[:, :n_out] * 2 + .1 * torch.randn(bs*k, n_out))
    return DataLoaders(TfmdDL(ds(n), bs=bs, shuffle=True), TfmdDL(ds(2), bs=bs), device=DEVICE)

def _mlp(sizes:list):
    from fastai.basics import nn
    layers = [nn.Linear(a, b) for a,b in zip(sizes[:-1], sizes[1:])]
    return nn.Sequential(*[m for l in layers[:-1] for m in (l, nn.ReLU())], layers[-1])

MODELS = {  # name: its description, the widths of the MLP (None: the text model)
    'issue': ('MLP 64-4096x3-1 (34M parameters, two 16.8M weights)', [64, 4096, 4096, 4096, 1]),
    'small': ('MLP 64-576x3-1 (0.7M parameters), for a quick look', [64, 576, 576, 576, 1]),
    'wide': ("bench/memory.py's 'wide': MLP 1024-4096-4096-10 (21.0M parameters, 16.8M in one weight)", [1024, 4096, 4096, 10]),
    'deep': ("bench/memory.py's 'deep': MLP 1024-1024x20-10 (21.0M parameters, none over 1.05M)", [1024] * 21 + [10]),
    'text': ("fastai's AWD_LSTM classifier (pretrained=False, one LSTM layer of 1536, WeightDropout), 12-word vocabulary, "
             "sequences of 8", None),
    'resnet': ("fastai's vision_learner(resnet18, pretrained=False) (fastai's head, 10 classes: 11.7M parameters), random "
               "64x64 images, two validation batches", None),
    'gpt2': ("transformers' GPT2LMHeadModel (random init, tied embeddings, 4 layers of 256, 32k vocabulary: 11.4M "
             "parameters, 8.2M in the embedding), random tokens, sequences of 32, one validation batch of 4", None),
}
GPT2 = dict(vocab_size=32000, n_positions=32, n_embd=256, n_layer=4, n_head=4, tie_word_embeddings=True)
RESNET = dict(px=64, n_out=10)
NEEDS = {'gpt2': 'transformers', 'resnet': 'torchvision'}  # the models that need a package beside the project's own
ARM_NEEDS = {'fastai + optimi kahan AdamW (bf16 model)': 'optimi', 'fastai + torchao AdamW8bit': 'torchao'}

def _image_data(px:int, n_out:int, bs:int, n:int):
    "Random images and classes that `export` can empty: `n` training batches of `bs`, two validation ones"
    from fastai.basics import torch
    from mpx.test_learners import _ExportableDS
    from fastai.data.core import TfmdDL, DataLoaders
    def ds(k): return _ExportableDS(torch.randn(bs*k, 3, px, px), torch.randint(0, n_out, (bs*k,)))
    return DataLoaders(TfmdDL(ds(n), bs=bs, shuffle=True), TfmdDL(ds(2), bs=bs), device=DEVICE)

def _gpt2_classes() -> tuple:
    "transformers' `GPT2Config` and `GPT2LMHeadModel`, a torchvision that cannot load kept out"
    try: import torchvision  # noqa: F401 (transformers' image helpers import it)
    except Exception: sys.modules['torchvision'] = None  # e.g. a CUDA build beside a CPU torch: transformers goes on
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2Config,GPT2LMHeadModel

def _gpt2_data(vocab:int, seq:int, bs:int, n:int):
    "Random token sequences that `export` can empty: `n` training batches of `bs`, one validation batch of 4"
    from fastai.basics import torch
    from mpx.test_learners import _ExportableDS
    from fastai.data.core import TfmdDL, DataLoaders
    def ds(k):
        x = torch.randint(0, vocab, (k, seq + 1))
        return _ExportableDS(x[:, :-1], x[:, 1:])
    return DataLoaders(TfmdDL(ds(bs*n), bs=bs, shuffle=True), TfmdDL(ds(4), bs=bs), device=DEVICE)  # 4: get_preds' logits stay small

def _gpt2_lm(**config):
    "A module whose forward gives a random GPT-2's logits (no download: `GPT2Config` only); `config` changes `GPT2`'s"
    from fastai.basics import nn
    Config,LMHead = _gpt2_classes()
    class LM(nn.Module):
        def __init__(self, m): super().__init__(); self.m = m
        def forward(self, x): return self.m(input_ids=x).logits
    return LM(LMHead(Config(**{**GPT2, **config})))

def _learner(model:str, bs:int=16, n:int=8):
    "The arm's learner, and the process's resident bytes once its data is made (before the model)"
    from fastai.basics import Learner, MSELossFlat, CrossEntropyLossFlat, Adam, set_seed
    from mpx.test_learners import _quiet, text_app_learner
    set_seed(0)
    sizes = MODELS[model][1]
    if model == 'gpt2':
        _gpt2_classes()  # transformers imported before the measure
        dls = _gpt2_data(GPT2['vocab_size'], GPT2['n_positions'], bs, n)
        base = _now()
        return _quiet(Learner(dls, _gpt2_lm(), loss_func=CrossEntropyLossFlat(), opt_func=Adam, lr=1e-3)),base
    if model == 'resnet':
        from fastai.vision.learner import vision_learner
        from torchvision.models import resnet18
        dls = _image_data(RESNET['px'], RESNET['n_out'], bs, n)
        base = _now()
        return _quiet(vision_learner(dls, resnet18, n_out=RESNET['n_out'], pretrained=False, loss_func=CrossEntropyLossFlat(),
                                     opt_func=Adam, lr=1e-3)),base
    if sizes is None:  # the text model: its data made with a tiny model first, then the model measured on that data
        from fastai.text.all import AWD_LSTM, text_classifier_learner
        dls = text_app_learner(n=bs*(n+1), bs=bs, emb_sz=8).dls
        base = _now()
        cfg = dict(emb_sz=1536, n_hid=1536, n_layers=1)
        return _quiet(text_classifier_learner(dls, AWD_LSTM, pretrained=False, config=cfg, seq_len=8, max_len=80, lin_ftrs=[64],
                                              opt_func=Adam, lr=1e-3)),base
    dls = _mlp_data(sizes[0], sizes[-1], bs, n)
    base = _now()  # the data made: what the model, the optimizer and the mode take is measured from here
    return _quiet(Learner(dls, _mlp(sizes), loss_func=MSELossFlat(), opt_func=Adam, lr=1e-3)),base

def _other(l, which:str):
    "fastai + optimi's Kahan AdamW on a bf16 model, or fastai + torchao's `AdamW8bit` on the fp32 model"
    from functools import partial
    from fastai.basics import OptimWrapper, Callback
    from mpx.core import to_float32 as to_float
    if which == 'torchao':
        sys.path.insert(0, str(Path(__file__).parent))
        from _common import torchao_adamw8bit
        l.opt_func = torchao_adamw8bit(**ADAM_KW)
        return l
    import optimi
    class BF16Model(Callback):
        order = 10
        def before_batch(self): self.learn.xb = tuple(x.bfloat16() if x.is_floating_point() else x for x in self.xb)
        def after_pred(self): self.learn.pred = to_float(self.pred)  # a text classifier's is a tuple
    l.model.bfloat16()
    hp_map = {'beta1': 'mom', 'beta2': 'sqr_mom', 'weight_decay': 'wd'}  # optimi's names, so fit_one_cycle can schedule `mom`
    l.opt_func = partial(OptimWrapper, opt=partial(optimi.AdamW, kahan_sum=True, **ADAM_KW), hp_map=hp_map)
    return l.add_cb(BF16Model())

def run_one(name:str, model:str) -> dict:
    "The arm's session in this process: each call's peak and what stays after it, in bytes a parameter"
    import torch
    torch.set_num_threads(1)
    import fastai.callback.schedule, mpx.all  # noqa: F401 (lr_find, fit_one_cycle; mpx patches Learner)
    learn,base = _learner(model)
    make = ARMS[name]
    if DEVICE == 'cuda': learn.model.cuda()  # fastai moves it at the first fit: 'built' counts the fp32 model, as on the CPU
    learn = _other(learn, make) if isinstance(make, str) else make(learn)
    n = sum(p.numel() for p in learn.model.parameters())
    per = lambda b: round((b - base) / n, 2)
    tmp = Path(tempfile.mkdtemp())  # the save's and the export's files, removed with the learner: ~10 bytes a parameter an arm
    learn.path = tmp
    calls = {'lr_find': lambda: learn.lr_find(num_it=8, show_plot=False), 'fit_one_cycle': lambda: learn.fit_one_cycle(1),
             'fit 2': lambda: learn.fit(1), 'fit 3': lambda: learn.fit(1), 'validate': learn.validate, 'get_preds': learn.get_preds,
             'save': lambda: learn.save('s', with_opt=True), 'load': lambda: learn.load('s', with_opt=True),
             'export': lambda: learn.export(tmp/'e.pkl')}
    res = dict(arm=name, params=n, built=per(_now()), peak={}, after={})
    for c in CALLS:
        _reset_peak()
        with learn.no_bar(), learn.no_logging(): calls[c]()
        res['peak'][c],res['after'][c] = per(_peak()),per(_now())
    del learn, calls  # `calls` holds bound methods of the learner (`learn.validate`)
    shutil.rmtree(tmp)
    import gc
    gc.collect()  # fastai's learner and its callbacks point at each other: `del learn` alone waits for the collector
    res['after del'] = per(_now())
    return res

def predict(model:str) -> dict:
    "`precision_report()`'s prediction for each mode's call, in bytes a parameter: its session peak, held in a fit, the peak's moment"
    import torch
    torch.set_num_threads(1)
    import mpx.all  # noqa: F401
    learn,_ = _learner(model)
    if DEVICE == 'cuda': learn.model.cuda()
    mem = learn.precision_report().memory
    n = sum(p.numel() for p in learn.model.parameters() if p.requires_grad)
    return {call: dict(peak=round(r['B/param'], 2), fit=round(r['fit'] / n, 2), at=r['at']) for call,r in mem.iterrows()}

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--arms', default='', help='comma-separated arm names, or parts of names (default: every arm)')
    ap.add_argument('--model', default='issue', choices=list(MODELS), help="the model ('issue': the issue's session)")
    ap.add_argument('--small', action='store_true', help="the 'small' model, for a quick look")
    ap.add_argument('--device', default='cpu', choices=['cpu', 'cuda'], help="whose memory: the process's resident set, or the GPU's")
    ap.add_argument('--one', default='', help=argparse.SUPPRESS)
    ap.add_argument('--predict', action='store_true', help=argparse.SUPPRESS)
    a = ap.parse_args()
    global DEVICE
    DEVICE = a.device
    model = 'small' if a.small else a.model
    import importlib, importlib.util
    if model in NEEDS:
        try: importlib.import_module(NEEDS[model])  # imported, not only found: torchvision beside torch's CPU wheel fails to load
        except Exception as e: sys.exit(f"--model {model} needs {NEEDS[model]}, which does not import here ({type(e).__name__}: {e}): "
                                        f"run it with .venv-apps/bin/python (make apptest builds it)")
    if a.one: return print(json.dumps(run_one(a.one, model)))
    if a.predict: return print(json.dumps(predict(model)))
    picks = [s.strip() for s in a.arms.split(',') if s.strip()]  # an arm's exact name picks it alone, else a part of names
    names = [n for n in ARMS if not picks or any(s == n or (s not in ARMS and s in n) for s in picks)]
    missing = [n for n in names if n in ARM_NEEDS and importlib.util.find_spec(ARM_NEEDS[n]) is None]
    names = [n for n in names if n not in missing]
    env = {**os.environ, 'MALLOC_MMAP_THRESHOLD_': '65536', 'PYTHONWARNINGS': 'ignore'}
    run = lambda *args: subprocess.run([sys.executable, __file__, '--model', model, '--device', DEVICE, *args], env=env, capture_output=True, text=True)
    import torch, fastai
    print(f"# Memory over a session (bench/session_memory.py): torch {torch.__version__}, fastai {fastai.__version__}, "
          f"{MODELS[model][0]}, Adam, batch 16, 8 batches an epoch; bytes a parameter above the process before the model"
          + (f", on {torch.cuda.get_device_name()} (torch.cuda's allocated bytes)" if DEVICE == 'cuda' else '') + "\n")
    for n in missing: print(f"# left out: {n} (needs {ARM_NEEDS[n]}, which is missing here)")
    out = run('--predict')
    pred = json.loads(out.stdout.strip().splitlines()[-1]) if not out.returncode else {}
    if out.returncode: print(f"precision_report's prediction failed\n{out.stderr[-2000:]}")
    rows = []
    for name in names:
        t = time.time()
        out = run('--one', name)
        if out.returncode: print(f"{name}: failed\n{out.stderr[-2000:]}"); continue
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"  {name}: {time.time() - t:.0f} s", file=sys.stderr)
    base = next((r for r in rows if r['arm'] == 'fastai fp32'), None)
    train_peak = lambda r: max(r['peak'][c] for c in TRAINING)
    print('| arm | training peak | x fastai | predicted | predicted / measured | after fit 1 | after fit 3 | growth fit 1->3 | '
          'save peak | export peak | end | after del |')
    print('|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|')
    for r in rows:
        ratio = f"{train_peak(r) / train_peak(base):.2f}" if base else ''
        p,af = r['peak'],r['after']
        pr = pred.get(PREDICTED.get(r['arm']), {}).get('peak')
        said = f"{pr:.1f} | {pr / train_peak(r):.2f}" if pr else ' | '
        print(f"| {r['arm']} | {train_peak(r):.1f} | {ratio} | {said} | {af['fit_one_cycle']:.1f} | {af['fit 3']:.1f} | "
              f"{af['fit 3'] - af['fit_one_cycle']:+.1f} | {p['save']:.1f} | {p['export']:.1f} | {af['export']:.1f} | "
              f"{r['after del']:.1f} |")
    print("\nThe prediction's two parts beside the measure: held in a fit (measured: resident after fit 1, which for the master "
          "mode is its layout between fits), and the peak above it:")
    print('| arm | predicted held in a fit | resident after fit 1 | predicted peak above it | measured peak above it | predicted at |')
    print('|---|---:|---:|---:|---:|---|')
    for r in rows:
        pr = pred.get(PREDICTED.get(r['arm']))
        if pr: print(f"| {r['arm']} | {pr['fit']:.1f} | {r['after']['fit_one_cycle']:.1f} | {pr['peak'] - pr['fit']:.1f} | "
                     f"{train_peak(r) - r['after']['fit_one_cycle']:.1f} | {pr['at']} |")
    print('\nEach call, peak / after:')
    print('| arm | ' + ' | '.join(CALLS) + ' |')
    print('|---|' + '---:|' * len(CALLS))
    for r in rows: print(f"| {r['arm']} | " + ' | '.join(f"{r['peak'][c]:.1f} / {r['after'][c]:.1f}" for c in CALLS) + ' |')

if __name__ == '__main__': main()
