"""Robustness 6 (issue 68): torch's own machinery reaching a kept layout's storage between fits (`share_memory()`, a cast by
hand to float64), each tried in every mode that keeps a layout, against the same session without it."""
import io
import pytest, torch
from fastai.basics import Adam, nn, Callback
from mpx.all import *
from mpx.test_utils import tiny_learner, fit_quiet, precision_cb, state_of, state_diffs

KEPT = {  # the modes whose layout stays between fits
    'pure_kahan': lambda l: l.to_bf16(pure=True), 'pure_stochastic': lambda l: l.to_bf16(pure=True, update='stochastic'),
    'amp_8bit': lambda l: l.to_bf16(opt_state='8bit'), 'pure_kahan_8bit': lambda l: l.to_bf16(pure=True, opt_state='8bit'),
}

def wide():
    "BatchNorm's statistics, and a 4,096-weight layer whose state a low-bit store holds"
    return nn.Sequential(nn.Linear(1, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))

HANDED_BACK = {'amp': lambda l: l.to_bf16(), 'master': lambda l: l.to_bf16(master=True)}  # fastai's layout between fits

def session(mode, between=None):
    "A learner in `mode` after a fit, `between(learn)`, and a second fit"
    learn = tiny_learner(lr=1e-2, opt_func=Adam, model=wide)
    {**KEPT, **HANDED_BACK}[mode](learn)
    fit_quiet(learn, 1)
    if between is not None: between(learn)
    fit_quiet(learn, 1)
    return learn

@pytest.mark.parametrize('mode', [*KEPT, *HANDED_BACK])
def test_share_memory(mode):
    "`model.share_memory()` between fits (as torch.multiprocessing's queues do to a parameter) moves the buckets' storages: nothing is written, no compensation is lost, every later step is the session's without it, and the weights stay shared."
    ref = session(mode)
    moved = session(mode, lambda l: l.model.share_memory())
    assert all(p.is_shared() for p in moved.model.parameters())
    assert not state_diffs(state_of(ref), state_of(moved))

@pytest.mark.parametrize('mode', [*KEPT, 'master'])
def test_double_by_hand(mode):
    "`model.double()` between fits changes no value: the next fit takes it back, the session's as without it; `to_fp32()` after it gives an fp32 model that fits."
    if mode == 'master':  # no layout kept: the next fit asks for an fp32 model, and `to_fp32()` gives one
        learn = fit_quiet(tiny_learner(lr=1e-2, opt_func=Adam, model=wide).to_bf16(master=True), 1)
        learn.model.double()
        with pytest.raises(ValueError, match="needs an fp32 model: parameter '0.weight' is torch.float64"): fit_quiet(learn, 1)
    else:
        ref = session(mode)
        learn = session(mode, lambda l: l.model.double())
        assert not state_diffs(state_of(ref), state_of(learn))
        learn.model.double()
    learn.to_fp32()
    assert {t.dtype for t in [*learn.model.parameters(), *learn.model.buffers()] if t.is_floating_point()} == {torch.float32}
    fit_quiet(learn, 1)

class Scaled(nn.Module):
    "A linear layer times a buffer that no optimizer steps (pure bf16 halves it, keeping its fp32 value aside)"
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(1, 1)
        self.register_buffer('scale', torch.ones(1))
    def forward(self, x): return self.lin(x) * self.scale

ASSIGN = {'attribute': lambda m,v: setattr(m, 'scale', v), 'data': lambda m,v: setattr(m.scale, 'data', v),
          'register_buffer': lambda m,v: m.register_buffer('scale', v)}

@pytest.mark.parametrize('how', ASSIGN)
@pytest.mark.parametrize('update', ['kahan', 'stochastic'])
def test_assigned_buffer_value_stays(update, how, tmp_path):
    "An fp32 value assigned to a halved buffer between fits, one bf16 rounds to what it holds (1.000244 where 1.0 is held), is its value: in a save, through the next fit, and after `to_fp32()`."
    v = 1 + 2**-12  # bf16 holds 1.0
    learn = fit_quiet(tiny_learner(lr=1e-2, opt_func=Adam, model=Scaled, path=tmp_path).to_bf16(pure=True, update=update), 1)
    ASSIGN[how](learn.model, torch.tensor([v]))
    learn.save('s')
    saved = torch.load(tmp_path/'models'/'s.pth', weights_only=False)
    assert float(saved.get('model', saved)['scale']) == v
    fit_quiet(learn, 1)
    assert learn.model.scale.dtype == torch.bfloat16 and float(precision_cb(learn).fp32_value(learn.model.scale)) == v
    learn.to_fp32()
    assert float(learn.model.scale) == v

class BigTied(nn.Module):
    "A 96x96 weight tied between two layers (a 9,216-weight tensor: a low-bit store holds its state), as GPT-2's wte and lm_head"
    def __init__(self, n=96):
        super().__init__()
        self.inp,self.enc,self.dec,self.head = nn.Linear(1, n),nn.Linear(n, n),nn.Linear(n, n),nn.Linear(n, 1)
        self.dec.weight = self.enc.weight
    def forward(self, x): return self.head(torch.relu(self.dec(torch.relu(self.enc(torch.relu(self.inp(x)))))))

@pytest.mark.parametrize('mode', [None, 'amp', 'amp_8bit', 'pure_kahan', 'pure_kahan_8bit'])
def test_tied_weights_saved_once(mode, tmp_path):
    "`learn.save` writes a tied weight as one record in every mode (AMP with low-bit state wrote it twice), and it loads tied."
    import zipfile
    makes = dict(amp=lambda l: l.to_bf16(), **KEPT)
    learn = tiny_learner(lr=1e-2, opt_func=Adam, model=BigTied, path=tmp_path)
    if mode: makes[mode](learn)
    fit_quiet(learn, 1)
    learn.save('s', with_opt=True)
    big = [i for i in zipfile.ZipFile(tmp_path/'models'/'s.pth').infolist() if '/data/' in i.filename and i.file_size == 96*96*4]
    assert len(big) <= 3  # the weight once, and at most its two moments in fp32
    m = torch.load(tmp_path/'models'/'s.pth', weights_only=False)['model']
    assert m['enc.weight'].untyped_storage().data_ptr() == m['dec.weight'].untyped_storage().data_ptr()

# ---- a model saved whole loads where mpx is not installed

NET = '''import torch
from torch import nn
class Net(nn.Module):
    "BatchNorm, a buffer no optimizer steps, and a 4,096-weight layer"
    def __init__(self):
        super().__init__()
        self.a,self.bn,self.b,self.c = nn.Linear(1, 64),nn.BatchNorm1d(64),nn.Linear(64, 64),nn.Linear(64, 1)
        self.register_buffer('scale', torch.ones(1))
    def forward(self, x): return self.c(torch.relu(self.b(torch.relu(self.bn(self.a(x)))))) * self.scale
'''
LOAD = '''import sys, importlib.abc
class NoMpx(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == 'mpx' or name.startswith('mpx.'): raise ModuleNotFoundError(f"No module named {name!r} (not installed here)")
sys.meta_path.insert(0, NoMpx())
sys.path.insert(0, sys.argv[1])
import torch
for f in sys.argv[2:]:
    m = torch.load(f + '.pt', weights_only=False)
    ref = torch.load(f + '.ref')
    sd = m.state_dict()
    assert sd.keys() == ref.keys() and all(sd[k].dtype == v.dtype and torch.equal(sd[k], v) for k,v in ref.items()), f
print('ok')
'''

class SaveMidFit(Callback):
    "`torch.save(learn.model)` after the third batch, with each tensor's fp32 value as a checkpoint holds it"
    order = 50
    def __init__(self, save): self.save,self.i = save,0
    def after_batch(self):
        if self.training and self.i == 2: self.save('mid')
        self.i += int(self.training)

@pytest.mark.parametrize('mode', ['amp', 'master', *KEPT])
def test_whole_model_loads_without_mpx(mode, tmp_path):
    "`torch.save(learn.model)` between fits, mid-fit and after `to_fp32()` loads in a process without mpx, every tensor its exact fp32 value (the model's class importable there)."
    import subprocess, sys
    (tmp_path/'net.py').write_text(NET)
    sys.path.insert(0, str(tmp_path))
    try: from net import Net
    finally: sys.path.remove(str(tmp_path))
    learn = tiny_learner(lr=1e-2, opt_func=Adam, model=Net)
    dict(amp=lambda l: l.to_bf16(), master=lambda l: l.to_bf16(master=True), **KEPT)[mode](learn)
    def save(name):
        cb = next((c for c in learn.cbs if hasattr(c, 'fp32_value')), None)
        val = (lambda t: t.detach()) if cb is None else cb.fp32_value
        torch.save(learn.model, tmp_path/f'{name}.pt')
        torch.save({k: val(t).clone() for k,t in learn.model.state_dict(keep_vars=True).items()}, tmp_path/f'{name}.ref')
    fit_quiet(learn, 1, cbs=SaveMidFit(save))
    save('between')
    learn.to_fp32()
    save('fp32')
    names = [str(tmp_path/n) for n in ('mid', 'between', 'fp32')]
    r = subprocess.run([sys.executable, '-c', LOAD, str(tmp_path), *names], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == 'ok', r.stderr[-1500:]

@pytest.mark.parametrize('mode', [m for m in KEPT if m.startswith('pure')])
def test_cast_by_hand_then_copied(mode, tmp_path):
    "`model.float()` by hand between fits, then `deepcopy`, `pickle`, `torch.save` of the model or a module, or a pickled `state_dict(keep_vars=True)`: every copy holds the exact fp32 values (a halved buffer came out rounded, 1.0 for 1.000244)."
    import pickle, io
    from copy import deepcopy
    learn = fit_quiet(KEPT[mode](tiny_learner(lr=1e-2, opt_func=Adam, model=Scaled)), 1)
    learn.model.scale = torch.tensor([1 + 2**-12])  # an exact fp32 value bf16 cannot hold
    cb = precision_cb(learn)
    ref = {k: cb.fp32_value(t).clone() for k,t in learn.model.state_dict(keep_vars=True).items()}
    def saved(m):
        buf = io.BytesIO()
        torch.save(m, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)
    copies = dict(deepcopy=lambda: deepcopy(learn.model).state_dict(), pickle=lambda: pickle.loads(pickle.dumps(learn.model)).state_dict(),
                  torch_save=lambda: saved(learn.model).state_dict(), keep_vars=lambda: pickle.loads(pickle.dumps(learn.model.state_dict(keep_vars=True))))
    for how,copy in copies.items():
        learn.model.float()  # by hand, each time
        got = copy()
        assert all(got[k].dtype == torch.float32 and torch.equal(got[k], v) for k,v in ref.items()), how
    assert float(ref['scale']) == 1 + 2**-12

class Same(nn.Module):
    "A parametrization that changes nothing"
    def forward(self, x): return x

@pytest.mark.parametrize('mode', [m for m in KEPT if m.startswith('pure')])
def test_parametrization_between_fits(mode):
    "`register_parametrization` between fits (torch's `set_` of the weight to itself moves its version counter, no value): no compensation is lost, and the next fits are the session's without it, bit for bit."
    from torch.nn.utils import parametrize
    def run(par:bool):
        learn = fit_quiet(KEPT[mode](tiny_learner(lr=1e-2, opt_func=Adam, model=wide)), 1)
        cb = precision_cb(learn)
        w = learn.model[3].weight
        before = cb.fp32_value(w).clone()
        if par:
            parametrize.register_parametrization(learn.model[3], 'weight', Same())
            assert learn.model[3].parametrizations.weight.original is w and torch.equal(cb.fp32_value(w), before)
        fit_quiet(learn, 2)
        return [cb.fp32_value(t).clone() for t in (w, learn.model[0].weight, learn.model[5].bias)]
    assert all(map(torch.equal, run(False), run(True)))

@pytest.mark.parametrize('mode', [m for m in KEPT if m.startswith('pure')])
def test_written_between_fits_resets(mode):
    "A weight written between fits (new values) takes them exactly, its compensation reset; one written with the values it holds keeps its exact value."
    learn = fit_quiet(KEPT[mode](tiny_learner(lr=1e-2, opt_func=Adam, model=wide)), 1)
    cb = precision_cb(learn)
    w,b = learn.model[3].weight,learn.model[0].weight
    kept = cb.fp32_value(b).clone()
    with torch.no_grad():
        w.mul_(2)  # new values: exactly them
        b.copy_(b.clone())  # the same values: a touch
    assert torch.equal(cb.fp32_value(w), w.float()) and torch.equal(cb.fp32_value(b), kept)

# ---- a module saved alone writes itself alone (torch saves a view's whole storage)

def _bytes(o) -> int:
    "How many bytes `torch.save(o)` writes"
    f = io.BytesIO()
    torch.save(o, f)
    return f.tell()

def deep():
    "An 8-layer MLP: one 256x256 layer is an eighth of its weights"
    return nn.Sequential(nn.Linear(1, 256), *[m for _ in range(6) for m in (nn.ReLU(), nn.Linear(256, 256))], nn.ReLU(),
                         nn.Linear(256, 1))

SAVED_ALONE = {'amp': lambda l: l.to_bf16(), 'amp_compile': lambda l: l.to_bf16(fused='compile'), 'master': lambda l: l.to_fp16(loss_scale=512),
               **KEPT}

class SavesOneLayer(Callback):
    "After the third batch: what `torch.save` writes of one layer (`_saved_alone`)"
    order = 60
    def __init__(self): self.i,self.got = 0,None
    def after_batch(self):
        if self.training and self.i == 2: self.got = _saved_alone(self.learn.model[4])
        self.i += int(self.training)

def _saved_alone(m:nn.Module) -> tuple:
    "The bytes `torch.save` writes of `m`'s state dict, its weight and `m`, and whether the state dict loads back as it was"
    sd = m.state_dict()
    f = io.BytesIO()
    torch.save(sd, f)
    f.seek(0)
    back = torch.load(f)
    same = back.keys() == sd.keys() and all(torch.equal(back[k], v) for k,v in sd.items())
    return [f.tell(), _bytes(m.weight), _bytes(m)],same

@pytest.mark.parametrize('mode', SAVED_ALONE)
def test_module_saved_alone(mode):
    """`torch.save` of one layer's state dict writes that layer, not the flat buffer it lies in (the whole model), mid-fit,
    between fits and after `to_fp32()`; between fits, so does a save of its weight or of the layer (plain torch tensors, or
    copies holding the fp32 values). A state dict of the whole model copies nothing."""
    if mode == 'amp_compile': pytest.importorskip('mpx.compiled')
    mid = SavesOneLayer()
    learn = fit_quiet(SAVED_ALONE[mode](tiny_learner(lr=1e-2, opt_func=Adam, model=deep)), 1, cbs=mid)
    own = sum(t.numel() * 4 for t in learn.model[4].parameters())  # its fp32 bytes (pure bf16 writes half)
    (sizes,same),(mid_sizes,mid_same) = _saved_alone(learn.model[4]),mid.got
    assert mid_same and same
    assert mid_sizes[0] < 1.1 * own, f'mid-fit: {mid_sizes[0]} bytes written for a layer of {own}'
    assert max(sizes) < 1.1 * own, f'between fits: {sizes} bytes written for a layer of {own}'
    whole = learn.model.state_dict()  # every tensor of a buffer in the dict: none copied
    assert all(whole[k].data_ptr() == t.data_ptr() for k,t in learn.model.state_dict(keep_vars=True).items())
    learn.to_fp32()
    assert max(_saved_alone(learn.model[4])[0]) < 1.1 * own
