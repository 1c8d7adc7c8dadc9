"""Run by test_preemption.py as each rank (through ``<tmp>/launch/train.py``, which the fake srun
puts where the script's ``launch/train.py`` was, so that the rank's command line is a rank's):
``launch.train.main`` with every optimizer step taking ``STEP_S`` more (so that a signal lands
mid-run) and every checkpoint file ``SAVE_FILE_S`` more to write (a large model's save)."""

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


Stepper.train_step = slowed(Stepper.train_step, float(os.environ["STEP_S"]))
saving._write_file = slowed(saving._write_file, float(os.environ["SAVE_FILE_S"]))

if __name__ == "__main__":
    exit_now(train.main(sys.argv[1:]))
