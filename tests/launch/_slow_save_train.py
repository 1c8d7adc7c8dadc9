"""Run by test_preemption.py as each rank (through ``<tmp>/launch/train.py``, which the fake srun
puts where the script's ``launch/train.py`` was, so that the rank's command line is a rank's):
``launch.train.main`` with every optimizer step taking ``STEP_S`` more (so that a signal lands
mid-run) and every checkpoint file ``SAVE_FILE_S`` more to write (a large model's save). With
``HOLD_STEP`` N, step N starts only once this rank has received a preemption signal (at most
``HOLD_S``, default 20 s): the signal lands mid-run however long it takes to arrive."""

import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from launch import train  # noqa: E402
from training.checkpoint import saving  # noqa: E402
from training.run.distributed import exit_now  # noqa: E402
from training.step.stepper import Stepper  # noqa: E402


def slowed(fn, seconds):
    def wrapper(*args, **kwargs):
        time.sleep(seconds)
        return fn(*args, **kwargs)
    return wrapper


def held(fn, step_n, seconds):
    def wrapper(self, step, *args, **kwargs):
        deadline = time.monotonic() + seconds
        while step == step_n and self.preemption.received is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return fn(self, step, *args, **kwargs)
    return wrapper


Stepper.train_step = slowed(Stepper.train_step, float(os.environ["STEP_S"]))
if os.environ.get("HOLD_STEP"):
    Stepper.train_step = held(Stepper.train_step, int(os.environ["HOLD_STEP"]),
                              float(os.environ.get("HOLD_S", "20")))
saving._write_file = slowed(saving._write_file, float(os.environ["SAVE_FILE_S"]))

if __name__ == "__main__":
    exit_now(train.main(sys.argv[1:]))
