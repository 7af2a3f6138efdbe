"""Planted bugs, for the negative controls: each context manager makes mpx wrong in one known way while inside, so a test can show that
its check fails on it. They reach into mpx's internals (its save, its rounding, its compiled step, the engine's `step` and `_state_dict`,
the low-bit codes): this file is the one place that does, and the one to change when those internals move. Never used outside a negative
control; `MPX_PLANTED=name` (or `name:number`, `lr_scaled:1.05`) runs a whole pytest session under one, to see which tests catch it."""
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
    def eager(self, eng, b, hyper, part=None):
        self.to_host(eng, b)
        if part is None: self.eager.bucket(eng, b, hyper)
        else: self.eager.extra(eng, b, *part, hyper)
    with _patched(CompiledSteps, 'bucket', eager): yield

def _lr_planted(lr):
    "Patch the engine's step so that each step runs with `lr(engine, group, lr_fastai_set)` in each group, fastai's hypers put back after"
    from mpx.fused import FusedSteps
    from mpx.plumbing import unwrap
    real = FusedSteps.step
    def step(self, closure=None):
        hypers = unwrap(self.opt)[1].hypers  # the fastai optimizer the engine steps: what its schedule set
        kept = [h.get('lr') for h in hypers]
        for i,h in enumerate(hypers):
            if 'lr' in h: h['lr'] = lr(self, i, h['lr'])
        try: return real(self, closure)
        finally:
            for h,k in zip(hypers, kept):
                if k is not None: h['lr'] = k
    return _patched(FusedSteps, 'step', step)  # set before a fit: the engine binds its step at install

@contextmanager
def lr_scaled(factor:float):
    "The step engine steps with `factor` times the learning rate fastai's hypers hold (every mode and `fused` setting that installs it)"
    with _lr_planted(lambda eng, i, lr: lr * factor): yield

@contextmanager
def group_lr_scaled(group:int=0, factor:float=2.):
    "The step engine steps parameter group `group` with `factor` times the learning rate fastai's hypers hold, the others as they are"
    with _lr_planted(lambda eng, i, lr: lr * factor if i == group else lr): yield

@contextmanager
def lr_frozen():
    "The step engine keeps stepping with the learning rates of a fit's first step: fastai's schedule (one-cycle, say) no longer reaches it"
    first,depth = {},[0]  # (optimizer, group) -> the lr of the outermost fit's first step
    def fit(real):
        def f(learn, *args, **kwargs):
            if not depth[0]: first.clear()
            depth[0] += 1
            try: return real(learn, *args, **kwargs)
            finally: depth[0] -= 1
        return f
    def lr(eng, i, lr): return first.setdefault((id(eng.opt), i), lr)  # by optimizer: `suspended` re-installs the engine
    with _patched(Learner, 'fit', fit(Learner.fit)), _lr_planted(lr): yield

@contextmanager
def lowbit_decoded_scaled(factor:float=.7):
    "8-bit state decodes as `factor` times its value, eager and compiled (the kernels made inside are dropped when it ends)"
    from mpx.lowbit import Float8Codes
    real = Float8Codes.decode
    def decode(self, codes, scale, qmap=None): return real(self, codes, scale, qmap) * factor
    with _kernels_dropped(), _patched(Float8Codes, 'decode', decode): yield  # a kernel made before keeps the true decode

@contextmanager
def lowbit_state_dict_zeros():
    "A low-bit fit's `opt.state_dict()` mid-fit, and what `learn.save` writes, give zeros for the state held in low bits"
    import mpx.patches
    from mpx.fused import FusedSteps
    from mpx.lowbit import LowBitState, MIN_LOWBIT
    from mpx.plumbing import unwrap, LazyTensor
    from functools import partial
    real,real_save = FusedSteps._state_dict,mpx.patches._fastai_save
    def zeroed(sd:dict, lows:list) -> dict:
        "`sd` with zeros for the entries named in `lows` (a set of keys a parameter)"
        zero = lambda v: torch.zeros_like(v) if torch.is_tensor(v) else LazyTensor(partial(torch.zeros, v.shape), v.dtype, v.shape)
        return {**sd, 'state': [{k: zero(v) if k in low else v for k,v in s.items()} for s,low in zip(sd['state'], lows)]}
    def state_dict(self):
        inner = unwrap(self.opt)[1]
        return zeroed(real(self), [{k for k,v in h.items() if isinstance(v, LowBitState)} for h in type(inner).state_dict(inner)['state']])
    def save(learn, file, **kwargs):
        from mpx.patches import is_mpx_precision
        if not any(is_mpx_precision(c) and getattr(c, 'opt_state', 'fp32') != 'fp32' for c in learn.cbs) or learn.opt is None:
            return real_save(learn, file, **kwargs)
        opt,had = learn.opt,'state_dict' in vars(learn.opt)
        fastai_sd = opt.state_dict  # in a save the fit is suspended: the state is fp32 tensors, the large ones were held low
        def sd():
            res = fastai_sd()
            return zeroed(res, [{k for k,v in s.items() if torch.is_tensor(v) and v.numel() >= MIN_LOWBIT} for s in res['state']])
        opt.state_dict = sd
        try: return real_save(learn, file, **kwargs)
        finally:
            if had: opt.state_dict = fastai_sd
            else: del opt.state_dict
    with _patched(FusedSteps, '_state_dict', state_dict), _patched(mpx.patches, '_fastai_save', save): yield

@contextmanager
def compiled_group0_hypers():
    "Compiled steps take parameter group 0's hyper-parameters (lr, wd, mom) for every group"
    from mpx.compiled import CompiledSteps
    real_bucket,real_extra = CompiledSteps.bucket,CompiledSteps.extra
    def bucket(self, eng, b, hyper, part=None): return real_bucket(self, eng, b, eng.inner.hypers[0], part)
    def extra(self, eng, b, i, n, hyper): return real_extra(self, eng, b, i, n, eng.inner.hypers[0])
    with _patched(CompiledSteps, 'bucket', bucket), _patched(CompiledSteps, 'extra', extra): yield

@contextmanager
def _kernels_dropped():
    "Inside, compiled kernels are made anew (a patch of what they trace reaches them), those made before put back after"
    import mpx.compiled
    kernels = dict(mpx.compiled._kernels)
    mpx.compiled._kernels.clear()
    try: yield
    finally:
        mpx.compiled._kernels.clear()
        mpx.compiled._kernels.update(kernels)

@contextmanager
def skip_counts_a_step():
    "A step skipped on the device (compiled) still advances its parameters' step counts (Adam's bias correction then runs ahead)"
    import mpx.compiled
    real = mpx.compiled._kernel_body
    def body(kind, store, chain, keys, t, hyper, run, group):
        real(kind, store, chain, keys, {k: v for k,v in t.items() if k != 'steps'}, hyper, run, group)
        if 'steps' in t: t['steps'].copy_(t['steps'] + 1)
    with _kernels_dropped(), _patched(mpx.compiled, '_kernel_body', body): yield

@contextmanager
def stream_on_one_base():
    "Stochastic rounding keys every window's bits on element 0, not its own place: parameters in other buckets draw the same bits"
    from mpx.pure import StochasticKind
    with _patched(StochasticKind, '_base', lambda self, b, i: 0): yield

@contextmanager
def unscale_by_host_scale():
    "Unscaling divides by the scale the host last read, while a compiled fit's scale moves on the device"
    from mpx.scaler import LossScaler, _f32
    from mpx.core import unscale_and_find_inf_
    def unscale_(self, tensors): return unscale_and_find_inf_(tensors, inv_scale=_f32(1. / self.scale))
    with _patched(LossScaler, 'unscale_', unscale_): yield

@contextmanager
def lowbit_values_from_neighbour():
    "A low-bit store reads a parameter's state (`value`: checkpoints, `opt.state` reads) from the next parameter of its shape"
    from mpx.lowbit import BF16Store, QuantStore
    def neighbour(b, i):
        same = [j for j,s in enumerate(b.specs) if s == b.specs[i]]
        return same[(same.index(i) + 1) % len(same)]
    real_bf16,real_quant = BF16Store.value,QuantStore.value
    def bf16(self, b, k, i): return real_bf16(self, b, k, neighbour(b, i))
    def quant(self, b, k, i): return real_quant(self, b, k, neighbour(b, i))
    with _patched(BF16Store, 'value', bf16), _patched(QuantStore, 'value', quant): yield

# ---- the third pass (issue 69): loads in pieces, set-up commits, the device's skip count, a store's options, the advisor

@contextmanager
def load_skips_last_piece():
    "A streamed load reads whole pieces only: the last partial piece of a tensor above the piece size (131,072) keeps its old values"
    import mpx.plumbing, mpx.checkpoint, mpx.fused
    real = mpx.plumbing.pieces
    def whole(v, n=None):
        n = n or mpx.plumbing.LOAD_PIECE
        for at,x in real(v, n):
            if at is None or x.numel() == n: yield at,x
    with ExitStack() as stack:
        for m in (mpx.plumbing, mpx.checkpoint, mpx.fused): stack.enter_context(_patched(m, 'pieces', whole))
        yield

@contextmanager
def set_up_commits_each_bucket():
    "A set-up commits each bucket for good as it goes: a failure at a later bucket cannot undo those before"
    from mpx.fused import FusedSteps
    def commit(self, built):
        for b in built:
            b.commit()
            b.settle()
    with _patched(FusedSteps, '_commit', commit): yield

@contextmanager
def device_skips_counted_once():
    "The device counts whether a step was skipped since the host last read (stochastic rounding's stream), not how many"
    from mpx.pure import Stream
    def skip_on_device(self, found):
        skips = self._skips(found.device)
        skips.copy_(torch.maximum(skips, (found.reshape(()) != 0).long()))
    with _patched(Stream, 'skip_on_device', skip_on_device): yield

@contextmanager
def store_options_ignored():
    "Under compile, a store's own `kernel_options` are ignored: only those of mpx's own stores (bf16, 8-bit, 4-bit) reach inductor"
    import mpx.compiled
    from mpx.lowbit import BF16Store, QuantStore
    real = mpx.compiled._known_options
    def known(options): return real(options) if any(options is o for o in (BF16Store.kernel_options, QuantStore.kernel_options)) else {}
    with _kernels_dropped(), _patched(mpx.compiled, '_known_options', known): yield

@contextmanager
def conv_speed_inverted():
    "The advisor's measured speed of convolutions in a 16-bit dtype is inverted (1/r): its probes' fp32 and 16-bit runs swapped"
    import mpx.hardware as hw, mpx.advisor
    from mpx.core import AMPMode
    real = hw.op_speed
    if getattr(real, 'planted', False):  # planted already (a session's `MPX_PLANTED`): inverted twice it would be right again
        yield
        return
    def op_speed(family, mode):  # a speed known already (cached) read as it is: only a measurement is inverted
        if family != 'conv': return real(family, mode)
        dtype,probe = AMPMode(mode).dtype,hw._probe
        def swapped(f, dt): return probe(f, dtype if dt == torch.float32 else torch.float32)
        with _patched(hw, '_probe', swapped): return real(family, mode)
    op_speed.planted = True
    with _patched(hw, 'op_speed', op_speed), _patched(mpx.advisor, 'op_speed', op_speed): yield

@contextmanager
def memory_state_all_lowbit():
    "The advisor's memory prediction holds every tensor's optimizer state low-bit (tensors under `MIN_LOWBIT` elements keep fp32)"
    import mpx.memory
    from mpx.lowbit import state_bytes
    def state(t, opt_state): return t.n_state * state_bytes(opt_state) * t.params
    with _patched(mpx.memory, '_state_bytes', state): yield

@contextmanager
def take_back_drops_last_compensation():
    "A cast by hand (`model.float()`) taken back zeroes the Kahan compensation of the last parameter of each bucket"
    from mpx.flat import Bucket
    from mpx.pure import KahanKind
    real = Bucket._take_back
    def take_back(self, i, p):
        real(self, i, p)
        if isinstance(self.kind, KahanKind) and i == len(self.params) - 1: self.own.slots[i].zero_()
    with _patched(Bucket, '_take_back', take_back): yield

@contextmanager
def loaded_piece_nibbles_swapped():
    "4-bit codes of a piece of a streamed load (a tensor above 131,072 elements) packed in the other nibble order"
    from mpx.lowbit import QuantStore
    real = QuantStore.put
    if getattr(real, 'planted', False):  # planted already (a session's `MPX_PLANTED`): swapped twice they would be right again
        yield
        return
    def put(self, b, k, i, v, at=None):
        real(self, b, k, i, v, at)
        if at is None or self.bits != 4: return
        lo = b.offs[i] + at
        codes = self._code_bytes(b, k, lo, lo + v.numel() // 2 * 2)
        codes.copy_((codes >> 4) | (codes << 4))
    put.planted = True
    with _patched(QuantStore, 'put', put): yield

@contextmanager
def loaded_stream_afresh():
    "A loaded checkpoint starts stochastic rounding's stream afresh (count 0), where it should go on from the count it saved"
    from mpx.pure import PureBF16
    def load(self, sd): self.reset_scaler()
    with _patched(PureBF16, '_load_scaler_state', load): yield
