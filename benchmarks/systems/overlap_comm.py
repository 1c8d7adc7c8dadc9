"""DeepSpeed's ``overlap_comm``: training steps with and without it, at ZeRO 1 and 2, in one
launch (each rank runs the four trainings one after the other in one process group).

    # GPU (the GPU suite, part 2): 2 ranks on the one GPU over gloo bound to CUDA
    RANK=r WORLD_SIZE=2 LOCAL_RANK=0 ... python -m benchmarks.systems.overlap_comm --backend cuda:gloo \\
        --recipe recipes/dense_125m.yaml --config ds_configs/zero1.json --steps 12
    # CPU (the rehearsal):
    python -m torch.distributed.run --nproc_per_node 2 -m benchmarks.systems.overlap_comm --backend gloo \\
        --recipe recipes/tiny_dense.yaml --config ds_configs/zero1_fp32.json --steps 4

``overlap_comm`` reduces each gradient bucket on a CUDA stream of its own while backward goes
on; on DeepSpeed's CPU accelerator there is no such stream and the reductions block, so the CPU
run only proves the step runs. The JSON's ``zero_optimization`` gets ``stage`` 1 or 2,
``overlap_comm`` false or true and ``reduce_bucket_size`` ``--bucket`` (the same in all four,
small enough that backward produces several buckets to overlap). Rank 0 prints a markdown table
(median step time after the first ``--warmup`` steps, the ratio to the same stage without
overlap, the final loss) and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SETTINGS = [(1, False), (1, True), (2, False), (2, True)]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", required=True)
    p.add_argument("--config", required=True, help="the DeepSpeed JSON the four settings start from")
    p.add_argument("--backend", default="gloo", choices=("gloo", "cuda:gloo", "nccl"))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--bucket", type=float, default=2e7, help="reduce_bucket_size, elements")
    p.add_argument("--set", nargs="*", default=[], help="more recipe keys for every run")
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    import deepspeed
    import torch

    from launch import train
    if args.backend != "gloo":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(dist_backend=args.backend)     # the runs join this group
    rank = int(os.environ["RANK"])
    base = json.loads(Path(args.config).read_text())
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for stage, overlap in SETTINGS:
            cfg = json.loads(json.dumps(base))
            cfg["zero_optimization"].update(stage=stage, overlap_comm=overlap,
                                            reduce_bucket_size=int(args.bucket))
            config = Path(tmp) / f"zero{stage}_overlap{int(overlap)}_rank{rank}.json"
            config.write_text(json.dumps(cfg))
            run_dir = Path(tmp) / f"zero{stage}_overlap{int(overlap)}"
            code = train.main(["--config", str(config), "--recipe", args.recipe, "--run-dir", str(run_dir),
                               "--steps", str(args.steps), "--set", f"parallel.backend={args.backend}",
                               "eval.every=0", "train.save_every=0", "tracking.wandb=false",
                               f"train.log_every={args.steps}", *args.set])
            if code:
                print(f"overlap_comm: the ZeRO-{stage} run (overlap {overlap}) exited {code}", file=sys.stderr)
                return code
            if rank == 0:
                rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
                rows = [r for r in rows if "loss" in r]
                results.append({"stage": stage, "overlap_comm": overlap, "final_loss": rows[-1]["loss"],
                                "step_time_s": statistics.median(r["step_time_s"] for r in rows[args.warmup:])})
    if rank == 0:
        print(f"`overlap_comm` on and off, {args.recipe}, {args.config} (stage and overlap set), "
              f"reduce_bucket_size {args.bucket:.0e}, {os.environ['WORLD_SIZE']} ranks over {args.backend}:\n")
        print("| ZeRO | overlap_comm | median step time | vs off | final loss |\n|---|---|---|---|---|")
        for r in results:
            off = next(o for o in results if o["stage"] == r["stage"] and not o["overlap_comm"])
            print(f"| {r['stage']} | {'on' if r['overlap_comm'] else 'off'} | {r['step_time_s'] * 1000:.1f} ms "
                  f"| {r['step_time_s'] / off['step_time_s']:.3f} | {r['final_loss']:.4f} |")
        print(json.dumps({"overlap_comm": results}))
    return 0


if __name__ == "__main__":
    from training.run.distributed import exit_now
    exit_now(main())
