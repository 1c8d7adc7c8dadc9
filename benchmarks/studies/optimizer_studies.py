"""Optimizer studies on the tiny dense recipe, two seeds each, through ``launch/sweep.py``:

* ``--study warmup``: Adam(W) with and without a linear warmup at the JSON's lr (6e-4) and at
  5x it (3e-3), where starting at the full lr hurts; the warmup length swept at 3e-3 (0, 2.5%,
  10%, 30% of the run); and Goyal et al.'s large-batch rule, the lr scaled linearly with the
  batch (the JSON's ``lr_scaling`` block) at 4x and 8x the batch on the same tokens, with and
  without a gradual warmup over the first quarter of them.
* ``--study decay``: the lr decay shapes at an equal budget (200 steps, peak 3e-3, 10% warmup):
  constant, step, exponential, inverse square root, linear, cosine (to 0 and to a 10% floor),
  cosine with restarts, WSD; the schedules of ``training/optim/schedules.py``.
* ``--study weight_decay``: the decoupled (AdamW) coefficient from 0 to 1.0; L2 added to the
  gradient inside Adam (DeepSpeed's ``"type": "Adam"`` with ``"adam_w_mode": false``) at the same
  nominal coefficients 0.1 and 1.0; and every parameter decayed (the JSON's
  ``"no_decay_group": false``) against norms, biases and embeddings left undecayed.

    OMP_NUM_THREADS=1 python -m benchmarks.studies.optimizer_studies --study warmup --out DIR        # 22 runs
    OMP_NUM_THREADS=1 python -m benchmarks.studies.optimizer_studies --study decay --out DIR         # 18 runs
    OMP_NUM_THREADS=1 python -m benchmarks.studies.optimizer_studies --study weight_decay --out DIR  # 18 runs

One process per run, fp32 ZeRO-1 (``ds_configs/zero1_fp32.json`` with the variant's optimizer,
schedule and batch), micro-batch 8 x 128 tokens, 200 steps at the base batch (a larger batch
runs fewer steps on the same tokens). Every variant uses one of our schedules (a multiplier of
``optimizer.params.lr``), so that "no warmup" means the first update runs at the peak lr. Each run
is scored by its held-out loss at the end (``eval.batches`` 16 batches of the validation split,
one pass) and, beside it, the mean training loss of its last 20 steps; loss spikes are
steps whose loss exceeds the mean of the 10 before by more than 10%. Writes ``<name>.json``
(per variant: each value's mean over the seeds and its spread, max - min) into ``--results``
(default ``benchmarks/studies/results/``) and ``<name>.png`` into ``--figures`` (default
``docs/studies/img/``), with ``<name>`` ``lr_warmup``, ``lr_decay_shapes`` or ``weight_decay``;
prints one table and a progress line per variant with an ETA. The runs live under ``DIR/runs``;
a variant already finished in ``DIR`` is read, not rerun, and each run is compared with a
reference variant of the same seed (``reference``). ``benchmarks/studies/results/<name>.json``
and ``docs/studies/img/<name>.png`` are these files from the runs of 2026-12-02.

Time: a 200-step run takes about 30 s on an idle 2-core Intel Xeon (AMX-BF16) (estimated from
a 100-step run alone: 16 s with start-up), so a study about 10 min; on 2026-12-02, under a load average of 14-21 from other jobs, the runs of the
three studies took 51, 39 and 39 min in all (``runs_wall_s`` in the JSON).
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

RECIPE = "recipes/tiny_dense.yaml"
BASE_JSON = "ds_configs/zero1_fp32.json"
SEEDS = ("1", "2")
TAIL = 20             # training steps averaged for the final training loss
SPIKE = 1.10          # a loss above 1.10 x the mean of the previous 10 steps
MICRO = 8             # sequences per micro-batch (the JSON's), the base global batch
HIGH_LR = 3e-3        # 5x the JSON's 6e-4: without warmup the tiny model stalls (measured)
OUTPUT = {"warmup": "lr_warmup", "decay": "lr_decay_shapes", "weight_decay": "weight_decay"}


def _cosine(warmup: float, floor: float = 0.1) -> dict:
    """Warmup, then one cosine from the peak to ``floor`` x peak at the last step."""
    return {"type": "WarmupCosineRestartsLR", "params": {"warmup_num_steps": warmup, "min_ratio": floor}}


def _variant(label: str, group: str, sched: dict, lr: float = HIGH_LR, accumulation: int = 1,
             optimizer: dict | None = None, top: dict | None = None, x: float | None = None) -> dict:
    """One setting: the schedule (its ``warmup_num_steps`` and ``step_size``-like params given as
    fractions of the run, turned into steps by ``ds_config``), the base lr, the batch as an
    accumulation factor, optimizer params, top-level JSON keys; ``x`` its place on the plot."""
    return dict(label=label, group=group, sched=sched, lr=lr, accumulation=accumulation,
                optimizer=optimizer or {}, top=top or {}, x=x)


def warmup_variants() -> dict[str, dict]:
    v = {}
    for lr in (6e-4, HIGH_LR):
        for frac in ((0.0, 0.1) if lr != HIGH_LR else (0.0, 0.025, 0.1, 0.3)):
            v[f"lr{lr:g}-w{frac:g}"] = _variant(f"lr {lr:g}, warmup {frac:.1%}", f"lr {lr:g}",
                                                _cosine(frac), lr=lr, x=frac)
    for k in (1, 4, 8):     # Goyal et al.: lr x k at k x the batch, with and without gradual warmup
        for frac in (0.0, 0.25):
            v[f"batch{k}x-w{frac:g}"] = _variant(
                f"{k}x batch, lr {6e-4 * k:g}, warmup {frac:.0%}", f"large batch, warmup {frac:.0%}",
                _cosine(frac), lr=6e-4, accumulation=k,
                top={"lr_scaling": {"rule": "linear", "base_batch_size": MICRO}}, x=k)
    v["batch1x-w0"]["same_as"] = f"lr{6e-4:g}-w0"    # the same run (lr_scaling at 1x changes nothing)
    return v


def decay_variants() -> dict[str, dict]:
    w = 0.1
    shapes = {
        "constant": {"type": "WarmupStableDecayLR", "params": {"warmup_num_steps": w, "decay_num_steps": 0}},
        "step": {"type": "WarmupStepDecayLR", "params": {"warmup_num_steps": w, "step_size": 0.3, "gamma": 0.3}},
        "exponential": {"type": "WarmupExponentialLR", "params": {"warmup_num_steps": w, "gamma": "to 0.02"}},
        "inverse-sqrt": {"type": "WarmupInverseSqrtLR", "params": {"warmup_num_steps": w}},
        "linear": {"type": "WarmupStableDecayLR", "params": {"warmup_num_steps": w, "decay_num_steps": 1 - w,
                                                             "decay_type": "linear"}},
        "cosine": _cosine(w, floor=0.0),
        "cosine-floor-10%": _cosine(w, floor=0.1),
        "cosine-restarts": {"type": "WarmupCosineRestartsLR",
                            "params": {"warmup_num_steps": w, "cycle_num_steps": "thirds"}},
        "wsd": {"type": "WarmupStableDecayLR", "params": {"warmup_num_steps": w}},
    }
    return {name: _variant(name, "shape", sched, x=i) for i, (name, sched) in enumerate(shapes.items())}


def weight_decay_variants() -> dict[str, dict]:
    v = {}
    for wd in (0.0, 0.01, 0.1, 0.3, 1.0):
        v[f"adamw-{wd:g}"] = _variant(f"AdamW (decoupled) {wd:g}", "AdamW, decoupled", _cosine(0.1),
                                      optimizer={"weight_decay": wd}, x=wd)
    for wd in (0.1, 1.0):
        v[f"adam-l2-{wd:g}"] = _variant(f"Adam + L2 (coupled) {wd:g}", "Adam + L2, coupled", _cosine(0.1),
                                        optimizer={"type": "Adam", "adam_w_mode": False, "weight_decay": wd},
                                        x=wd)
        v[f"adamw-all-{wd:g}"] = _variant(f"AdamW {wd:g}, every parameter decayed",
                                          "AdamW, norms/biases/embeddings decayed too", _cosine(0.1),
                                          optimizer={"weight_decay": wd}, top={"no_decay_group": False}, x=wd)
    return v


STUDIES = {"warmup": warmup_variants, "decay": decay_variants, "weight_decay": weight_decay_variants}


def run_steps(v: dict, steps: int) -> int:
    """Optimizer steps of a variant: the base budget's tokens at its batch."""
    return max(1, steps // v["accumulation"])


def _steps_of(value, total: int):
    """A fraction of the run (a float below 1, or 0) as whole steps; anything else as it is."""
    if isinstance(value, float) and 0 <= value < 1 or value == 0:
        return int(round(value * total))
    return value


def ds_config(v: dict, steps: int) -> dict:
    """The variant's DeepSpeed JSON: ``BASE_JSON`` with its optimizer, schedule and batch."""
    cfg = json.loads((REPO / BASE_JSON).read_text())
    T = run_steps(v, steps)
    params = {k: _steps_of(p, T) if k.endswith(("_steps", "step_size")) else p for k, p in v["sched"]["params"].items()}
    W = params["warmup_num_steps"]
    if params.get("gamma") == "to 0.02":         # exponential: 0.02 x peak at the last step
        params["gamma"] = 0.02 ** (1 / max(T - max(W, 1), 1))
    if params.get("cycle_num_steps") == "thirds":  # three equal cosine cycles after the peak
        params["cycle_num_steps"] = math.ceil((T - max(W, 1) + 1) / 3)
    if params.get("decay_num_steps") is not None and params["decay_num_steps"] > 0:
        params["decay_num_steps"] = T - W          # linear: the whole run after the warmup
    cfg["scheduler"] = {"type": v["sched"]["type"], "params": params}
    opt = dict(v["optimizer"])
    cfg["optimizer"]["type"] = opt.pop("type", cfg["optimizer"]["type"])
    cfg["optimizer"]["params"].update(lr=v["lr"], **opt)
    cfg["gradient_accumulation_steps"] = v["accumulation"]
    cfg.update(v["top"])
    return cfg


def spikes(losses: list[float]) -> int:
    return sum(1 for i in range(10, len(losses)) if losses[i] > SPIKE * statistics.mean(losses[i - 10:i]))


def run_summary(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    return {"steps": [r["step"] for r in train], "tokens": [r["tokens"] for r in train],
            "loss": [r["loss"] for r in train], "lr": [r["lr"] for r in train],
            "eval_loss": evals[-1], "final_train_loss": statistics.mean(r["loss"] for r in train[-TAIL:]),
            "peak_loss_after_10": max(r["loss"] for r in train[10:]) if len(train) > 10 else None,
            "peak_grad_norm": max(r["grad_norm"] for r in train), "spikes": spikes([r["loss"] for r in train]),
            "mean_lr": statistics.mean(r["lr"] for r in train), "final_lr": train[-1]["lr"]}


def run_variant(name: str, v: dict, args, sets: list[str]) -> dict[str, dict]:
    """Both seeds of one variant through ``launch/sweep.py``; {seed: run_summary}."""
    from launch import sweep
    vdir = args.out / "runs" / name
    results = vdir / "sweep" / "results.json"
    finished = json.loads(results.read_text()) if results.exists() else []
    if sorted(str(r["point"]["train.seed"]) for r in finished if r["status"] == "ok") != sorted(args.seeds):
        vdir.mkdir(parents=True, exist_ok=True)
        T = run_steps(v, args.steps)
        (vdir / "ds.json").write_text(json.dumps(ds_config(v, args.steps), indent=1))
        rc = sweep.main(["--config", str(vdir / "ds.json"), "--recipe", RECIPE,
                         "--grid", "train.seed=" + ",".join(args.seeds), "--steps", str(T),
                         "--set", f"eval.every={T}", "eval.batches=16", f"train.save_every={T * 10}",
                         f"train.log_every={max(T // 4, 1)}", *sets, "--out", str(vdir / "sweep")])
        if rc != 0:
            raise RuntimeError(f"{name}: the sweep failed (exit {rc}); see {vdir / 'sweep'}")
    done = json.loads(results.read_text())
    return {str(r["point"]["train.seed"]): {**run_summary(Path(r["run_dir"])), "wall_s": r["seconds"]}
            for r in done if r["status"] == "ok"}


def reference(study: str, name: str) -> str | None:
    """The variant a variant is compared with seed by seed (same init and data order)."""
    if study == "decay":
        return "cosine"
    if study == "weight_decay":
        return "adamw-0.1"               # the stock JSONs' setting
    return name.rsplit("-w", 1)[0] + "-w0"   # the same lr or batch without warmup


def _stats(values: dict[str, float]) -> dict:
    return {"mean": statistics.mean(values.values()), "spread": max(values.values()) - min(values.values()),
            "seeds": values}


def summarize(study: str, runs: dict[str, dict[str, dict]]) -> dict:
    """Per variant: each scalar's mean over the seeds, its spread (max - min) and the seeds'
    values; and ``eval_loss_vs_<reference>``, the held-out loss minus the reference variant's of
    the same seed (a paired difference: both runs share the init and the data order)."""
    out = {}
    for name, seeds in runs.items():
        keys = [k for k, val in next(iter(seeds.values())).items() if not isinstance(val, list) and val is not None]
        out[name] = {k: _stats({seed: s[k] for seed, s in seeds.items()}) for k in keys}
        ref = reference(study, name)
        if ref in runs and ref != name and set(runs[ref]) == set(seeds):
            out[name][f"eval_loss_vs_{ref}"] = _stats({seed: s["eval_loss"] - runs[ref][seed]["eval_loss"]
                                                      for seed, s in seeds.items()})
    return out


def _smooth(values: list[float], n: int = 10) -> list[float]:
    return [statistics.mean(values[max(0, i - n + 1):i + 1]) for i in range(len(values))]


def plot(study: str, variants: dict, runs: dict, summary: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = 4 if study == "warmup" else 3
    fig, axes = plt.subplots(1, panels, figsize=(5.6 * panels, 4.6))
    names = list(runs)
    colours = dict(zip(names, plt.cm.tab10.colors * 3))
    curves = [n for n in names if variants[n]["accumulation"] == 1]
    for name in curves:                       # lr (first seed) and smoothed training loss
        for seed, r in runs[name].items():
            style = dict(color=colours[name], linestyle="-" if seed == min(runs[name]) else "--", linewidth=1)
            if seed == min(runs[name]):
                axes[0].plot(r["steps"], r["lr"], label=variants[name]["label"], **style)
            axes[1].plot(r["steps"], _smooth(r["loss"]), **style)
    axes[0].set_title("lr (base batch)")
    axes[0].legend(fontsize=7)
    axes[1].set_title("training loss, mean of 10 steps (solid seed 1, dashed 2)")
    axes[1].set_ylim(top=7.0)
    for ax in axes[:2]:
        ax.set_xlabel("step")
    groups = {}
    for name in names:
        groups.setdefault(variants[name]["group"], []).append(name)
    for group, members in groups.items():
        ax = axes[3] if group.startswith("large batch") else axes[2]
        xs = list(range(len(members))) if study == "decay" else [variants[n]["x"] for n in members]
        ax.plot(xs, [summary[n]["eval_loss"]["mean"] for n in members], marker="o", label=group,
                linestyle="none" if study == "decay" else "-")
        for x, n in zip(xs, members):
            for val in summary[n]["eval_loss"]["seeds"].values():
                ax.plot([x], [val], marker="_", color="k", markersize=8)
    if study == "decay":
        axes[2].set_xticks(range(len(names)), names, rotation=40, ha="right", fontsize=8)
    elif study == "weight_decay":
        axes[2].set_xscale("symlog", linthresh=0.01)
        axes[2].set_xlabel("weight_decay coefficient")
    else:
        axes[2].set_xlabel("warmup, fraction of the run")
        axes[3].set_xscale("log", base=2)
        axes[3].set_xlabel("batch multiple (lr scaled linearly, same tokens)")
        axes[3].set_title("large batch: held-out loss at the end")
    axes[2].set_title("held-out loss at the end (line: mean, ticks: seeds)")
    for ax in axes[2:]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--study", choices=sorted(STUDIES), required=True)
    p.add_argument("--out", type=Path, required=True, help="the study's folder: its runs")
    add_output_args(p, "studies")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps at the base batch")
    p.add_argument("--seeds", nargs="+", default=list(SEEDS))
    p.add_argument("--variants", nargs="+", help="run only these (default: all of the study's)")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="extra recipe overrides")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    variants = variants_all = STUDIES[args.study]()
    chosen = args.variants or list(variants)
    unknown = [n for n in chosen if n not in variants]
    if unknown or args.steps < 10:
        what = f"--variants {' '.join(unknown)}: not in this study (known: {' '.join(variants)})" if unknown \
            else f"--steps {args.steps}: must be >= 10"
        print(f"error: {what}", file=sys.stderr)
        return 2
    variants = {n: variants[n] for n in chosen}
    results, figures = output_dirs(args, "studies")
    start, runs = time.time(), {}
    for i, (name, v) in enumerate(variants.items(), 1):
        source = v.get("same_as", name)
        runs[name] = runs[source] if source in runs else run_variant(source, variants_all[source], args, args.set)
        elapsed = time.time() - start
        eta = elapsed / i * (len(variants) - i)
        losses = " ".join(f"{r['eval_loss']:.4f}" for r in runs[name].values())
        print(f"== [{i}/{len(variants)}] {name}: held-out loss {losses} "
              f"({elapsed / 60:.1f} min, ETA {eta / 60:.1f} min)", flush=True)
    summary = summarize(args.study, runs)
    out = OUTPUT[args.study]
    (results / f"{out}.json").write_text(json.dumps(
        {"study": args.study, "recipe": RECIPE, "ds_config": BASE_JSON, "steps_at_base_batch": args.steps,
         "seeds": args.seeds, "extra_settings": args.set, "eval": "held-out loss, 16 batches, at the last step",
         "variants": {n: {"label": v["label"], "group": v["group"], "steps": run_steps(v, args.steps),
                          "ds": {k: ds_config(v, args.steps)[k] for k in ("optimizer", "scheduler")},
                          "top": v["top"], "accumulation": v["accumulation"]} for n, v in variants.items()},
         "summary": summary,
         "runs_wall_s": sum(s["wall_s"] for n, seeds in runs.items() if "same_as" not in variants[n]
                            for s in seeds.values())}, indent=1))
    plot(args.study, variants, runs, summary, figures / f"{out}.png")
    print(f"wrote {results / f'{out}.json'} and {figures / f'{out}.png'}", file=sys.stderr)
    cols = ("eval_loss", "final_train_loss", "peak_grad_norm", "spikes", "mean_lr")
    print(f"{RECIPE}, {args.steps} steps at the base batch, seeds {' '.join(args.seeds)}: mean (spread)")
    print(" | ".join(["variant", *cols, "eval_loss minus the reference's, per seed"]))
    for name, s in summary.items():
        paired = [f"{k[len('eval_loss_vs_'):]}: " + " ".join(f"{d:+.4f}" for d in v["seeds"].values())
                  for k, v in s.items() if k.startswith("eval_loss_vs_")]
        print(" | ".join([name, *(f"{s[c]['mean']:.4g} ({s[c]['spread']:.4g})" for c in cols), *paired]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
