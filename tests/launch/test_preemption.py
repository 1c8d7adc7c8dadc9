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
# with the script's launch/train.py replaced by <tmp>/launch/train.py (the slowed trainer).
FAKE_SRUN = f"""#!{sys.executable}
import os, sys
args = sys.argv[1:]
if "--overlap" in args:
    open(os.environ["MARKS"] + "/overlap", "w").write(" ".join(args))
    cmd = args[args.index("sh"):]
else:
    cmd = [sys.executable, "-m", "torch.distributed.run"] + [
        os.environ["FAKE_TRAIN"] if a.endswith("launch/train.py") else a
        for a in args[args.index("torchrun") + 1:]]
os.execvp(cmd[0], cmd)
"""


def _bin(folder: Path, name: str, text: str) -> None:
    (folder / name).write_text(text)
    (folder / name).chmod(0o755)


def test_a_preempted_job_saves_within_the_lead_time_requeues_and_resumes(warm_launcher, tmp_path):
    marks, bin_dir, run_dir = tmp_path / "marks", tmp_path / "bin", tmp_path / "run"
    for folder in (marks, bin_dir, tmp_path / "launch"):
        folder.mkdir()
    _bin(bin_dir, "srun", FAKE_SRUN)
    _bin(bin_dir, "scontrol", f'#!/bin/sh\nif [ "$1" = requeue ]; then echo "$2" > {marks}/requeued; '
                              f'exit 0; fi\necho 127.0.0.1\n')
    (tmp_path / "job.sbatch").write_text(SBATCH)
    (tmp_path / "launch" / "train.py").write_text(
        f"import runpy\nrunpy.run_path({str(REPO / 'tests/launch/_slow_save_train.py')!r}, run_name='__main__')\n")
    train_args = ["--run-dir", str(run_dir), "--steps", str(STEPS), "--set", *SMALL,
                  "train.save_every=100", "train.hang_timeout_s=30"]
    job_env = {**env(), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "MARKS": str(marks),
               "SLURM_JOB_ID": JOB_ID, "SLURM_JOB_NODELIST": "127.0.0.1", "MASTER_PORT": str(free_port()),
               "FAKE_TRAIN": str(tmp_path / "launch" / "train.py"), "STEP_S": "0.5",
               "SAVE_FILE_S": str(SAVE_FILE_S)}
    log = open(tmp_path / "job.log", "w")
    job = subprocess.Popen(["bash", str(tmp_path / "job.sbatch"), str(REPO / "recipes/tiny_mixtral.yaml"),
                            str(REPO / "ds_configs/zero1_fp32.json"), *train_args],
                           cwd=tmp_path, env=job_env, stdout=log, stderr=subprocess.STDOUT,
                           start_new_session=True)
    try:
        metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 240
        while not (metrics.is_file() and '"step": 2,' in metrics.read_text()):
            assert job.poll() is None and time.monotonic() < deadline, (tmp_path / "job.log").read_text()[-3000:]
            time.sleep(0.1)
        job.send_signal(signal.SIGUSR1)                  # SLURM's warning, LEAD_S before the limit
        sent = time.monotonic()
        rc = job.wait(timeout=LEAD_S + 30)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    took = time.monotonic() - sent
    text = (tmp_path / "job.log").read_text()
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
