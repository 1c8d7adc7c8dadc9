"""The optimizer step's share of a training step, by AdamW implementation: the stock JSON
(``torch_adam: true``: torch picks the for-loop on CPU, foreach on CUDA) against ``foreach`` and
``fused`` passed through the JSON's ``optimizer.params``, and against ZeRO-Offload's
``DeepSpeedCPUAdam`` (``offload_optimizer`` to the CPU with ``torch_adam`` deleted).

    python -m benchmarks.peers.optimizer_step                        # CPU: 1 process, fp32 ZeRO-1, mid size
    python -m benchmarks.peers.optimizer_step --config ds_configs/zero1.json --steps 30   # a GPU, bf16

In a run, the same choices are ``--set ds.optimizer.params.fused=true``, or a JSON with
``offload_optimizer`` and without ``torch_adam``. One model per variant is built from the same
weights and trained through the trainer's own step (``Stepper.train_step``, as
``benchmarks/peers/end_to_end.py`` does) on the same fixed batches, one step of each in turn, so that
load on a shared machine hits all alike. Prints per variant the optimizer class DeepSpeed built
(checked against the one asked for), the median step and optimizer time (``engine.step``:
DeepSpeed's ZeRO bookkeeping plus the update) and tokens/s, the speed-up over the stock JSON
(median of per-step ratios), and the largest relative difference of a step's loss from the stock
run's: the implementations round differently, so the losses agree to rounding, not bitwise. On a
GPU the offload variant moves the states over PCIe and steps on the host: it trades speed for
device memory.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
from pathlib import Path

import torch

from benchmarks.peers import end_to_end  # the sizes, batches, trainer build and phase timer

REPO = Path(__file__).resolve().parents[2]


def _offload_cpu_adam(ds: dict) -> None:
    ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    del ds["optimizer"]["params"]["torch_adam"]


# label -> (change to the JSON, the optimizer DeepSpeed must build from it)
TORCH_ADAMW = {"update": "torch.optim.adamw.AdamW"}
VARIANTS = {
    "stock JSON": (lambda ds: None, TORCH_ADAMW),
    '"foreach": true': (lambda ds: ds["optimizer"]["params"].update(foreach=True), {**TORCH_ADAMW, "foreach": True}),
    '"fused": true': (lambda ds: ds["optimizer"]["params"].update(fused=True), {**TORCH_ADAMW, "fused": True}),
    "offload, DeepSpeedCPUAdam": (_offload_cpu_adam, {"update": "deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam"}),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = end_to_end.run_parser(__doc__.split("\n\n")[0],
                              ("--size", dict(default="mid", choices=sorted(end_to_end.SIZES))), "variant")
    args = p.parse_args(argv)
    end_to_end.check_warmup(p, args, "optimizer_step.py")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    end_to_end.start(args)
    from training.engine.build import optimizer_summary
    from training.run.preflight import plan_for
    from training.run.trainer import Run

    plan = plan_for(args.config, args.recipe, end_to_end.SIZES[args.size] + ["model.moe.router_jitter=0.0"],
                    args.steps)
    recipe, ds0 = plan.recipe, plan.ds
    ctx = Run(plan).join_job()
    micro, acc = ds0["train_micro_batch_size_per_gpu"], ds0["gradient_accumulation_steps"]
    batches = end_to_end._batches(recipe.model, micro, acc, recipe.seq_len, args.steps, ctx.device)
    runs = {}
    for name, (change, expected) in VARIANTS.items():
        ds = copy.deepcopy(ds0)
        change(ds)
        model, timer, step = end_to_end.build_ours(Run(dataclasses.replace(plan, ds=ds)))
        built = optimizer_summary(step.__self__.engine)
        built.pop("wrapper")
        assert built == expected, (name, built)      # DeepSpeed built what the JSON asked for
        runs[name] = {"timer": timer, "step": step, "rows": [], "losses": []}
    for i, micro_batches in enumerate(batches, 1):
        for run in runs.values():
            with run["timer"].step(run["rows"]):
                row, _ = run["step"](i, micro_batches)
            run["losses"].append(row["loss"])

    tokens = micro * acc * recipe.seq_len
    stock = runs["stock JSON"]
    print(f"config {args.config}, size {args.size} ({recipe.model.num_params() / 1e6:.1f}M parameters), "
          f"device {ctx.device}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"medians over {args.steps - args.warmup} steps (ms)\n")
    print("| implementation | step | optimizer step | tokens/s | faster than stock | max rel loss diff |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, run in runs.items():
        timed = run["rows"][args.warmup:]
        total = statistics.median(r["total"] for r in timed)
        optim = statistics.median(r["optimizer"] for r in timed)
        speedup = statistics.median(s["total"] / r["total"]
                                    for s, r in zip(stock["rows"][args.warmup:], timed))
        diff = max(abs(a - b) / abs(a) for a, b in zip(stock["losses"], run["losses"]))
        print(f"| {name} | {1e3 * total:.1f} | {1e3 * optim:.1f} | {tokens / total:,.0f} | "
              f"{speedup:.2f}x | {diff:.1e} |")
    return end_to_end.finish()


if __name__ == "__main__":
    from training.run.distributed import exit_now
    exit_now(main())        # no interpreter finalization, where gloo's threads can abort a finished run
