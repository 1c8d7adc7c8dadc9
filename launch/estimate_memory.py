"""Per-GPU memory of a training run, and a planner that picks a layout that fits.

    python launch/estimate_memory.py --recipe R --config C --gpus N [--gpus-per-node 8]
                                     [--gpu h100-80gb] [--host-memory-gb GB] [--set key=value ...]
                                     [--json]
    python launch/estimate_memory.py --plan --recipe R [--config C] --nodes N --gpus-per-node G
                                     --gpu TYPE [--global-batch SEQS] [--host-memory-gb GB]
                                     [--cluster NAME | --network-gbit-s GBPS] [--moe-imbalance X]
                                     [--gemm-fraction F]
                                     [--write-config PATH] [--json]
    python launch/estimate_memory.py --checkpoint-interval --failures-per-node-day F [--nodes N]
                                     (--run-dir D | --save-stall-s S --step-time-s T)
                                     [--restart-s R] [--json]

What the estimate counts and how the planner ranks layouts: ``planning/estimator.py``; the
predicted step time (both modes) is ``planning/cost_model.py``'s, docs/planning.md; the
checkpoint interval (Young/Daly) is ``planning/checkpoint_interval.py``'s,
docs/checkpoints.md#how-often-to-save. Bad
inputs and layouts the trainer would refuse are one line on stderr, exit code 2. Estimates, not
measurements: check the top choice with a short run (``mem_gb`` in metrics.jsonl).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from planning import memory_model as mm  # noqa: E402
from planning.checkpoint_interval import checkpoint_interval, format_interval  # noqa: E402
from planning.estimator import estimate, launch_command, plan, step_time  # noqa: E402
from planning.report import format_estimate, format_plan  # noqa: E402
from planning.hardware import CLUSTERS, cluster  # noqa: E402
from training.config.ds_config import load_ds_config  # noqa: E402
from training.gpus import GPUS  # noqa: E402
from training.config.recipe import load_recipe  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default=None, help="recipe YAML (default: recipes/tiny_mixtral.yaml)")
    p.add_argument("--config", default=None, help="DeepSpeed JSON (estimate: required; plan: precision)")
    p.add_argument("--gpus", type=int, default=None, help="total GPUs (estimate)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu", default="h100-80gb", help=f"one of {', '.join(GPUS)}")
    p.add_argument("--host-memory-gb", type=float, default=None,
                   help="host memory per node the model build may use (default 128 per GPU)")
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="override recipe keys, as train.py does")
    p.add_argument("--plan", action="store_true", help="enumerate layouts and rank those that fit")
    p.add_argument("--nodes", type=int, default=1, help="nodes (plan, checkpoint interval)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per step (plan; default 4M tokens)")
    p.add_argument("--top", type=int, default=10, help="layouts to print (plan)")
    p.add_argument("--cluster", default=None,
                   help=f"a cluster shape, setting --gpu, --gpus-per-node and --network-gbit-s: "
                        f"one of {', '.join(CLUSTERS)}")
    p.add_argument("--network-gbit-s", type=float, default=None,
                   help="network bandwidth per node, Gb/s (default 400 per GPU: 3200 for 8)")
    p.add_argument("--gemm-fraction", type=float, default=None,
                   help="the GPU's large-GEMM share of its peak, measured (default: the table's)")
    p.add_argument("--moe-imbalance", type=float, default=1.0,
                   help="the busiest expert-parallel rank's routed tokens over the mean (default 1)")
    p.add_argument("--write-config", default=None,
                   help="plan: write the best layout's DeepSpeed JSON here and use it in the command")
    p.add_argument("--checkpoint-interval", action="store_true",
                   help="the train.save_every that minimises the expected lost time (Young/Daly)")
    p.add_argument("--failures-per-node-day", type=float, default=None,
                   help="checkpoint interval: failures of one node per day")
    p.add_argument("--run-dir", default=None,
                   help="checkpoint interval: a run whose metrics.jsonl gives the save stall and step time")
    p.add_argument("--save-stall-s", type=float, default=None,
                   help="checkpoint interval: seconds one save stops training (else the run's median)")
    p.add_argument("--step-time-s", type=float, default=None,
                   help="checkpoint interval: seconds per step (else the run's median)")
    p.add_argument("--restart-s", type=float, default=0.0,
                   help="checkpoint interval: seconds each failure costs besides the work redone")
    p.add_argument("--json", action="store_true", help="print one JSON object with every figure")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.checkpoint_interval:
            result = checkpoint_interval(args.failures_per_node_day, args.nodes, args.save_stall_s,
                                         args.step_time_s, args.run_dir, args.restart_s)
            print(json.dumps(result, indent=1) if args.json else format_interval(result))
            return 0
        if args.cluster is not None:
            if args.cluster not in CLUSTERS:
                raise ValueError(f"--cluster {args.cluster!r} is unknown: choose one of "
                                 f"{', '.join(CLUSTERS)}")
            args.gpu, args.gpus_per_node, network = CLUSTERS[args.cluster]
            args.network_gbit_s = args.network_gbit_s or network
        recipe = load_recipe(args.recipe, args.set)
        recipe_path = args.recipe or "recipes/tiny_mixtral.yaml"
        if args.plan:
            precision = mm.precision_of(load_ds_config(args.config)) if args.config else "bf16"
            result = plan(recipe, args.nodes, args.gpus_per_node, args.gpu, precision,
                          args.global_batch, args.top, args.host_memory_gb, args.network_gbit_s,
                          args.moe_imbalance, args.gemm_fraction)
            command = note = ""
            if result["layouts"]:
                best = result["layouts"][0]
                config = args.write_config
                if config:
                    ds = load_ds_config(str(REPO / best["config"]))
                    ds.update(train_micro_batch_size_per_gpu=best["micro_batch"],
                              gradient_accumulation_steps=best["accumulation"])
                    Path(config).write_text(json.dumps(ds, indent=2) + "\n")
                else:
                    note = (f"# then set in {best['config']}: \"train_micro_batch_size_per_gpu\": "
                            f"{best['micro_batch']}, \"gradient_accumulation_steps\": {best['accumulation']} "
                            f"(or rerun with --write-config PATH)")
                command = launch_command(best, recipe_path, args.nodes, args.gpus_per_node, config)
            result["command"] = command
            print(json.dumps(result, indent=1) if args.json else format_plan(result, command, note))
            return 0
        if args.config is None or args.gpus is None:
            raise ValueError("--config and --gpus are required (or use --plan --nodes N)")
        ds = load_ds_config(args.config)
        est = estimate(recipe, ds, args.gpus, args.gpus_per_node, args.gpu, args.host_memory_gb)
        where = cluster(args.gpu, args.gpus_per_node, args.network_gbit_s,
                        gemm_fraction=args.gemm_fraction)
        est["predicted"] = step_time(recipe, est, ds, where, args.moe_imbalance)
        print(json.dumps(est, indent=1) if args.json else format_estimate(est))
        return 0
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
