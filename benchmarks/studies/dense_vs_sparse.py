"""Dense vs Switch vs Mixtral at equal active parameters, on the same tokens, over several seeds.

Hardware: CPU (one process per run, fp32, gloo); the study in docs/studies/dense-vs-sparse.md
(250 steps x 2 seeds x 3 families, then 11 sweep runs of 120 steps) took 16 min 51 s on a
2-core machine with another job on the other core. Launch:

    python benchmarks/dense_vs_sparse.py --steps 250 --seeds 2 --eval-every 50 --out runs/dvs \\
        [--families dense,switch,mixtral] [--sweeps capacity top_k experts aux] [--sweep-steps N]

Each arm (a tiny recipe plus overrides) runs through ``launch/sweep.py`` with
``--grid train.seed=1234,1235,...``: seed index i is the same sample order and init seed in
every arm. Writes ``DIR/results.json`` (one row per family), ``DIR/results.md``,
``DIR/eval_loss_vs_tokens.png`` and ``DIR/eval_loss_vs_flops.png``; with ``--sweeps``,
``DIR/sweeps.json``, ``DIR/sweeps.md`` and ``DIR/sweep_<name>.png``. Runs live under
``DIR/runs/<arm>/run00i`` (their checkpoints are deleted once collected). Bad input is one line
and exit code 2. See ``analysis/dense_vs_sparse.py`` and ``docs/studies/dense-vs-sparse.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

from analysis import dense_vs_sparse as dvs
from launch import sweep as sweep_cli

REPO = Path(__file__).resolve().parents[2]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, required=True, help="optimizer steps of each family run")
    p.add_argument("--out", required=True, help="output directory (new or empty)")
    p.add_argument("--seeds", type=int, default=2, help="seeds per arm (train.seed 1234, 1235, ...)")
    p.add_argument("--families", default="dense,switch,mixtral", help="comma-separated families")
    p.add_argument("--sweeps", nargs="*", default=[], metavar="NAME",
                   help=f"sweeps to run too: {', '.join(dvs.SWEEPS)}")
    p.add_argument("--sweep-steps", type=int, help="steps of each sweep run (default: --steps)")
    p.add_argument("--sweep-seeds", type=int, default=1, help="seeds per sweep arm")
    p.add_argument("--eval-every", type=int, default=50, help="eval.every of every run")
    p.add_argument("--eval-batches", type=int, default=8, help="eval.batches of every run")
    p.add_argument("--config", default="ds_configs/zero1_fp32.json", help="DeepSpeed JSON")
    return p.parse_args(argv)


def _check(args) -> tuple[list, dict]:
    for name in ("steps", "seeds", "sweep_steps", "sweep_seeds", "eval_every", "eval_batches"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} {value}: must be >= 1")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out}: exists and is not an empty directory; choose a new one")
    families = dvs.family_arms([f.strip() for f in args.families.split(",") if f.strip()])
    return families, dvs.sweep_arms(args.sweeps)


def _common(args) -> list[str]:
    return [f"eval.every={args.eval_every}", f"eval.batches={args.eval_batches}",
            "train.save_every=1000000", "train.keep_last=1", "tracking.wandb=false"]


def _run_arm(args, arm, steps: int, seeds: list[int], where: Path) -> list[dict]:
    """Every seed of one arm through ``launch/sweep.py``; the runs' curves, seed order."""
    argv = ["--config", args.config, "--recipe", str(REPO / arm.recipe), "--steps", str(steps),
            "--grid", "train.seed=" + ",".join(map(str, seeds)), "--out", str(where),
            "--set", *_common(args), *arm.sets]
    print(f"== {arm.name}: {len(seeds)} seed(s) x {steps} steps", flush=True)
    with contextlib.redirect_stdout(sys.stderr):          # the sweep's own table: progress only
        rc = sweep_cli.main(argv)
    rows = json.loads((where / "results.json").read_text()) if (where / "results.json").is_file() else []
    failed = [r["status"] for r in rows if r["status"] != "ok"]
    if rc != 0 or failed or len(rows) != len(seeds):
        raise RuntimeError(f"{arm.name}: runs failed ({'; '.join(failed) or f'exit {rc}'}; logs in {where})")
    curves = [dvs.curve(Path(r["run_dir"])) for r in rows]
    for r in rows:
        shutil.rmtree(Path(r["run_dir"]) / "checkpoints", ignore_errors=True)
    return curves


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        families, sweeps = _check(args)
        facts = {arm.name: dvs.model_facts(arm, _common(args))
                 for arm in families + [a for arms in sweeps.values() for a in arms]}
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    try:
        _study(args, families, sweeps, facts, out)
    except RuntimeError as err:                       # a run failed: its log is named
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


def _study(args, families, sweeps, facts, out: Path) -> None:
    runs = {arm.name: (facts[arm.name], _run_arm(args, arm, args.steps, dvs.seeds(args.seeds),
                                                 out / "runs" / arm.name)) for arm in families}
    rows = [dvs.summarize(arm, *runs[arm.name]) for arm in families]
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    (out / "results.md").write_text(dvs.table(rows))
    dvs.plot_eval(runs, out)
    print(dvs.table(rows), end="")

    if sweeps:
        sweep_rows = []
        for name, arms in sweeps.items():
            curves = {a.name: _run_arm(args, a, args.sweep_steps or args.steps, dvs.seeds(args.sweep_seeds),
                                       out / "runs" / a.name) for a in arms}
            these = [{"sweep": name, **dvs.summarize(a, facts[a.name], curves[a.name])} for a in arms]
            dvs.plot_sweep(name, these, curves, out)
            sweep_rows += these
            (out / "sweeps.json").write_text(json.dumps(sweep_rows, indent=1))
        (out / "sweeps.md").write_text(dvs.table(sweep_rows))
        print(dvs.table(sweep_rows), end="")


if __name__ == "__main__":
    sys.exit(main())
