"""Run on every rank by test_durability.py: ``launch.train.main(argv)`` with every ``os.fsync``
(by the path its descriptor names) and every ``os.replace`` recorded, in order with a monotonic
clock shared by the ranks of one host, in ``$DURABILITY_LOG.<rank>.jsonl``."""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from launch import train  # noqa: E402

LOG = open(f"{os.environ['DURABILITY_LOG']}.{os.environ.get('RANK', '0')}.jsonl", "a", buffering=1)
_fsync, _replace = os.fsync, os.replace


def fsync(fd):
    path = os.readlink(f"/proc/self/fd/{fd}")
    _fsync(fd)
    LOG.write(json.dumps({"t": time.monotonic(), "fsync": path}) + "\n")


def replace(src, dst, *args, **kwargs):
    _replace(src, dst, *args, **kwargs)
    LOG.write(json.dumps({"t": time.monotonic(), "replace": [os.path.abspath(src), os.path.abspath(dst)]}) + "\n")


os.fsync, os.replace = fsync, replace

if __name__ == "__main__":
    sys.exit(train.main(sys.argv[1:]))
