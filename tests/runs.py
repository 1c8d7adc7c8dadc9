"""Launch ``launch/train.py`` as a user would (torchrun or plain python) and read its metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.distributed import free_port

REPO = Path(__file__).resolve().parents[1]
STEPS = 10
# A small MoE model so that each step takes milliseconds; router jitter on, so that the resume
# test also proves the RNG streams continue.
SMALL = ["model.hidden_size=64", "model.num_layers=2", "model.ffn_hidden_size=64",
         "model.max_seq_len=64", "data.seq_len=64", "data.max_bytes=1500000",
         "tokenizer.train_bytes=1500000", "model.moe.router_jitter=0.01", "eval.every=5",
         "eval.batches=2", "train.log_every=5"]
# Absolute tolerance for weights compared with the single-process control after a few AdamW
# steps (with rtol 1e-4). Nearly every weight agrees to ~1e-7, but AdamW's m / (sqrt(v) + eps)
# turns a layout's rounding difference in a near-zero gradient (a rare token's embedding row,
# where the contributions nearly cancel) into a visible fraction of one step's lr: measured up to
# 7.1e-6 on one element of 262,144 (10 steps, PP2 x TP2). A wrong shard or a wrong update is off
# by O(init_std) = 2e-2 or by about lr = 6e-4 per step, 20x this bound or more.
WEIGHT_ATOL = 3e-5


def env():
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", WANDB_SILENT="true",
               TOKENIZERS_PARALLELISM="false")
    env.pop("RANK", None)
    return env


def launch(run_dir: Path, config: str, nproc: int = 2, extra=(), timeout: int = 300,
           wait: bool = True, steps: int = STEPS, script: str = "launch/train.py",
           extra_env: dict | None = None, check: bool = True):
    """Start ``launch/train.py`` (or a test ``script`` that wraps it) like a user would
    (torchrun for nproc > 1); with ``wait``, assert exit code 0 unless ``check`` is False."""
    prefix = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", str(free_port())] if nproc > 1 else [sys.executable])
    cmd = prefix + [script, "--config", config, "--run-dir", str(run_dir),
                    "--steps", str(steps), "--set", *SMALL, *extra]
    log = open(run_dir.parent / f"{run_dir.name}.log", "a")
    proc = subprocess.Popen(cmd, cwd=REPO, env={**env(), **(extra_env or {})}, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    if not wait:
        return proc
    rc = proc.wait(timeout=timeout)
    assert rc == 0 or not check, (run_dir.parent / f"{run_dir.name}.log").read_text()[-3000:]
    return proc


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


def ds_variant(tmp: Path, name: str, **changes) -> str:
    cfg = json.loads((REPO / "ds_configs" / f"{name}.json").read_text())
    cfg.update(changes)
    path = tmp / f"{name}-{'-'.join(f'{k}{v}' for k, v in changes.items())}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def kill_after_step(proc, run_dir: Path, step: int, timeout: float = 300) -> None:
    """SIGKILL every process of a run once its metrics.jsonl shows ``step`` (a crash mid-run)."""
    import signal
    import time
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and f'"step": {step},' in metrics.read_text():
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed"
    # torchrun puts its workers in their own sessions: kill every process of this run.
    os.killpg(proc.pid, signal.SIGKILL)
    subprocess.run(["pkill", "-KILL", "-f", str(run_dir)], check=False)
    proc.wait()
    time.sleep(1)
