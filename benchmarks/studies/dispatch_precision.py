"""What sending the expert all-to-all in bf16 or fp8 does to training (``model.moe.dispatch_dtype``).

    python -m benchmarks.studies.dispatch_precision                    # CPU: 2 gloo ranks, EP2, fp32, 60 steps
    python -m benchmarks.studies.dispatch_precision --nproc 8 --config ds_configs/zero1.json --set parallel.expert_parallel_size=8

Trains the same recipe (tiny Mixtral by default, at expert parallelism 2) from the same seed and
data three times: the exchange as computed (fp32 here), in bf16, and in fp8 (e4m3, one scale per
row, for the dispatch; the combine and the backward in bf16). Prints, per run, the loss at a few
steps, the largest relative loss difference from the first run over all steps, and the final eval
loss; the bytes each exchange moves are counted by ``benchmarks/systems/comm_volume.py``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WIRES = ("null", "bf16", "fp8")


def run(args, wire: str, run_dir: Path) -> dict:
    prefix = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc)]
              if args.nproc > 1 else [sys.executable])
    cmd = prefix + ["launch/train.py", "--config", args.config, "--recipe", args.recipe,
                    "--run-dir", str(run_dir), "--steps", str(args.steps), "--set",
                    "parallel.expert_parallel_size=2", f"eval.every={args.steps}",
                    "train.log_every=10", f"model.moe.dispatch_dtype={wire}", *args.set]
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"loss": [r["loss"] for r in logged if "loss" in r],
            "eval_loss": [r["eval_loss"] for r in logged if "eval_loss" in r][-1]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="ds_configs/zero1_fp32.json")
    p.add_argument("--recipe", default="recipes/tiny_mixtral.yaml")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--set", nargs="*", default=[], help="more recipe overrides")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="dispatch-"))
    try:
        results = {wire: run(args, wire, root / wire) for wire in WIRES}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ref = results["null"]["loss"]
    marks = sorted({1, len(ref) // 4, len(ref) // 2, len(ref)})
    print(f"{args.recipe}, {args.config}, {args.nproc} ranks at EP2, {args.steps} steps\n")
    print("| exchange | " + " | ".join(f"loss step {m}" for m in marks)
          + " | max relative loss difference | final eval loss |")
    print("|---|" + "---|" * (len(marks) + 2))
    for wire, r in results.items():
        diff = max(abs(a - b) / abs(b) for a, b in zip(r["loss"], ref))
        name = {"null": "as computed (fp32)", "bf16": "bf16", "fp8": "fp8 e4m3 + row scale"}[wire]
        print(f"| {name} | " + " | ".join(f"{r['loss'][m - 1]:.4f}" for m in marks)
              + f" | {diff:.2e} | {r['eval_loss']:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
