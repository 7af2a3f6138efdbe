"""Planted bugs, for the negative controls: each context manager makes mpx wrong in one known way while inside, so a test can show that
its check fails on it. They reach into mpx's internals (its save, its rounding, its compiled step): this file is the one place that does,
and the one to change when those internals move. Never used outside a negative control."""
import random
from contextlib import contextmanager, ExitStack
from copy import deepcopy
import numpy as np
import pytest, torch
from fastai.learner import Learner

@contextmanager
def _patched(obj, name, new):
    old = getattr(obj, name)
    setattr(obj, name, new)
    try: yield old
    finally: setattr(obj, name, old)

def _has_mpx_precision(learn) -> bool:
    from mpx.patches import is_mpx_precision
    return any(is_mpx_precision(c) for c in learn.cbs)

@contextmanager
def masters_rounded_on_save(dtype=torch.float16):
    "`learn.save` under an mpx precision callback writes the fp32 weights (the masters, mid-fit) rounded through `dtype`"
    import mpx.patches
    real = mpx.patches._fastai_save
    def save(learn, file, **kwargs):
        if not _has_mpx_precision(learn): return real(learn, file, **kwargs)
        ps = [p for p in learn.model.parameters() if p.dtype == torch.float32]
        kept = [p.detach().clone() for p in ps]
        with torch.no_grad():
            for p in ps: p.copy_(p.to(dtype).float())
        try: return real(learn, file, **kwargs)
        finally:
            with torch.no_grad():
                for p,k in zip(ps, kept): p.copy_(k)
    with _patched(mpx.patches, '_fastai_save', save): yield

@contextmanager
def nested_effect_dropped():
    "`validate`, `get_preds` and `lr_find` called in an mpx fit put back what they change of it: training, the loader, the hypers, the RNGs"
    depth = [0]
    def fit(real):
        def f(learn, *args, **kwargs):
            depth[0] += 1
            try: return real(learn, *args, **kwargs)
            finally: depth[0] -= 1
        return f
    def nested(real):
        def f(learn, *args, **kwargs):
            if not (depth[0] and _has_mpx_precision(learn)): return real(learn, *args, **kwargs)
            kept = (learn.training, learn.dl, deepcopy([dict(h) for h in learn.opt.hypers]), torch.get_rng_state(), random.getstate(),
                    np.random.get_state(), learn.dls.train.rng.getstate())
            try: return real(learn, *args, **kwargs)
            finally:
                learn.training,learn.dl = kept[:2]
                for h,k in zip(learn.opt.hypers, kept[2]): h.update(k)
                torch.set_rng_state(kept[3]); random.setstate(kept[4]); np.random.set_state(kept[5]); learn.dls.train.rng.setstate(kept[6])
        return f
    with ExitStack() as stack:
        stack.enter_context(_patched(Learner, 'fit', fit(Learner.fit)))
        for name in ('validate', 'get_preds', 'lr_find'): stack.enter_context(_patched(Learner, name, nested(getattr(Learner, name))))
        yield

@contextmanager
def biased_stochastic_rounding(bias:int=1 << 14):
    "Rounding with `bias` (in 2**-16 of an ulp; 2**14: a quarter) added to its random bits, eager and compiled (set before compiling)"
    import mpx.pure
    real_bits = mpx.pure.random_bits16
    def bits(idx, key): return real_bits(idx, key) + bias  # the one generator the eager and the compiled rounding draw from
    with _patched(mpx.pure, 'random_bits16', bits): yield

@contextmanager
def compiled_replaced_by_eager():
    "`fused='compile'` quietly steps with the eager step: no kernel runs, no warning is given, nothing is recorded as having failed"
    from mpx.compiled import CompiledSteps
    def eager(self, eng, b, hyper, runs, phase):
        self.to_host(eng, b)
        if phase: self.eager.extra(eng, b, runs[0][0], phase, hyper)
        else: self.eager.bucket(eng, b, hyper)
        return False
    with _patched(CompiledSteps, '_step', eager): yield
