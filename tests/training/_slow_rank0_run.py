"""Run by test_startup.py on every rank: ``launch.train.main(argv)`` with rank 0's tokenizer
build delayed by ``SLOW_RANK0_S`` seconds (env), as a large corpus would delay it."""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from launch import train  # noqa: E402
from training.data import build  # noqa: E402

load_tokenizer = build.load_tokenizer


def slow_on_rank0(*args, **kwargs):
    if os.environ.get("RANK") == "0":
        time.sleep(float(os.environ["SLOW_RANK0_S"]))
    return load_tokenizer(*args, **kwargs)


build.load_tokenizer = slow_on_rank0

if __name__ == "__main__":
    sys.exit(train.main(sys.argv[1:]))
