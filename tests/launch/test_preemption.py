"""A SLURM-style preemption rehearsed on CPU, through the launch scripts' whole chain: the batch
script gets SLURM's warning (SIGUSR1) with a lead time, sends SIGUSR1 to the ranks on every node
(``srun --overlap``, here a fake srun that runs the step on this machine), torchrun is left
alone; the ranks finish their step and save it, the save taking longer than the 30 s any
launcher would have given (and shorter than the lead), exit 75, and the script requeues the job
naming the checkpoint; the same command resumes from it (``launch/common.sh``,
``training/resilience/preemption.py``, docs/reliability.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from training.run.spawn import free_port
from tests.runs import REPO, SMALL, STEPS, env

LEAD_S = 90          # the job's --signal lead time: the ranks' grace
SAVE_FILE_S = 16     # per checkpoint file: rank 0 writes 2 (ZeRO-1), so the save takes 32 s > 30 s
JOB_ID = "777"

# A one-node copy of launch/slurm_8x8.sbatch, as a user makes one for another shape.
SBATCH = f"""#!/usr/bin/env bash
#SBATCH --signal=B:USR1@{LEAD_S}
#SBATCH --requeue
NUM_NODES=1
NPROC_PER_NODE=2
source {REPO}/launch/common.sh
launch_srun_torchrun "$@"
"""

# srun: an --overlap step's command runs here; the job's step is its torchrun command, run here
# with the script's launch/train.py replaced by <tmp>/launch/train.py (the slowed trainer). With
# OVERLAP_LATE set, the --overlap step starts only once the job's step has ended (a signal that
# reaches the ranks after their last step).
FAKE_SRUN = f"""#!{sys.executable}
import os, sys, time
args, marks = sys.argv[1:], os.environ["MARKS"]
def running(pid):
    try:
        return open(f"/proc/{{pid}}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
if "--overlap" in args:
    open(marks + "/overlap", "w").write(" ".join(args))
    cmd = args[args.index("sh"):]
    job, deadline = open(marks + "/job_pid").read(), time.time() + 60
    while os.environ.get("OVERLAP_LATE") and running(job) and time.time() < deadline:
        time.sleep(0.1)
else:
    open(marks + "/job_pid", "w").write(str(os.getpid()))
    cmd = [sys.executable, "-m", "torch.distributed.run"] + [
        os.environ["FAKE_TRAIN"] if a.endswith("launch/train.py") else a
        for a in args[args.index("torchrun") + 1:]]
os.execvp(cmd[0], cmd)
"""


def _bin(folder: Path, name: str, text: str) -> None:
    (folder / name).write_text(text)
    (folder / name).chmod(0o755)


def _run_job(tmp_path: Path, train_args: list[str], signal_after_step: int, **extra_env: str):
    """The one-node job (``SBATCH``) with the fake srun and scontrol, SIGUSR1 to the script once
    ``signal_after_step`` is logged; returns its exit code, the seconds from the signal to its end
    and its log."""
    marks, bin_dir = tmp_path / "marks", tmp_path / "bin"
    for folder in (marks, bin_dir, tmp_path / "launch"):
        folder.mkdir()
    _bin(bin_dir, "srun", FAKE_SRUN)
    _bin(bin_dir, "scontrol", f'#!/bin/sh\nif [ "$1" = requeue ]; then echo "$2" > {marks}/requeued; '
                              f'exit 0; fi\necho 127.0.0.1\n')
    (tmp_path / "job.sbatch").write_text(SBATCH)
    (tmp_path / "launch" / "train.py").write_text(
        f"import runpy\nrunpy.run_path({str(REPO / 'tests/launch/_slow_save_train.py')!r}, run_name='__main__')\n")
    job_env = {**env(), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "MARKS": str(marks),
               "SLURM_JOB_ID": JOB_ID, "SLURM_JOB_NODELIST": "127.0.0.1", "MASTER_PORT": str(free_port()),
               "FAKE_TRAIN": str(tmp_path / "launch" / "train.py"), **extra_env}
    log = open(tmp_path / "job.log", "w")
    job = subprocess.Popen(["bash", str(tmp_path / "job.sbatch"), str(REPO / "recipes/tiny_mixtral.yaml"),
                            str(REPO / "ds_configs/zero1_fp32.json"), *train_args],
                           cwd=tmp_path, env=job_env, stdout=log, stderr=subprocess.STDOUT,
                           start_new_session=True)
    try:
        metrics, deadline = Path(train_args[1]) / "metrics.jsonl", time.monotonic() + 240
        while not (metrics.is_file() and f'"step": {signal_after_step},' in metrics.read_text()):
            assert job.poll() is None and time.monotonic() < deadline, (tmp_path / "job.log").read_text()[-3000:]
            time.sleep(0.1)
        job.send_signal(signal.SIGUSR1)                  # SLURM's warning, LEAD_S before the limit
        sent = time.monotonic()
        rc = job.wait(timeout=LEAD_S + 30)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    return rc, time.monotonic() - sent, (tmp_path / "job.log").read_text()


def test_a_preempted_job_saves_within_the_lead_time_requeues_and_resumes(warm_launcher, tmp_path):
    marks, run_dir = tmp_path / "marks", tmp_path / "run"
    train_args = ["--run-dir", str(run_dir), "--steps", str(STEPS), "--set", *SMALL,
                  "train.save_every=100", "train.hang_timeout_s=30"]
    # HOLD_STEP: step 3 waits for the signal, so that it lands mid-run however slow its way.
    rc, took, text = _run_job(tmp_path, train_args, 2, STEP_S="0.5", SAVE_FILE_S=str(SAVE_FILE_S),
                              HOLD_STEP="3")
    metrics = run_dir / "metrics.jsonl"
    assert rc == 0, text[-3000:]
    assert 30 < took < LEAD_S, (took, text[-3000:])        # the save outlasted 30 s, not the lead
    saved = next((line.split("; it resumes from ")[1] for line in text.splitlines()
                  if f"requeued job {JOB_ID}; it resumes from " in line), None)
    assert saved is not None, text[-3000:]          # the job's own words when it did not say so
    step = int(Path(saved).name[len("step"):])
    assert 2 <= step < STEPS and f"preempted at step {step}: {saved} saved" in text, text[-3000:]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == Path(saved).name
    assert (run_dir / "checkpoints" / Path(saved).name / "manifest.json").is_file()
    assert (marks / "requeued").read_text().strip() == JOB_ID
    assert "forcefully exiting" not in text          # torchrun SIGKILLed nobody
    assert not list(tmp_path.glob(".train_exit_codes.*"))

    # The requeued job: the same command, resumed from that checkpoint, no step lost or repeated.
    warm_launcher.run(["launch/train.py", "--config", "ds_configs/zero1_fp32.json", "--recipe",
                       "recipes/tiny_mixtral.yaml", *train_args], tmp_path / "rerun.log", nproc=2)
    assert f"resumed from {saved}" in (tmp_path / "rerun.log").read_text()
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if '"loss"' in line]
    assert steps == list(range(1, STEPS + 1)), steps


def test_a_signal_that_reaches_the_ranks_after_their_last_step_does_not_requeue_a_finished_job(tmp_path):
    """SLURM's warning reaches the ranks only after the run's last step (the --overlap step starts
    once the job's step has ended): the run finished and its final save verified, so the script
    says so and exits 0 without a requeue (it used to requeue, "no checkpoint verified")."""
    run_dir = tmp_path / "run"
    train_args = ["--run-dir", str(run_dir), "--steps", "2", "--set", *SMALL, "train.save_every=100"]
    rc, _, text = _run_job(tmp_path, train_args, 1, STEP_S="0.5", SAVE_FILE_S="2", OVERLAP_LATE="1")
    assert rc == 0, text[-3000:]
    assert "the run finished before the signal reached its ranks (exit code 0)" in text, text[-3000:]
    assert "requeued job" not in text and not (tmp_path / "marks" / "requeued").exists(), text[-3000:]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step00000002"
    assert not list(tmp_path.glob(".train_exit_codes.*"))
