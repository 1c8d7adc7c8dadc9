"""Run by test_startup.py on every rank: ``launch.train.main(argv)`` with rank 0's tokenizer
build delayed by ``SLOW_RANK0_S`` seconds (env), as a large corpus would delay it; on the other
ranks, sampling the corpus for the tokenizer and planning the data's preparation raise (rank 0
hands them its results). Records the launch's id (``LAUNCH_ID_OUT``)."""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from launch import train  # noqa: E402
from training.data import build  # noqa: E402
from training.run import distributed  # noqa: E402

load_tokenizer = build.load_tokenizer


def slow_on_rank0(*args, **kwargs):
    if os.environ.get("RANK") == "0":
        time.sleep(float(os.environ["SLOW_RANK0_S"]))
    return load_tokenizer(*args, **kwargs)


def not_here(*args, **kwargs):
    raise AssertionError(f"rank {os.environ.get('RANK')} redid rank 0's start-up work")


end_startup = distributed.DistContext.end_startup


def recorded_end_startup(self):
    """This launch's id to ``$LAUNCH_ID_OUT`` (the test looks for its own markers only: other
    tests' runs start up beside it in the same checkout)."""
    Path(os.environ["LAUNCH_ID_OUT"]).write_text(str(self.launch_id))
    return end_startup(self)


build.load_tokenizer = slow_on_rank0
distributed.DistContext.end_startup = recorded_end_startup
if os.environ.get("RANK") != "0":
    build.streams.training_sample = build.streams.prepare_raw = not_here

if __name__ == "__main__":
    sys.exit(train.main(sys.argv[1:]))
