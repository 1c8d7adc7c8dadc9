"""Router loss studies, two seeds each, through ``launch/sweep.py``:

* ``--loss z``: how large the router logits grow, and whether training spikes, with the z-loss
  coefficient from 0 to 1e-2 at a high learning rate (tiny Mixtral, 8 experts, top-2, lr 6e-3,
  10x the JSON's): the trainer's ``router_lse`` and ``router_logit_max`` (docs/trainer.md).
* ``--loss aux``: balance against the language-model loss, the aux coefficient from 0 to 1.0
  (tiny Switch, 8 experts, top-1, capacity 1.25, the JSON's lr): ``expert_load_max_over_mean``,
  ``dropped_frac`` and the loss.

    OMP_NUM_THREADS=1 python benchmarks/router_loss_study.py --loss z --out DIR     # 8 runs, ~9 min
    OMP_NUM_THREADS=1 python benchmarks/router_loss_study.py --loss aux --out DIR   # 10 runs, ~10 min

One process per run, fp32 ZeRO-1 (``ds_configs/zero1_fp32.json``), 300 steps. Per run: each
value at the end (mean of the last 20 steps), its extreme over the run, and the loss spikes
(steps whose loss exceeds the mean of the 10 before by more than 10%). Writes
``DIR/summary.json`` (per coefficient: the mean and the spread, max - min, over the seeds) and
``DIR/router_<loss>_loss.png``; prints one table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SEEDS = ("1", "2")
TAIL = 20           # steps averaged for the final values
SPIKE = 1.10        # a loss above 1.10 x the mean of the previous 10 steps
# per study: recipe, swept key, default values, extra settings, the metrics read per step
STUDIES = {
    "z": dict(recipe="recipes/tiny_mixtral.yaml", key="model.moe.z_loss_coef",
              coefs=("0", "1e-4", "1e-3", "1e-2"), sets=["ds.optimizer.params.lr=6e-3"],
              metrics=("router_lse", "router_logit_max")),
    "aux": dict(recipe="recipes/tiny_switch.yaml", key="model.moe.aux_loss_coef",
                coefs=("0", "1e-3", "1e-2", "1e-1", "1.0"), sets=[],
                metrics=("expert_load_max_over_mean", "dropped_frac")),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loss", choices=sorted(STUDIES), required=True, help="the coefficient swept")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--coefs", nargs="+", help="coefficient values (default: the study's)")
    p.add_argument("--seeds", nargs="+", default=list(SEEDS))
    return p.parse_args(argv)


def spikes(losses: list[float]) -> int:
    return sum(1 for i in range(10, len(losses)) if losses[i] > SPIKE * statistics.mean(losses[i - 10:i]))


def run_summary(run_dir: Path, metrics: tuple[str, ...]) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    tail = rows[-TAIL:]
    out = {"steps": [r["step"] for r in rows], "loss": [r["loss"] for r in rows],
           "final_loss": statistics.mean(r["loss"] for r in tail), "spikes": spikes([r["loss"] for r in rows])}
    for m in metrics:
        out[m] = [r[m] for r in rows]
        out[f"final_{m}"] = statistics.mean(r[m] for r in tail)
        out[f"peak_{m}"] = max(r[m] for r in rows)
    return out


def summarize(runs: dict[tuple[str, str], dict]) -> dict:
    """Per coefficient: each final or peak value's mean over the seeds and its spread (max - min)."""
    out = {}
    for coef in sorted({c for c, _ in runs}, key=float):
        seeds = [runs[k] for k in runs if k[0] == coef]
        keys = [k for k in seeds[0] if k.startswith(("final_", "peak_")) or k == "spikes"]
        out[coef] = {key: {"mean": statistics.mean(s[key] for s in seeds),
                           "spread": max(s[key] for s in seeds) - min(s[key] for s in seeds)}
                     for key in keys}
    return out


def plot(runs: dict[tuple[str, str], dict], metrics: tuple[str, ...], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(metrics) + 1, figsize=(5 * (len(metrics) + 1), 4.2))
    coefs = sorted({c for c, _ in runs}, key=float)
    colours = dict(zip(coefs, plt.cm.viridis([i / max(len(coefs) - 1, 1) for i in range(len(coefs))])))
    for (coef, seed), r in sorted(runs.items()):
        style = dict(color=colours[coef], linestyle="-" if seed == SEEDS[0] else "--", linewidth=1)
        for ax, key in zip(axes, (*metrics, "loss")):
            ax.plot(r["steps"], r[key], label=coef if seed == SEEDS[0] and ax is axes[0] else None, **style)
    for ax, key in zip(axes, (*metrics, "training loss")):
        ax.set_title(key)
        ax.set_xlabel("step")
    axes[-1].set_yscale("log")
    axes[0].legend(title="coefficient (solid seed 1, dashed 2)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    study = STUDIES[args.loss]
    coefs = args.coefs or list(study["coefs"])
    from launch import sweep
    sweep_dir = args.out / "sweep"
    rc = sweep.main(["--config", "ds_configs/zero1_fp32.json", "--recipe", study["recipe"],
                     "--grid", f"{study['key']}=" + ",".join(coefs),
                     "--grid", "train.seed=" + ",".join(args.seeds), "--steps", str(args.steps),
                     "--set", *study["sets"], "eval.every=0", f"train.save_every={args.steps * 10}",
                     "train.log_every=50", "--out", str(sweep_dir)])
    if rc != 0:
        return rc
    results = json.loads((sweep_dir / "results.json").read_text())
    runs = {(str(r["point"][study["key"]]), str(r["point"]["train.seed"])):
            run_summary(Path(r["run_dir"]), study["metrics"]) for r in results if r["status"] == "ok"}
    summary = summarize(runs)
    (args.out / "summary.json").write_text(json.dumps(
        {"study": args.loss, "recipe": study["recipe"], "key": study["key"], "settings": study["sets"],
         "steps": args.steps, "summary": summary,
         "runs": {f"{c}-seed{s}": {k: v for k, v in r.items() if not isinstance(v, list)}
                  for (c, s), r in runs.items()}}, indent=1))
    plot(runs, study["metrics"], args.out / f"router_{args.loss}_loss.png")
    columns = [f"final_{m}" for m in study["metrics"]] + [f"peak_{m}" for m in study["metrics"]] + \
        ["final_loss", "spikes"]
    print(f"{study['recipe']} {' '.join(study['sets'])}, {args.steps} steps, seeds {' '.join(args.seeds)}: "
          f"mean (spread) per {study['key']}")
    print(" | ".join(["coef", *columns]))
    for coef, s in summary.items():
        print(" | ".join([coef, *(f"{s[c]['mean']:.4f} ({s[c]['spread']:.4f})" for c in columns)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
