"""Which hyperparameters matter at this scale: one at a time x1/4, x1/2, x2, x4 around a baseline,
the change in the final eval loss against the baseline's seed-to-seed spread.

    OMP_NUM_THREADS=1 python -m benchmarks.studies.sensitivity_study --out runs/sensitivity   # 39 runs

39 runs took 40.4 min on 2 cores (Intel Xeon with AMX-BF16) shared with other jobs (load average
15-19); on a free core a step takes 0.16 s (6,600 tokens/s, 1 thread).

The baseline is ``recipes/tiny_switch.yaml`` (8 experts, top-1, capacity factor 1.25: the tiny
recipe in which every knob below is in use) on ``ds_configs/zero1_fp32.json``, one process per
run, 120 steps, run with seeds 1, 2 and 3; every other point changes one hyperparameter and runs
with seed 1. Each hyperparameter's baseline value is read from the recipe and the JSON as the
trainer resolves them (``training/run/preflight.py``), and multiplied:

* ``lr`` (``ds.optimizer.params.lr``), ``weight_decay``, ``init_std`` (``model.init_std``),
  ``aux_loss_coef``, ``z_loss_coef``, ``capacity_factor`` (``model.moe.*``): the value x m.
* ``beta2``: the multiplier scales 1 - beta2 (the averaging horizon 1 / (1 - beta2) divided by m),
  not beta2 itself, which x2 would push past 1: 0.95 -> 0.9875, 0.975, 0.9, 0.8.
* ``warmup`` (``ds.scheduler.params.warmup_num_steps``, "auto" = 5% of the run) and ``batch``
  (``ds.train_micro_batch_size_per_gpu``, the global batch at one process and no accumulation):
  rounded half up to an integer, at least 1. The batch changes at a fixed step count, so the
  tokens seen change with it (x4 trains on 4x the tokens) and the lr stays the JSON's (no
  ``lr_scaling``). ``eval.batches`` is set so that every run evaluates the same 64 windows.

The measure is the eval loss at the last step (the same held-out windows for every run; eval
uses the recipe's ``eval_capacity_factor``, 2.0, whatever the training capacity), with the mean
training loss of the last 20 steps beside it. A hyperparameter is **critical** where some
multiplier moves the eval loss from the baseline's seed mean by more than the seed spread
(max - min over the 3 seeds), and **robust at this scale** otherwise; a run that fails is
critical. Every run goes through ``launch/sweep.py`` (one sweep per hyperparameter; a sweep whose
``results.json`` already holds all its points, ok, is reused; the runs live under ``DIR/runs``).
Writes ``sensitivity.json`` into ``--results`` (default ``benchmarks/studies/results/``) and
``sensitivity.png`` (change in eval loss vs multiplier, one line per hyperparameter, the spread
shaded) into ``--figures`` (default ``docs/studies/img/``) and prints the table; progress is one
line per run (the sweep's) and one per hyperparameter with the elapsed time and an ETA.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from benchmarks import add_output_args, output_dirs

REPO = Path(__file__).resolve().parents[2]

CONFIG = "ds_configs/zero1_fp32.json"
RECIPE = "recipes/tiny_switch.yaml"
MULTIPLIERS = (0.25, 0.5, 2.0, 4.0)
SEEDS = (1, 2, 3)
TAIL = 20                   # training steps averaged for the final training loss
# hyperparameter -> the key it is read from (after the trainer's resolution) and set through
KEYS = {
    "lr": "ds.optimizer.params.lr",
    "warmup": "ds.scheduler.params.warmup_num_steps",
    "weight_decay": "ds.optimizer.params.weight_decay",
    "beta2": "ds.optimizer.params.betas",
    "init_std": "model.init_std",
    "batch": "ds.train_micro_batch_size_per_gpu",
    "aux_loss_coef": "model.moe.aux_loss_coef",
    "z_loss_coef": "model.moe.z_loss_coef",
    "capacity_factor": "model.moe.capacity_factor",
}
INTEGER = ("warmup", "batch")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the study's directory: its runs")
    add_output_args(p, "studies")
    p.add_argument("--steps", type=int, default=120, help="steps of every run")
    p.add_argument("--hparams", nargs="+", default=list(KEYS), metavar="NAME",
                   help=f"the hyperparameters to vary (default all: {' '.join(KEYS)})")
    p.add_argument("--multipliers", nargs="+", type=float, default=list(MULTIPLIERS))
    p.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS), help="the baseline's seeds")
    return p.parse_args(argv)


def _round_half_up(x: float) -> int:
    return max(1, math.floor(x + 0.5))


def _clean(x: float) -> float:
    return float(f"{x:.6g}")        # 6e-4 * 0.25 -> 0.00015, not 0.00015000000000000001


def baseline_values(steps: int) -> dict:
    """Each hyperparameter's baseline value as the trainer resolves recipe and JSON ("auto" filled),
    plus what ``apply`` needs besides: beta1 and the eval windows (eval.batches x micro batch)."""
    from training.run.preflight import plan_for
    plan = plan_for(CONFIG, RECIPE, steps=steps)
    opt, moe = plan.ds["optimizer"]["params"], plan.recipe.model.moe
    return {"lr": opt["lr"], "warmup": plan.ds["scheduler"]["params"]["warmup_num_steps"],
            "weight_decay": opt["weight_decay"], "beta2": opt["betas"][1], "beta1": opt["betas"][0],
            "init_std": plan.recipe.model.init_std, "batch": plan.ds["train_micro_batch_size_per_gpu"],
            "aux_loss_coef": moe.aux_loss_coef, "z_loss_coef": moe.z_loss_coef,
            "capacity_factor": moe.capacity_factor,
            "eval_windows": plan.recipe.eval.batches * plan.ds["train_micro_batch_size_per_gpu"]}


def apply(name: str, base: dict, m: float) -> dict:
    """The ``--set`` keys (as ``{key: value}``) of hyperparameter ``name`` at multiplier ``m``.

    beta2 scales 1 - beta2; warmup and batch round half up to an integer >= 1; batch also sets
    ``eval.batches`` so that the eval covers the baseline's windows (rounded up where the micro
    batch does not divide them). ValueError (one line) for an unknown name or a value the
    trainer would refuse."""
    if name not in KEYS:
        raise ValueError(f"--hparams {name}: not a hyperparameter of this study; use {' '.join(KEYS)}")
    if not m > 0:
        raise ValueError(f"--multipliers {m}: must be > 0")
    value = base[name]
    if value is None:
        raise ValueError(f"{name}: the baseline has none (dropless routing); use a recipe with "
                         f"model.moe.capacity_factor set")
    key = KEYS[name]
    if name == "beta2":
        beta2 = 1.0 - (1.0 - value) * m
        if not 0.0 <= beta2 < 1.0:
            raise ValueError(f"--multipliers {m}: 1 - beta2 = {1 - value:g} x {m:g} leaves beta2 = "
                             f"{beta2:g} outside [0, 1); use a smaller multiplier")
        return {key: [base["beta1"], _clean(beta2)]}
    if name == "batch":
        micro = _round_half_up(value * m)
        return {key: micro, "eval.batches": -(-base["eval_windows"] // micro)}
    if name in INTEGER:
        return {key: _round_half_up(value * m)}
    return {key: _clean(value * m)}


def verdict(deltas: dict[float, float | None], spread: float) -> dict:
    """Critical where some |delta| exceeds the seed spread (or a run failed: delta None), else
    robust at this scale; with the worst multiplier and |delta| / spread there."""
    failed = [m for m, d in deltas.items() if d is None]
    if failed:
        return {"verdict": "critical", "worst_multiplier": failed[0], "worst_delta": None,
                "ratio_to_spread": None, "failed": failed}
    worst = max(deltas, key=lambda m: abs(deltas[m]))
    ratio = abs(deltas[worst]) / spread if spread > 0 else math.inf
    return {"verdict": "critical" if abs(deltas[worst]) > spread else "robust at this scale",
            "worst_multiplier": worst, "worst_delta": deltas[worst],
            "ratio_to_spread": None if math.isinf(ratio) else ratio, "failed": []}


def summarize(baseline: list[float], points: dict[str, dict[float, float | None]]) -> dict:
    """``baseline``: the baseline's eval loss per seed; ``points``: {hyperparameter: {multiplier:
    eval loss, None for a failed run}}. Returns the baseline's mean and spread (max - min) and per
    hyperparameter the change from the mean at each multiplier and the verdict."""
    if len(baseline) < 2:
        raise ValueError("the baseline needs 2 or more seeds for a spread: give --seeds 1 2 3")
    mean, spread = statistics.mean(baseline), max(baseline) - min(baseline)
    out = {}
    for name, losses in points.items():
        deltas = {m: None if loss is None else loss - mean for m, loss in losses.items()}
        out[name] = {"deltas": deltas, **verdict(deltas, spread)}
    return {"baseline_mean": mean, "baseline_spread": spread, "hparams": out}


def run_summary(row: dict) -> dict:
    """Final eval loss, mean training loss of the last TAIL steps, and whether the loss stayed
    finite, of one sweep result row; eval_loss None for a failed run."""
    if row["status"] != "ok":
        return {"eval_loss": None, "train_loss": None, "status": row["status"], "seconds": row.get("seconds")}
    rows = [json.loads(line) for line in (Path(row["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    train = [r["loss"] for r in rows if "loss" in r]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    final = evals[-1] if evals and math.isfinite(evals[-1]) else None
    return {"eval_loss": final, "train_loss": statistics.mean(train[-TAIL:]), "status": "ok",
            "seconds": row.get("seconds")}


def _sweep(out: Path, steps: int, grid: list[str], sets: list[str], expected: int) -> list[dict]:
    """One ``launch/sweep.py`` run (or its results, when all ``expected`` points are there, ok)."""
    done = out / "results.json"
    if done.exists():
        rows = json.loads(done.read_text())
        if len(rows) == expected and all(r["status"] == "ok" for r in rows):
            print(f"reusing {done}", flush=True)
            return rows
    from launch import sweep
    common = [f"eval.every={steps}", "train.save_every=0", "train.log_every=20"]
    sweep.main(["--config", CONFIG, "--recipe", RECIPE, "--steps", str(steps), "--out", str(out),
                *sum((["--grid", g] for g in grid), []), "--set", *common, *sets])
    return json.loads(done.read_text()) if done.exists() else []


def _settings(d: dict) -> list[str]:
    from analysis.sweep import settings
    return settings(d)


def _cpu() -> str:
    """The CPU's model name, its bf16 instructions where it has them, and the cores."""
    import os
    import platform
    name, flags = platform.processor() or "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    bf16 = [label for flag, label in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16")) if flag in flags]
    return name + (f" with {'/'.join(bf16)}" if bf16 else "") + f", {os.cpu_count()} cores"


def plot(summary: dict, multipliers: list[float], title: str, path: Path, seeds: list[float] = ()) -> None:
    """Change in eval loss vs multiplier, one line per hyperparameter (through 0 at x1, the seed
    mean), the band of +-spread shaded, the baseline's seeds as grey dots at x1."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    spread = summary["baseline_spread"]
    xs = sorted({*multipliers, 1.0})
    fig, ax = plt.subplots(figsize=(9, 5.5))
    ax.axhspan(-spread, spread, color="0.85", label=f"seed spread ±{spread:.4f} (inside: robust)")
    ax.axhline(0, color="0.5", linewidth=0.8)
    markers = "os^vDP*Xh"
    worst = max((abs(d) for h in summary["hparams"].values() for d in h["deltas"].values() if d is not None),
                default=spread)
    for i, (name, h) in enumerate(summary["hparams"].items()):
        ys = [0.0 if x == 1.0 else h["deltas"].get(x) for x in xs]
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
        tag = "critical" if h["verdict"] == "critical" else "robust"
        ax.plot(*zip(*pts), marker=markers[i % len(markers)], linewidth=1.4,
                color=plt.cm.tab10(i % 10), label=f"{name} ({tag})")
    if seeds:
        mean = statistics.mean(seeds)
        ax.plot([1.0] * len(seeds), [x - mean for x in seeds], "o", color="0.3", markersize=4,
                label=f"baseline seeds ({len(seeds)})", zorder=5)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"x{x:g}" if x >= 1 else f"x1/{1 / x:g}" for x in xs])
    if worst > 20 * spread > 0:         # a diverging knob would flatten every other line
        ax.set_yscale("symlog", linthresh=2 * spread)
        ticks = [t for t in (0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5) if t <= 2 * worst]
        ax.set_yticks([-t for t in ticks[::-1]] + [0] + ticks, [f"{-t:g}" for t in ticks[::-1]] + ["0"]
                      + [f"+{t:g}" for t in ticks])
    ax.set_xlabel("multiplier of the baseline value (beta2: of 1 - beta2)")
    ax.set_ylabel("change in final eval loss vs the baseline's seed mean")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, ncol=2, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.steps < 1:
            raise ValueError(f"--steps {args.steps}: must be >= 1")
        base = baseline_values(args.steps)
        plans = {name: {m: apply(name, base, m) for m in args.multipliers} for name in args.hparams}
        if len(set(args.seeds)) < 2:
            raise ValueError("--seeds: give 2 or more distinct seeds (the baseline's spread)")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    results, figures = output_dirs(args, "studies")
    # a run's cost in baseline runs: its batch over the baseline's (steps are fixed)
    cost = {name: sum(p.get(KEYS["batch"], base["batch"]) / base["batch"] for p in pts.values())
            for name, pts in plans.items()}
    total, done_cost, start = len(args.seeds) + sum(cost.values()), 0.0, time.time()
    seed = args.seeds[0]

    rows = _sweep(args.out / "runs" / "baseline", args.steps,
                  ["train.seed=" + ",".join(map(str, args.seeds))], [], len(args.seeds))
    baseline_runs = {r["point"]["train.seed"]: run_summary(r) for r in rows}
    done_cost += len(args.seeds)
    runs: dict[str, dict[float, dict]] = {}
    for i, (name, pts) in enumerate(plans.items(), 1):
        elapsed = time.time() - start
        print(f"== {name} ({i}/{len(plans)}): {done_cost:.1f}/{total:.1f} run-equivalents done, "
              f"{elapsed / 60:.1f} min, ETA {elapsed / done_cost * (total - done_cost) / 60:.1f} min",
              flush=True)
        out = args.out / "runs" / name
        single = all(len(s) == 1 and not isinstance(next(iter(s.values())), list) for s in pts.values())
        runs[name] = {}
        if single:      # one grid over the one key
            rows = _sweep(out, args.steps, [f"{KEYS[name]}=" + ",".join(str(s[KEYS[name]]) for s in pts.values())],
                          [f"train.seed={seed}"], len(pts))
            by_value = {json.dumps(r["point"][KEYS[name]]): r for r in rows}
            for m, s in pts.items():
                row = by_value.get(json.dumps(s[KEYS[name]]))
                runs[name][m] = run_summary(row) if row else {"eval_loss": None, "status": "not run"}
        else:           # a list value or two coupled keys: one sweep per point
            for m, s in pts.items():
                rows = _sweep(out / f"x{m:g}", args.steps, [f"train.seed={seed}"], _settings(s), 1)
                runs[name][m] = run_summary(rows[0]) if rows else {"eval_loss": None, "status": "not run"}
        done_cost += cost[name]

    base_losses = [r["eval_loss"] for r in baseline_runs.values()]
    if any(x is None for x in base_losses):
        print(f"error: a baseline run failed: {baseline_runs}", file=sys.stderr)
        return 1
    summary = summarize(base_losses, {n: {m: r["eval_loss"] for m, r in rs.items()} for n, rs in runs.items()})
    cpu = _cpu()
    result = {
        "command": "OMP_NUM_THREADS=1 python -m benchmarks.studies.sensitivity_study " + " ".join(argv or sys.argv[1:]),
        "cpu": cpu, "recipe": RECIPE, "config": CONFIG, "steps": args.steps, "seeds": args.seeds,
        "point_seed": seed, "this_call_s": round(time.time() - start),
        "runs_s": round(sum(r.get("seconds") or 0 for r in [*baseline_runs.values(),
                                                             *(x for rs in runs.values() for x in rs.values())])),
        "metric": "eval loss at the last step (64 held-out windows of 128 tokens)",
        "baseline_values": base, "keys": {n: KEYS[n] for n in plans},
        "baseline_runs": {str(s): r for s, r in baseline_runs.items()},
        "baseline_mean": summary["baseline_mean"], "baseline_spread": summary["baseline_spread"],
        "hparams": {n: {**summary["hparams"][n],
                        "deltas": {f"{m:g}": d for m, d in summary["hparams"][n]["deltas"].items()},
                        "settings": {f"{m:g}": plans[n][m] for m in plans[n]},
                        "runs": {f"{m:g}": r for m, r in runs[n].items()}} for n in plans},
    }
    (results / "sensitivity.json").write_text(json.dumps(result, indent=1))
    plot(summary, args.multipliers, f"{RECIPE}, {CONFIG}, {args.steps} steps, one change at a time "
         f"(seed {seed}): final eval loss\n{cpu}",
         figures / "sensitivity.png", base_losses)
    print(f"baseline eval loss {summary['baseline_mean']:.4f}, seed spread {summary['baseline_spread']:.4f} "
          f"(seeds {' '.join(map(str, args.seeds))}); change per multiplier:")
    print("| hyperparameter | " + " | ".join(f"x{m:g}" for m in args.multipliers) + " | verdict | worst / spread |")
    for n, h in summary["hparams"].items():
        cells = ["failed" if d is None else f"{d:+.4f}" for d in h["deltas"].values()]
        ratio = "-" if h["ratio_to_spread"] is None else f"{h['ratio_to_spread']:.1f}x"
        print(f"| {n} | " + " | ".join(cells) + f" | {h['verdict']} | {ratio} |")
    print(f"wrote {results / 'sensitivity.json'} and {figures / 'sensitivity.png'} "
          f"(runs {result['runs_s'] / 60:.1f} min, this call {result['this_call_s'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
