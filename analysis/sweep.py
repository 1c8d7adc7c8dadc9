"""Hyperparameter sweeps over recipe keys and DeepSpeed JSON keys (``launch/sweep.py``).

A sweep is a grid of ``KEY=V1,V2,...`` (recipe keys as in ``--set``, DeepSpeed keys with a
``ds.`` prefix), run whole or as a random sample of its points, one ``launch/train.py`` after
another; or handed to W&B as a sweep file whose agent runs the same command. Each point's run
directory holds its own ``config.json`` and ``metrics.jsonl``; the sweep collects the final and
best losses into ``results.json``, ``results.md`` and plots.
"""

from __future__ import annotations

import itertools
import json
import random
import shlex
from pathlib import Path

from training.config.recipe import parse_value


def parse_grid(items: list[str]) -> dict[str, list]:
    """``["train.seed=1,2", "ds.optimizer.params.lr=1e-3,3e-3"]`` -> {key: [values]}, each value
    parsed as YAML; ValueError (one line) on a malformed item or a repeated key."""
    grid: dict[str, list] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip() or not text.strip():
            raise ValueError(f"--grid {item!r}: expected KEY=V1,V2,..., e.g. "
                             f"ds.optimizer.params.lr=3e-4,1e-3")
        if key in grid:
            raise ValueError(f"--grid {key} is given twice: list all its values in one --grid")
        grid[key] = [parse_value(value) for value in text.split(",")]
    if not grid:
        raise ValueError("no --grid given: name at least one KEY=V1,V2,... to sweep")
    return grid


def points(grid: dict[str, list], sample: int | None = None, seed: int = 0) -> list[dict]:
    """Every combination of the grid in order, or ``sample`` of them drawn without replacement
    (random search over the listed values, reproducible from ``seed``)."""
    combos = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
    if sample is None or sample >= len(combos):
        return combos
    if sample < 1:
        raise ValueError(f"--random {sample}: must be >= 1")
    return random.Random(seed).sample(combos, sample)


def settings(point: dict) -> list[str]:
    """A point as ``--set`` arguments (YAML text of each value)."""
    return [f"{key}={json.dumps(value) if isinstance(value, (list, dict, bool)) or value is None else value}"
            for key, value in point.items()]


def collect(run_dir: Path) -> dict:
    """Final loss, final and best eval loss and mean tokens/s of a finished run."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    return {"steps": train[-1]["step"], "final_loss": train[-1]["loss"],
            "final_eval_loss": evals[-1] if evals else None,
            "best_eval_loss": min(evals) if evals else None,
            "tokens_per_s": sum(r["tokens_per_s"] for r in train) / len(train)}


def table(results: list[dict]) -> str:
    """Markdown table of the results, best first (by best eval loss, else final loss)."""
    keys = sorted({k for r in results for k in r["point"]})
    done = sorted((r for r in results if r["status"] == "ok"),
                  key=lambda r: (r["best_eval_loss"] is None, r["best_eval_loss"] or 0, r["final_loss"]))
    lines = ["| run | " + " | ".join(keys) + " | final loss | best eval loss | tokens/s |",
             "|---|" + "---|" * len(keys) + "---:|---:|---:|"]
    for r in done + [r for r in results if r["status"] != "ok"]:
        cells = [str(r["point"].get(k, "")) for k in keys]
        if r["status"] == "ok":
            best = "-" if r["best_eval_loss"] is None else f"{r['best_eval_loss']:.4f}"
            tail = [f"{r['final_loss']:.4f}", best, f"{r['tokens_per_s']:,.0f}"]
        else:
            tail = [r["status"], "-", "-"]
        lines.append(f"| {r['name']} | " + " | ".join(cells + tail) + " |")
    return "\n".join(lines) + "\n"


def wandb_sweep(grid: dict[str, list], config: str, recipe: str | None, steps: int | None,
                fixed: list[str], sample: int | None) -> dict:
    """A W&B sweep definition whose agent runs ``launch/train.py`` with each point as ``--set``
    arguments (``${args_no_hyphens}`` expands to ``key=value ...``), each run in its own run
    directory ``runs/sweep-<sweep id>/<run id>`` (the agent sets both ids in the environment)."""
    train = ["python", "launch/train.py", "--config", config]
    train += ["--recipe", recipe] if recipe else []
    train += ["--steps", str(steps)] if steps else []
    script = (f"exec {shlex.join(train)} --run-dir \"runs/sweep-$WANDB_SWEEP_ID/$WANDB_RUN_ID\" "
              f"--set {shlex.join(['tracking.wandb=true', *fixed])} \"$@\"")
    command = ["bash", "-c", script, "sweep", "${args_no_hyphens}"]
    return {"program": "launch/train.py", "method": "random" if sample else "grid",
            **({"run_cap": sample} if sample else {}),
            "metric": {"name": "eval_loss", "goal": "minimize"},
            "parameters": {key: {"values": values} for key, values in grid.items()},
            "command": command}
