"""W&B across a resume, and the API key kept out of everything the run writes.

One process, W&B offline (``tests.runs.env``) with a fake ``WANDB_API_KEY`` in the environment:
the first launch trains 4 steps; the same command with ``--steps 8`` resumes from step 4. Both
launches must log into the same W&B run (the id kept in ``<run-dir>/wandb_run_id``, passed to
``wandb.init(id=..., resume="allow")``): ``wandb sync`` of the two offline folders then appends
the second launch's steps 5-8 to the first's 1-4. The key must appear in no file under the run
directory (metrics, config, W&B's own offline files) and in no log line.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.launch.test_train import wandb_history
from tests.runs import shared_launcher

SECRET = "0123456789abcdef0123456789abcdef01234567"   # 40 hex characters, like a real key


def test_resumed_run_appends_to_the_same_wandb_run_and_the_key_stays_out(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", SECRET)       # tests.runs.env() copies os.environ
    run_dir = tmp_path / "wb"
    extra = ["tracking.wandb=true", "train.save_every=4"]
    shared_launcher().launch(run_dir, "ds_configs/zero1_fp32.json", nproc=1, extra=extra, steps=4)
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    shared_launcher().launch(run_dir, "ds_configs/zero1_fp32.json", nproc=1, extra=extra, steps=8)
    assert (run_dir / "wandb_run_id").read_text().strip() == run_id

    folders = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(folders) == 2, folders
    assert all(f.name.endswith(f"-{run_id}") for f in folders), folders    # one W&B run id
    steps = [[h["_step"] for h in wandb_history(next(f.glob("*.wandb"))) if "loss" in h]
             for f in folders]
    assert steps == [[1, 2, 3, 4], [5, 6, 7, 8]], steps

    logs = (tmp_path / "wb.log").read_bytes()
    leaked = [str(p.relative_to(run_dir)) for p in run_dir.rglob("*")
              if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert not leaked, leaked
    assert SECRET.encode() not in logs
    assert os.environ["WANDB_API_KEY"] == SECRET      # the test did pass a key
    assert Path(run_dir / "metrics.jsonl").is_file()
