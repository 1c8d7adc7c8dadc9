"""Run by test_startup.py on every rank: ``launch.train.main(argv)`` with each rank sending itself
SIGUSR1 while it loads the tokenizer, in start-up before the model build and the checkpoint load
(the launch scripts' preemption warning can come at any time)."""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from launch import train  # noqa: E402
from training.data import build  # noqa: E402

load_tokenizer = build.load_tokenizer


def signalled(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGUSR1)
    return load_tokenizer(*args, **kwargs)


build.load_tokenizer = signalled

if __name__ == "__main__":
    sys.exit(train.main(sys.argv[1:]))
