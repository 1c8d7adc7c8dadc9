"""Run by test_watchdog.py on every rank: ``launch.train.main`` once per run (the runs' arguments
separated by ``--then``, one after another in one process group, created here), with the phases between steps
made slow on purpose, each longer than the run's ``train.hang_timeout_s`` in total but made of
parts shorter than it: every checkpoint file written (DeepSpeed's synchronous writes and the
background writer's) and every evaluation batch (the validation set read three times over) sleeps ``SLOW_S`` (env), and closing the metrics
file sleeps ``SLOW_CLOSE_S`` on rank 0."""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine  # noqa: E402

from launch import train  # noqa: E402
from training import tracking  # noqa: E402
from training.checkpoint import saving  # noqa: E402
from training.step.stepper import Stepper  # noqa: E402

SLOW_S = float(os.environ["SLOW_S"])


def slowed(fn, seconds):
    def wrapper(*args, **kwargs):
        time.sleep(seconds)
        return fn(*args, **kwargs)
    return wrapper


class SlowBatches(list):
    def __iter__(self):             # the validation batches three times over (a longer evaluation)
        for batch in 3 * list(super().__iter__()):
            time.sleep(SLOW_S)
            yield batch


evaluate = Stepper.evaluate
TorchCheckpointEngine.save = slowed(TorchCheckpointEngine.save, SLOW_S)      # synchronous saves
saving._write_file = slowed(saving._write_file, SLOW_S)                      # the background writer
Stepper.evaluate = lambda self, batches, *a, **k: evaluate(self, SlowBatches(batches), *a, **k)
if os.environ.get("RANK") == "0":
    tracking.Tracker.close = slowed(tracking.Tracker.close, float(os.environ["SLOW_CLOSE_S"]))

if __name__ == "__main__":
    args, runs = sys.argv[1:], []
    while "--then" in args:
        cut = args.index("--then")
        runs.append(args[:cut])
        args = args[cut + 1:]
    import torch.distributed as dist
    dist.init_process_group("gloo")         # one group for the runs (each joins the one it finds)
    for argv in runs + [args]:
        if code := train.main(argv):
            sys.exit(code)
