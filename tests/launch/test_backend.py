"""``parallel.backend``: the collective backend, auto by default (gloo on CPU, NCCL on GPUs).

On this CPU machine: an explicit ``gloo`` trains like ``auto``; ``nccl`` and ``cuda:gloo`` (the
GPU device-contract check in ``benchmarks/gpu_suite.sh``) are refused in one line before anything
is written; a misspelt backend is refused by the recipe check.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.runs import REPO, env, rows

CONFIG = "ds_configs/zero0_fp32.json"


def _train(tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "launch/train.py", "--config", CONFIG, "--run-dir",
                           str(tmp_path / "run"), "--steps", "2", "--set", *overrides],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("backend", ["nccl", "cuda:gloo"])
def test_gpu_backends_are_refused_without_a_gpu(tmp_path, backend):
    proc = _train(tmp_path, f"parallel.backend={backend}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: parallel.backend {backend} needs CUDA GPUs and this machine has none: use auto "
        f"(gloo on CPU) or gloo"]
    assert not (tmp_path / "run").exists()


def test_misspelt_backend_is_refused(tmp_path):
    proc = _train(tmp_path, "parallel.backend=ncl")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    line, = proc.stderr.strip().splitlines()
    assert line.startswith("error: ") and "parallel.backend" in line and "nccl" in line, line


def test_explicit_gloo_trains_as_auto_does(warm_launcher, tmp_path):
    """2 ranks, 3 steps each way: the same losses (the same backend underneath)."""
    got = {}
    for backend in ("auto", "gloo"):       # each its own launch: the run creates its process group
        run_dir = tmp_path / backend
        warm_launcher.launch(run_dir, CONFIG, extra=[f"parallel.backend={backend}", "eval.every=0"], steps=3)
        got[backend] = [r["loss"] for r in rows(run_dir)]
    assert len(got["gloo"]) == 3 and got["gloo"] == got["auto"], got
