"""Gradient accumulation for memory: peak memory, step time and loss of micro-batch 8 x
accumulation 1, 4 x 2 and 1 x 8 (the same 8 sequences per step), through the trainer's own step,
beside the memory estimator's figure for each.

    OMP_NUM_THREADS=1 python -m benchmarks.systems.accumulation_memory          # CPU, 1 process, 20-30 s
    python -m benchmarks.systems.accumulation_memory --splits 8x1,2x4 --steps 4 --json acc.json --plot ''

Hardware: one CPU process (or one GPU); no launcher. Each split is the trainer's run of the
recipe (default: tiny Mixtral, 2.82M parameters, 128 tokens per sequence) under ``--config``
(default ``ds_configs/zero0_fp32.json``: fp32, ZeRO-0, so that no ZeRO bucket sized for large
models sits in the peak), built and stepped as ``launch/train.py`` does
(``Run.build_model``: the DeepSpeed engine; ``Run.build_stepper``: ``Stepper.train_step``, the
exact accumulation of training/step/stepper.py) with ``ds.train_micro_batch_size_per_gpu`` and
``ds.gradient_accumulation_steps`` set per split. The load-balancing loss is switched off
(``model.moe.aux_loss_coef=0``): it is a per-micro-batch statistic and the one term of the
objective that depends on the split by design (docs/accumulation.md); with it off the three
splits train the same model, and their per-step losses are compared.

Every split gets the same tokens: fixed Zipf-distributed ids per step (``step_batches`` of
``benchmarks/peers/fsdp2_vs_zero3.py``), the step's 8 sequences cut into micro-batches in order.

- peak: tensor bytes allocated above the start, over the build and the first ``--memory-steps``
  steps (``PeakMemory`` of ``benchmarks/peers/fsdp2_vs_zero3.py``: on CPU the running sum of
  ``torch.profiler``'s allocation events, not RSS; on GPU ``torch.cuda.max_memory_allocated``).
- estimate: ``planning.estimator.estimate`` of the same recipe and resolved JSON on 1 rank
  (``on_gpu=False``: the optimizer temporaries of torch's CPU Adam): its total, the model states
  and the activation term (``activations["total"]``: saved + the one block recomputed + the logits
  and their gradient), the only term that depends on the micro-batch.
- step time: median of the steps after the memory steps, the splits taking turns within each
  step so that other load hits all alike.

Writes ``--json`` (default benchmarks/systems/results/accumulation_memory.json) and ``--plot`` (default
docs/studies/img/accumulation_memory.png); prints one table. Exits 1 when a step's loss differs
from the first split's by more than ``--rtol``; 2 on a bad argument.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.peers.fsdp2_vs_zero3 import PeakMemory, step_batches
from training.run.host import cpu_name

REPO = Path(__file__).resolve().parents[2]

MB = 1e6


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="recipes/tiny_mixtral.yaml")
    p.add_argument("--config", default="ds_configs/zero0_fp32.json", help="DeepSpeed JSON")
    p.add_argument("--splits", default="8x1,4x2,1x8",
                   help="micro-batch x accumulation steps, comma-separated; every product equal")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per split")
    p.add_argument("--memory-steps", type=int, default=2, help="first steps run under the memory profiler")
    p.add_argument("--rtol", type=float, default=1e-5, help="largest relative loss difference allowed")
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="recipe overrides and ds.* DeepSpeed keys, as launch/train.py takes them")
    p.add_argument("--json", default="benchmarks/systems/results/accumulation_memory.json", help="results ('' for none)")
    p.add_argument("--plot", default="docs/studies/img/accumulation_memory.png", help="figure ('' for none)")
    return p.parse_args(argv)


def parse_splits(text: str) -> list[tuple[int, int]]:
    """``"8x1,4x2"`` -> [(8, 1), (4, 2)]; ValueError naming the flag when malformed or unequal."""
    try:
        splits = [tuple(int(v) for v in s.split("x")) for s in text.split(",")]
        ok = all(len(s) == 2 and min(s) >= 1 for s in splits)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"--splits {text!r}: write MICROxACCUMULATION pairs, e.g. 8x1,4x2,1x8")
    if len({m * g for m, g in splits}) != 1:
        raise ValueError(f"--splits {text!r}: micro x accumulation must be the same for every split "
                         f"(the same sequences per step)")
    return splits


def build_split(micro: int, gas: int, args):
    """The trainer's run of this split, joined to the process group, and its estimate."""
    from planning.estimator import estimate
    from training.run.preflight import plan_for
    from training.run.trainer import Run
    sets = [*args.set, "model.moe.aux_loss_coef=0.0", f"ds.train_micro_batch_size_per_gpu={micro}",
            f"ds.gradient_accumulation_steps={gas}"]
    plan = plan_for(REPO / args.config, str(REPO / args.recipe), sets, args.steps)
    if plan.world_size != 1:
        raise ValueError(f"WORLD_SIZE {plan.world_size}: run this benchmark as one process (no torchrun)")
    est = estimate(plan.recipe, plan.ds, 1, on_gpu=False)["worst"]
    run = Run(plan)
    run.join_job()
    return run, est


def measure(args) -> dict:
    splits = parse_splits(args.splits)
    rows, runs, t_start = [], {}, time.time()
    for i, (micro, gas) in enumerate(splits):
        name = f"{micro}x{gas}"
        run, est = build_split(micro, gas, args)
        ctx, recipe, ds = run.ctx, run.plan.recipe, run.plan.ds
        batches = step_batches(recipe.model, ds, recipe.seq_len, args.steps, 0, 1, ctx.device)
        row = {"split": name, "micro_batch": micro, "accumulation": gas, "seq_len": recipe.seq_len,
               "tokens_per_step": ds["train_batch_size"] * recipe.seq_len, "loss": [], "time_s": [],
               "estimate": {"total": est["gpu_total"], "model_states": est["model_states"],
                            "activations": est["activations"]["total"],
                            "activations_saved": est["activations"]["saved"],
                            "optimizer_step": est["buffers"]["optimizer_step"]}}
        gc.collect()
        with PeakMemory(ctx.device) as mem:
            run.build_model()
            stepper = run.build_stepper()
            for step in range(1, args.memory_steps + 1):
                row["loss"].append(_step(stepper, step, batches))
        row["peak_bytes"] = mem.peak
        runs[name] = (stepper, batches)
        rows.append(row)
        done = time.time() - t_start
        print(f"[{i + 1}/{len(splits)}] {name}: peak {mem.peak / MB:.1f} MB, estimate "
              f"{est['gpu_total'] / MB:.1f} MB; {done:.0f} s, ETA {done / (i + 1) * (len(splits) - i - 1):.0f} s "
              f"before the timed steps", flush=True)
    for step in range(args.memory_steps + 1, args.steps + 1):
        k = step % len(rows)
        for row in rows[k:] + rows[:k]:             # each split first in turn
            stepper, batches = runs[row["split"]]
            t0 = time.perf_counter()
            row["loss"].append(_step(stepper, step, batches))
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            row["time_s"].append(time.perf_counter() - t0)
    base = rows[0]["loss"]
    for row in rows:
        row["median_step_s"] = statistics.median(row["time_s"]) if row["time_s"] else None
        row["max_rel_loss_diff"] = max(abs(a - b) / abs(b) for a, b in zip(row["loss"], base))
    return {"header": header(args), "rows": rows,
            "command": " ".join(["python -m benchmarks.systems.accumulation_memory", *sys.argv[1:]])}


def _step(stepper, step: int, batches) -> float:
    row, _ = stepper.train_step(step, batches[step - 1])
    assert "skipped" not in row, row
    return row["loss"]


def header(args) -> str:
    return (f"{datetime.date.today()} | {cpu_name()} | torch "
            f"{torch.__version__} | {torch.get_num_threads()} threads | {args.recipe} | {args.config} "
            f"| {args.steps} steps, peak over the build and the first {args.memory_steps}")


def format_table(rows: list[dict]) -> str:
    lines = ["| micro x accumulation | peak measured (MB) | estimate total (MB) | estimate: model states "
             "| estimate: activations | median step (ms) | loss, last step | max relative loss "
             "difference from the first |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        e, t = r["estimate"], r["median_step_s"]
        lines.append(f"| {r['micro_batch']} x {r['accumulation']} | {r['peak_bytes'] / MB:.2f} "
                     f"| {e['total'] / MB:.2f} | {e['model_states'] / MB:.2f} | {e['activations'] / MB:.2f} "
                     f"| {'-' if t is None else f'{t * 1e3:.1f}'} | {r['loss'][-1]:.6f} "
                     f"| {r['max_rel_loss_diff']:.1e} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [f"{r['micro_batch']} x {r['accumulation']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    w = 0.38
    ax.bar([i - w / 2 for i in x], [r["peak_bytes"] / MB for r in rows], w, label="measured peak")
    ax.bar([i + w / 2 for i in x], [r["estimate"]["total"] / MB for r in rows], w, label="estimate: total")
    ax.plot(list(x), [r["estimate"]["activations"] / MB for r in rows], "k.--", label="estimate: activations")
    ax.set_xticks(list(x), labels)
    ax.set_xlabel("micro-batch x accumulation steps (8 sequences per step)")
    ax.set_ylabel("MB")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        parse_splits(args.splits)
        if not 1 <= args.memory_steps < args.steps:
            raise ValueError(f"--memory-steps ({args.memory_steps}) must be in [1, --steps {args.steps})")
        res = measure(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(res["header"])
    print(format_table(res["rows"]))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    if args.plot:
        plot(res["rows"], Path(args.plot), f"{Path(args.recipe).stem}, {Path(args.config).stem}: peak memory per split")
    worst = max(r["max_rel_loss_diff"] for r in res["rows"])
    if worst > args.rtol:
        print(f"FAIL: the splits' losses differ by {worst:.1e} relative (> {args.rtol:g})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from training.run.distributed import exit_now
    exit_now(main())        # no interpreter finalization, where gloo's threads can abort a finished run
