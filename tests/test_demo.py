"""Tests for demo/digits.py: data, models, the advisor's lines, the table and its why-column, the verdict, the path of a CPU
without fast 16-bit kernels (faked), a one-epoch run of every mode, and the demo's log off a terminal."""
import contextlib, dataclasses, importlib.util, inspect, io, pathlib, subprocess, sys
import pytest, torch
import fastprogress.fastprogress as fpp, fastai.callback.progress as fcp
from fastai.basics import Learner, defaults
from fastai.callback.progress import ProgressCallback
import mpx.advisor
from mpx.hardware import cpu_hardware, cuda_hardware, slow_reason
from mpx.progress import QuietProgress

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEMO = ROOT/'demo'/'digits.py'
KEYS = {'mode', 'accuracy', 'secs_per_epoch', 'loss_scale', 'skipped_steps', 'total_steps'}
WIDTH,BS = 64,64  # the MLP of these tests and its batches: every mode, fp16 on a CPU without fast fp16 kernels included, trains in seconds
FAST_BF16 = cpu_hardware({'avx2', 'avx512f', 'avx512_bf16'}, name='A CPU with AVX512-BF16')
NO_FAST = cpu_hardware({'avx2'}, name='An AVX2-only CPU')

@pytest.fixture(scope='module')
def demo():
    spec = importlib.util.spec_from_file_location('digits_demo', DEMO)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

@pytest.fixture(scope='module')
def advice(demo):
    "The advisor's timed report on the demo's learner"
    return demo.advise(width=WIDTH)

def test_advice(demo, advice):
    "The demo's learner is numerically safe in every mode; the advice names the hardware, the mode and why"
    slow = set(advice.hardware.measured_slow)  # measured slow by the probes on this CPU: not timed, and said so
    assert advice.recommended in demo.MODES and advice.at_risk == {} and set(advice.timings) == set(demo.MODES) - slow
    lines = demo.format_advice(advice).splitlines()
    assert lines[0] == f'hardware: {advice.hardware}' and lines[0].startswith('hardware: cpu (')
    assert lines[1] == f'advisor: {advice.recommended} recommended'
    assert lines[2] == f'  - {mpx.advisor.plain_text(advice.reasons[0])}' and len(lines) == 2 + len(advice.reasons)
    for m in ('bf16', 'fp16'):
        said = f"{m}: measured" if m in advice.timings else "so not timed"
        assert any(said in l for l in lines if m in l), (m, lines)
    assert '`' not in '\n'.join(lines), 'a terminal shows no markdown'
    assert len([l for l in lines if l.startswith(f'  - {advice.recommended}: measured')]) <= 1, 'the pick\'s timing said twice'

@pytest.fixture(scope='module')
def rows(demo):
    "One short epoch per mode, shared by the tests below"
    with contextlib.redirect_stdout(io.StringIO()): return {m: demo.train(m, epochs=1, bs=BS, lr=1e-2, width=WIDTH) for m in demo.MODES}

def test_data(demo):
    (xt,yt),(xv,yv) = demo.get_data()
    assert len(xt)+len(xv) == 1797 and len(xv) == int(1797*0.2)
    assert xt.shape == (len(yt),1,8,8) and xv.shape == (len(yv),1,8,8)
    assert xt.dtype == torch.float32 and yt.dtype == torch.int64
    assert 0 <= xt.min() and xt.max() <= 1 and xt.max() > 0.9
    assert set(yt.tolist()) == set(yv.tolist()) == set(range(10))
    (xt2,_),(xv2,_) = demo.get_data()
    assert torch.equal(xt, xt2) and torch.equal(xv, xv2), 'split must be reproducible'

def test_dls_and_model(demo):
    dls = demo.get_dls(bs=32)
    assert (len(dls.train_ds), len(dls.valid_ds)) == (1797-359, 359)
    assert (len(dls.train), len(dls.valid)) == ((1797-359)//32, -(-359//32)), 'train drops its last partial batch, valid keeps it'
    xb,yb = dls.one_batch()
    assert xb.shape == (32,1,8,8) and yb.shape == (32,)
    assert xb.dtype == torch.float32 and yb.dtype == torch.int64
    assert demo.get_model()(xb).shape == (32,10)
    for w in (demo.WIDE, WIDTH):
        mlp = demo.get_mlp(w)
        assert mlp(xb).shape == (32,10) and [m.out_features for m in mlp if isinstance(m, torch.nn.Linear)] == [w, w, 10]

def test_dls_batches(demo):
    "Batches are the data's own rows: the validation rows in order; the training rows shuffled, the same from the same seed"
    (xt,yt),(xv,yv) = demo.get_data()
    xs,ys = map(torch.cat, zip(*demo.get_dls(bs=100).valid))
    assert torch.equal(xs, xv) and torch.equal(ys, yv)
    def train_ys(seed): demo.set_seed(seed); return torch.cat([y for _,y in demo.get_dls(bs=100).train])
    a,b = train_ys(0),train_ys(0)
    assert torch.equal(a, b) and len(a) == (len(yt)//100)*100 and not torch.equal(a, yt[:len(a)])

def test_mlp_width(demo):
    "The model is wide where a 16-bit dtype computes fast (its matmuls then decide a step's time), narrow where none does"
    assert demo.WIDE > demo.NARROW
    assert demo.mlp_width(FAST_BF16) == demo.WIDE and demo.mlp_width(NO_FAST) == demo.NARROW
    assert demo.mlp_width(cpu_hardware({'avx512f', 'avx512_fp16'})) == demo.WIDE
    assert demo.mlp_width(cuda_hardware('A GPU', (8, 0), True)) == demo.WIDE

def row(mode, secs, acc=0.97, scale=None, skipped=None, total=None):
    return dict(mode=mode, accuracy=acc, secs_per_epoch=secs, loss_scale=scale, skipped_steps=skipped, total_steps=total)

def test_format_table(demo):
    rs = [row('fp32', 2.0), row('bf16', 1.0, 0.96, 1.0, 0, 22), row('fp16', 4.0, 0.96, 32768.0, 3, 22)]
    lines = demo.format_table(rs, FAST_BF16).splitlines()
    assert len(lines) == 2 + len(rs)
    assert lines[0].split('  ')[0] == 'mode' and lines[0].endswith('why') and all(c in lines[0] for c in demo.COLS)
    body = {l.split()[0]: l.split() for l in lines[2:]}
    assert list(body) == ['fp32', 'bf16', 'fp16']
    assert body['fp32'][1:] == ['0.9700', '2.000', '1.00x', '-', '-', '-']
    assert body['bf16'][1:4] == ['0.9600', '1.000', '2.00x'] and body['bf16'][4] == '1' and body['bf16'][5:8] == ['0', 'of', '22']
    assert body['fp16'][3:5] == ['0.50x', '32768'] and body['fp16'][5:8] == ['3', 'of', '22']

def why_cells(table:str) -> dict:
    "mode -> the text of its `why` cell: a table line from where the header's `why` column starts"
    lines = table.splitlines()
    at = lines[0].index('why')
    return {l.split()[0]: l[at:] for l in lines[2:]}

def test_why_column(demo):
    "Where a mode is slower than fp32 its row says why: the hardware's reason, or the per-batch work where the hardware is fast"
    rs = [row('fp32', 2.0), row('bf16', 1.0, scale=1.0, skipped=0, total=22), row('fp16', 20.0, scale=65536.0, skipped=0, total=22)]
    why = why_cells(demo.format_table(rs, FAST_BF16))
    assert why['fp32'] == '-'
    assert why['bf16'] == 'this CPU has AVX512-BF16 (no AMX): native bf16 dot products'  # faster: why it is fast
    assert why['fp16'] == slow_reason(FAST_BF16, 'fp16') and 'no AVX512-FP16' in why['fp16']
    slow_bf16 = [rs[0], row('bf16', 3.0, scale=1.0, skipped=0, total=22), rs[2]]
    why = why_cells(demo.format_table(slow_bf16, NO_FAST))
    assert why['bf16'] == slow_reason(NO_FAST, 'bf16') and 'no AVX512-BF16/AMX' in why['bf16']
    assert why['fp16'] == slow_reason(NO_FAST, 'fp16')
    why = why_cells(demo.format_table(slow_bf16, FAST_BF16))  # fast hardware, slower all the same: the model is too small
    assert 'computes fast here' in why['bf16'] and 'per-batch work' in why['bf16']

def test_train_fp32(rows):
    r = rows['fp32']
    assert set(r) == KEYS and r['mode'] == 'fp32'
    assert 0 <= r['accuracy'] <= 1 and r['accuracy'] > 0.5, 'one epoch should already beat chance by far'
    assert r['secs_per_epoch'] > 0
    assert r['loss_scale'] is r['skipped_steps'] is r['total_steps'] is None

@pytest.mark.parametrize('mode', ['bf16', 'fp16'])
def test_train_mixed(rows, mode):
    r,n_batches = rows[mode],(1797-359)//BS  # fastai drops the last partial training batch
    assert set(r) == KEYS and r['mode'] == mode
    assert abs(r['accuracy'] - rows['fp32']['accuracy']) <= .05, 'one epoch in 16 bits learns what fp32 learns (fp32 .755, bf16 .738, fp16 .749)'
    assert r['total_steps'] == n_batches and 0 <= r['skipped_steps'] <= r['total_steps']
    if mode == 'bf16': assert r['loss_scale'] == 1.0 and r['skipped_steps'] == 0
    else: assert r['loss_scale'] > 1.0

def test_table_from_runs(demo, rows, advice):
    lines = demo.format_table(list(rows.values()), advice.hardware).splitlines()
    assert [l.split()[0] for l in lines[2:]] == list(demo.MODES)
    assert all(len(l.split()) >= len(demo.COLS) for l in lines[2:])

def test_unknown_mode(demo):
    with pytest.raises(ValueError): demo.train('fp8', epochs=1)

def run_main(demo, monkeypatch, capsys, **kwargs) -> list:
    "The lines `demo.main` prints, torch's thread count put back"
    threads = torch.get_num_threads()
    try: demo.main(epochs=1, threads=1, **kwargs)
    finally: torch.set_num_threads(threads)
    return capsys.readouterr().out.splitlines()

def test_main_prints_advice_before_table(demo, advice, rows, monkeypatch, capsys):
    "main prints the hardware and the recommendation first, and again just above the table, then the verdict"
    monkeypatch.setattr(demo, 'advise', lambda *a, **k: advice)
    monkeypatch.setattr(demo, 'train', lambda mode, *a, **k: rows[mode])
    out = run_main(demo, monkeypatch, capsys)
    hw = [i for i,l in enumerate(out) if l == f'hardware: {advice.hardware}']
    table = out.index(next(l for l in out if l.startswith('mode ')))
    assert len(hw) == 2 and hw[0] == 0 and out[1] == f'advisor: {advice.recommended} recommended'
    assert out[2+len(advice.reasons)].startswith('model: MLP 64-')
    assert out[table-1].startswith(f'advisor: {advice.recommended} recommended (') and hw[1] == table-2
    assert [l.split()[0] for l in out[table+2:table+5]] == list(demo.MODES)
    assert out[table+5].startswith(f'verdict: {advice.recommended}, the advisor\'s pick') and len(out) == table+6

def test_verdict(demo, advice):
    "The verdict says whether training bore out the advisor's pick"
    pick = dataclasses.replace(advice, recommended='bf16', timings=dict(fp32=2., bf16=1., fp16=8.))
    faster,slower = [row('fp32', 2.0), row('bf16', 1.25), row('fp16', 8.)],[row('fp32', 2.0), row('bf16', 2.5), row('fp16', 8.)]
    assert demo.verdict(pick, faster) == ("verdict: bf16, the advisor's pick, ran at 1.60x fp32's speed in training, "
                                          "2.00x in the advisor's timed steps")
    assert 'ran at only 0.80x' in demo.verdict(pick, slower) and 'they disagree' in demo.verdict(pick, slower)
    fp32 = dataclasses.replace(advice, recommended='fp32')
    assert demo.verdict(fp32, slower) == ("verdict: fp32, the advisor's pick, is the mode to use here: "
                                          "in training the 16-bit modes ran at bf16 0.80x, fp16 0.25x its speed")

def test_no_fast_16bit_said_honestly(demo, rows, monkeypatch, capsys):
    "On a CPU without fast bf16 or fp16 (faked: its flags and the advisor's step times) the demo picks the narrow model and says so"
    monkeypatch.setattr(demo, 'detect_hardware', lambda device=None: NO_FAST)
    monkeypatch.setattr(mpx.advisor, 'detect_hardware', lambda device=None: NO_FAST)
    slow = dict(fp32=.01, bf16=.2, fp16=.5)  # what an AVX2-only CPU measures: 16 bits 20-50x slower
    probes = {(dt, f): .05 for dt in (torch.bfloat16, torch.float16) for f in ('matmul', 'conv', 'recurrent')}
    monkeypatch.setattr(mpx.hardware, '_speeds', probes)  # and its probes of each layer family
    monkeypatch.setattr(mpx.advisor, 'time_steps', lambda model, xb, yb, loss_func, modes, n=5: {m: slow[m] for m in modes})
    widths = []
    advise = demo.advise
    monkeypatch.setattr(demo, 'advise', lambda bs, device, arch, width: widths.append(width) or advise(bs, device, arch, WIDTH))
    trained = {m: dict(rows[m], secs_per_epoch=rows['fp32']['secs_per_epoch']*f) for m,f in dict(fp32=1, bf16=20, fp16=50).items()}
    monkeypatch.setattr(demo, 'train', lambda mode, *a, width=None, **k: widths.append(width) or trained[mode])
    out = run_main(demo, monkeypatch, capsys)
    assert widths == [demo.NARROW]*4, 'the advisor and every run get the narrow model'
    assert out[0] == f'hardware: {NO_FAST}' and out[1] == 'advisor: fp32 recommended'
    model = next(l for l in out if l.startswith('model: '))
    assert f'MLP 64-{demo.NARROW}-{demo.NARROW}-10' in model and 'computes neither bf16 nor fp16 fast' in model and 'Use fp32' in model
    table = out.index(next(l for l in out if l.startswith('mode ')))
    why = why_cells('\n'.join(out[table:table+5]))
    said = mpx.hardware.measured(NO_FAST, {'matmul': 'Linear'})  # the MLP's family, timed
    assert why['bf16'] == slow_reason(said, 'bf16') and why['fp16'] == slow_reason(said, 'fp16')
    assert why['fp16'] == 'slow for matmuls (Linear: 0.05x) against fp32, measured on this CPU'
    assert out[table+5] == ("verdict: fp32, the advisor's pick, is the mode to use here: "
                            "in training the 16-bit modes ran at bf16 0.05x, fp16 0.02x its speed")

def fit_output(learn, n_epoch) -> str:
    "What `learn.fit` writes to a stdout that is not a terminal"
    with contextlib.redirect_stdout(io.StringIO()) as out: learn.fit(n_epoch)
    return out.getvalue()

def test_one_line_per_epoch(demo):
    "Off a terminal the demo's learner prints fastai's table, one line per epoch, and no bar; a plain fastai learner floods"
    learn = demo.get_learner(width=WIDTH)
    assert type(learn.progress) is QuietProgress
    out = fit_output(learn, 3)
    lines = out.splitlines()
    assert lines[0].split() == ['epoch', 'train_loss', 'valid_loss', 'accuracy', 'time'] and len(lines) == 4
    assert [l.split()[0] for l in lines[1:]] == ['0', '1', '2'] and all(len(l.split()) == 5 for l in lines[1:])
    assert '\r' not in out and '█' not in out
    plain = demo.get_learner(width=WIDTH).quiet_progress(False)
    bars = fit_output(plain, 3)  # fastprogress's console bars, off a terminal
    assert '\r' in bars and len(bars) > 3*len(out), "fastprogress's console bars off a terminal: the flood quiet_progress stops"

class TTY(io.StringIO):
    def isatty(self): return True

def test_bars_on_a_terminal(demo):
    "On a terminal the quiet learner draws fastai's bars as fastai does"
    learn = demo.get_learner(width=WIDTH)
    with contextlib.redirect_stdout(TTY()) as out: learn.fit(1)
    assert '\r' in out.getvalue() and learn.progress.lines is False

def progress_globals() -> dict:
    "What could switch progress bars for the whole process, in fastprogress and fastai"
    return dict(no_bar=fpp.NO_BAR, writer=fpp.WRITER_FN, printing=fpp.printing, bars=(fpp.master_bar, fpp.progress_bar),
                fastai_bars=(fcp.master_bar, fcp.progress_bar), callback=dict(vars(ProgressCallback)),
                defaults=list(defaults.callbacks), learner=dict(vars(Learner)))

def test_quiet_progress_changes_nothing_global(demo):
    "quiet_progress changes its learner only: fastprogress, fastai's callback and the next learner's bars are as they were"
    before = progress_globals()
    learn = demo.get_learner(width=WIDTH).to_bf16()
    fit_output(learn.quiet_progress(), 1)
    assert progress_globals() == before
    fresh = Learner(learn.dls, demo.get_mlp(WIDTH), loss_func=learn.loss_func)
    assert type(fresh.progress) is ProgressCallback and '\r' in fit_output(fresh, 1)

def test_log_off_a_terminal(demo):
    "The demo run as a script with its output in a pipe: under 4 KB, fastai's table one line per epoch in each mode, no bar"
    epochs = inspect.signature(demo.main).parameters['epochs'].default
    cmd = [sys.executable, str(DEMO), '--width', str(WIDTH)]  # the default schedule, on a narrow model
    res = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=True, timeout=600)
    log = res.stdout.decode()
    assert len(res.stdout) < 4096, log
    assert '\r' not in log and '█' not in log
    sections = log.split('\n== ')[1:]
    assert [s.splitlines()[0] for s in sections] == ['fp32', 'bf16', 'fp16']
    for s in sections:
        epochs_logged = [l.split()[0] for l in s.splitlines() if l[:1].isdigit()]
        assert epochs_logged == [str(e) for e in range(epochs)], s
    assert 'mode  accuracy (valid)' in log and '\nverdict: ' in log
