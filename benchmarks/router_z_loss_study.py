"""Router z-loss study: how large the router logits grow, and whether training spikes, with the
z-loss coefficient from 0 to 1e-2 at a high learning rate; two seeds each.

    OMP_NUM_THREADS=1 python benchmarks/router_z_loss_study.py --out DIR [--steps 300] [--lr 6e-3]

``launch/sweep.py`` runs ``recipes/tiny_mixtral.yaml`` (8 experts, top-2) on one process, fp32
ZeRO-1 (``ds_configs/zero1_fp32.json``), at ``--lr`` (10x the JSON's 6e-4) with the grid
``model.moe.z_loss_coef`` x ``train.seed``. From each run's ``metrics.jsonl`` (the trainer's
``router_logit_max`` and ``router_lse``, docs/trainer.md): the logits' size at the end (mean of
the last 20 steps), their largest value over the run, the final loss (mean of the last 20
steps) and the loss spikes (steps whose loss exceeds the mean of the 10 before by more than
10%). Writes ``DIR/summary.json`` (per coefficient: the mean and the spread over the seeds)
and ``DIR/router_z_loss.png``; prints one table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

COEFS = ("0", "1e-4", "1e-3", "1e-2")
SEEDS = ("1", "2")
TAIL = 20           # steps averaged for the final values
SPIKE = 1.10        # a loss above 1.10 x the mean of the previous 10 steps


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=6e-3)
    p.add_argument("--coefs", nargs="+", default=list(COEFS), help="z_loss_coef values")
    p.add_argument("--seeds", nargs="+", default=list(SEEDS))
    return p.parse_args(argv)


def spikes(losses: list[float]) -> int:
    return sum(1 for i in range(10, len(losses)) if losses[i] > SPIKE * statistics.mean(losses[i - 10:i]))


def run_summary(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    tail = rows[-TAIL:]
    return {"steps": [r["step"] for r in rows], "loss": [r["loss"] for r in rows],
            "logit_max": [r["router_logit_max"] for r in rows], "lse": [r["router_lse"] for r in rows],
            "final_loss": statistics.mean(r["loss"] for r in tail),
            "final_logit_max": statistics.mean(r["router_logit_max"] for r in tail),
            "final_lse": statistics.mean(r["router_lse"] for r in tail),
            "peak_logit_max": max(r["router_logit_max"] for r in rows),
            "spikes": spikes([r["loss"] for r in rows])}


def summarize(runs: dict[tuple[str, str], dict]) -> dict:
    """Per coefficient: each value's mean over the seeds and its spread (max - min)."""
    out = {}
    for coef in sorted({c for c, _ in runs}, key=float):
        seeds = [runs[k] for k in runs if k[0] == coef]
        out[coef] = {key: {"mean": statistics.mean(s[key] for s in seeds),
                           "spread": max(s[key] for s in seeds) - min(s[key] for s in seeds)}
                     for key in ("final_loss", "final_logit_max", "final_lse", "peak_logit_max", "spikes")}
    return out


def plot(runs: dict[tuple[str, str], dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    coefs = sorted({c for c, _ in runs}, key=float)
    colours = dict(zip(coefs, plt.cm.viridis([i / max(len(coefs) - 1, 1) for i in range(len(coefs))])))
    for (coef, seed), r in sorted(runs.items()):
        style = dict(color=colours[coef], linestyle="-" if seed == SEEDS[0] else "--", linewidth=1)
        label = f"z {coef}" if seed == SEEDS[0] else None
        axes[0].plot(r["steps"], r["logit_max"], label=label, **style)
        axes[1].plot(r["steps"], r["lse"], **style)
        axes[2].plot(r["steps"], r["loss"], **style)
    for ax, title in zip(axes, ("router_logit_max (largest logit)", "router_lse (mean log-sum-exp)",
                                "training loss")):
        ax.set_title(title)
        ax.set_xlabel("step")
    axes[2].set_yscale("log")
    axes[0].legend(title="z_loss_coef (solid seed 1, dashed 2)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    from launch import sweep
    sweep_dir = args.out / "sweep"
    rc = sweep.main(["--config", "ds_configs/zero1_fp32.json", "--recipe", "recipes/tiny_mixtral.yaml",
                     "--grid", "model.moe.z_loss_coef=" + ",".join(args.coefs),
                     "--grid", "train.seed=" + ",".join(args.seeds), "--steps", str(args.steps),
                     "--set", f"ds.optimizer.params.lr={args.lr}", "eval.every=0",
                     f"train.save_every={args.steps * 10}", "train.log_every=50",
                     "--out", str(sweep_dir)])
    if rc != 0:
        return rc
    results = json.loads((sweep_dir / "results.json").read_text())
    runs = {(str(r["point"]["model.moe.z_loss_coef"]), str(r["point"]["train.seed"])):
            run_summary(Path(r["run_dir"])) for r in results if r["status"] == "ok"}
    summary = summarize(runs)
    (args.out / "summary.json").write_text(json.dumps(
        {"lr": args.lr, "steps": args.steps, "summary": summary,
         "runs": {f"z{c}-seed{s}": {k: v for k, v in r.items() if not isinstance(v, list)}
                  for (c, s), r in runs.items()}}, indent=1))
    plot(runs, args.out / "router_z_loss.png")
    print(f"tiny_mixtral, lr {args.lr}, {args.steps} steps, seeds {' '.join(args.seeds)}: mean (spread)")
    print(f"{'z_loss_coef':>11} {'final logit max':>16} {'peak logit max':>15} {'final lse':>14} "
          f"{'final loss':>15} {'spikes':>9}")
    for coef, s in summary.items():
        cell = lambda k, f: f"{s[k]['mean']:{f}} ({s[k]['spread']:{f}})"   # noqa: E731
        print(f"{coef:>11} {cell('final_logit_max', '.2f'):>16} {cell('peak_logit_max', '.2f'):>15} "
              f"{cell('final_lse', '.3f'):>14} {cell('final_loss', '.4f'):>15} {cell('spikes', '.1f'):>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
