"""How long a checkpoint save stops training: background saves (``train.async_save``, the
default) against DeepSpeed's own ``save_checkpoint`` writing every file in the loop.

    python -m benchmarks.reliability.checkpoint_stall                 # CPU: 2 gloo ranks, tiny Mixtral at hidden 512
    python -m benchmarks.reliability.checkpoint_stall --size tiny     # the tiny recipe as it is
    python -m benchmarks.reliability.checkpoint_stall --nproc 8 --config ds_configs/zero3.json --set model.hidden_size=2048

Runs ``launch/train.py`` twice with the same recipe, DeepSpeed JSON and seed, saving every
``--save-every`` steps into a run directory under ``--dir`` (put it on the filesystem the
checkpoints will really go to: a shared filesystem is where background saves pay). Reads the
trainer's ``save_stall_s`` rows (the wall time the loop spent in the save call, the finish of an
earlier background save included) and ``step_time_s`` rows from ``metrics.jsonl``, and the bytes
of one checkpoint. Prints a markdown table and the ratio of the median stalls (background / in
the loop). The losses of the two runs must be equal: the check fails the benchmark otherwise.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SIZES = {"tiny": [], "mid": ["model.hidden_size=512", "model.num_heads=8", "model.num_kv_heads=4",
                             "model.ffn_hidden_size=512", "model.num_layers=4"]}


def run(args, background: bool, run_dir: Path) -> dict:
    prefix = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc)]
              if args.nproc > 1 else [sys.executable])
    cmd = prefix + ["launch/train.py", "--config", args.config, "--recipe", args.recipe,
                    "--run-dir", str(run_dir), "--steps", str(args.steps), "--set", *SIZES[args.size],
                    "eval.every=0", "train.log_every=5",
                    f"train.save_every={args.save_every}", "train.keep_last=2",
                    f"train.async_save={str(background).lower()}", *args.set]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    stalls = [r["save_stall_s"] for r in logged if "save_stall_s" in r]
    steps = [r["step_time_s"] for r in logged if "step_time_s" in r]
    ckpt = run_dir / "checkpoints"
    tag = (ckpt / "latest").read_text().strip()
    size = sum(p.stat().st_size for p in (ckpt / tag).rglob("*") if p.is_file())
    return {"stalls": stalls, "step_s": statistics.median(steps), "wall_s": wall, "bytes": size,
            "losses": [r["loss"] for r in logged if "loss" in r]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="ds_configs/zero3_fp32.json")
    p.add_argument("--recipe", default="recipes/tiny_mixtral.yaml")
    p.add_argument("--size", choices=sorted(SIZES), default="mid",
                   help="tiny: the recipe as is; mid: hidden 512, 4 layers (a few hundred MB)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=21)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--dir", default=None, help="where the run directories go (default: a temp dir)")
    p.add_argument("--set", nargs="*", default=[], help="more recipe overrides")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(dir=args.dir, prefix="ckpt-stall-"))
    try:
        results = {mode: run(args, mode == "background", root / mode) for mode in ("loop", "background")}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if results["loop"]["losses"] != results["background"]["losses"]:
        print("FAIL: the two runs' losses differ", file=sys.stderr)
        return 1
    print(f"{args.size}: {args.nproc} ranks, {args.config}, checkpoint {results['loop']['bytes'] / 1e6:.1f} MB, "
          f"a save every {args.save_every} of {args.steps} steps\n")
    print("| saves written | median stall per save (s) | max stall (s) | median step (s) | run wall (s) |")
    print("|---|---|---|---|---|")
    for mode, r in results.items():
        name = "in the loop (DeepSpeed's save_checkpoint)" if mode == "loop" else "in the background"
        print(f"| {name} | {statistics.median(r['stalls']):.3f} | {max(r['stalls']):.3f} | "
              f"{r['step_s']:.3f} | {r['wall_s']:.1f} |")
    ratio = statistics.median(results["background"]["stalls"]) / statistics.median(results["loop"]["stalls"])
    print(f"\nstall ratio (background / in the loop): {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
