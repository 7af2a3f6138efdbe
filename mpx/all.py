"Every public name of mpx; importing it patches `Learner.to_fp16`, `to_bf16`, `to_fp32`, `save` and `load`."
from .core import *
from .callback import *
from .amp import *
from .master import *
from .advisor import *
from .learner import *
