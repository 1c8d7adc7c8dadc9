"""One rank lost or stopped (``training/resilience/watchdog.py``): named in one line, exit code 76 within a
bound, and the same command reproduces the uninterrupted run. 2 gloo ranks under torchrun, as a
user would launch them (the faults are signals to one worker)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.runs import STEPS, launch, rows
from training.resilience import watchdog

CONFIG = "ds_configs/zero1_fp32.json"
# A 10 s limit: heartbeats every second (a tenth of it), so that one names a completed step while
# the 10-step run is still going.
ARGS = ["train.save_every=2", "train.hang_timeout_s=10"]


@pytest.fixture(scope="module")
def warm(warm_launcher):
    return warm_launcher


@pytest.fixture(scope="module")
def control(tmp_path_factory, warm):
    """The uninterrupted run the faulted ones must reproduce."""
    run_dir = tmp_path_factory.mktemp("control") / "run"
    warm.launch(run_dir, CONFIG, extra=ARGS)
    return run_dir


def _heartbeat(run_dir: Path, rank: int) -> dict | None:
    try:
        return json.loads((run_dir / watchdog.HEARTBEATS / f"rank{rank}.json").read_text())
    except (OSError, ValueError):
        return None


def _signal_rank_after(run_dir: Path, proc, rank: int, step: int, signum, timeout: float = 240) -> float:
    """Send ``signum`` to rank ``rank`` (its pid from its heartbeat) once ``metrics.jsonl`` shows
    ``step`` and the rank's heartbeat names a completed step (heartbeats follow the steps up to a
    period behind: a fast run can log step ``step`` before the first such heartbeat);
    the time it was sent."""
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        beat = _heartbeat(run_dir, rank)
        if beat and beat.get("step") is not None and metrics.is_file() and \
                f'"step": {step},' in metrics.read_text():
            os.kill(beat["pid"], signum)
            return time.monotonic()
        time.sleep(0.02)
    raise AssertionError(f"the run never reached step {step} (exit {proc.poll()})")


def _matches(control: Path, run_dir: Path) -> None:
    ref, resumed = rows(control), rows(run_dir)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    for a, b in zip(ref, resumed, strict=True):
        # The same processes and reduction order, fp32: a resumed run is the same computation;
        # 1e-6 relative allows only checkpoint-format rounding, of which there is none.
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6), a["step"]


def _errors(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if line.startswith("error:")]


def test_a_stopped_rank_is_named_with_every_live_ranks_stacks_and_the_rerun_matches(
        control, warm, tmp_path):
    run_dir, exit_file = tmp_path / "stopped", tmp_path / "exit_codes"
    proc = launch(run_dir, CONFIG, extra=ARGS, wait=False,
                  extra_env={"TRAIN_EXIT_CODE_FILE": str(exit_file), "TORCH_FR_BUFFER_SIZE": "200"})
    sent = _signal_rank_after(run_dir, proc, 1, 5, signal.SIGSTOP)
    try:
        proc.wait(timeout=90)
    finally:
        stopped = _heartbeat(run_dir, 1)
        try:
            os.kill(stopped["pid"], signal.SIGKILL)
        except OSError:
            pass
    took = time.monotonic() - sent
    assert took <= 60, f"the job took {took:.0f} s to exit after rank 1 was stopped"
    log = (tmp_path / "stopped.log").read_text()
    errors = _errors(tmp_path / "stopped.log")
    assert len(errors) == 1, log[-3000:]
    assert errors[0].startswith("error: no progress for "), errors
    assert (f"rank 1 (pid {stopped['pid']} on {stopped['host']}) stopped (its last heartbeat: "
            f"step {stopped['step']}, {stopped['phase']})" in errors[0]), errors
    assert stopped["step"] is not None, stopped      # heartbeats follow the steps (a period behind)
    assert "killed rank 1" in errors[0] and "exit code 76" in errors[0], errors
    assert exit_file.read_text().split() == ["76", "0"]
    hang = run_dir / watchdog.HANG
    stacks = (hang / "stacks_rank0.txt").read_text()
    assert "no progress for" in stacks and "File " in stacks     # faulthandler's frames
    assert not (hang / "stacks_rank1.txt").exists()              # the stopped rank wrote none
    assert (hang / "fr_trace_rank_0").stat().st_size > 0          # the Flight Recorder buffer
    warm.launch(run_dir, CONFIG, extra=ARGS)
    _matches(control, run_dir)


def _cpu_local(run_dir: Path, *args: str, steps: int = STEPS):
    """``launch/cpu_local.sh`` (torchrun, 2 gloo ranks) with the tests' small settings."""
    import subprocess

    from tests.runs import REPO, SMALL, env
    log = open(run_dir.parent / f"{run_dir.name}.log", "a")
    return subprocess.Popen(
        ["bash", "launch/cpu_local.sh", *args, "recipes/tiny_mixtral.yaml", CONFIG,
         "--run-dir", str(run_dir), "--steps", str(steps), "--set", *SMALL, *ARGS],
        cwd=REPO, env={**env(), "NPROC": "2"}, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True)


def test_a_killed_rank_is_named_within_30_s_and_max_restarts_finishes_the_job(control, tmp_path):
    """``launch/cpu_local.sh --max-restarts 1``: rank 1 SIGKILLed once after step 5; rank 0
    names it in one line and exits 76 within 30 s, the script reruns the command once, and the
    rerun resumes and reproduces the uninterrupted run."""
    run_dir, log_path = tmp_path / "killed", tmp_path / "killed.log"
    proc = _cpu_local(run_dir, "--max-restarts", "1")
    victim = None
    while victim is None:                       # the first attempt's rank 1
        victim = _heartbeat(run_dir, 1)
        time.sleep(0.02)
    sent = _signal_rank_after(run_dir, proc, 1, 5, signal.SIGKILL)
    while ": restart 1 of 1" not in log_path.read_text() and time.monotonic() - sent < 60:
        time.sleep(0.05)
    took = time.monotonic() - sent
    assert proc.wait(timeout=300) == 0, log_path.read_text()[-3000:]
    log = log_path.read_text()
    assert took <= 30, f"the job took {took:.0f} s to end after rank 1 was killed"
    first = log.split(": restart 1 of 1")[0]
    errors = [line for line in first.splitlines() if line.startswith("error:")]
    assert errors == [f"error: rank 1 (pid {victim['pid']} on {victim['host']}) lost during step "
                      f"{errors[0].split('during step ')[1].split(':')[0]}: its process ended "
                      f"(killed, a GPU error, a node lost); rerun the same command to resume from "
                      f"the newest checkpoint (exit code 76)"], first[-3000:]
    assert int(errors[0].split("during step ")[1].split(":")[0]) >= 5   # killed after step 5 was logged
    assert "Traceback" not in first.split("error: rank 1")[0][-3000:]   # none from our ranks
    restarts = [line for line in log.splitlines() if ": restart " in line]
    assert restarts == ["cpu_local.sh: restart 1 of 1 after exit code 76 (a rank was lost or "
                        "stopped making progress): the same command resumes from the newest "
                        "checkpoint"], log[-3000:]
    assert "resumed from " in log
    _matches(control, run_dir)


def test_bad_input_is_not_restarted(tmp_path):
    run_dir = tmp_path / "bad"
    proc = _cpu_local(run_dir, "--max-restarts", "2", steps=0)
    assert proc.wait(timeout=120) == 2
    log = (tmp_path / "bad.log").read_text()
    assert log.count("+ torchrun ") == 1 and "not restarted" in log, log[-3000:]
    assert "error: --steps: 0 must be >= 1" in log and not run_dir.exists()
