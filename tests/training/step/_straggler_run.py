"""Run by test_stragglers.py on every rank: ``launch.train.main(argv)`` with the rank named by
``$STRAGGLER_RANK`` sleeping ``$STRAGGLER_SLEEP_S`` seconds at the start of every step's first
forward (``Stepper._forward`` of micro-batch 1): a host stall in that rank's own work of the step,
inside the span its busy time measures (``training/step/stats.py``, "Stragglers").
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from launch import train  # noqa: E402
from training.step import stepper  # noqa: E402

forward = stepper.Stepper._forward


def stalled_forward(self, *args, **kwargs):
    if self.where.micro_batch == 1:
        time.sleep(float(os.environ["STRAGGLER_SLEEP_S"]))
    return forward(self, *args, **kwargs)


if os.environ.get("RANK", "0") == os.environ["STRAGGLER_RANK"]:
    stepper.Stepper._forward = stalled_forward

if __name__ == "__main__":
    sys.exit(train.main(sys.argv[1:]))
