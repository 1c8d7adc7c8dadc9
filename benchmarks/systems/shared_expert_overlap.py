"""Shared experts overlapped with the expert dispatch, against the sequential layer: step time
and losses through the trainer, side by side in one run.

    OMP_NUM_THREADS=1 python -m benchmarks.systems.shared_expert_overlap [--steps 40] [--repeats 2] [--out DIR]

``recipes/tiny_deepseek_moe.yaml`` (16 routed experts of inner size 32, top-6, a shared expert
of 64; block 0 dense) at 2 ranks, EP2, fp32 ZeRO-1 (``ds_configs/zero1_fp32.json``), with
``parallel.shared_expert_overlap`` off and on, alternated ``--repeats`` times so that both see
the same machine. Prints one table (median step time over the steps after the first 5, and the
largest loss difference between the two settings) and one JSON line; exits 1 when a loss
differs by more than 1e-6 (fp32: the same operations in another order). Writes
``DIR/results.json`` with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WARMUP = 5            # steps left out of the step-time median
TOLERANCE = 1e-6


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(overlap: bool, steps: int, run_dir: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_port()), "launch/train.py", "--config", "ds_configs/zero1_fp32.json",
           "--recipe", "recipes/tiny_deepseek_moe.yaml", "--run-dir", str(run_dir),
           "--steps", str(steps), "--set", "parallel.expert_parallel_size=2",
           f"parallel.shared_expert_overlap={str(overlap).lower()}", "eval.every=0",
           f"train.save_every={steps * 10}", f"train.log_every={steps}",
           "data.max_bytes=1500000", "tokenizer.train_bytes=1500000"]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
    with open(f"{run_dir}.log", "w") as log:
        subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.steps <= WARMUP or args.repeats < 1:
        p.error(f"--steps must exceed {WARMUP} and --repeats be >= 1")
    times: dict[bool, list[float]] = {False: [], True: []}
    losses: dict[bool, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for overlap in (False, True):
                rows = _run(overlap, args.steps, Path(tmp) / f"{'on' if overlap else 'off'}{i}")
                times[overlap] += [r["step_time_s"] for r in rows[WARMUP:]]
                losses.setdefault(overlap, [r["loss"] for r in rows])
                print(f"repeat {i + 1}/{args.repeats}, overlap {'on' if overlap else 'off'}: "
                      f"median {statistics.median(times[overlap]) * 1000:.1f} ms/step so far", flush=True)
    diff = max(abs(a - b) for a, b in zip(losses[False], losses[True]))
    off, on = statistics.median(times[False]), statistics.median(times[True])
    result = {"recipe": "tiny_deepseek_moe", "layout": "ep2, fp32 ZeRO-1", "steps": args.steps,
              "repeats": args.repeats, "step_time_s_sequential": round(off, 5),
              "step_time_s_overlapped": round(on, 5), "overlapped_over_sequential": round(on / off, 3),
              "max_loss_difference": diff}
    print("| shared experts | median step time | ratio |\n|---|---|---|")
    print(f"| sequential | {off * 1000:.1f} ms | 1.000 |")
    print(f"| overlapped with the dispatch | {on * 1000:.1f} ms | {on / off:.3f} |")
    print(f"largest loss difference over {args.steps} steps: {diff:.2e} (bound {TOLERANCE:g})")
    print(json.dumps(result))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(result, indent=1))
    return 0 if diff <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
