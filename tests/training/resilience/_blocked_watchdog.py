"""Run by test_watchdog.py in a process of its own: a watchdog (``train.hang_timeout_s`` 2 s) whose
heartbeat file cannot be written: its temporary file is a FIFO nobody reads, so the write blocks
as on a hung filesystem (an NFS hard mount). ``stalled``: the trainer makes no progress;
``beating``: the trainer beats every 0.2 s, only the write is stuck. The watchdog must exit 76
with one line within the timeout plus a few seconds, whatever the write does."""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from training.resilience import watchdog  # noqa: E402

run_dir, mode = Path(sys.argv[1]), sys.argv[2]
(run_dir / watchdog.HEARTBEATS).mkdir(parents=True)
os.mkfifo(run_dir / watchdog.HEARTBEATS / f".rank0.json.tmp{os.getpid()}")
dog = watchdog.Watchdog(run_dir, 0, 1, 2.0)
dog.beat(1)                              # past start-up: the 2 s limit holds
dog.attach(launch_id=7)
while True:
    time.sleep(0.2)
    if mode == "beating":
        dog.beat()
