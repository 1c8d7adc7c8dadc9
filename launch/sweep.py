"""Sweep hyperparameters: a grid (or a random sample of it) over recipe and DeepSpeed JSON keys.

    python launch/sweep.py --config ds_configs/zero1_fp32.json [--recipe R] \\
        --grid ds.optimizer.params.lr=3e-4,1e-3,3e-3 --grid train.seed=1,2 \\
        [--random N] [--steps N] [--set KEY=VALUE ...] [--nproc K] [--out DIR]
    python launch/sweep.py ... --wandb-sweep sweep.yaml     # write a W&B sweep file instead

Each point runs ``launch/train.py`` in ``DIR/<run>`` with the point's keys as ``--set`` (DeepSpeed
keys with the ``ds.`` prefix), one after another; every point is validated before the first
starts. Writes ``DIR/results.json``, ``DIR/results.md`` (best first) and ``DIR/training.png`` (all
runs' curves, ``analysis/run_plots.py``). A failed run is recorded and the sweep goes on. Bad
input is one line and exit code 2. See ``analysis/sweep.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from analysis import run_plots, sweep  # noqa: E402
from launch import train  # noqa: E402
from training.run.preflight import prepare  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="DeepSpeed JSON every run starts from")
    p.add_argument("--recipe", help="recipe YAML (default: the trainer's)")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,...",
                   help="a key and its values; repeat for more keys (ds. prefix: DeepSpeed JSON)")
    p.add_argument("--random", type=int, help="run this many points drawn from the grid")
    p.add_argument("--seed", type=int, default=0, help="seed of --random's draw")
    p.add_argument("--steps", type=int, help="--steps of every run")
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="fixed overrides for every run")
    p.add_argument("--nproc", type=int, default=1, help="ranks per run (torchrun for > 1)")
    p.add_argument("--out", default="runs/sweep", help="the sweep's directory")
    p.add_argument("--wandb-sweep", metavar="FILE", help="write a W&B sweep file and exit")
    return p.parse_args(argv)


def _train_argv(args, point: dict, run_dir: Path) -> list[str]:
    argv = ["--config", args.config, "--run-dir", str(run_dir)]
    argv += ["--recipe", args.recipe] if args.recipe else []
    argv += ["--steps", str(args.steps)] if args.steps else []
    return argv + ["--set", *args.set, *sweep.settings(point)]


def _validate(args, runs: list[tuple[str, dict]], out: Path) -> None:
    """The trainer's own up-front checks for every point (no process group, no file written)."""
    world = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(args.nproc)
    try:
        for name, point in runs:
            try:
                prepare(train.parse_args(_train_argv(args, point, out / name)))
            except (ValueError, FileNotFoundError) as err:
                raise ValueError(f"{name} ({' '.join(sweep.settings(point))}): {err}") from None
    finally:
        if world is None:
            os.environ.pop("WORLD_SIZE")
        else:
            os.environ["WORLD_SIZE"] = world


def _run(args, name: str, point: dict, out: Path) -> dict:
    run_dir = out / name
    prefix = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(args.nproc)] if args.nproc > 1 else [sys.executable])
    cmd = prefix + [str(REPO / "launch" / "train.py"), *_train_argv(args, point, run_dir)]
    start = time.time()
    with open(out / f"{name}.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    row = {"name": name, "point": point, "run_dir": str(run_dir), "seconds": time.time() - start}
    if rc != 0:
        return {**row, "status": f"failed (exit {rc}, see {name}.log)"}
    return {**row, "status": "ok", **sweep.collect(run_dir)}


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    try:
        if args.nproc < 1:
            raise ValueError(f"--nproc {args.nproc}: must be >= 1")
        grid = sweep.parse_grid(args.grid)
        if args.wandb_sweep:
            spec = sweep.wandb_sweep(grid, args.config, args.recipe, args.steps, args.set, args.random)
            Path(args.wandb_sweep).write_text(yaml.safe_dump(spec, sort_keys=False))
            print(f"wrote {args.wandb_sweep}: run `wandb sweep {args.wandb_sweep}`, then "
                  f"`wandb agent <the sweep id it prints>` on each machine")
            return 0
        runs = [(f"run{i:03d}", p) for i, p in enumerate(sweep.points(grid, args.random, args.seed))]
        _validate(args, runs, out)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for i, (name, point) in enumerate(runs, 1):
        row = _run(args, name, point, out)
        results.append(row)
        summary = row["status"]
        if row["status"] == "ok":
            best = row["best_eval_loss"]
            summary = f"final loss {row['final_loss']:.4f}" + (f", best eval {best:.4f}" if best else "")
        print(f"[{i}/{len(runs)}] {name} {' '.join(sweep.settings(point))}: {summary} "
              f"({row['seconds']:.0f} s)", flush=True)
        (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(sweep.table(results))
    done = {r["name"]: run_plots.read_metrics(Path(r["run_dir"])) for r in results if r["status"] == "ok"}
    if done:
        run_plots.plot_training(done, out)
    print(sweep.table(results), end="")
    return 0 if done else 1


if __name__ == "__main__":
    sys.exit(main())
