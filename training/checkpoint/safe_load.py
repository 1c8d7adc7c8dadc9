"""Reading checkpoint files without running pickled code.

``torch.load(weights_only=True)`` unpickles only tensors, containers and plain values, plus the
classes listed as safe. DeepSpeed 0.19.8 pickles four plain-data classes into the files this
trainer resumes from (loss scalers, the ZeRO stage enum, the address of a parameter fragment in
its flat buffers); they are allowed here and nothing else is. A file that holds any other object
is refused with one line instead of being executed. ``install`` makes DeepSpeed's own checkpoint
engine load the same way for ``engine.load_checkpoint``.

The universal conversion (``interop/universal.py``) and its loading
(``universal_load.py``) read every file through ``load`` as well.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import torch


def _deepspeed_classes() -> list:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def load(path: str | Path, map_location="cpu", mmap: bool = False):
    """``torch.load`` of ``path``, weights only (tensors, containers, plain values and
    DeepSpeed's four plain-data classes); ValueError (one line) for anything else."""
    try:
        with torch.serialization.safe_globals(_deepspeed_classes()):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        if found is None:                 # a damaged file, not a refused object
            raise
        what = found.group(1)
        raise ValueError(f"{path}: refusing to load it: it holds a pickled object that is not "
                         f"plain data ({what}), which could run code; load it only if you trust "
                         f"its source (torch.load(..., weights_only=False))") from None


def install(engine) -> None:
    """Make DeepSpeed's checkpoint engine read files with ``load``."""
    engine.checkpoint_engine.load = lambda path, map_location=None: load(path, map_location)
