"Pure bf16 (`PureBF16`): the ramp converges, no fp32 masters are kept, checkpoints resume bit-exactly, every optimizer trains, workflows end like fp32."
import random, pytest, torch
from torch import nn, Tensor
from functools import partial
from fastcore.foundation import L
from fastcore.basics import first
from fastai.basics import Learner, DataLoaders, TfmdDL, Callback, SGD, Adam, OptimWrapper, set_seed
from fastai.callback.core import CancelFitException
from fastai.callback.tracker import SaveModelCallback
import fastai.callback.schedule
from mpx.all import *
from mpx.pure import *
from mpx.test_utils import tiny_learner, tiny_split, OPTIMIZERS, learner_problems, fit_quiet, ramp_learner, check_stochastic_rounding
from planted import biased_stochastic_rounding
from test_workflows import summary, values, far_from_fp32, _diff, SEQUENCES, check_like_fp32, _die_then_fit, _failed_ref, tiny

pytestmark = pytest.mark.filterwarnings('ignore::UserWarning')
UPDATES = ('kahan', 'stochastic')

def pure(learn, update='kahan'): return learn._set_precision(PureBF16(update))

# ---- convergence

def one_weight_ramp(n, opt_func, cbs=None):
    "One weight of 1.0 whose loss `w*x` (x = 1) has gradient 1: `n` steps of lr 1e-4 take it to 1 - n*1e-4"
    xs = torch.ones(n, 1)
    dls = DataLoaders(TfmdDL(list(zip(xs, xs)), bs=1), TfmdDL(list(zip(xs[:1], xs[:1])), bs=1))
    model = nn.Linear(1, 1, bias=False); nn.init.ones_(model.weight)
    learn = Learner(dls, model, loss_func=lambda p,y: p.mean(), opt_func=opt_func, lr=1e-4, wd=0., cbs=cbs)
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    return learn.to_fp32().model.weight.item()  # its fp32 value: between fits a pure model is bf16

@pytest.mark.parametrize('opt', ['sgd', 'adam'])
def test_ramp(opt):
    "1000 steps of 1e-4 take a weight of 1.0 to 0.900 with Kahan's update, as in fp32, where plain bf16 rounding keeps it at 1.0."
    opt_func = partial(SGD, mom=0.) if opt == 'sgd' else partial(Adam, eps=1e-12)
    assert abs(one_weight_ramp(1000, opt_func) - 0.9) < 1e-3
    assert abs(one_weight_ramp(1000, opt_func, PureBF16('kahan')) - 0.9) < 1e-3

@pytest.mark.parametrize('fused', [False, True])
def test_stochastic_unbiased(fused):
    "Stochastic rounding (fastai's loop or fused): 4096 weights' 20 steps of a quarter ulp come down as unbiased rounding's Binomial."
    check_stochastic_rounding(fit_quiet(ramp_learner().to_bf16(pure=True, update='stochastic', fused=fused)))

@pytest.mark.parametrize('bias', [1 << 14, -(1 << 14)], ids=['up', 'down'])
def test_stochastic_check_sees_a_bias(bias):
    "Negative control: stochastic rounding biased by a quarter of an ulp, up or down, fails `check_stochastic_rounding`."
    with biased_stochastic_rounding(bias): learn = fit_quiet(ramp_learner().to_bf16(pure=True, update='stochastic'))
    with pytest.raises(AssertionError, match='biased'): check_stochastic_rounding(learn)

def test_regression_trains():
    "A tiny regression trains in pure bf16, either update, to within 10% of fp32's validation loss."
    ref = tiny_learner(bn=True, lr=1e-2); ref.fit(3)
    for update in UPDATES:
        learn = tiny_learner(bn=True, lr=1e-2, cbs=PureBF16(update)); learn.fit(3)
        assert learn.validate()[0] < 1.1 * ref.validate()[0]

# ---- no masters

class NoMasterProbe(Callback):
    "Before and after every step: the dtypes of the weights, the optimizer's tensors, the fp32 tensors the mode keeps"
    order = PureBF16.order + 1
    def before_fit(self): self.recs = []
    def before_step(self): self.rec()
    def after_step(self): self.rec()
    def rec(self):
        ps,bw = list(self.model.parameters()),self.learn.mixed_precision.bf16_weights
        self.recs.append(dict(dtypes={(type(m).__name__, p.dtype) for m in self.model.modules() for p in m.parameters(recurse=False)},
                              same=[id(p) for pg in self.opt.param_lists for p in pg] == [id(p) for p in ps],
                              grads={p.grad.dtype for p in ps if p.grad is not None}, kept=len(bw.fp32_kept),
                              comp={c.dtype for c in bw.comp.values()}, learn_params='parameters' in self.learn.__dict__))

@pytest.mark.parametrize('update', UPDATES)
def test_no_masters(update):
    "During a fit the weights and gradients are bf16 (BatchNorm fp32), the optimizer steps the model's own parameters, and no fp32 copy of a trained weight is kept."
    probe = NoMasterProbe()
    learn = tiny_learner(bn=True, cbs=[PureBF16(update), probe], opt_func=Adam)
    learn.fit(1)
    for r in probe.recs:
        assert r['dtypes'] == {('Linear', torch.bfloat16), ('BatchNorm1d', torch.float32)} and r['same'] and not r['learn_params']
        assert r['grads'] <= {torch.bfloat16, torch.float32} and r['kept'] == 0
        assert r['comp'] == ({torch.bfloat16} if update == 'kahan' else set())
    assert {(type(m).__name__, p.dtype) for m in learn.model.modules() for p in m.parameters(recurse=False)} == probe.recs[-1]['dtypes']
    assert {v.dtype for st in learn.opt.state.values() for v in st.values() if isinstance(v, Tensor) and v.dim()} == {torch.float32}
    learn.to_fp32()  # the fp32 model, made when asked for
    assert {p.dtype for p in learn.model.parameters()} == {torch.float32}

def test_fp32_after_fit_holds_w_plus_c():
    "Between fits the pairs stay; `to_fp32()` makes each weight exactly its last bf16 weight plus its compensation, which splits back into the same pair."
    learn = tiny_learner(bn=True, lr=1e-2, cbs=PureBF16())
    class Snap(Callback):
        order = PureBF16.order + 1
        def before_fit(self): self.snaps = []
        def after_step(self): self.snaps.append({p: (p.detach().clone(), c.clone()) for p,c in self.learn.mixed_precision.bf16_weights.comp.items()})
    learn.add_cb(Snap()); learn.fit(1)
    snaps = learn.snap.snaps
    assert snaps[-1]
    for p,(w,c) in snaps[-1].items(): assert torch.equal(p.data, w) and torch.equal(learn.pure_bf16.bf16_weights.comp[p], c)  # kept
    learn.to_fp32()
    for p,(w,c) in snaps[-1].items():
        assert torch.equal(p.data, w.float() + c.float())
        w2,c2 = split_kahan(p.data)
        assert torch.equal(w2, w) and torch.equal(c2, c)
    assert any(not torch.equal(p, p.bfloat16().float()) for p in learn.model.parameters())

# ---- skipped steps

class InjectInf(Callback):
    order = PureBF16.order - 1
    def after_backward(self):
        if self.train_iter == 2: first(self.model.parameters()).grad.fill_(float('inf'))

@pytest.mark.parametrize('update', UPDATES)
@pytest.mark.parametrize('opt', ['adam', 'ranger', 'torch_adamw'])
def test_skip_changes_nothing(update, opt):
    "A step with an inf gradient is skipped: weights, compensations, optimizer state and the stream's count are bit-identical after it."
    learn = tiny_learner(bn=True, opt_func=OPTIMIZERS[opt], cbs=[PureBF16(update), InjectInf()])
    snaps = []
    def snap(*_):
        bw,opt = learn.mixed_precision.bf16_weights,learn.opt
        st = opt.opt.state if isinstance(opt, OptimWrapper) else opt.state if 'state' in vars(opt) else opt.opt.state
        snaps.append([p.detach().clone() for p in learn.model.parameters()] + [c.clone() for c in bw.comp.values()]
                     + [v.clone() for s in st.values() for v in s.values() if isinstance(v, Tensor)] + [torch.tensor(learn.mixed_precision.stream.count)])
    learn.add_cb(Callback(after_batch=snap))
    learn.fit(1)
    assert learn.mixed_precision.skipped_steps == 1
    assert all(torch.equal(a, b) for a,b in zip(snaps[1], snaps[2])) and len(snaps[1]) == len(snaps[2])
    assert not all(torch.equal(a, b) for a,b in zip(snaps[2], snaps[3]))

# ---- every optimizer

@pytest.mark.parametrize('update', UPDATES)
@pytest.mark.parametrize('opt', OPTIMIZERS)
def test_optimizer_trains(opt, update):
    "fastai's SGD, Adam, RAdam, QHAdam, Lamb, Larc, ranger and torch's AdamW through OptimWrapper train in pure bf16 as far as fp32 within 40%, their state as fp32's."
    ref = tiny_learner(bn=True, splitter=tiny_split, opt_func=OPTIMIZERS[opt], lr=1e-2, wd=1e-2); ref.fit(2)
    learn = tiny_learner(bn=True, splitter=tiny_split, opt_func=OPTIMIZERS[opt], lr=1e-2, wd=1e-2, cbs=PureBF16(update))
    l0 = learn.validate()[0]; learn.fit(2); l1,r1 = learn.validate()[0],ref.validate()[0]
    assert abs(l1 - r1) < 0.4 * (l0 - r1), (l0, l1, r1)  # within 40% of fp32's progress (Larc moves little in 2 epochs)
    assert learner_problems(learn) == []
    s,r = summary(learn),summary(ref)
    for k in r: assert s.get(k) == r[k], f'{k}: {_diff(s.get(k), r[k])}'

# ---- checkpoints

class SaveAt(Callback):
    "Save `learn` with its optimizer after batch `at`; record the fp32 values `w + c` at that moment"
    order = 50
    def __init__(self, at=4): self.at = at
    def after_batch(self):
        if self.train_iter != self.at: return
        bw = self.learn.mixed_precision.bf16_weights
        self.wide = [bw.value_of(p).clone() for p in self.model.parameters()]
        self.learn.save('mid', with_opt=True)

@pytest.mark.parametrize('update', UPDATES)
def test_checkpoints(update, tmp_path):
    "A save mid-fit writes the fp32 values w + c and does not perturb the fit; plain fastai loads the weights; resuming from a save after the fit is bit-exact."
    def fresh(cbs=()):
        learn = tiny_learner(bn=True, opt_func=Adam, lr=1e-2, cbs=[PureBF16(update), *cbs]); learn.path = tmp_path; return learn
    a,b = fresh(),fresh([sv := SaveAt()])
    a.fit(1); b.fit(1)
    assert all(torch.equal(p, q) for p,q in zip(a.model.parameters(), b.model.parameters())), 'a save mid-fit changed the fit'
    sd = torch.load(tmp_path/'models/mid.pth', weights_only=False)
    assert all(torch.equal(sd['model'][k], w) for k,w in zip(b.model.state_dict(), sv.wide) if 'running' not in k)
    plain = tiny_learner(bn=True); plain.path = tmp_path; plain.load('mid', with_opt=False)  # no precision callback
    assert all(torch.equal(p, w) for p,w in zip(plain.model.parameters(), sv.wide))
    a.save('end', with_opt=True)
    c = fresh(); c.load('end', with_opt=True)
    for l in (a, c): l.dls.train.rng = random.Random(1); set_seed(1); l.fit(1)
    assert all(torch.equal(p, q) for p,q in zip(a.model.parameters(), c.model.parameters())), 'resume is not bit-exact'

def test_stochastic_reproducible():
    "Stochastic rounding draws from a seeded generator: the same seed repeats a run exactly, another seed does not."
    def run(seed): learn = tiny_learner(bn=True, lr=1e-2, cbs=PureBF16('stochastic', seed=seed)); learn.fit(1); return list(learn.model.parameters())
    a,b,c = run(0),run(0),run(1)
    assert all(torch.equal(p, q) for p,q in zip(a, b)) and not all(torch.equal(p, q) for p,q in zip(a, c))

# ---- workflows

_SEQ_CELLS = [(s, u) for s in SEQUENCES for u in UPDATES if u == 'kahan' or s in ('save_load_opt', 'lrfind_finetune', 'export_nocpu', 'switch')]

@pytest.mark.parametrize('seq,update', _SEQ_CELLS, ids=['-'.join(c) for c in _SEQ_CELLS])
def test_sequence(seq, update, tmp_path):
    "lr_find then fit_one_cycle, fine_tune, save/load then unfreeze, second fits, export/load_learner, freeze with discriminative lrs, precision switches: as in fp32."
    check_like_fp32('tiny', seq, f'pure_{update}', 'adam', tmp_path)

@pytest.mark.parametrize('opt', ['ranger', 'torch_adamw'])
def test_optimizer_sequence(opt, tmp_path):
    "ranger (Lookahead) and torch's AdamW go through save/load and freeze with discriminative lrs as in fp32."
    for seq in ('save_load_opt', 'freeze_discrim'): check_like_fp32('tiny', seq, 'pure_kahan', opt, tmp_path/seq)

_FAILS = [('after_pred', RuntimeError, 0, 3), ('before_step', KeyboardInterrupt, 11, 3), ('after_step', RuntimeError, 11, 3), ('after_batch', CancelFitException, 0, 3)]

@pytest.mark.parametrize('event,exc,order,at', _FAILS, ids=[f'{e}-{x.__name__}' for e,x,_,_ in _FAILS])
def test_failed_fit(event, exc, order, at):
    "A fit that dies leaves an fp32 model from w + c and the optimizer as it was; the next fit ends like fp32's."
    learn = pure(tiny())
    after_fail,after_next = _die_then_fit(learn, event, exc, order, at)
    assert after_fail == [] and after_next == [], (after_fail, after_next)
    (ref,ref_vals,start),got = _failed_ref(event, exc, order, at),summary(learn)
    for k in ref: assert got.get(k) == ref[k], f'{k} differs from fp32: {_diff(got.get(k), ref[k])}'
    assert not (far := far_from_fp32(values(learn), ref_vals, start, 'pure_kahan')), far

def test_dies_inside_step():
    "An exception inside the optimizer's step functions: the window is folded, the model is fp32, and mpx left the step functions as the user made them."
    learn = pure(tiny())
    class Die(Callback):
        order = PureBF16.order + 1
        def before_step(self):
            o = self.learn.opt; n = [0]
            def boom(p, **kw):
                n[0] += 1
                if n[0] == 2: raise KeyboardInterrupt('Boom in the step')
            o.cbs = L(list(o.cbs)[:2] + [boom] + list(o.cbs)[2:])
    learn.create_opt(); cbs = list(learn.opt.cbs)
    with pytest.raises(KeyboardInterrupt): learn.fit(1, cbs=Die())
    got = list(learn.opt.cbs)
    assert learner_problems(learn) == [] and got[:2] + got[3:] == cbs and got[2].__name__ == 'boom'  # the user's change, and only it
    learn.opt.cbs = L(cbs)
    learn.fit(1)
    assert learner_problems(learn) == []

# ---- arguments

def test_bad_update():
    "An unknown update is a ValueError naming it and the allowed ones; a non-fp32 model is refused before anything changes."
    with pytest.raises(ValueError, match="update='fp8' is not allowed: update must be one of 'kahan', 'stochastic'"): PureBF16('fp8')
    learn = tiny_learner(cbs=PureBF16()); learn.model.double()
    with pytest.raises(ValueError, match="PureBF16 needs an fp32 model: parameter '0.weight' is torch.float64"): learn.fit(1)
    assert {p.dtype for p in learn.model.parameters()} == {torch.float64}
