"""Upcycling study: continue a dense model dense, or upcycle it into an MoE and train that.

    python -m benchmarks.studies.upcycling_study                 # 2 CPU cores: about 3.5 min
    python -m benchmarks.studies.upcycling_study --out DIR       # the table, JSON and plots all in DIR

1. ``recipes/tiny_dense.yaml`` (1.6M parameters, ffn 256) trains ``--dense-steps`` steps.
2. From its last checkpoint, three arms train ``--steps`` more steps each, all with a fresh
   optimizer and the JSON's warmup + cosine schedule, on the same batches (``train.seed``
   ``--seed2``, another order than phase 1's, so that phase 2 does not replay phase 1's first
   batches):
   - ``dense``: the dense model itself (its weights written as an init dir);
   - ``copies``: ``launch/upcycle.py`` into tiny_mixtral with ffn 256, 8 copies of each MLP,
     top-2 renormalized: the dense function at init (2x the dense FFN's active compute);
   - ``split``: ``launch/upcycle.py --split 2`` into tiny_mixtral as it is (ffn 128): each MLP
     cut into 2 halves, 4 copies of each, top-2: the dense model's active size, but a token sees
     two of the eight halves, so it does not start at the dense function.
3. Prints a markdown table (first training loss of phase 2, on the same batch for every arm;
   eval loss at every ``eval.every`` steps, same validation batches) and writes it as
   ``upcycling.md`` with ``upcycling.json`` (every step's loss and every eval) into ``--results``
   (default ``benchmarks/studies/results/``), and the plots ``upcycling.png``
   (``analysis/run_plots.plot_training``: loss and eval loss against the global step, lr, grad
   norm, tokens/s) and ``upcycling_vs_dense.png`` (eval loss, and each arm's train loss minus the
   dense arm's on the same batch) into ``--figures`` (default ``docs/studies/img/``); ``--out DIR``
   puts all four in DIR. The runs go to ``--work`` (default ``runs/upcycling_study``, which must
   not exist).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import add_output_args, output_dirs

REPO = Path(__file__).resolve().parents[2]

ARMS = {   # name: (recipe, extra recipe overrides, upcycle flags or None for the dense control)
    "dense": ("recipes/tiny_dense.yaml", [], None),
    "copies": ("recipes/tiny_mixtral.yaml", ["model.ffn_hidden_size=256"], []),
    "split": ("recipes/tiny_mixtral.yaml", [], ["--split", "2"]),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_output_args(p, "studies", out=True)
    p.add_argument("--work", type=Path, default=REPO / "runs" / "upcycling_study",
                   help="where the runs go (must not exist)")
    p.add_argument("--config", default="ds_configs/zero1_fp32.json", help="DeepSpeed JSON of every run")
    p.add_argument("--dense-steps", type=int, default=200, help="phase 1: dense steps")
    p.add_argument("--steps", type=int, default=200, help="phase 2: steps of each arm")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--seed2", type=int, default=4321, help="train.seed of phase 2 (data order)")
    return p.parse_args(argv)


def run(cmd: list[str], log: Path) -> None:
    # One thread per run unless OMP_NUM_THREADS says otherwise: the tiny models gain little
    # from more, and on a shared machine idle OpenMP workers spin.
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("RANK", None)
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    print(f"  {' '.join(cmd[1:3])} ... {time.time() - t0:.0f} s (log {log})", file=sys.stderr, flush=True)
    if rc != 0:
        sys.exit(f"failed (exit {rc}): {' '.join(cmd)}; see {log}")


def train(args, recipe: str, run_dir: Path, steps: int, sets: list[str], init_from: Path | None = None):
    cmd = [sys.executable, "launch/train.py", "--config", args.config, "--recipe", recipe,
           "--run-dir", str(run_dir), "--steps", str(steps), "--set",
           f"eval.every={args.eval_every}", f"train.save_every={steps}", *sets]
    if init_from is not None:
        cmd += ["--init-from", str(init_from)]
    run(cmd, run_dir.parent / f"{run_dir.name}.log")


def plot_against_dense(runs: dict, dense_evals: list[dict], first: int, out: Path, window: int = 20):
    """``upcycling_vs_dense.png``: eval loss against the global step, and each arm's train loss
    minus the dense arm's on the same batch (a ``window``-step mean), phase 2 starting after
    step ``first``; returns {arm: (steps, smoothed differences)} as drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    left.plot([r["step"] for r in dense_evals], [r["eval_loss"] for r in dense_evals], "o-",
              color="C0", label=f"dense, steps 1-{first}")
    base = {r["step"]: r["loss"] for r in runs["dense"][0]}
    drawn = {}
    for i, (name, (train, evals)) in enumerate(runs.items(), 1):
        left.plot([first + r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-",
                  color=f"C{i}", label=name)
        diff = [r["loss"] - base[r["step"]] for r in train]
        smooth = [sum(diff[max(0, j - window + 1):j + 1]) / len(diff[max(0, j - window + 1):j + 1])
                  for j in range(len(diff))]
        steps = [first + r["step"] for r in train]
        right.plot(steps, smooth, color=f"C{i}", label=name)
        drawn[name] = (steps, smooth)
    left.set_title("eval loss (the same validation batches)")
    left.set_ylim(top=dense_evals[0]["eval_loss"] + 0.1)
    right.axhline(0.0, color="grey", lw=0.8, ls="--")
    right.set_title(f"train loss - the dense arm's, same batch ({window}-step mean)")
    for ax in (left, right):
        ax.set_xlabel("step")
        ax.legend(fontsize="small")
    fig.savefig(out / "upcycling_vs_dense.png", dpi=100)
    plt.close(fig)
    return drawn


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.work.exists():
        sys.exit(f"--work {args.work} exists; choose a new directory or delete it")
    args.work.mkdir(parents=True)
    results, figures = output_dirs(args, "studies")
    from analysis import run_plots
    from interop import hf
    from interop.consolidate import load_run_model
    from training.config.recipe import load_recipe

    N, M = args.dense_steps, args.steps
    print(f"phase 1: dense, {N} steps", file=sys.stderr)
    dense_dir = args.work / "dense_phase1"
    train(args, "recipes/tiny_dense.yaml", dense_dir, N, [])
    print(f"phase 2: {', '.join(ARMS)}, {M} steps each", file=sys.stderr)
    runs, params = {}, {}
    for name, (recipe, sets, flags) in ARMS.items():
        init = args.work / f"init_{name}"
        if flags is None:                        # the dense model's own weights as an init dir
            model, cfg, tokenizer = load_run_model(dense_dir)
            hf.save_init_dir(init, cfg, model.state_dict(), tokenizer)
        else:
            run([sys.executable, "launch/upcycle.py", "--from", str(dense_dir), "--recipe", recipe,
                 "--out", str(init), *flags, *(["--set", *sets] if sets else [])],
                args.work / f"upcycle_{name}.log")
        train(args, recipe, args.work / name, M, [*sets, f"train.seed={args.seed2}"], init)
        cfg = load_recipe(recipe, sets).model
        params[name] = (cfg.num_params(), cfg.num_params(active=True))
        runs[name] = run_plots.read_metrics(args.work / name)

    # Phase 2's steps continue phase 1's on the plot and in the table.
    def shifted(rows):
        return [{**r, "step": r["step"] + N} for r in rows]
    dense_train, dense_evals = run_plots.read_metrics(dense_dir)
    curves = {f"dense, steps 1-{N}": (dense_train, dense_evals)}
    curves.update({f"{n}, steps {N + 1}-{N + M}": (shifted(t), shifted(e)) for n, (t, e) in runs.items()})
    run_plots.plot_training(curves, figures)
    (figures / "training.png").replace(figures / "upcycling.png")
    plot_against_dense(runs, dense_evals, N, figures)

    header = ("| step | " + " | ".join(f"{n} ({params[n][0] / 1e6:.2f}M, {params[n][1] / 1e6:.2f}M active)"
                                          for n in runs) + " |")
    lines = [header, "|" + "---|" * (len(runs) + 1)]
    lines.append(f"| {N + 1}: first train loss (same batch) | "
                 + " | ".join(f"{t[0]['loss']:.4f}" for t, _ in runs.values()) + " |")
    lines.append(f"| {N}: dense eval loss (the start) | "
                 + " | ".join(f"{dense_evals[-1]['eval_loss']:.4f}" if n == "dense" else "-" for n in runs) + " |")
    base = {r["step"]: r["loss"] for r in runs["dense"][0]}
    for lo, hi in ((1, 50), (M - 49, M)):
        lines.append(f"| {N + lo}-{N + hi}: mean train loss - the dense arm's (same batches) | "
                     + " | ".join(f"{sum(r['loss'] - base[r['step']] for r in t if lo <= r['step'] <= hi) / (hi - lo + 1):+.4f}"
                                  for t, _ in runs.values()) + " |")
    for i, row in enumerate(runs["dense"][1]):
        lines.append(f"| {row['step'] + N}: eval loss | "
                     + " | ".join(f"{e[i]['eval_loss']:.4f}" for _, e in runs.values()) + " |")
    table = "\n".join(lines)
    print(table)
    (results / "upcycling.md").write_text(table + "\n")
    result = {"dense_steps": N, "steps": M, "config": args.config, "params": params,
              "dense_phase1_eval": dense_evals,
              "arms": {n: {"train": [{"step": r["step"], "loss": r["loss"]} for r in t],
                       "eval": e} for n, (t, e) in runs.items()}}
    (results / "upcycling.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {figures}/: upcycling.png, upcycling_vs_dense.png; {results}/: upcycling.md, upcycling.json",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
