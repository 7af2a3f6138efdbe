"""Training speed: fp32 vs mpx's `to_bf16` vs fastai 2.8's bf16 callback vs a raw `torch.autocast` loop, on an MLP and a small CNN.

The issue's sizes are an MLP 1024->4096->4096->10 at batch 1024 and a CNN of 64/128/256 channels at batch 256 (3x32x32),
8 batches an epoch. A one-step bf16 probe divides them by 16, 8, 4, 2 or 1 (widths and batch alike), the largest size
whose timed run fits the budget (`--budget`; `--div` chooses instead): on CPUs without AVX512-BF16/AMX a bf16 matmul is
~100x slower than fp32, and the full MLP would take minutes a step. Every mode uses torch's SGD(momentum=.9). Rounds are
interleaved; a round's time is the median step of its epoch's second half (the first half settles what the previous mode
left in caches and clocks), times are medians over rounds, ratios the median of the rounds' paired ratios.
Run: `.venv/bin/python bench/train_speed.py`."""
import argparse, time
from _common import *
from copy import deepcopy

ROUNDS,N_BATCHES = 11,8

def mlp_case(d):
    "The issue's MLP and its data with every size divided by `d`"
    return mlp(1024//d, 4096//d), synth_batches((1024//d, 1024//d), n=N_BATCHES)

def cnn_case(d):
    "The small CNN (64 channels, batch 256 at full size) and its data, divided by `d`"
    return small_cnn(64//d), synth_batches((256//d, 3, 32, 32), n=N_BATCHES)

def probe(case, d) -> float:
    "Seconds of one raw bf16 autocast step of `case` at divisor `d`"
    model,batches = case(d)
    step = raw_step(model, batches[:1], torch.bfloat16)
    step()  # the first step pays one-off set-up (oneDNN kernels, allocations)
    return step()

def pick_divisor(case, budget) -> tuple:
    "The smallest divisor whose bf16 runs (2 modes, warm-up and rounds; each probe runs 2 steps) fit in `budget` seconds; and the probes' times"
    n_steps,probes,best = 2*(ROUNDS+1)*N_BATCHES,{},16
    for d in (16, 8, 4, 2, 1):
        probes[d] = probe(case, d)
        if probes[d]*n_steps > budget: break
        best = d
    return best,probes

RAW_DTYPES = {'raw fp32 loop': 'float32', 'raw bf16 autocast loop': 'bfloat16'}

def modes(case, d) -> tuple:
    "The learners, and every mode's step-timing function, each mode on its own copy of one model"
    model,batches = case(d)
    lrn = lambda cbs=None: learner(deepcopy(model), batches, cbs=cbs, opt_func=torch_sgd)
    learners = {'fp32 learner': lrn(), 'mpx to_bf16': lrn().to_bf16(), 'fastai bf16': lrn(ffp16.MixedPrecision(amp_mode='bf16'))}
    raw = {'raw fp32 loop': raw_step(deepcopy(model), batches), 'raw bf16 autocast loop': raw_step(deepcopy(model), batches, torch.bfloat16)}
    return learners, {k: learner_step(l) for k,l in learners.items()} | raw

def measure(name, case, budget, div=None) -> dict:
    "Pick the size (unless `div` is given), time every mode, print the probe line; the medians and compute dtypes"
    d,probes = (div, {}) if div else pick_divisor(case, budget)
    print(f"# {name}: sizes / {d}" + (f"; one bf16 step: " + ', '.join(f"{t*1e3:.0f} ms at /{k}" for k,t in probes.items()) if probes else ''))
    learners,runs = modes(case, d)
    t = interleaved(runs, ROUNDS)
    return dict(div=d, t=t, dtypes={k: dtype_of(l) for k,l in learners.items()} | RAW_DTYPES)

def rows(name, r) -> list:
    "Table rows of one model: every mode's dtype, ms/step and speed-up against the fp32 learner"
    f = r['t']['fp32 learner']
    return [[f"{name} /{r['div']}", k, r['dtypes'][k], f"{med(t)*1e3:.2f}", f"{ratio(f, t):.2f}x"] for k,t in r['t'].items()]

def summary(name, r) -> list:
    "mpx's speed-up, the raw loop's over its fp32 twin, mpx's speed-up as a share of the raw loop's (one fp32 baseline), fastai's loop against a raw one"
    t = r['t']
    return [name, f"{ratio(t['fp32 learner'], t['mpx to_bf16']):.3f}x", f"{ratio(t['raw fp32 loop'], t['raw bf16 autocast loop']):.3f}x",
            f"{ratio(t['raw bf16 autocast loop'], t['mpx to_bf16']):.0%}", f"{ratio(t['raw fp32 loop'], t['fp32 learner']):.0%}"]

def plot(res):
    plt = plt_agg()
    fig,axs = plt.subplots(1, len(res), figsize=(6*len(res), 3.6))
    for ax,(name,r) in zip(axs, res.items()):
        f = r['t']['fp32 learner']
        bars = ax.bar(range(len(r['t'])), [ratio(f, t) for t in r['t'].values()], color=['C7', 'C0', 'C1', 'C7', 'C2'])
        ax.bar_label(bars, fmt='%.2fx', fontsize=8)
        ax.set_xticks(range(len(r['t'])), [k.replace(' ', '\n', 1) for k in r['t']], fontsize=8)
        ax.axhline(1, color='k', lw=.8)
        ax.set(title=f"{name} (sizes /{r['div']})", ylabel='speed-up vs fp32 learner')
    fig.suptitle(f"Training step speed, {cpu_name()}", fontsize=9)
    savefig(fig, 'train_speed')

def main(budget=45., div=None):
    header("training speed", f"{N_BATCHES} prebatched synthetic batches an epoch, torch's SGD(momentum=.9) in learners and loops alike, {ROUNDS} interleaved rounds timing each epoch's second half: median step, ratios the median of paired ratios",
           "fastai bf16 = fastai.callback.fp16.MixedPrecision(amp_mode='bf16') added directly: it autocasts on 'cuda' only, so on a CPU it runs fp32")
    res = {'MLP': measure('MLP', mlp_case, budget, div), 'CNN': measure('CNN', cnn_case, budget, div)}
    print()
    table(['model', 'mode', 'compute dtype', 'ms/step:', 'speed-up vs fp32 learner:'], [row for n,r in res.items() for row in rows(n, r)])
    table(['model', 'mpx bf16 speed-up vs fp32 learner:', 'raw bf16 loop speed-up vs raw fp32 loop:', "mpx speed-up as a share of the raw loop's (raw bf16 step / mpx step):", 'fp32 learner speed / raw fp32 loop speed:'],
          [summary(n, r) for n,r in res.items()])
    plot(res)

def parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--budget', type=float, default=45., help="seconds each model's bf16 runs may take; picks the size")
    p.add_argument('--div', type=int, help='divide the sizes by this instead (1: the issue\'s full sizes)')
    return p.parse_args()

if __name__ == '__main__':
    t = time.perf_counter(); main(**vars(parse())); print(f"# {time.perf_counter()-t:.0f} s")
