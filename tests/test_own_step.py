"""A step function of the user's own, declared elementwise (`register_step`, issue 71): stepped over flat runs bit for bit
as fastai's loop steps it, compiled into the kernel within its tolerance and with no recompile, its state begun as
fastai's loop begins it, and what the declaration's probe refuses before anything changes."""
import warnings
from functools import partial
import pytest, torch
from torch import Tensor
from fastai.optimizer import Optimizer, weight_decay
import fastai.callback.schedule  # `fit_one_cycle`
from mpx.all import *
from mpx.core import register_step
from mpx.fused import FusedSteps
import mpx.compiled
from mpx.test_utils import stepped_opt, opt_diffs, tiny_learner, fit_quiet, weights, precision_cb, KernelRuns
from mpx.test_learners import ALL_MODES
from conftest import compiles

@register_step
def lion_step(p, lr, mom, sqr_mom, grad_avg=None, **kwargs):
    "Lion's step: the sign of a blend of momentum and gradient, then the momentum follows"
    if grad_avg is None: grad_avg = torch.zeros_like(p.grad)
    p.data.add_((grad_avg * mom + p.grad * (1 - mom)).sign(), alpha=-lr)
    grad_avg.mul_(sqr_mom).add_(p.grad, alpha=1 - sqr_mom)
    return {'grad_avg': grad_avg}

@register_step
def ema_step(p, lr, mom, ema=None, pull=.1, **kwargs):
    "SGD pulled toward an average of the weights, which it begins at the weights themselves (not at zero)"
    if ema is None: ema = p.data.clone()
    ema.mul_(mom).add_(p.data, alpha=1 - mom)
    p.data.add_(p.grad, alpha=-lr).lerp_(ema, pull)
    return {'ema': ema}

@register_step
def counted_step(p, lr, count=0, **kwargs):
    "SGD counting its own steps in the state (a number, not a tensor)"
    p.data.add_(p.grad, alpha=-lr)
    return {'count': count + 1}

@register_step
def normalized_step(p, lr, **kwargs):
    "A step of length `lr`: it reads the gradient's norm over the whole parameter"
    p.data.add_(p.grad / p.grad.norm(), alpha=-lr)

@register_step
def noisy_step(p, lr, **kwargs):
    "SGD with noise: a random draw per element"
    p.data.add_(p.grad + torch.randn_like(p.grad), alpha=-lr)

@register_step
def branching_step(p, lr, wd, **kwargs):
    "SGD with weight decay where `wd` is not 0: a branch on a hyper-parameter, which a kernel cannot take"
    if wd != 0: p.data.mul_(1 - lr * wd)
    p.data.add_(p.grad, alpha=-lr)

def undeclared_step(p, lr, **kwargs): p.data.add_(p.grad, alpha=-lr)

def Lion(params, lr=1e-2, mom=.9, sqr_mom=.99, wd=.1):
    return Optimizer(params, [weight_decay, lion_step], lr=lr, mom=mom, sqr_mom=sqr_mom, wd=wd)
def Ema(params, lr=1e-2, mom=.9, wd=0.):
    return Optimizer(params, [weight_decay, partial(ema_step, pull=.2)], lr=lr, mom=mom, wd=wd)
def with_step(step): return lambda params, lr=1e-2, **hypers: Optimizer(params, [step], lr=lr, **hypers)

DECLARED = {'lion': Lion, 'ema': Ema, 'counted': with_step(counted_step)}

@pytest.mark.parametrize('layout', [{}, dict(dup=True), dict(la=True), dict(frozen=True)], ids=['plain', 'dup', 'lookahead', 'frozen'])
@pytest.mark.parametrize('name', DECLARED)
def test_declared_eager_is_fastais_loop(name, layout):
    "Stepped over flat runs, a declared function gives fastai's loop's weights and state bit for bit: tied, Lookahead, frozen"
    opt_func = DECLARED[name]
    assert opt_diffs(stepped_opt(opt_func, **layout), stepped_opt(opt_func, FusedSteps, **layout)) == []
    engine = []
    stepped_opt(opt_func, lambda opt: engine.append(FusedSteps(opt)) or engine[0])
    assert type(engine[0].buckets[0].stepper).__name__ == 'RunSteps'  # over runs, not fastai's loop a parameter at a time

def said_eagerly(run) -> list:
    "The lines `run()` warns that say a compiled step steps eagerly, and what it returns"
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter('always')
        res = run()
    return [str(w.message) for w in said if 'steps eagerly' in str(w.message)],res

def gap(a:tuple, b:tuple) -> float:
    "The largest difference between two (model, optimizer) pairs' weights and state tensors, relative to each tensor's largest"
    (ma,oa),(mb,ob) = a,b
    ws = [(x.detach(), y.detach()) for x,y in zip(ma.parameters(), mb.parameters())]
    res = [float((x - y).abs().max() / y.abs().max().clamp_min(1e-12)) for x,y in ws]
    for (x,sa),(y,sb) in zip(oa.state.items(), ob.state.items()):
        res += [float((sa[k] - sb[k]).abs().max() / sb[k].abs().max().clamp_min(1e-12)) for k in sb if isinstance(sb[k], Tensor)]
    return max(res)

@pytest.mark.compiled
@pytest.mark.parametrize('name', ['lion', 'ema'])
def test_declared_compiled_within_tolerance(name):
    "Compiled, a declared function steps as fastai's loop does, up to the order of the kernel's arithmetic"
    opt_func = DECLARED[name]
    with KernelRuns() as runs: compiled = stepped_opt(opt_func, partial(FusedSteps, fused='compile'))
    assert runs.n > 0 and gap(compiled, stepped_opt(opt_func)) < 1e-5

@pytest.mark.compiled
def test_state_begun_as_fastais_loop_begins_it(monkeypatch):
    "A declared function's state is begun by its first step eagerly (`ema_step` begins it at the weights); the kernel takes the later steps"
    ref = stepped_opt(Ema)
    assert gap(stepped_opt(Ema, partial(FusedSteps, fused='compile')), ref) < 1e-5
    # the control: a kernel from the first step begins the state at zero, and the fit goes elsewhere
    monkeypatch.setattr(mpx.compiled, '_begun', lambda *args: True)
    assert gap(stepped_opt(Ema, partial(FusedSteps, fused='compile')), ref) > 1e-3

@pytest.mark.compiled
def test_every_mode_compiles_it_with_no_recompile():
    "In every mode `lr_find` then `fit_one_cycle` (lr and mom change each step) compile Lion with dynamo allowed no recompile"
    made = dict(mpx.compiled._kernels)
    mpx.compiled._kernels.clear()  # kernels of their own
    try:
        with torch._dynamo.config.patch(recompile_limit=1), warnings.catch_warnings(record=True) as said:
            warnings.simplefilter('always')
            for mode in ('amp_bf16', 'master_fp16', 'pure_kahan', 'pure_stochastic'):
                learn = ALL_MODES[mode](tiny_learner(opt_func=Lion, lr=1e-2), fused='compile')
                with KernelRuns() as runs, learn.no_bar(), learn.no_logging():
                    learn.lr_find(num_it=20, show_plot=False)  # its first lr, 1e-7, is a float dynamo would specialise on
                    learn.fit_one_cycle(2)
                assert runs.n > 0, mode
    finally: mpx.compiled._kernels.update(made)
    eager = [str(w.message) for w in said if 'steps eagerly' in str(w.message)]
    assert not eager, eager

def test_amp_compiled_fit_is_the_eager_fit():
    "An AMP learner's fit with Lion compiled ends where its eager fit ends (Lion's sign makes a step the same size anywhere)"
    fits = {fused: weights(fit_quiet(tiny_learner(opt_func=Lion, lr=1e-2).to_bf16(fused=fused), 2)) for fused in (True, 'compile')}
    assert max(float((a - b).abs().max()) for a,b in zip(*fits.values())) < 1e-5

@pytest.mark.parametrize('step,op', [(normalized_step, 'linalg_vector_norm'), (noisy_step, 'randn_like')])
def test_a_declaration_that_is_not_elementwise_is_refused(step, op):
    "A declared function calling an op that is not elementwise is refused at `before_fit`, the op named; nothing changes"
    learn = tiny_learner(opt_func=with_step(step)).to_bf16()
    before = [p.detach().clone() for p in learn.model.parameters()]
    with pytest.raises(ValueError, match=f"{step.__name__} is declared elementwise.*calls {op}"): fit_quiet(learn, 1)
    assert all(torch.equal(a, p) for a,p in zip(before, learn.model.parameters()))
    assert all(p.dtype == torch.float32 for p in learn.model.parameters()) and precision_cb(learn) is not None
    with pytest.raises(ValueError, match=f'calls {op}'): stepped_opt(with_step(step), FusedSteps)  # the engine itself

def test_a_branch_on_a_hyper_parameter_steps_eagerly():
    "A declared function that branches on a hyper-parameter (a 0-dim tensor in the kernel) steps eagerly, as fastai's loop, said once"
    lines,stepped = said_eagerly(lambda: stepped_opt(with_step(branching_step), partial(FusedSteps, fused='compile'), wd=.1))
    assert len(lines) == 1 and 'torch.compile failed' in lines[0] and 'branching_step' in lines[0], lines
    assert opt_diffs(stepped_opt(with_step(branching_step), wd=.1), stepped) == []
    # the failure the engine remembers is this case's point: taken out, so that tests/conftest.py sees no other
    ours = [k for k in mpx.compiled._failed if isinstance(k, tuple) and any(f is branching_step for f,_ in k[2])]
    assert len(ours) == 1 and 'Data-dependent' in mpx.compiled._failed[ours[0]] or not compiles()
    for k in ours: mpx.compiled._failed.pop(k)

def test_numbers_in_the_state_step_eagerly():
    "A declared function that keeps a number in the state steps over runs eagerly; under `fused='compile'` it says why, once"
    learn = tiny_learner(opt_func=with_step(counted_step)).to_bf16(fused='compile')
    lines,_ = said_eagerly(lambda: fit_quiet(learn, 2))
    assert len(lines) == 1 and 'keeps numbers in the state (count)' in lines[0], lines
    assert {s['count'] for s in learn.opt.state.values()} == {precision_cb(learn).total_steps}  # each parameter, each step

def test_low_bit_state_needs_fastais_own_functions():
    "Low-bit state with a declared function is refused at the call's fit, before anything changes"
    learn = tiny_learner(opt_func=Lion).to_bf16(opt_state='8bit')
    with pytest.raises(ValueError, match="opt_state='8bit' needs the step engine's own steps: a step function is not fastai's own"):
        fit_quiet(learn, 1)

def test_undeclared_says_how_to_declare():
    "An undeclared function of the user's steps in fastai's loop, and the one line names `register_step` with it"
    lines,_ = said_eagerly(lambda: fit_quiet(tiny_learner(opt_func=with_step(undeclared_step)).to_bf16(fused='compile'), 1))
    assert len(lines) == 1 and 'register_step(undeclared_step)' in lines[0], lines

def test_register_step_takes_functions():
    "`register_step` takes a function (a decorator: it gives it back) or a partial of one with keywords; else a clear error"
    assert register_step(undeclared_step) is undeclared_step
    keyworded = partial(ema_step, pull=.3)
    assert register_step(keyworded) is keyworded
    for bad in (partial(ema_step, 1), 3, torch.add):
        with pytest.raises(ValueError, match='a step function is a Python function'): register_step(bad)
