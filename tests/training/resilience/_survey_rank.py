"""Run by test_survey_hosts.py, one process per rank: a rank of a job on simulated hosts, with its
real watchdog. Arguments: the run directory, the rank, the world size, its host (what
``socket.gethostname`` returns here), ``train.hang_timeout_s`` (0: automatic) and the time scale
(the watchdog's constants in seconds that the survey and the report use are multiplied by it)
and the seconds each heartbeat write takes (0, or more for a slow filesystem).

It prints ``imported`` and reads one line: the wall-clock time to start its watchdog at (ranks
started together check in step, every quarter period) and ``-`` (its trainer then beats every
50 ms) or a delay. With a delay it prints ``stall <time>``: from then on (a quarter period after
the second heartbeat put on its own, and as long before the next) its trainer makes no
progress, so that the watchdog fires at its next check, as after a real hang, the delay later;
the process exits 76 with its line, if it prints one, on stderr."""

import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

run_dir, rank, world, host = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
timeout_s, scale, write_s = float(sys.argv[5]), float(sys.argv[6]), float(sys.argv[7])
socket.gethostname = lambda: host

from training.resilience import heartbeats, watchdog  # noqa: E402

write = heartbeats.atomic_write
heartbeats.atomic_write = lambda *args, **kwargs: (time.sleep(write_s), write(*args, **kwargs))

for name in ("PERIOD_MIN_S", "PERIOD_MAX_S", "SURVEY_READS_S", "REPORT_S"):
    setattr(watchdog, name, getattr(watchdog, name) * scale)
print("imported", flush=True)
start, delay = sys.stdin.readline().split()
time.sleep(max(0.0, float(start) - time.time()))
dog = watchdog.Watchdog(run_dir, rank, world, timeout_s)
dog.attach(launch_id=7)
dog.beat(1)                              # past start-up: the automatic or fixed limit holds
if delay == "-":
    while True:
        time.sleep(0.05)
        dog.beat()
stall = float(start) + 6.5 * dog.period_s / 4      # heartbeats are put at checks 1, 5, 9, ...
print(f"stall {stall}", flush=True)
time.sleep(max(0.0, stall - time.time()))
if float(delay):
    fire = dog._fire
    dog._fire = lambda *args, **kwargs: (time.sleep(float(delay)), fire(*args, **kwargs))
dog._last -= dog.allowed_s() + 1                   # no progress for longer than the limit
time.sleep(60)
