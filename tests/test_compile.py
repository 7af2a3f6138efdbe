"mpx with `torch.compile` and fastai's `ChannelsLast`: trains, same dtypes, mpx stays outside the compiled forward."
import pytest, torch
from torch import nn
import torch._dynamo
from fastai.basics import Callback, set_seed
from fastai.callback.channelslast import ChannelsLast
from mpx.all import *
from mpx.test_utils import tiny_learner, fit_quiet, weights, precision_cb, MODES, BASIC_MODES

COMPILE_MODES = BASIC_MODES
def half(mode): return torch.bfloat16 if mode.endswith('bf16') else torch.float16

class PredDtype(Callback):
    "The dtype of the model's output, before mpx casts it to fp32 for the loss"
    order = 9
    def before_fit(self): self.dtypes = set()
    def after_pred(self): self.dtypes.add(self.pred.dtype)

@pytest.mark.parametrize('mode', COMPILE_MODES)
def test_compiled_model(mode):
    "A `torch.compile`d model trains under every mode with the same output dtype as uncompiled, and mpx causes no graph break."
    torch._dynamo.reset(); torch._dynamo.utils.counters.clear()
    set_seed(0); model = nn.Sequential(nn.Linear(1, 8), nn.ReLU(), nn.Linear(8, 1))
    learn = MODES[mode](tiny_learner(lr=1e-2, model=torch.compile(model, backend='eager'), cbs=PredDtype()))
    fit_quiet(learn, 2)
    assert learn.pred_dtype.dtypes == {half(mode)}
    assert not torch._dynamo.utils.counters['graph_break'], dict(torch._dynamo.utils.counters['graph_break'])
    assert torch._dynamo.utils.counters['stats']['unique_graphs'] >= 1
    assert {p.dtype for p in learn.model.parameters()} == {torch.float32}
    assert precision_cb(learn).total_steps == 20 and all(torch.isfinite(p).all() for p in learn.model.parameters())

@pytest.mark.compiled
def test_inductor_bf16():
    "A model compiled by inductor (generated C++) trains under `to_bf16()` and matches the uncompiled model's first steps."
    torch._dynamo.reset()
    res = []
    for compile in (False, True):
        set_seed(0); model = nn.Sequential(nn.Linear(1, 8), nn.ReLU(), nn.Linear(8, 1))
        learn = tiny_learner(lr=1e-2, model=torch.compile(model) if compile else model, n_trn=2).to_bf16()
        res.append(weights(fit_quiet(learn)))
    for a,b in zip(*res): assert torch.allclose(a, b, atol=2e-2)

class TinyCNN(nn.Sequential):
    "A CNN whose second conv has 4 input channels, so its weight's channels_last layout differs from the contiguous one"
    def __init__(self): super().__init__(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 1))

class Image(Callback):
    "Turn the synthetic (bs,1) inputs into (bs,1,4,4) images"
    order = -5
    def before_batch(self): self.learn.xb = (self.xb[0].view(-1, 1, 1, 1).expand(-1, 1, 4, 4).contiguous(),)

class LayoutProbe(Callback):
    "Whether the conv weight and the inputs are channels_last during training"
    order = 11
    def before_fit(self): self.cl = set()
    def after_pred(self):
        if self.training: self.cl.add((self.model[3].weight.is_contiguous(memory_format=torch.channels_last), self.xb[0].is_contiguous(memory_format=torch.channels_last)))

@pytest.mark.parametrize('mode', COMPILE_MODES)
def test_channels_last(mode):
    "fastai's ChannelsLast with every mode: trains, keeps the model and inputs channels_last during the fit and after it."
    set_seed(0)
    probe = LayoutProbe()
    learn = MODES[mode](tiny_learner(lr=1e-2, model=TinyCNN(), cbs=[Image(), ChannelsLast(), probe]))
    fit_quiet(learn, 2)
    assert probe.cl == {(True, True)}
    w = learn.model[3].weight
    assert w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous() and w.dtype == torch.float32
    fit_quiet(learn, 1)
    assert probe.cl == {(True, True)} and learn.model[3].weight.is_contiguous(memory_format=torch.channels_last)
