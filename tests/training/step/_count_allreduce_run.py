"""Run by test_allreduce_count.py on every rank: ``launch.train.main(argv)`` with each optimizer
step (``Stepper.train_step``) counting the ``torch.distributed.all_reduce`` calls, whoever makes
them (our code or DeepSpeed's), named by the innermost frame of this repository on the stack
(``deepspeed`` when DeepSpeed's code calls first). Writes ``{step: {"count": n, "where": [...]}}`` to
``$ALLREDUCE_COUNTS.<rank>.json``.
"""

import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch.distributed as dist

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from launch import train  # noqa: E402
from training.step import stepper  # noqa: E402

OURS = tuple(str(REPO / d) + os.sep for d in ("model", "training", "launch"))
COMM = os.path.join("model", "parallel", "comm.py")


def _caller() -> str:
    """The innermost caller outside ``model/parallel/comm.py`` (the wrappers), or "deepspeed"
    when DeepSpeed's code is met first."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if f"{os.sep}deepspeed{os.sep}" in name:
            return "deepspeed"
        if name.startswith(OURS) and not name.endswith(COMM):
            return f"{Path(name).relative_to(REPO)}:{frame.f_code.co_qualname}"
        frame = frame.f_back
    return "other"


where: Counter | None = None
all_reduce = dist.all_reduce


def counted_all_reduce(*args, **kwargs):
    if where is not None:
        where[_caller()] += 1
    return all_reduce(*args, **kwargs)


counts: dict[int, dict] = {}
train_step = stepper.Stepper.train_step


def counted_train_step(self, step, batches):
    global where
    where = Counter()
    try:
        out = train_step(self, step, batches)
    finally:
        counts[step] = {"count": sum(where.values()), "where": sorted(where.items())}
        where = None
    Path(f"{os.environ['ALLREDUCE_COUNTS']}.{os.environ.get('RANK', '0')}.json").write_text(
        json.dumps(counts))
    return out


dist.all_reduce = counted_all_reduce
stepper.Stepper.train_step = counted_train_step

if __name__ == "__main__":
    sys.exit(train.main(sys.argv[1:]))
