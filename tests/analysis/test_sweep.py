"""``launch/sweep.py``: grid and random points, the trainer's checks on every point before the
first run, real runs whose results are the runs' own metrics, the W&B sweep file, bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from analysis import sweep
from tests.runs import REPO, SMALL, env, rows

CONFIG = "ds_configs/zero1_fp32.json"


def _sweep(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "launch/sweep.py", "--config", CONFIG, *args], cwd=REPO,
                          env=env(), capture_output=True, text=True, timeout=600)


def test_grid_and_random_points():
    grid = sweep.parse_grid(["ds.optimizer.params.lr=1e-3,3e-3", "train.seed=1,2,3"])
    assert grid == {"ds.optimizer.params.lr": [0.001, 0.003], "train.seed": [1, 2, 3]}
    every = sweep.points(grid)
    assert len(every) == 6 and every[0] == {"ds.optimizer.params.lr": 0.001, "train.seed": 1}
    drawn = sweep.points(grid, sample=4, seed=7)
    assert len(drawn) == 4 and len({json.dumps(p) for p in drawn}) == 4
    assert all(p in every for p in drawn) and drawn == sweep.points(grid, sample=4, seed=7)
    assert sweep.settings({"a.b": 0.001, "c": True}) == ["a.b=0.001", "c=true"]
    for bad, message in ((["lr"], "expected KEY=V1,V2"), (["a=1", "a=2"], "given twice"), ([], "no --grid")):
        with pytest.raises(ValueError, match=message):
            sweep.parse_grid(bad)


def test_sweep_runs_every_point_and_collects_its_metrics(tmp_path):
    out = tmp_path / "sweep"
    proc = _sweep("--grid", "ds.optimizer.params.lr=1e-3,1e-2", "--steps", "6", "--out", str(out),
                  "--set", *SMALL, "eval.every=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert [r["point"] for r in results] == [{"ds.optimizer.params.lr": 0.001},
                                             {"ds.optimizer.params.lr": 0.01}]
    for r in results:
        run_dir = out / r["name"]
        lr = json.loads((run_dir / "config.json").read_text())["ds_config"]["optimizer"]["params"]["lr"]
        assert lr == r["point"]["ds.optimizer.params.lr"]           # the point reached the run
        logged = rows(run_dir)
        assert r["status"] == "ok" and r["steps"] == 6 and r["final_loss"] == logged[-1]["loss"]
    # 10x the learning rate learns faster in 6 steps (measured: 8.28 vs 7.73 final loss)
    assert results[1]["final_loss"] < results[0]["final_loss"] - 0.2, results
    table = (out / "results.md").read_text().splitlines()
    assert table[2].startswith("| run001 | 0.01 |") and table[3].startswith("| run000 | 0.001 |")
    assert (out / "training.png").stat().st_size > 10_000


def test_bad_points_are_refused_before_any_run(tmp_path):
    out = tmp_path / "sweep"
    proc = _sweep("--grid", "train.seed=1,2", "--grid", "model.num_heads=3", "--out", str(out),
                  "--set", *SMALL)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    line, = proc.stderr.strip().splitlines()
    assert line.startswith("error: run000 (train.seed=1 model.num_heads=3): ") and "num_heads" in line
    assert not out.exists()
    proc = _sweep("--grid", "train.seed", "--out", str(out))
    assert proc.returncode == 2 and proc.stderr.startswith("error: --grid 'train.seed': expected")


def test_wandb_sweep_file(tmp_path):
    path = tmp_path / "sweep.yaml"
    proc = _sweep("--grid", "ds.optimizer.params.lr=1e-3,3e-3", "--grid", "train.seed=1,2",
                  "--random", "3", "--steps", "100", "--set", "eval.every=50", "--wandb-sweep", str(path))
    assert proc.returncode == 0, proc.stderr
    spec = yaml.safe_load(path.read_text())
    assert spec["method"] == "random" and spec["run_cap"] == 3
    assert spec["parameters"] == {"ds.optimizer.params.lr": {"values": [0.001, 0.003]},
                                  "train.seed": {"values": [1, 2]}}
    assert spec["command"][:2] == ["bash", "-c"] and spec["command"][-1] == "${args_no_hyphens}"
    script = spec["command"][2]
    assert script.startswith("exec python launch/train.py --config ds_configs/zero1_fp32.json --steps 100")
    assert '--run-dir "runs/sweep-$WANDB_SWEEP_ID/$WANDB_RUN_ID"' in script
    assert script.endswith('--set tracking.wandb=true eval.every=50 "$@"')
    # What the agent runs: the point's keys reach the trainer as --set values.
    argv = subprocess.run(["bash", "-c", script.replace("exec python launch/train.py", "printf '%s\\n'"),
                           "sweep", "train.seed=2", "ds.optimizer.params.lr=0.003"],
                          env={"WANDB_SWEEP_ID": "s1", "WANDB_RUN_ID": "r1", "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True).stdout.split()
    assert argv[argv.index("--run-dir") + 1] == "runs/sweep-s1/r1"
    assert argv[-3:] == ["eval.every=50", "train.seed=2", "ds.optimizer.params.lr=0.003"]


def test_trainer_set_reaches_deepspeed_keys(tmp_path):
    """``--set ds.<key>=value`` overrides the JSON (1e-3 is a number, not YAML 1.1's string),
    and a key path through a value is one line, exit 2."""
    sys.path.insert(0, str(REPO))
    from launch import train
    from training.run.preflight import prepare
    plan = prepare(train.parse_args(["--config", CONFIG, "--run-dir", str(tmp_path / "r"),
                                           "--set", "ds.optimizer.params.lr=1e-3",
                                           "ds.zero_optimization.reduce_bucket_size=5e7"]))
    assert plan.ds["optimizer"]["params"]["lr"] == 0.001
    assert plan.ds["zero_optimization"]["reduce_bucket_size"] == 5e7
    proc = subprocess.run([sys.executable, "launch/train.py", "--config", CONFIG, "--run-dir",
                           str(tmp_path / "r"), "--set", "ds.gradient_clipping.max=1"],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: --set 'ds.gradient_clipping.max=1': DeepSpeed key gradient_clipping is a value, "
        "not a section: set it directly"], proc.stderr
