"""How long `learn.precision_report()` takes on a first call in a fresh process, and whether its advice holds on a busy
machine: the demo's MLP (at the width the demo gives it on this machine), the digits tutorial's small CNN (`demo/digits.py
--arch cnn`), a tabular learner (`mpx.test_learners.tabular_app_learner`) and a 4-layer CNN on 32x32 images. Each model is
reported in a process of its own, so its time holds the process's first probes (`mpx.hardware.op_speed`) and first
kernels; the medians of `--rounds` processes are printed.

`--busy` runs every round beside a process spinning each core (as other jobs on a shared machine, a data loader's
workers), and prints each model's picks over the rounds, the verdict of each 16-bit mode, and any line whose words
disagree with its measured ratios (`tests/test_hardware.py`'s check): a report that holds gives one pick per model.

Run: `PYTHONPATH=. .venv/bin/python bench/report_time.py` (`--rounds N`, `--time`, `--threads 0` for torch's own count,
`--busy`)."""
import argparse, collections, json, os, statistics, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ('demo mlp', 'demo cnn', 'tabular', 'cnn4')

def learner(model:str):
    "The learner of `model`, in fp32"
    import torch
    from fastai.basics import Learner, nn, CrossEntropyLossFlat, DataLoaders
    sys.path.insert(0, str(ROOT/'demo'))
    from digits import get_learner, mlp_width
    from mpx.hardware import detect_hardware
    if model == 'demo mlp': return get_learner(arch='mlp', width=mlp_width(detect_hardware('cpu')))
    if model == 'demo cnn': return get_learner(arch='cnn')
    if model == 'tabular':
        from mpx.test_learners import tabular_app_learner
        return tabular_app_learner()
    def block(ni, nf, stride): return [nn.Conv2d(ni, nf, 3, stride, 1), nn.BatchNorm2d(nf), nn.ReLU()]
    net = nn.Sequential(*block(3, 32, 1), *block(32, 64, 2), *block(64, 128, 2), *block(128, 128, 2),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))
    x,y = torch.randn(256, 3, 32, 32),torch.randint(0, 10, (256,))
    return Learner(DataLoaders.from_dsets(list(zip(x, y)), list(zip(x[:64], y[:64])), bs=64), net, loss_func=CrossEntropyLossFlat())

def one(model:str, timed:bool, threads:int) -> dict:
    "The first `precision_report()` of `model`'s learner here (its seconds, pick and lines), and what `to_auto_precision()` applies"
    import warnings, torch
    warnings.simplefilter('ignore')  # fastai's and numpy's, and `to_bf16()`'s on a slow CPU: not what is measured
    if threads: torch.set_num_threads(threads)
    import mpx.all  # noqa: F401 (patches Learner)
    from mpx.advisor import plain_text
    learn = learner(model)
    t0 = time.perf_counter()
    r = learn.precision_report(time=timed)
    secs = time.perf_counter() - t0
    cb = getattr(learn.to_auto_precision(time=timed), 'mixed_precision', None)  # a second report: what it applies
    return dict(seconds=secs, pick=r.recommended, reasons=[plain_text(s) for s in r.reasons], speedups=r.speedups,
                verdicts={m: r.hardware._speed(m) for m in ('bf16', 'fp16')}, applied='fp32' if cb is None else str(cb.amp_mode))

def _run(model:str, a) -> dict:
    args = [sys.executable, __file__, '--one', model, '--threads', str(a.threads)] + ['--time'] * a.time
    out = subprocess.run(args, capture_output=True, text=True, check=True, env={**os.environ, 'PYTHONPATH': str(ROOT)})
    return json.loads(out.stdout.strip().splitlines()[-1])

def _spin() -> list:
    "A process spinning each core"
    return [subprocess.Popen([sys.executable, '-c', 'while 1: pass']) for _ in range(os.cpu_count() or 2)]

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--rounds', type=int, default=3)
    ap.add_argument('--time', action='store_true', help='precision_report(time=True)')
    ap.add_argument('--threads', type=int, default=1, help="torch's CPU threads; 0: torch's own choice")
    ap.add_argument('--busy', action='store_true', help='a process spinning each core beside every round')
    ap.add_argument('--models', default=','.join(MODELS))
    ap.add_argument('--one', default='', help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one: return print(json.dumps(one(a.one, a.time, a.threads)))
    sys.path.insert(0, str(ROOT/'tests'))
    from test_hardware import said_against_thresholds
    import torch
    from mpx.hardware import detect_hardware
    spinners = _spin() if a.busy else []
    try: runs = {m: [_run(m, a) for _ in range(a.rounds)] for m in a.models.split(',')}
    finally:
        for p in spinners: p.kill()
    threads = f'{a.threads} thread{"s" * (a.threads > 1)}' if a.threads else f"torch's {torch.get_num_threads()} threads"
    print(f"# precision_report({'time=True' * a.time}) on a first call, {threads}{', every core busy' * a.busy}: "
          f"torch {torch.__version__}, {detect_hardware('cpu')}")
    print('| model | seconds (median) | rounds | picks | applied | bf16 | fp16 | lines against their thresholds |')
    print('|---|---:|---|---|---|---|---|---:|')
    for m,rs in runs.items():
        count = lambda key: ', '.join(f'{k} x{n}' for k,n in collections.Counter(key(r) for r in rs).items())
        bad = sum(len(said_against_thresholds(r['reasons'])) for r in rs)
        secs = [r['seconds'] for r in rs]
        print(f"| {m} | {statistics.median(secs):.2f} | {' '.join(f'{s:.2f}' for s in secs)} | {count(lambda r: r['pick'])} | "
              f"{count(lambda r: r['applied'])} | "
              f"{count(lambda r: r['verdicts']['bf16'])} | {count(lambda r: r['verdicts']['fp16'])} | {bad} |")
    for m,rs in runs.items(): print(f"\n{m}, the first round's reasons:", *(f'  - {s}' for s in rs[0]['reasons']), sep='\n')

if __name__ == '__main__': main()
