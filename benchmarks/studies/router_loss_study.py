"""Router loss and precision studies, two seeds each, through ``launch/sweep.py``:

* ``--loss z``: how large the router logits grow, and whether training spikes, with the z-loss
  coefficient from 0 to 1e-2 at a high learning rate (tiny Mixtral, 8 experts, top-2, lr 6e-3,
  10x the JSON's): the trainer's ``router_lse`` and ``router_logit_max`` (docs/trainer.md).
* ``--loss aux``: balance against the language-model loss, the aux coefficient from 0 to 1.0
  (tiny Switch, 8 experts, top-1, capacity 1.25, the JSON's lr): ``expert_load_max_over_mean``,
  ``dropped_frac`` and the loss.
* ``--study precision``: the router in fp32 against bf16 (``model.moe.router_dtype``), each with
  the z-loss off and at its default 1e-3, at the z study's high lr (tiny Switch, 8 experts,
  top-1, capacity 1.25, lr 6e-3, 10x the JSON's): ``router_lse``, ``router_logit_max``,
  ``dropped_frac`` and ``grad_norm``; and per seed, bf16's values minus fp32's (same data and
  init). The rest of the model runs in fp32, so the comparison isolates the router's precision.

    OMP_NUM_THREADS=1 python -m benchmarks.studies.router_loss_study --loss z --out DIR     # 8 runs, ~9 min
    OMP_NUM_THREADS=1 python -m benchmarks.studies.router_loss_study --loss aux --out DIR   # 10 runs, ~10 min
    OMP_NUM_THREADS=1 python -m benchmarks.studies.router_loss_study --study precision --out DIR   # 8 runs

(``--study`` and ``--loss`` are one option.) One process per run, fp32 ZeRO-1
(``ds_configs/zero1_fp32.json``), 300 steps. Per run: each value at the end (mean of the last 20
steps), its extreme over the run, and the loss spikes (steps whose loss exceeds the mean of the
10 before by more than 10%). The runs go to ``DIR/sweep``; writes ``router_<loss>_loss.json``
(``router_precision.json``; per coefficient, or per router dtype and z-loss coefficient: the mean
and the spread, max - min, over the seeds) into ``--results`` (default
``benchmarks/studies/results/``) and ``router_<loss>_loss.png`` (``router_precision.png``) into
``--figures`` (default ``docs/studies/img/``); prints one table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from benchmarks import add_output_args, output_dirs

REPO = Path(__file__).resolve().parents[2]

SEEDS = ("1", "2")
TAIL = 20           # steps averaged for the final values
SPIKE = 1.10        # a loss above 1.10 x the mean of the previous 10 steps
# per study: recipe, swept key, default values, extra settings, the metrics read per step; with
# ``also``, a second key swept with each value (its values: ``--also``)
STUDIES = {
    "z": dict(recipe="recipes/tiny_mixtral.yaml", key="model.moe.z_loss_coef",
              coefs=("0", "1e-4", "1e-3", "1e-2"), sets=["ds.optimizer.params.lr=6e-3"],
              metrics=("router_lse", "router_logit_max")),
    "aux": dict(recipe="recipes/tiny_switch.yaml", key="model.moe.aux_loss_coef",
                coefs=("0", "1e-3", "1e-2", "1e-1", "1.0"), sets=[],
                metrics=("expert_load_max_over_mean", "dropped_frac")),
    "precision": dict(recipe="recipes/tiny_switch.yaml", key="model.moe.router_dtype",
                      coefs=("fp32", "bf16"), also=("model.moe.z_loss_coef", ("0", "1e-3")),
                      sets=["ds.optimizer.params.lr=6e-3"],
                      metrics=("router_lse", "router_logit_max", "dropped_frac", "grad_norm")),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--study", "--loss", dest="loss", choices=sorted(STUDIES), required=True,
                   help="the coefficient swept (z, aux), or the router's precision (precision)")
    p.add_argument("--out", type=Path, required=True, help="the study's folder: its runs")
    add_output_args(p, "studies")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--coefs", nargs="+", help="coefficient values, or router dtypes (default: the study's)")
    p.add_argument("--also", nargs="+", help="values of the study's second key (precision: the "
                   "z-loss coefficients; default: the study's)")
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


def _order(runs: dict[tuple[str, str], dict], order: list[str] | None) -> list[str]:
    """The points of ``runs``: in ``order`` if given, else by their value."""
    points = {c for c, _ in runs}
    return [c for c in order if c in points] if order else sorted(points, key=float)


def summarize(runs: dict[tuple[str, str], dict], order: list[str] | None = None) -> dict:
    """Per coefficient (point): each final or peak value's mean over the seeds and its spread (max - min)."""
    out = {}
    for coef in _order(runs, order):
        seeds = [runs[k] for k in runs if k[0] == coef]
        keys = [k for k in seeds[0] if k.startswith(("final_", "peak_")) or k == "spikes"]
        out[coef] = {key: {"mean": statistics.mean(s[key] for s in seeds),
                           "spread": max(s[key] for s in seeds) - min(s[key] for s in seeds)}
                     for key in keys}
    return out


def paired(runs: dict[tuple[str, str], dict], summary: dict) -> dict:
    """For points "<a> z=<c>" and "<b> z=<c>" (the first two values of the swept key, each z-loss
    coefficient): per seed, b's final or peak value minus a's (same seed: same data and init),
    with the mean, min and max over the seeds."""
    values = list(dict.fromkeys(p.split(" z=")[0] for p in summary))[:2]
    out = {}
    for z in dict.fromkeys(p.split(" z=")[1] for p in summary):
        a, b = (f"{v} z={z}" for v in (values * 2)[:2])
        seeds = sorted({s for c, s in runs if c == a} & {s for c, s in runs if c == b}, key=int)
        if len(values) < 2 or not seeds:
            continue
        out[f"{values[1]} - {values[0]} z={z}"] = {
            key: {"per_seed": d, "mean": statistics.mean(d), "min": min(d), "max": max(d)}
            for key in summary[a] for d in [[runs[(b, s)][key] - runs[(a, s)][key] for s in seeds]]}
    return out


def plot(runs: dict[tuple[str, str], dict], metrics: tuple[str, ...], path: Path,
         order: list[str] | None = None, title: str = "coefficient") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(metrics) + 1, figsize=(5 * (len(metrics) + 1), 4.2))
    coefs = _order(runs, order)
    colours = dict(zip(coefs, plt.cm.viridis([i / max(len(coefs) - 1, 1) for i in range(len(coefs))])))
    if order:                           # pairs: a dark and a light shade per value of the first key
        colours = dict(zip(coefs, plt.cm.tab20(range(len(coefs)))))
    seeds = sorted({s for _, s in runs}, key=int)
    lines = ("-", "--", ":", "-.")
    for (coef, seed), r in sorted(runs.items(), key=lambda item: (coefs.index(item[0][0]), item[0][1])):
        first = seed == seeds[0]
        style = dict(color=colours[coef], linestyle=lines[seeds.index(seed) % len(lines)], linewidth=1)
        for ax, key in zip(axes, (*metrics, "loss")):
            ax.plot(r["steps"], r[key], label=coef if first and ax is axes[0] else None, **style)
    for ax, key in zip(axes, (*metrics, "training loss")):
        ax.set_title(key)
        ax.set_xlabel("step")
    for ax, key in zip(axes, (*metrics, "loss")):
        if key in ("loss", "grad_norm"):
            ax.set_yscale("log")
    names = ("solid", "dashed", "dotted", "dash-dot")
    legend = dict(title=f"{title} (" + ", ".join(f"{names[i % 4]} seed {s}" for i, s in enumerate(seeds)) + ")",
                  fontsize=8)
    if order:                           # below the panels, clear of the curves
        fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=len(coefs), **legend)
        fig.tight_layout(rect=(0, 0.12, 1, 1))
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return
    axes[0].legend(**legend)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    study = STUDIES[args.loss]
    coefs = args.coefs or list(study["coefs"])
    also_key, also = (study["also"][0], args.also or list(study["also"][1])) if "also" in study else (None, [])
    grids = ["--grid", f"{also_key}=" + ",".join(also)] if also_key else []
    from launch import sweep
    output_dirs(args, "studies")
    sweep_dir = args.out / "sweep"
    rc = sweep.main(["--config", "ds_configs/zero1_fp32.json", "--recipe", study["recipe"],
                     "--grid", f"{study['key']}=" + ",".join(coefs), *grids,
                     "--grid", "train.seed=" + ",".join(args.seeds), "--steps", str(args.steps),
                     "--set", *study["sets"], "eval.every=0", f"train.save_every={args.steps * 10}",
                     "train.log_every=50", "--out", str(sweep_dir)])
    if rc != 0:
        return rc
    report(args, json.loads((sweep_dir / "results.json").read_text()))
    return 0


def report(args: argparse.Namespace, results: list[dict]) -> None:
    """The summary JSON, the figure and the table, from the sweep's ``results.json`` rows."""
    study = STUDIES[args.loss]
    coefs = args.coefs or list(study["coefs"])
    also_key, also = (study["also"][0], args.also or list(study["also"][1])) if "also" in study else (None, [])

    def label(point: dict) -> str:      # the coefficient, or "<dtype> z=<coefficient>"
        return str(point[study["key"]]) + (f" z={point[also_key]}" if also_key else "")
    order = None
    if also_key:                        # the grid's order: fp32 z=0, fp32 z=0.001, bf16 z=0, ...
        order = list(dict.fromkeys(label(r["point"]) for r in results))
    runs = {(label(r["point"]), str(r["point"]["train.seed"])):
            run_summary(Path(r["run_dir"]), study["metrics"]) for r in results if r["status"] == "ok"}
    summary = summarize(runs, order)
    head = {"study": args.loss, "recipe": study["recipe"], "key": study["key"]}
    if also_key:
        head.update(also_key=also_key, grid={study["key"]: coefs, also_key: also}, seeds=args.seeds,
                    paired=paired(runs, summary))
    name = f"router_{args.loss}" if also_key else f"router_{args.loss}_loss"
    results, figures = output_dirs(args, "studies")
    (results / f"{name}.json").write_text(json.dumps(
        {**head, "settings": study["sets"], "steps": args.steps, "summary": summary,
         "runs": {f"{c}-seed{s}": {k: v for k, v in r.items() if not isinstance(v, list)}
                  for (c, s), r in runs.items()}}, indent=1))
    plot(runs, study["metrics"], figures / f"{name}.png", order, "router dtype, z-loss" if also_key else "coefficient")
    print(f"wrote {results / f'{name}.json'} and {figures / f'{name}.png'}", file=sys.stderr)
    columns = [f"final_{m}" for m in study["metrics"]] + [f"peak_{m}" for m in study["metrics"]] + \
        ["final_loss", "spikes"]
    print(f"{study['recipe']} {' '.join(study['sets'])}, {args.steps} steps, seeds {' '.join(args.seeds)}: "
          f"mean (spread) per {study['key']}" + (f" and {also_key}" if also_key else ""))
    print(" | ".join(["point" if also_key else "coef", *columns]))
    for coef, s in summary.items():
        print(" | ".join([coef, *(f"{s[c]['mean']:.4f} ({s[c]['spread']:.4f})" for c in columns)]))
    if also_key:
        print("within each seed, the second point minus the first: mean [min, max] over the seeds")
        for pair, d in head["paired"].items():
            print(" | ".join([pair, *(f"{d[c]['mean']:+.4f} [{d[c]['min']:+.4f}, {d[c]['max']:+.4f}]"
                                      for c in columns)]))


if __name__ == "__main__":
    sys.exit(main())
