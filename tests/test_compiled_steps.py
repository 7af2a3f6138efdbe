"""`fused='compile'` (issue 27): one compiled kernel a run in every mode, within a stated tolerance of the eager step, skipping a
bad step on the device with no host sync, falling back to the eager step with a reason where it cannot compile, and the
stochastic rounding's stream and the step counts carried across checkpoints. Compiling costs seconds a kernel; each
(storage kind, chain) compiles once a process, so the cases share a few. Every compiled case checks that its steps ran in
compiled regions (`check_compiled_steps`): where the kernel quietly gave way to the eager step, comparing it with the eager
step would compare the eager step with itself. Where torch.compile cannot build, the `compiled` cases skip with the reason."""
import functools, os, re, subprocess, sys, warnings
from pathlib import Path
from functools import partial
import pytest, torch
from torch import nn
from fastai.basics import Callback, Optimizer, Adam, SGD, RAdam, QHAdam, RMSProp, Lamb, Larc, ranger, sgd_step, load_learner
import fastai.callback.schedule  # noqa: F401 (fit_one_cycle, lr_find)
from mpx.all import *
import mpx.compiled
from mpx.test_utils import (tiny_learner, tiny_split, ALL_MODES, fit_quiet, state_of, state_diffs, precision_cb, Snapshot, InjectGrad,
                            check_skips_change_nothing, CountOps, weights, tabular_app_learner, collab_app_learner, text_app_learner,
                            StepProfile, check_compiled_steps, ramp_learner, check_stochastic_rounding, suspended, StepLrs, check_step_lrs,
                            step_lr_tol)
from planted import compiled_replaced_by_eager, lr_scaled, lr_frozen

pytestmark = [pytest.mark.filterwarnings('ignore::UserWarning'), pytest.mark.usefixtures('one_thread')]

COMPILED = [m for m in ALL_MODES if m != 'master_fp16_dynamic']  # its kernels are master_fp16's: the dynamic scale is the callback's

# ---- numerics: a step against the eager step, from the same state

class StepOnce(Callback):
    "Before the `at`-th step: keep the state; after it, the stepped tensors (what a mode steps: masters, `w + c`, the parameters)"
    order = 100
    def __init__(self, at): self.at,self.n,self.before,self.after = at,0,None,None
    def before_step(self):
        if self.n == self.at: self.before = self._wide()
    def after_step(self):
        if self.n == self.at: self.after = self._wide()
        self.n += 1
    def _wide(self):
        with suspended(self.learn): return weights(self.learn)  # the fp32 model the fit would leave

def stepped(mode, fused, opt='adam', at=3, **kw):
    "The fp32 weights before and after step `at` and the learner; compiled, every step checked to have run in compiled regions"
    learn = tiny_learner(bn=True, splitter=tiny_split, opt_func=dict(adam=Adam, sgd=partial(SGD, mom=.9), radam=RAdam, qhadam=QHAdam,
                                                                      rmsprop=partial(RMSProp, mom=.9))[opt], lr=1e-2, wd=1e-2, n_trn=4)
    ALL_MODES[mode](learn, fused=fused, **kw)
    probe,prof = StepOnce(at),StepProfile()
    fit_quiet(learn, 1, cbs=[probe] + (prof.cbs if fused == 'compile' else []))
    if fused == 'compile': check_compiled_steps(prof)
    return probe.before,probe.after,learn

@pytest.mark.compiled
@pytest.mark.parametrize('opt', ['adam', 'sgd', 'radam', 'qhadam', 'rmsprop'])
@pytest.mark.parametrize('mode', COMPILED)
def test_compiled_within_tolerance(mode, opt):
    """The compiled kernels step within 1e-4 of the eager step's update, and a run of steps within 2% of its change: inductor
    rounds `a + b*c` as two operations and square roots correctly, where the eager CPU kernels fuse and may not."""
    (b0,a0,l0),(b1,a1,l1) = stepped(mode, True, opt),stepped(mode, 'compile', opt)
    upd = sum(float((a - b).norm()**2) for a,b in zip(a0, b0))**.5
    one = sum(float(((x1 - y1) - (x0 - y0)).norm()**2) for x0,y0,x1,y1 in zip(a0, b0, a1, b1))**.5  # the two updates, from where each was
    if 'stochastic' not in mode: assert one <= 1e-4 * upd + 1e-7, (one, upd)  # stochastic rounding: other random bits, other weights
    start = weights(tiny_learner(bn=True, splitter=tiny_split, n_trn=4))
    drift = lambda a,b: sum(float((x - y).norm()**2) for x,y in zip(a, b))**.5 / sum(float((x - s).norm()**2) for x,s in zip(a, start))**.5
    if 'stochastic' in mode:  # compiled, the random bits are others: as far apart as two seeds' eager runs, not further
        assert drift(weights(l0), weights(l1)) < 3 * drift(weights(l0), weights(stepped(mode, True, opt, seed=1)[2]))
    else: assert drift(weights(l0), weights(l1)) < .02
    assert precision_cb(l1).total_steps == precision_cb(l0).total_steps
    assert [s.get('step') for s in l0.opt.state_dict()['state']] == [s.get('step') for s in l1.opt.state_dict()['state']]

@pytest.mark.compiled
def test_stochastic_compiled_unbiased():
    "Compiled stochastic rounding is unbiased, its bits independent: 4096 weights' 20 steps of a quarter ulp each come down as they must."
    prof = StepProfile()
    learn = fit_quiet(ramp_learner().to_bf16(pure=True, update='stochastic', fused='compile'), cbs=prof.cbs)
    check_compiled_steps(prof)
    check_stochastic_rounding(learn)

@pytest.mark.compiled
def test_kahan_compensation_lives():
    "The Kahan compensation is non-zero in a compiled step: inductor would otherwise fold `bf16(x).float()` back into `x`."
    seen = []
    class Comp(Callback):
        order = 100
        def after_step(self): seen.append(max(float(c.float().abs().max()) for c in self.learn.pure_bf16.bf16_weights.comp.values()))
    learn = tiny_learner(opt_func=Adam, lr=1e-3, n_trn=4, cbs=Comp()).to_bf16(pure=True, fused='compile')
    prof = StepProfile()
    fit_quiet(learn, 1, cbs=prof.cbs)
    check_compiled_steps(prof)
    assert seen and all(c > 0 for c in seen[1:])

def compiled_lrs(mode) -> StepLrs:
    "A one-cycle fit of a `ramp_learner` compiled in `mode`, every step checked to have run compiled: each step's lr, set and used"
    probe,prof = StepLrs(),StepProfile()
    learn = ALL_MODES[mode](ramp_learner(lr=1e-2), fused='compile')
    learn.fit_one_cycle(1, 1e-2, cbs=[probe, *prof.cbs])
    check_compiled_steps(prof)
    return probe

@pytest.mark.compiled
@pytest.mark.parametrize('mode', ['amp_bf16', 'master_fp16', 'pure_kahan', 'pure_stochastic'])
def test_compiled_step_lr_is_the_schedules(mode):
    "Each compiled step of a one-cycle fit moves the fp32 weights by the lr fastai's schedule set at that step: plain SGD by hand."
    check_step_lrs(compiled_lrs(mode), *step_lr_tol(mode))

@pytest.mark.compiled
@pytest.mark.parametrize('bug', [lambda: lr_scaled(1.05), lr_frozen], ids=['lr_x1.05', 'lr_frozen'])
def test_compiled_wrong_step_lr_is_caught(bug):
    "Negative control: compiled steps taking 1.05 times fastai's lr, or the fit's first lr all along, fail the check."
    with bug(), pytest.raises(AssertionError, match='where fastai set'):
        check_step_lrs(compiled_lrs('pure_kahan'), *step_lr_tol('pure_kahan'))

# ---- skipped on the device, with no host sync

@pytest.mark.compiled
@pytest.mark.parametrize('mode', ALL_MODES)
def test_no_host_sync_and_skips_on_device(mode):
    "Every checking mode compiled: a step with an inf skipped (state bit-identical after it), and no host sync a step after the first."
    learn = tiny_learner(bn=True, splitter=tiny_split, opt_func=Adam, lr=1e-2, n_trn=6)
    ALL_MODES[mode](learn, fused='compile')
    prof,snap = StepProfile(wide=True),Snapshot()  # from `after_backward` to the end of `after_step`
    inject = InjectGrad(at=[2], micro=mode.startswith('master'))  # the master modes take the gradients after the backward
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        fit_quiet(learn, 1, cbs=[*prof.cbs, inject, snap])
    assert not [x for x in w if 'steps eagerly' in str(x.message)]
    check_compiled_steps(prof)
    cb = precision_cb(learn)
    assert prof.syncs[1:] == [0]*(len(prof.syncs) - 1), prof.syncs  # the first step compiles (and may read values doing so)
    check_skips_change_nothing(cb, snap, skipped=[2])
    assert cb.last_overflow.step == 2 and cb.last_overflow.param is None  # read lazily: the gradients are gone, the step is known

def _fused_unscales(learn) -> int:
    "Calls of torch's fused unscale-and-check kernel (which writes the gradients back) in one fit of `learn`"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p: fit_quiet(learn, 1)
    return sum(e.name == 'aten::_amp_foreach_non_finite_check_and_unscale_' for e in p.events())

@pytest.mark.compiled
def test_unscaled_finite_check_compiled_reads_only():
    """A compiled step with no loss scale checks its gradients in one compiled reduction, read-only: the fused unscale kernel, which
    writes them back, runs only in the eager fit (the control). The compiled check flags as the eager one: infs and nans, and
    nothing for huge finite values whose sum overflows; it writes nothing. (inductor folds `g * 0` to 0 for fp32 `g`: the first case
    failed so.)"""
    from mpx.compiled import find_nonfinite
    from mpx.core import unscale_and_find_inf_
    big = torch.full((2050,), 3e38)
    cases = [[torch.tensor([1., float('inf')])], [torch.ones(5, dtype=torch.bfloat16)], [big, torch.zeros(2)],
             [big, torch.tensor([1., float('inf')])],
             [torch.zeros(3073).index_fill_(0, torch.tensor([3000]), float('nan'))],  # in a row of 1,024 (the check sums rows)
             [torch.zeros(3073, dtype=torch.bfloat16).index_fill_(0, torch.tensor([3072]), float('inf'))],  # past the rows
             [torch.tensor([-float('inf')]).bfloat16(), torch.ones(3)], [torch.tensor([0., float('nan')])], [torch.tensor([-0.])]]
    for gs in cases:
        before = [g.clone() for g in gs]
        got = find_nonfinite(gs)
        assert got is not None and torch.equal(got, unscale_and_find_inf_([g.clone() for g in gs])), (gs, got)
        assert all(torch.equal(g.view(torch.uint8), b.view(torch.uint8)) for g,b in zip(gs, before))
    n = {}
    for fused in (True, 'compile'):
        learn = tiny_learner(opt_func=Adam, lr=1e-2, n_trn=4).to_bf16(pure=True, fused=fused)
        fit_quiet(learn, 1)  # compiled first
        n[fused] = _fused_unscales(learn)
    assert n[True] == 4 and n['compile'] == 0, n

@pytest.mark.compiled
def test_dynamic_scale_on_device():
    "fp16 compiled: the dynamic scale backs off at the overflow and grows after `growth_interval` clean steps, on the device, as eagerly."
    res = {}
    for fused in (True, 'compile'):
        for mode,f in (('amp', lambda l: l.to_fp16(init_scale=256., growth_interval=3, fused=fused)),
                       ('master', lambda l: l.to_fp16(loss_scale=256., dynamic=True, growth_interval=3, fused=fused))):
            learn,prof = f(tiny_learner(opt_func=Adam, lr=1e-2, n_trn=8)),StepProfile()
            fit_quiet(learn, 1, cbs=[InjectGrad(at=[2], micro=mode == 'master'), *(prof.cbs if fused == 'compile' else [])])
            if fused == 'compile': check_compiled_steps(prof)
            res[(mode, fused)] = precision_cb(learn).scales
    assert res[('amp', True)] == res[('amp', 'compile')] == [256., 256., 256., 128., 128., 128., 256., 256.]
    assert res[('master', True)] == res[('master', 'compile')] == res[('amp', True)]

# ---- falls back where it cannot compile, with a reason

FALLBACK = dict(lamb=(Lamb, 'lamb_step reduces over each parameter'), larc=(Larc, 'reduce over each parameter'),
                ranger=(ranger, 'Lookahead syncs its slow weights'),
                mine=(lambda ps, **kw: Optimizer(ps, [sgd_step, lambda p, **k: None], **kw), "step function <lambda> is not fastai's own"))

@pytest.mark.parametrize('opt', list(FALLBACK))
def test_falls_back_with_a_reason(opt):
    "Lamb, LARC, Lookahead and a step function of the user's step eagerly under `fused='compile'`, said once, with the eager results."
    f,why = FALLBACK[opt]
    res = []
    for fused in (True, 'compile'):
        learn = tiny_learner(opt_func=f, lr=1e-2, n_trn=4).to_bf16(pure=True, fused=fused)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter('always')
            fit_quiet(learn, 2)
        res.append(state_of(learn))
    said = [str(x.message) for x in w if 'steps eagerly' in str(x.message)]
    assert len(said) == 1 and why in said[0], said
    assert not state_diffs(*res)

def test_falls_back_under_a_dispatch_mode():
    "Under a `TorchDispatchMode` (an op counter) `torch.compile` refuses to run: the step is eager and says so."
    learn = tiny_learner(opt_func=Adam, lr=1e-2, n_trn=2).to_bf16(fused='compile')
    with warnings.catch_warnings(record=True) as w, CountOps():
        warnings.simplefilter('always')
        fit_quiet(learn, 1)
    assert any('dispatch mode' in str(x.message) for x in w)

# ---- checkpoints: stochastic rounding's stream and the step counts

class SaveAt(Callback):
    order = 100
    def __init__(self, at): self.at,self.n = at,0
    def after_step(self):
        self.n += 1
        if self.n == self.at: self.learn.save('mid', with_opt=True)

@pytest.mark.compiled
def test_stochastic_stream_survives_a_checkpoint(tmp_path):
    "Pure stochastic compiled: fit 2 epochs; or save after the first, load it in a new learner and fit one more: bit-identical."
    def learner(): return tiny_learner(opt_func=Adam, lr=1e-2, n_trn=4, path=tmp_path).to_bf16(pure=True, update='stochastic', fused='compile')
    a,prof = learner(),StepProfile()
    fit_quiet(a, 1, cbs=prof.cbs); order = a.dls.train.rng.getstate(); fit_quiet(a, 1)
    check_compiled_steps(prof)
    b = learner(); fit_quiet(b, 1); b.save('ck', with_opt=True)
    c = learner(); c.load('ck', with_opt=True); c.dls.train.rng.setstate(order); fit_quiet(c, 1)  # the second epoch's batches
    assert not state_diffs(state_of(a), state_of(c))
    assert torch.load(tmp_path/'models/ck.pth', weights_only=False)['opt']['mpx']['pure_bf16']['scaler']['count'] == 4

@pytest.mark.compiled
def test_step_counts_written_back(tmp_path):
    "Step counts live on the device during a compiled fit; a save mid-fit and the end of the fit write fastai's `step` back."
    learn,prof = tiny_learner(opt_func=Adam, lr=1e-2, n_trn=4, path=tmp_path).to_bf16(fused='compile'),StepProfile()
    fit_quiet(learn, 1, cbs=[SaveAt(2), *prof.cbs])
    check_compiled_steps(prof)
    assert {s['step'] for s in learn.opt.state_dict()['state']} == {4}
    sd = torch.load(tmp_path/'models/mid.pth', weights_only=False)['opt']
    assert {s['step'] for s in sd['state']} == {2}

# ---- the workflow matrix of fastai's applications, compiled

def _workflow(make, mode, tmp_path):
    "lr_find -> fit_one_cycle -> save/load -> unfreeze -> fit -> export/load_learner, in `mode` compiled; the final validation loss"
    learn,prof = make(),StepProfile()
    learn.path = tmp_path
    ALL_MODES[mode](learn, fused='compile')
    with learn.no_bar(), learn.no_logging():
        learn.lr_find(num_it=8, show_plot=False, suggest_funcs=None)
        learn.freeze(); learn.fit_one_cycle(1, 1e-2, cbs=prof.cbs)
        check_compiled_steps(prof)
        learn.save('ck', with_opt=True); learn.load('ck', with_opt=True)
        learn.unfreeze(); learn.fit(1, 1e-3)
        learn.export('ex.pkl')
        new = load_learner(tmp_path/'ex.pkl', cpu=False)
        loss = learn.validate()[0]
    learn.to_fp32()  # ends a layout kept between fits (pure bf16): fastai's fp32 layout
    assert {p.dtype for p in learn.model.parameters()} == {torch.float32} and all(torch.isfinite(p).all() for p in learn.model.parameters())
    assert 'step' not in vars(learn.opt) and {p.dtype for p in new.model.parameters()} == {torch.float32}
    return loss

APPS = [('tabular', tabular_app_learner, 'amp_bf16'), ('collab', partial(collab_app_learner, use_nn=True), 'master_fp16'),
        ('text', text_app_learner, 'pure_kahan')]

@pytest.mark.compiled
@pytest.mark.parametrize('name,make,mode', APPS, ids=[a[0] for a in APPS])
def test_application_workflow(name, make, mode, tmp_path):
    "fastai's applications go through lr_find, fit_one_cycle, save/load, unfreeze, fit and export compiled, and train as eagerly."
    compiled = _workflow(make, mode, tmp_path/'c')
    learn = make(); learn.path = tmp_path/'e'
    ALL_MODES[mode](learn)
    with learn.no_bar(), learn.no_logging():
        learn.lr_find(num_it=8, show_plot=False, suggest_funcs=None)
        learn.freeze(); learn.fit_one_cycle(1, 1e-2); learn.unfreeze(); learn.fit(1, 1e-3)
        eager = learn.validate()[0]
    assert abs(compiled - eager) <= .1 * abs(eager) + 1e-3, (compiled, eager)

# ---- per-step work does not grow with the number of parameter tensors

def regions_a_step(mode, n_layers, model=None) -> float:
    "Compiled regions a step enters, on `model` or a chain of `n_layers` Linear(4, 4) with Adam (a dispatch mode cannot count them)"
    model = model or (lambda: nn.Sequential(nn.Linear(1, 4), *[nn.Linear(4, 4) for _ in range(n_layers)], nn.Linear(4, 1)))
    learn,prof = tiny_learner(model=model, opt_func=Adam, n_trn=4),StepProfile()
    ALL_MODES[mode](learn, fused='compile')
    fit_quiet(learn, 1, cbs=prof.cbs)
    check_compiled_steps(prof)
    return sum(s['compiled'] for s in prof.steps) / len(prof.steps)

@pytest.mark.compiled
@pytest.mark.parametrize('mode', ['amp_bf16', 'master_fp16', 'pure_kahan', 'pure_stochastic'])
def test_compiled_kernels_do_not_grow(mode):
    "A compiled step enters as many compiled regions at 100 parameter tensors as at 10: a kernel (and its scalars) a run, not a tensor."
    few,many = regions_a_step(mode, 4),regions_a_step(mode, 49)
    assert few == many and 0 < few <= 4, (few, many)

@pytest.mark.compiled
def test_kernels_never_recompile():
    "With dynamo allowed no recompile, fp16 and bf16 masters, AMP, runs of one element and of many, all step compiled in one process"
    single = lambda: nn.Linear(1, 1, bias=False)  # one run of one element: torch.compile specialises sizes 0 and 1
    limit,made = torch._dynamo.config.recompile_limit,dict(mpx.compiled._kernels)
    mpx.compiled._kernels.clear()  # kernels of their own, whatever earlier cases compiled (and for which sizes)
    try:
        with torch._dynamo.config.patch(recompile_limit=1):  # its own undo: monkeypatch's leaves the config module broken
            for mode in ('master_fp16', 'master_bf16', 'amp_fp16', 'amp_bf16'):
                for model in (single, None): regions_a_step(mode, 2, model)
    finally: mpx.compiled._kernels.update(made)
    assert torch._dynamo.config.recompile_limit == limit
    # tests/conftest.py fails this case if any kernel fell back to eager steps

# A compiled case of each file that runs `fused='compile'`: the `compiled` marker's check (tests/conftest.py) must fail each
SWAPPED = ['test_compiled_steps.py::test_kahan_compensation_lives', 'test_visible_state.py::test_state_call_in_amp[set_hyper-compile]',
           'test_visible_state.py::test_weight_write_reaches_the_step[pure_kahan-before_step-60-compile]',
           'test_lowbit.py::test_state_follows_fp32_state[8bit-adam-compile]', 'test_lowbit.py::test_resume_bit_for_bit[4bit-compile]',
           'test_engine.py::test_stream_resumes_under_either[True-compile]', 'test_fit_scope.py::test_fit_leaves_nothing[amp_bf16-compile]',
           'test_flat_master.py::test_masters_always_flat[compile]', 'test_scale_schedules.py::test_fp16_modes_with_hysteresis[amp-compile]']

@pytest.mark.compiled
def test_eager_swap_fails_every_compiled_file():
    "Negative control: with the compiled step quietly replaced by the eager one, a compiled case of every compile-path file fails."
    torch.compile(lambda x: x + 1)(torch.ones(2))  # this case's own kernel (the marker asks for one)
    tests = Path(__file__).parent
    out = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '-rfE', *SWAPPED], cwd=tests, capture_output=True,
                         text=True, timeout=540, env={**os.environ, 'MPX_PLANTED': 'compiled_replaced_by_eager'}).stdout
    failed = set(re.findall(r'^(?:FAILED|ERROR) (\S+)', out, re.M))
    missed = [t for t in SWAPPED if not any(f.startswith(t) for f in failed)]
    assert not missed, f'passed with no kernel run: {missed}\n{out[-2000:]}'

@pytest.mark.compiled
def test_compiled_check_sees_the_eager_step():
    "Negative control: a compiled kernel quietly replaced by the eager step (no warning, nothing recorded) fails `check_compiled_steps`."
    torch.compile(lambda x: x + 1)(torch.ones(2))  # this case's own kernel (the `compiled` marker asks for one)
    learn,prof = tiny_learner(opt_func=Adam, lr=1e-2, n_trn=2).to_bf16(pure=True, fused='compile'),StepProfile()
    with compiled_replaced_by_eager(): fit_quiet(learn, 1, cbs=prof.cbs)
    with pytest.raises(AssertionError, match='ran no compiled region'): check_compiled_steps(prof)
