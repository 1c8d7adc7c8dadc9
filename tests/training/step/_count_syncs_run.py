"""Run by test_host_syncs.py on every rank: ``launch.train.main(argv)`` with each optimizer step
(``Stepper.train_step``) under a ``TorchFunctionMode`` that counts the calls from this
repository's code that make a GPU wait for the host: ``.item()``, ``.tolist()``, ``bool()``,
``float()``, ``int()``, ``.cpu()``, ``.numpy()``, ``nonzero``, ``bincount``, ``unique``,
``masked_select``, boolean-mask indexing and ``repeat_interleave`` without ``output_size``.
Calls made inside torch or DeepSpeed are not counted (the nearest frame outside torch decides).
Writes ``{step: {"count": n, "where": [...]}}`` to ``$SYNC_COUNTS.<rank>.json``.
"""

import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from launch import train  # noqa: E402
from training.step import stepper  # noqa: E402

ALWAYS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy",
          "nonzero", "bincount", "unique", "masked_select"}
OURS = tuple(str(REPO / d) + os.sep for d in ("model", "training", "launch", "planning", "interop"))
TORCH = str(Path(torch.__file__).parent) + os.sep


def _caller() -> str | None:
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(TORCH):
        frame = frame.f_back
    if frame is None or not frame.f_code.co_filename.startswith(OURS):
        return None
    return f"{Path(frame.f_code.co_filename).relative_to(REPO)}:{frame.f_lineno}"


def _syncs(name: str, args, kwargs) -> bool:
    if name in ALWAYS:
        return True
    if name == "repeat_interleave":
        return "output_size" not in kwargs
    if name == "__getitem__":
        index = args[1] if len(args) > 1 else None
        items = index if isinstance(index, tuple) else (index,)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)
    return False


class CountSyncs(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.where = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if _syncs(name, args, kwargs):
            where = _caller()
            if where is not None:
                self.where[f"{name} {where}"] += 1
        return func(*args, **kwargs)


counts: dict[int, dict] = {}
train_step = stepper.Stepper.train_step


def counted_train_step(self, step, batches):
    with CountSyncs() as mode:
        out = train_step(self, step, batches)
    counts[step] = {"count": sum(mode.where.values()), "where": sorted(mode.where.items())}
    Path(f"{os.environ['SYNC_COUNTS']}.{os.environ.get('RANK', '0')}.json").write_text(json.dumps(counts))
    return out


stepper.Stepper.train_step = counted_train_step

if __name__ == "__main__":
    sys.exit(train.main(sys.argv[1:]))
