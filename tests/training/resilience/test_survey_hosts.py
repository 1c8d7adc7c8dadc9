"""The hang survey across hosts (training/resilience/watchdog.py, heartbeats.py): a rank stopped
on another host is named within the documented bound at the automatic heartbeat period, and
ranks that fire together do not name each other.

Each rank is a process of its own (``_survey_rank.py``) with its real watchdog, on one of two
simulated hosts (``socket.gethostname`` patched): a rank judges those of the other host by their
heartbeat counters, as across nodes. Time is scaled by ``SCALE``: the watchdog's constants in
seconds that the survey and the report use (the heartbeat period's bounds ``PERIOD_MIN_S`` and
``PERIOD_MAX_S``, the survey's read allowance ``SURVEY_READS_S``, the report's ``REPORT_S``) are
all multiplied by it, so that the automatic period is 1 s here instead of 10 s, the survey's
observation 2.5 s instead of 25 s and its bound (docs/reliability.md: 2.5 x period + 10 s) 3.5 s
instead of 35 s. The ratios between them are the real default's, and the one thing not scaled,
reading a few small files, takes milliseconds, so a survey that fits its bound here fits it at
the real default too (and the 20 s the survey had before, 2 s here, is as short of the
observation here as there). A hang is made by moving a rank's last progress back past its
allowed time: its watchdog fires at its next check (the allowed time itself is not waited for).
Ranks start their watchdogs at the same instant, so they check in step, and stop progressing
half-way between two of their heartbeat puts: ranks that fire together do so within
milliseconds, with no heartbeat of theirs put by the ordinary schedule in between.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from training.resilience import watchdog

SCALE = 0.1
PERIOD = 10.0 * SCALE                        # the automatic heartbeat period, scaled
HOSTS = ["host-a", "host-a", "host-b", "host-b"]


def _bound(period: float) -> float:
    """The documented bound on a survey (docs/reliability.md), scaled."""
    return 2.5 * period + 10.0 * SCALE


def _job(run_dir, timeout_s: float, firing: dict[int, float], stopped: list[int],
         write_s: float = 0.0) -> dict:
    """Ranks on ``HOSTS``: ``stopped`` SIGSTOPped once their first heartbeat is written, ``firing``
    without progress from ``stall`` on (together; each fires its delay after its check), the
    others beating, every heartbeat write ``write_s`` long; returns the firing ranks' exit codes
    and ``error:`` lines (with their arrival times), the ranks' pids and ``stall``."""
    procs = [subprocess.Popen([sys.executable, "tests/training/resilience/_survey_rank.py",
                               str(run_dir), str(r), str(len(HOSTS)), host, str(timeout_s),
                               str(SCALE), str(write_s)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r, host in enumerate(HOSTS)]
    lines: list[tuple[float, int, str]] = []

    def collect(rank, stream):
        for line in stream:
            if line.startswith("error:"):
                lines.append((time.time(), rank, line.strip()))
    try:
        for proc in procs:
            assert proc.stdout.readline().strip() == "imported"
        readers = [threading.Thread(target=collect, args=(r, p.stderr), daemon=True)
                   for r, p in enumerate(procs)]
        for reader in readers:
            reader.start()
        start = time.time() + 0.2
        for r, proc in enumerate(procs):
            proc.stdin.write(f"{start} {firing.get(r, '-')}\n")
            proc.stdin.flush()
        stall = min(float(procs[r].stdout.readline().split()[1]) for r in firing)
        for r in stopped:
            beat = run_dir / watchdog.HEARTBEATS / f"rank{r}.json"
            while not beat.exists():
                time.sleep(0.005)
            os.kill(procs[r].pid, signal.SIGSTOP)
            stat = Path(f"/proc/{procs[r].pid}/stat")
            while stat.read_text().rsplit(")", 1)[1].split()[0] != "T":        # until it landed
                time.sleep(0.005)
        assert time.time() < stall, "the stopped ranks were stopped after the others stalled"
        codes = {r: procs[r].wait(timeout=30) for r in firing}
        for r in firing:
            readers[r].join(timeout=5)
        return {"codes": codes, "lines": lines, "stall": stall, "pids": [p.pid for p in procs]}
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.mark.parametrize("firing,stopped", [(0, [2]), (2, [0, 1])],
                         ids=["rank-2-on-the-other-host", "both-lower-ranks-on-the-other-host"])
def test_a_rank_stopped_on_the_other_host_is_named_within_the_bound(tmp_path, firing, stopped):
    """Automatic timeout (the 10 s period, scaled): the firing rank names the ranks stopped on the
    other host, and only those, within a quarter period (its next check) plus the bound. When
    both ranks below it are on the other host, one observation covers them and the others
    (before: one per lower rank, and the survey was cut off after 20 s < 25 s anyway)."""
    job = _job(tmp_path, 0.0, {firing: 0.0}, stopped)
    assert job["codes"] == {firing: watchdog.EXIT_CODE}
    assert len(job["lines"]) == 1, job["lines"]
    arrived, rank, line = job["lines"][0]
    named = [f"rank {r} (pid {job['pids'][r]} on {HOSTS[r]}) stopped" for r in stopped]
    assert rank == firing and all(n in line for n in named), line
    assert line.count(" stopped (") == len(stopped) and "filesystem" not in line, line
    assert arrived - job["stall"] <= PERIOD / 4 + _bound(PERIOD), (arrived - job["stall"], line)


@pytest.mark.parametrize("timeout_s,late_s,write_s", [(0.0, 0.0, 0.0), (5.0, 0.0, 0.0), (5.0, 0.1, 0.03)],
                         ids=["automatic", "period-0.5s", "period-0.5s-rank-2-later-slow-writes"])
def test_ranks_that_fire_together_do_not_name_each_other(tmp_path, timeout_s, late_s, write_s):
    """Ranks 0 (host-a) and 2 (host-b) stop progressing at the same moment and fire at the same
    check; ranks 1 and 3 beat. Each rank's heartbeat keeps moving while it surveys, so rank 0's
    line names nobody (every rank is still running) and rank 2 defers to it. ``period-0.5s``: a
    fixed 5 s timeout (a real 50 s one, period 5 s, under the scale), whose survey fits the old
    20 s: before, each firing rank's counter stood still during its own survey and rank 0 named
    rank 2 stopped. ``...-later-slow-writes``: rank 2 fires 0.1 s after rank 0 and every
    heartbeat write takes 30 ms, so rank 2 finds rank 0 already reporting and exits at once:
    before, it exited in the middle of writing its ``hung`` heartbeat (a write in progress was
    not waited for) and rank 0 named it stopped."""
    job = _job(tmp_path, timeout_s, {0: 0.0, 2: late_s}, [], write_s)
    assert job["codes"] == {0: watchdog.EXIT_CODE, 2: watchdog.EXIT_CODE}
    assert [(rank, " stopped (" in line) for _, rank, line in job["lines"]] == [(0, False)], job["lines"]
    line = job["lines"][0][2]
    assert "every rank is still running" in line and "filesystem" not in line, line
