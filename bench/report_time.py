"""How long `learn.precision_report()` (without `time=True`) takes on a first call in a fresh process: the demo's MLP, the
demo's small CNN (`demo/digits.py --arch cnn`) and a 4-layer CNN on 32x32 images, one thread. Each model is reported in a
process of its own, so its time holds the process's first probes (`mpx.hardware.op_speed`) and first kernels; the medians
of `--rounds` processes are printed.

Run: `PYTHONPATH=. .venv/bin/python bench/report_time.py` (`--rounds N`)."""
import argparse, json, statistics, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ('demo mlp', 'demo cnn', 'cnn4')

def one(model:str) -> float:
    "Seconds of the first `precision_report()` of `model`'s learner in this process"
    import torch
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT/'demo'))
    import mpx.all  # noqa: F401 (patches Learner)
    from fastai.basics import Learner, nn, CrossEntropyLossFlat, DataLoaders
    if model.startswith('demo'):
        from digits import get_learner
        learn = get_learner(arch=model.split()[1])
    else:
        def block(ni, nf, stride): return [nn.Conv2d(ni, nf, 3, stride, 1), nn.BatchNorm2d(nf), nn.ReLU()]
        net = nn.Sequential(*block(3, 32, 1), *block(32, 64, 2), *block(64, 128, 2), *block(128, 128, 2),
                            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))
        x,y = torch.randn(256, 3, 32, 32),torch.randint(0, 10, (256,))
        learn = Learner(DataLoaders.from_dsets(list(zip(x, y)), list(zip(x[:64], y[:64])), bs=64), net, loss_func=CrossEntropyLossFlat())
    t0 = time.perf_counter()
    learn.precision_report()
    return time.perf_counter() - t0

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--rounds', type=int, default=3)
    ap.add_argument('--one', default='', help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one: return print(json.dumps(one(a.one)))
    import torch
    from mpx.hardware import detect_hardware
    print(f"# precision_report() on a first call, one thread: torch {torch.__version__}, {detect_hardware('cpu')}")
    print('| model | seconds (median) | rounds |\n|---|---:|---|')
    for m in MODELS:
        runs = [json.loads(subprocess.run([sys.executable, __file__, '--one', m], capture_output=True, text=True,
                                          check=True).stdout.strip().splitlines()[-1]) for _ in range(a.rounds)]
        print(f"| {m} | {statistics.median(runs):.2f} | {' '.join(f'{r:.2f}' for r in runs)} |")

if __name__ == '__main__': main()
