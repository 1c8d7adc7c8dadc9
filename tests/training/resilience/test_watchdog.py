"""The watchdog (training/resilience/watchdog.py): who the heartbeats say stopped, the allowed time,
the peer-lost errors it recognises, firing while the run directory blocks; the checkpoint-share
wait's timeout and its end on a failed writer; and, in one launched job, slow phases between
steps that are progress, not a hang."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from training.checkpoint import saving
from training.resilience import watchdog
from training.files import atomic_write
from tests.runs import SMALL

LAUNCH = 1234


def _beat(run_dir, rank, **fields):
    folder = run_dir / watchdog.HEARTBEATS
    folder.mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "launch": LAUNCH, "host": socket.gethostname(), "pid": os.getpid(),
              "step": 7, "phase": "forward", "state": "running", "counter": 1, **fields}
    atomic_write(folder / f"rank{rank}.json", json.dumps(record))   # as the watchdog writes


def test_survey_names_dead_stopped_silent_and_missing_ranks_and_spares_the_live(tmp_path):
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()                                               # a pid that no longer runs
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    os.kill(stopped.pid, 19)                                   # SIGSTOP
    while open(f"/proc/{stopped.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
        time.sleep(0.01)                                       # until the signal has landed
    try:
        _beat(tmp_path, 0)                                     # this process: alive, local
        _beat(tmp_path, 1, host="elsewhere", counter=5)        # remote, its counter moves
        _beat(tmp_path, 2, pid=ended.pid)                      # local, ended
        _beat(tmp_path, 3, host="elsewhere", counter=9)        # remote, silent
        _beat(tmp_path, 4, pid=stopped.pid)                    # local, stopped
        _beat(tmp_path, 5, launch=LAUNCH - 1)                  # an earlier launch's file
        _beat(tmp_path, 6, host="elsewhere", state="hung")     # remote, reported its own hang
        # rank 7 wrote nothing
        moving = threading.Event()

        def tick():
            n = 5
            while not moving.is_set():
                n += 1
                _beat(tmp_path, 1, host="elsewhere", counter=n)
                time.sleep(0.02)
        ticker = threading.Thread(target=tick)
        ticker.start()
        try:
            printer, out = watchdog.survey(tmp_path, 0, 8, LAUNCH, observe_s=0.3)
        finally:
            moving.set()
            ticker.join()
        assert printer
        assert [r["rank"] for r in out] == [2, 3, 4, 5, 7]
        assert out[-1] == {"rank": 7}
        # A higher rank defers to a live lower one, and reads only its file.
        assert watchdog.survey(tmp_path, 6, 8, LAUNCH, observe_s=0.3) == (False, [])
        # The lowest live rank speaks when every rank below it stopped.
        printer, out = watchdog.survey(tmp_path, 3, 5, LAUNCH, observe_s=0.1)
        assert printer is False            # rank 0 (alive) is below 3
    finally:
        stopped.kill()
        stopped.wait()


def test_the_lowest_live_rank_speaks_when_rank_0_is_gone(tmp_path):
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    _beat(tmp_path, 0, pid=ended.pid)
    _beat(tmp_path, 1)
    printer, out = watchdog.survey(tmp_path, 1, 2, LAUNCH, observe_s=0.1)
    assert printer and [r["rank"] for r in out] == [0]
    line = watchdog.hang_message(5, 31.4, 30, out, [0], tmp_path / "hang")
    assert line == (f"no progress for 31 s after step 5 (train.hang_timeout_s): rank 0 (pid "
                    f"{ended.pid} on {socket.gethostname()}) stopped (its last heartbeat: step 7, "
                    f"forward); killed rank 0; the live ranks' stacks are in {tmp_path / 'hang'}; "
                    f"rerun the same command to resume (exit code 76)")


def test_allowed_time_fixed_automatic_and_at_start_up(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(watchdog.time, "monotonic", lambda: clock[0])
    fixed = watchdog.Watchdog(tmp_path, 0, 1, 30.0)
    auto = watchdog.Watchdog(tmp_path, 0, 1, 0.0)
    try:
        assert fixed.allowed_s() == auto.allowed_s() == watchdog.STARTUP_S   # before step 1
        assert fixed.period_s == 3.0 and auto.period_s == 10.0
        for dog in (fixed, auto):
            for step, dt in enumerate([5.0, 40.0, 50.0, 45.0], start=1):
                clock[0] += dt
                dog.beat(step)
        assert fixed.allowed_s() == 30.0
        assert auto.allowed_s() == 10 * 50.0           # the slowest interval after step 1
        auto._step_times = [1.0] * 5
        assert auto.allowed_s() == watchdog.AUTO_FLOOR_S
        assert watchdog.startup_allowance(9000.0) == 9000.0
    finally:
        fixed._stop.set()
        auto._stop.set()


@pytest.mark.parametrize("message,lost", [
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4512", True),
    ("NCCL error in: ProcessGroupNCCL.cpp:1934, remote process exited or there was a network error", True),
    ("[gloo] Connection reset by peer", True),
    ("CUDA error: an illegal memory access was encountered", False),
    ("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)", False),
])
def test_peer_lost_errors_are_recognised_and_others_are_not(message, lost):
    assert watchdog.is_peer_lost(RuntimeError(message)) is lost


def test_the_checkpoint_share_wait_names_the_missing_ranks(tmp_path):
    (tmp_path / "manifest.rank0.json").write_text("{}")
    (tmp_path / "manifest.rank2.json").write_text("{}")
    t0 = time.monotonic()
    with pytest.raises(ValueError) as info:
        saving._all_shares_written(tmp_path, 4, timeout_s=0.3)
    assert time.monotonic() - t0 < 5
    assert str(info.value) == (f"waited 0 s for the checkpoint share of rank(s) 1, 3 in {tmp_path}: "
                               f"those ranks died, or their writes to this filesystem block (is "
                               f"{tmp_path.parent} shared by every node?)")
    (tmp_path / "manifest.rank1.json").write_text("{}")
    (tmp_path / "manifest.rank3.json").write_text("{}")
    assert saving._all_shares_written(tmp_path, 4, timeout_s=0.3) is True


@pytest.mark.parametrize("mode", ["stalled", "beating"])
def test_the_watchdog_fires_while_the_run_directory_blocks(tmp_path, mode):
    """The heartbeat's write blocks forever (a FIFO stands in for the hung filesystem): the
    watchdog decides without it and exits 76 with one line within its 2 s timeout plus a few
    seconds, stacks written. ``beating``: the trainer progresses and only that write is stuck,
    past the timeout: the same end, and the line says a write blocks."""
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "tests/training/resilience/_blocked_watchdog.py", str(tmp_path / "run"), mode],
                         capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == watchdog.EXIT_CODE and len(errors) == 1, out.stderr[-2000:]
    assert took < 2.0 + 6.0, took
    assert errors[0].startswith("error: a write to the run directory has not returned for " if mode == "beating"
                                else "error: no progress for "), errors
    assert (tmp_path / "run" / watchdog.HANG / "stacks_rank0.txt").read_text().startswith("rank 0 (pid ")


def test_the_share_wait_ends_when_the_job_reports_a_failed_writer(tmp_path):
    """Rank 0's writer stops waiting for the missing shares as soon as the step's job-wide sum
    reports a failed writer (``abandon``), not after its hours-long timeout."""
    (tmp_path / "manifest.rank0.json").write_text("{}")
    abandon = threading.Event()
    threading.Timer(0.3, abandon.set).start()
    t0 = time.monotonic()
    assert saving._all_shares_written(tmp_path, 2, timeout_s=3600, abandon=abandon) is False
    assert time.monotonic() - t0 < 3


def test_slow_saves_evaluations_and_closing_are_progress_not_a_hang(warm_launcher, tmp_path):
    """``train.hang_timeout_s`` 3 s; each phase after the last step takes longer, in parts shorter
    than it (1.8 s per checkpoint file and per evaluation batch, ``_slow_phases_run.py``): an
    evaluation of 3 batches (5.4 s), a synchronous final save (rank 0's two files: 3.6 s, the
    other rank waiting for it), a background final save on which the ranks wait in the job-wide
    sum, and 4 s closing the metrics on rank 0. Both runs finish with exit code 0 and their
    checkpoints published; before heartbeats in these phases the first run exited 76."""
    sync, background = tmp_path / "sync", tmp_path / "background"
    common = ["--config", "ds_configs/zero1_fp32.json", "--steps", "2", "--set", *SMALL,
              "train.hang_timeout_s=3", "train.save_every=2"]
    warm_launcher.script("tests/training/resilience/_slow_phases_run.py",
                         [*common, "train.async_save=false", "eval.every=2", "--run-dir", str(sync),
                          "--then", *common, "train.async_save=true", "eval.every=0",
                          "--run-dir", str(background)],
                         tmp_path / "run.log", extra_env={"SLOW_S": "1.8", "SLOW_CLOSE_S": "4"})
    log = (tmp_path / "run.log").read_text()
    assert "no progress for" not in log, log[-3000:]
    assert (sync / "checkpoints" / "latest").read_text() == "step00000002"
    assert (background / "checkpoints" / "latest").read_text() == "step00000002"
    metrics = [json.loads(line) for line in (sync / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics if "eval_loss" in r] == [2]
    stalls = [r["save_stall_s"] for r in metrics if "save_stall_s" in r]
    assert stalls and stalls[0] > 3, stalls           # the save did outlast the timeout


def test_heartbeats_are_written_at_most_once_per_period_whatever_the_step_rate(tmp_path, monkeypatch):
    """The filesystem load docs/reliability.md states: a rank's heartbeat file is rewritten at
    most once per period however often the trainer reports (here 2,000 records in about 1 s at
    a 0.25 s period), plus the writes asked for at once (the first step, the final state)."""
    from training.resilience import heartbeats
    writes = []
    monkeypatch.setattr(heartbeats, "atomic_write", lambda path, text, durable: writes.append(
        (time.monotonic(), json.loads(text), durable)))
    writer = heartbeats.HeartbeatWriter(tmp_path / "rank0.json", interval_s=0.25)
    t0 = time.monotonic()
    for n in range(2000):
        writer.put({"counter": n})
        time.sleep(0.0005)
    writer.put({"counter": "final"}, now=True)
    assert writer.flush(timeout_s=5)
    took = time.monotonic() - t0
    writer.close()
    assert writes[-1][1] == {"counter": "final"} and not any(w[2] for w in writes)   # never fsynced
    periodic = writes[:-1]
    assert 2 <= len(periodic) <= took / 0.25 + 2, (len(periodic), took)
    gaps = [b[0] - a[0] for a, b in zip(periodic, periodic[1:])]
    assert min(gaps) >= 0.24, gaps
