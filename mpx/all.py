"Every public name of mpx; importing it patches `Learner.to_fp16`, `Learner.to_bf16` and `Learner.to_fp32`."
from .core import *
from .amp import *
from .learner import *
