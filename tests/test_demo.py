"Tests for demo/digits.py: data, models, the advisor's lines, table formatting, and a one-epoch run of every mode against mpx's contract."
import importlib.util, pathlib
import pytest, torch

DEMO = pathlib.Path(__file__).resolve().parent.parent/'demo'/'digits.py'
KEYS = {'mode', 'accuracy', 'secs_per_epoch', 'loss_scale', 'skipped_steps', 'total_steps'}

@pytest.fixture(scope='module')
def demo():
    spec = importlib.util.spec_from_file_location('digits_demo', DEMO)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

@pytest.fixture(scope='module')
def advice(demo):
    "The advisor's timed report on the demo's learner"
    return demo.advise()

def test_advice(demo, advice):
    "The demo's learner is numerically safe in every mode; the advice names the hardware, the mode and why"
    assert advice.recommended in demo.MODES and advice.at_risk == {} and set(advice.timings) == set(demo.MODES)
    lines = demo.format_advice(advice).splitlines()
    assert lines[0] == f'hardware: {advice.hardware}' and lines[0].startswith('hardware: cpu (')
    assert lines[1] == f'advisor: {advice.recommended} recommended'
    assert lines[2] == f'  - {advice.reasons[0]}' and len(lines) == 2 + len(advice.reasons)
    assert any("bf16: measured" in l for l in lines) and any("fp16: measured" in l for l in lines)

@pytest.fixture(scope='module')
def rows(demo):
    "One short epoch per mode, shared by the tests below"
    return {m: demo.train(m, epochs=1) for m in demo.MODES}

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
    mlp = demo.get_mlp()
    assert mlp(xb).shape == (32,10) and [m.out_features for m in mlp if isinstance(m, torch.nn.Linear)] == [512, 512, 10]

def test_dls_batches(demo):
    "Batches are the data's own rows: the validation rows in order; the training rows shuffled, the same from the same seed"
    (xt,yt),(xv,yv) = demo.get_data()
    xs,ys = map(torch.cat, zip(*demo.get_dls(bs=100).valid))
    assert torch.equal(xs, xv) and torch.equal(ys, yv)
    def train_ys(seed): demo.set_seed(seed); return torch.cat([y for _,y in demo.get_dls(bs=100).train])
    a,b = train_ys(0),train_ys(0)
    assert torch.equal(a, b) and len(a) == (len(yt)//100)*100 and not torch.equal(a, yt[:len(a)])

def test_format_table(demo):
    rs = [dict(mode='fp32', accuracy=0.98, secs_per_epoch=2.0, loss_scale=None, skipped_steps=None, total_steps=None),
          dict(mode='bf16', accuracy=0.97, secs_per_epoch=1.0, loss_scale=1.0, skipped_steps=0, total_steps=22),
          dict(mode='fp16', accuracy=0.96, secs_per_epoch=4.0, loss_scale=32768.0, skipped_steps=3, total_steps=22)]
    lines = demo.format_table(rs).splitlines()
    assert len(lines) == 2 + len(rs)
    assert all(c in lines[0] for c in demo.COLS)
    body = {l.split()[0]: l.split() for l in lines[2:]}
    assert list(body) == ['fp32', 'bf16', 'fp16']
    assert body['fp32'][1:] == ['0.9800', '2.000', '1.00x', '-', '-']
    assert body['bf16'][1:4] == ['0.9700', '1.000', '2.00x'] and body['bf16'][4] == '1'
    assert body['fp16'][3:5] == ['0.50x', '32768'] and ' '.join(body['fp16'][5:]) == '3 of 22'

def test_train_fp32(rows):
    r = rows['fp32']
    assert set(r) == KEYS and r['mode'] == 'fp32'
    assert 0 <= r['accuracy'] <= 1 and r['accuracy'] > 0.5, 'one epoch should already beat chance by far'
    assert r['secs_per_epoch'] > 0
    assert r['loss_scale'] is r['skipped_steps'] is r['total_steps'] is None

@pytest.mark.parametrize('mode', ['bf16', 'fp16'])
def test_train_mixed(rows, mode):
    r,n_batches = rows[mode],(1797-359)//128  # fastai drops the last partial training batch
    assert set(r) == KEYS and r['mode'] == mode and 0 <= r['accuracy'] <= 1
    assert r['total_steps'] == n_batches and 0 <= r['skipped_steps'] <= r['total_steps']
    if mode == 'bf16': assert r['loss_scale'] == 1.0 and r['skipped_steps'] == 0
    else: assert r['loss_scale'] > 1.0

def test_table_from_runs(demo, rows):
    lines = demo.format_table(list(rows.values())).splitlines()
    assert [l.split()[0] for l in lines[2:]] == list(demo.MODES)
    assert all(len(l.split()) >= len(demo.COLS) for l in lines[2:])

def test_unknown_mode(demo):
    with pytest.raises(ValueError): demo.train('fp8', epochs=1)

def test_main_prints_advice_before_table(demo, advice, rows, monkeypatch, capsys):
    "main prints the hardware and the recommendation first, and again just above the table"
    monkeypatch.setattr(demo, 'advise', lambda *a, **k: advice)
    monkeypatch.setattr(demo, 'train', lambda mode, *a, **k: rows[mode])
    threads = torch.get_num_threads()
    try: demo.main(epochs=1, threads=1)
    finally: torch.set_num_threads(threads)
    out = capsys.readouterr().out.splitlines()
    hw = [i for i,l in enumerate(out) if l == f'hardware: {advice.hardware}']
    table = out.index(next(l for l in out if l.startswith('mode ')))
    assert len(hw) == 2 and hw[0] == 0 and out[1] == f'advisor: {advice.recommended} recommended'
    assert out[table-1].startswith(f'advisor: {advice.recommended} recommended (') and hw[1] == table-2
    assert [l.split()[0] for l in out[table+2:]] == list(demo.MODES)
