"""Multi-token prediction (MTP) against none on the same tokens: does the main head get better?

Tiny DeepSeek-V3 (``recipes/tiny_deepseek_v3.yaml``: MLA, DeepSeek's MoE) with ``model.mtp_depth``
0, 1 and 2 (``model.mtp_loss_coef`` 0.3, the recipe's), three seeds, through ``launch/sweep.py``
with ``--grid train.seed=... --grid model.mtp_depth=...``: a seed's arms run back to back (their
step times are measured under the same load) and share ``train.seed``, so they start from the
same main-model weights (the MTP modules are built after it; ``model/transformer.py``) and see
the same batches in the same order. Only the objective differs: the main head's cross-entropy,
plus ``coef / D`` x the depths' (``model/mtp.py``).

    OMP_NUM_THREADS=1 python -m benchmarks.studies.mtp_study --out DIR     # 9 runs x 600 steps, ~27 min

One process per run, fp32 ZeRO-1 (``ds_configs/zero1_fp32.json``), 600 steps of 8 x 128 tokens
(under one epoch of the recipe's 4 MB), held-out eval every 50 steps on 16 batches (the main head
only: MTP is off in evaluation). Per run, from ``metrics.jsonl``: the main head's training
``loss`` (MTP's loss is not in it) and ``eval_loss`` against the step, each MTP depth's
``mtp_loss``, the median ``step_time_s`` (steps after the first 10), the tokens. Per arm: the
final eval loss (last evaluation) and the final training loss (mean of the last 50 steps) over the
seeds (mean, spread = max - min, per seed); per seed, each MTP arm minus the no-MTP arm (paired)
and its median step time over the no-MTP one's. An arm's effect counts as measured only when
every seed's paired difference has the same sign and the mean difference exceeds the larger of
the two arms' seed spreads (with one seed, never); otherwise the JSON says ``within noise``.
Writes ``mtp.json`` into ``--results`` (default ``benchmarks/studies/results/``) and ``mtp.png``
into ``--figures`` (default ``docs/studies/img/``); prints one table. Runs live under
``DIR/sweep`` (checkpoints deleted).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import add_output_args, output_dirs

REPO = Path(__file__).resolve().parents[2]

RECIPE = "recipes/tiny_deepseek_v3.yaml"
CONFIG = "ds_configs/zero1_fp32.json"
TAIL = 50            # steps averaged for the final training losses
SKIP = 10            # first steps left out of the median step time (allocator, caches)
SMOOTH = 25          # moving-average window of the plotted training curves


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the study's folder: its runs")
    add_output_args(p, "studies")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--depths", nargs="+", type=int, default=[0, 1, 2], help="model.mtp_depth values "
                   "(the first is the control the others are paired with)")
    p.add_argument("--coef", default="0.3", help="model.mtp_loss_coef of the MTP arms")
    p.add_argument("--seeds", nargs="+", default=["1", "2", "3"], help="train.seed values")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--report-only", action="store_true", help="no runs: the JSON, figure and table "
                   "again from the finished runs in DIR/sweep (same options as the study)")
    return p.parse_args(argv)


def machine() -> str:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        name, lscpu = platform.processor() or "unknown CPU", ""
    flags = [f for f in ("AMX-BF16", "AVX512-BF16") if f.lower().replace("-", "_") in lscpu]
    return f"{name}{' with ' + '/'.join(flags) if flags else ''}, {os.cpu_count()} cores"


def smooth(values: list[float], window: int = SMOOTH) -> list[float]:
    """Trailing moving average (shorter windows at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def run_curves(run_dir: Path) -> dict:
    """One run's curves and final values from its ``metrics.jsonl``."""
    from analysis import run_plots
    train, evals = run_plots.read_metrics(run_dir)
    depth = len(train[-1].get("mtp_loss") or [])
    tail = train[-TAIL:]
    return {"steps": [r["step"] for r in train], "loss": [r["loss"] for r in train],
            "mtp_loss": [[r["mtp_loss"][k] for r in train] for k in range(depth)],
            "eval_steps": [r["step"] for r in evals], "eval_loss": [r["eval_loss"] for r in evals],
            "first_loss": train[0]["loss"], "tokens": train[-1]["tokens"],
            "final_eval_loss": evals[-1]["eval_loss"] if evals else None,
            "final_loss": statistics.mean(r["loss"] for r in tail),
            "final_mtp_loss": [statistics.mean(r["mtp_loss"][k] for r in tail) for k in range(depth)],
            "step_time_s": statistics.median(r["step_time_s"] for r in (train[SKIP:] or train))}


def _stat(values: list[float]) -> dict:
    return {"mean": statistics.mean(values), "spread": max(values) - min(values), "per_seed": values}


def model_facts(depth: int, coef: str) -> dict:
    from training.config.recipe import load_recipe
    from model.flops import train_flops_per_token
    recipe = load_recipe(str(REPO / RECIPE), [f"model.mtp_depth={depth}", f"model.mtp_loss_coef={coef}"])
    cfg = recipe.model
    return {"total_params": cfg.num_params(), "active_params": cfg.num_params(active=True),
            "train_flops_per_token": train_flops_per_token(cfg, recipe.seq_len)}


def summarize(runs: dict[tuple[int, str], dict], depths: list[int], seeds: list[str], coef: str) -> dict:
    """Per arm (depth): model facts, final eval and train losses, MTP losses and step time over
    the seeds; per MTP arm, per seed, its value minus the control's and its step-time ratio."""
    arms = {}
    for d in depths:
        rs = [runs[(d, s)] for s in seeds]
        arms[str(d)] = {**model_facts(d, coef), "tokens": rs[0]["tokens"],
                        "final_eval_loss": _stat([r["final_eval_loss"] for r in rs]),
                        "final_loss": _stat([r["final_loss"] for r in rs]),
                        "final_mtp_loss": [_stat([r["final_mtp_loss"][k] for r in rs]) for k in range(d)],
                        "step_time_s": _stat([r["step_time_s"] for r in rs])}
    control, paired = depths[0], {}
    for d in depths[1:]:
        a, b = arms[str(control)], arms[str(d)]
        row = {}
        for key in ("final_eval_loss", "final_loss"):
            diff = [runs[(d, s)][key] - runs[(control, s)][key] for s in seeds]
            band = max(a[key]["spread"], b[key]["spread"])
            same_sign = all(x < 0 for x in diff) or all(x > 0 for x in diff)
            measured = len(seeds) > 1 and same_sign and abs(statistics.mean(diff)) > band
            row[key] = {"per_seed": diff, "mean": statistics.mean(diff), "min": min(diff), "max": max(diff),
                        "noise_band": band, "verdict": ("lower" if diff[0] < 0 else "higher") if measured
                        else "within noise"}
        ratio = [runs[(d, s)]["step_time_s"] / runs[(control, s)]["step_time_s"] for s in seeds]
        row["step_time_ratio"] = {"per_seed": ratio, "mean": statistics.mean(ratio), "min": min(ratio),
                                  "max": max(ratio)}
        row["flops_ratio"] = b["train_flops_per_token"] / a["train_flops_per_token"]
        row["first_loss_equal"] = all(runs[(d, s)]["first_loss"] == runs[(control, s)]["first_loss"]
                                      for s in seeds)
        paired[f"{d} - {control}"] = row
    return {"arms": arms, "paired": paired}


def plot(runs: dict[tuple[int, str], dict], depths: list[int], seeds: list[str], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.4))
    (ev, tr), (mt, df) = axes
    for i, d in enumerate(depths):
        colour = f"C{i}"
        rs = [runs[(d, s)] for s in seeds]
        n = min(len(r["eval_steps"]) for r in rs)
        for r in rs:
            ev.plot(r["eval_steps"], r["eval_loss"], color=colour, linewidth=0.7, alpha=0.6)
            tr.plot(r["steps"], smooth(r["loss"]), color=colour, linewidth=0.5, alpha=0.5)
        ev.plot(rs[0]["eval_steps"][:n], [statistics.mean(r["eval_loss"][j] for r in rs) for j in range(n)],
                color=colour, linewidth=2.2, marker="o", markersize=3, label=f"mtp_depth {d}")
        m = min(len(r["loss"]) for r in rs)
        tr.plot(rs[0]["steps"][:m], smooth([statistics.mean(r["loss"][j] for r in rs) for j in range(m)]),
                color=colour, linewidth=2.2, label=f"mtp_depth {d}")
        if d:
            mean_main = smooth([statistics.mean(r["loss"][j] for r in rs) for j in range(m)])
            mt.plot(rs[0]["steps"][:m], mean_main, color=colour, linewidth=1.6, label=f"mtp_depth {d}: main head")
            for k, style in zip(range(d), ("--", ":")):
                mt.plot(rs[0]["steps"][:m], smooth([statistics.mean(r["mtp_loss"][k][j] for r in rs)
                                                    for j in range(m)]),
                        color=colour, linewidth=1.6, linestyle=style, label=f"mtp_depth {d}: depth {k + 1}")
            for si, s in enumerate(seeds):
                a, b = runs[(depths[0], s)], runs[(d, s)]
                k = min(len(a["eval_loss"]), len(b["eval_loss"]))
                df.plot(b["eval_steps"][:k], [y - x for x, y in zip(a["eval_loss"][:k], b["eval_loss"][:k])],
                        color=colour, linestyle=("-", "--", ":", "-.")[si % 4], marker="o", markersize=3,
                        label=f"mtp_depth {d}, seed {s}")
    df.axhline(0.0, color="black", linewidth=0.8)
    titles = ("held-out eval loss, main head (thin: seeds, thick: mean)",
              f"training loss, main head ({SMOOTH}-step mean; thin: seeds)",
              f"MTP depths' training losses ({SMOOTH}-step mean over steps, mean over seeds)",
              f"eval loss minus mtp_depth {depths[0]}'s, same seed")
    for ax, title in zip(axes.flat, titles):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    for ax in (ev, tr, mt):
        ax.set_ylabel("cross-entropy (nats)")
    ev_lo = min(min(r["eval_loss"]) for r in runs.values())
    tr_lo = min(min(smooth(r["loss"])) for r in runs.values())
    ev.set_ylim(ev_lo - 0.1, ev_lo + 1.8)               # from about step 100 down
    tr.set_ylim(tr_lo - 0.1, tr_lo + 2.2)
    mt.set_ylim(tr_lo - 0.1, tr_lo + 2.2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sweep_dir = args.out / "sweep"
    results, _ = output_dirs(args, "studies")
    if args.report_only:                                  # the study's wall time, as first written
        rc, wall = 0, json.loads((results / "mtp.json").read_text())["wall_s"]
    else:
        from launch import sweep
        start = time.time()
        with contextlib.redirect_stdout(sys.stderr):      # the sweep's progress lines
            rc = sweep.main(["--config", CONFIG, "--recipe", RECIPE,
                             "--grid", "train.seed=" + ",".join(args.seeds),
                             "--grid", "model.mtp_depth=" + ",".join(map(str, args.depths)),
                             "--steps", str(args.steps),
                             "--set", f"model.mtp_loss_coef={args.coef}", f"eval.every={args.eval_every}",
                             f"eval.batches={args.eval_batches}", f"train.save_every={args.steps * 10}",
                             "train.log_every=50", "tracking.wandb=false", "--out", str(sweep_dir)])
        wall = time.time() - start
    results = json.loads((sweep_dir / "results.json").read_text()) if (sweep_dir / "results.json").is_file() else []
    failed = [f"{r['name']}: {r['status']}" for r in results if r["status"] != "ok"]
    if rc != 0 or failed or len(results) != len(args.seeds) * len(args.depths):
        print(f"error: runs failed ({'; '.join(failed) or f'exit {rc}'}; logs in {sweep_dir})", file=sys.stderr)
        return 1
    runs = {}
    for r in results:
        runs[(int(r["point"]["model.mtp_depth"]), str(r["point"]["train.seed"]))] = {
            **run_curves(Path(r["run_dir"])), "wall_s": r["seconds"]}
        shutil.rmtree(Path(r["run_dir"]) / "checkpoints", ignore_errors=True)
    report(args, runs, wall)
    return 0


def report(args: argparse.Namespace, runs: dict[tuple[int, str], dict], wall: float) -> dict:
    import torch
    summary = summarize(runs, args.depths, args.seeds, args.coef)
    every = max(1, args.steps // 100)          # the smoothed training curves, thinned for the JSON
    out = {"study": "mtp", "recipe": RECIPE, "config": CONFIG, "steps": args.steps, "depths": args.depths,
           "mtp_loss_coef": float(args.coef), "seeds": args.seeds,
           "eval": {"every": args.eval_every, "batches": args.eval_batches},
           "machine": machine(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d", time.gmtime()),
           "wall_s": wall, "runs_wall_s": sum(r["wall_s"] for r in runs.values()),
           "command": "OMP_NUM_THREADS=1 python -m " + " ".join(["benchmarks.studies.mtp_study",
                                                                 *(a for a in sys.argv[1:] if a != "--report-only")]),
           **summary,
           "runs": {f"depth{d}-seed{s}": {
               "tokens": r["tokens"], "first_loss": r["first_loss"], "final_loss": r["final_loss"],
               "final_eval_loss": r["final_eval_loss"], "final_mtp_loss": r["final_mtp_loss"],
               "step_time_s": r["step_time_s"], "wall_s": r["wall_s"],
               "eval_steps": r["eval_steps"], "eval_loss": r["eval_loss"],
               "smoothed_steps": r["steps"][every - 1::every],
               "smoothed_loss": smooth(r["loss"])[every - 1::every],
               "smoothed_mtp_loss": [smooth(c)[every - 1::every] for c in r["mtp_loss"]]}
               for (d, s), r in sorted(runs.items())}}
    results, figures = output_dirs(args, "studies")
    (results / "mtp.json").write_text(json.dumps(out, indent=1))
    plot(runs, args.depths, args.seeds, figures / "mtp.png")
    print(f"wrote {results / 'mtp.json'} and {figures / 'mtp.png'}", file=sys.stderr)
    print(f"{RECIPE}, mtp_loss_coef {args.coef}, {args.steps} steps, seeds {' '.join(args.seeds)}; "
          f"{out['machine']}; {wall:.0f} s")
    print("mtp_depth | final eval loss (spread) | final train loss (spread) | final MTP losses | "
          "step time s (spread) | tokens")
    for d, a in summary["arms"].items():
        mtp = ", ".join(f"{m['mean']:.4f} ({m['spread']:.4f})" for m in a["final_mtp_loss"]) or "-"
        print(f"{d} | {a['final_eval_loss']['mean']:.4f} ({a['final_eval_loss']['spread']:.4f}) | "
              f"{a['final_loss']['mean']:.4f} ({a['final_loss']['spread']:.4f}) | {mtp} | "
              f"{a['step_time_s']['mean']:.4f} ({a['step_time_s']['spread']:.4f}) | {a['tokens']:,}")
    print("per seed, minus the control: eval loss | train loss | step-time ratio (FLOPs ratio) -> verdict")
    for name, p in summary["paired"].items():
        e, t, r = p["final_eval_loss"], p["final_loss"], p["step_time_ratio"]
        print(f"{name} | {' '.join(f'{x:+.4f}' for x in e['per_seed'])} (band {e['noise_band']:.4f}) | "
              f"{' '.join(f'{x:+.4f}' for x in t['per_seed'])} (band {t['noise_band']:.4f}) | "
              f"{' '.join(f'{x:.3f}' for x in r['per_seed'])} ({p['flops_ratio']:.3f}) -> "
              f"eval {e['verdict']}, train {t['verdict']}")
    return out


if __name__ == "__main__":
    sys.exit(main())
