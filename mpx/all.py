"""mpx's public names; importing it patches `Learner`:
`to_fp16`, `to_bf16`, `to_fp32`, `to_fp8`, `precision_report`, `to_auto_precision`, `log_loss_scale`, `save`, `load`,
`quiet_progress`."""
from .core import *
from .scaler import *
from .callback import *
from .amp import *
from .master import *
from .pure import *
from .fp8 import *
from .advisor import *
from .learner import *
from .progress import *  # `Learner.quiet_progress`, `DeviceLosses`; `QuietProgress` stays in `mpx.progress`

# Star-exported: what a user writes. Helpers stay importable from their modules (`mpx.core`, `mpx.scaler`, ...).
__all__ = ['AMPMode', 'LossScaler', 'PrecisionCallback', 'MixedPrecision', 'MasterPrecision', 'PureBF16', 'FP8Precision', 'PrecisionReport',
           'DeviceLosses']

# Sharded training (FSDP2: `Learner.to_fsdp`, `ShardedTrainer`) is `from mpx.distributed import *`, as fastai's is
# `from fastai.distributed import *`: it imports FSDP2 and DTensor, which would add about a second to this import.
