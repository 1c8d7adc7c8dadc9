"""Does the expert bias balance the load without an auxiliary loss? (DeepSeek-V3's loss-free balancing)

    python -m benchmarks.studies.loss_free_balancing                       # CPU: tiny DeepSeek-style MoE, 200 steps per rate
    python -m benchmarks.studies.loss_free_balancing --rates 0,0.001 --steps 400 --recipe recipes/tiny_qwen3_moe.yaml

Trains ``--recipe`` once per ``model.moe.expert_bias_update_rate`` in ``--rates`` with the
auxiliary loss off (``aux_loss_coef`` 0), the same seed and data otherwise, one process each
through ``launch/train.py``. Reads ``expert_load_max_over_mean`` (the worst MoE layer's busiest
expert over the mean, every step) from ``metrics.jsonl`` and prints, per rate: its mean over
the first and the last ``--window`` steps, the first step from which it stays under
``--target`` for the rest of the run, the final training loss, and ``expert_bias_range`` (the
widest spread max - min of one layer's biases) at the middle step and the last.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(args, rate: str, run_dir: Path) -> list[dict]:
    cmd = [sys.executable, "launch/train.py", "--config", args.config, "--recipe", args.recipe,
           "--run-dir", str(run_dir), "--steps", str(args.steps), "--set", "eval.every=0",
           "train.log_every=50", f"train.save_every={args.steps}", "model.moe.aux_loss_coef=0.0",
           f"model.moe.expert_bias_update_rate={rate}"]
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def settled(loads: list[float], target: float) -> int | None:
    """The first step from which the load stays under ``target`` to the end (None: never)."""
    step = None
    for i, load in enumerate(loads, 1):
        if load >= target:
            step = None
        elif step is None:
            step = i
    return step


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="recipes/tiny_deepseek_moe.yaml")
    p.add_argument("--config", default="ds_configs/zero1_fp32.json")
    p.add_argument("--rates", default="0,0.001,0.002", help="comma-separated bias update rates")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--window", type=int, default=20, help="steps averaged at the start and the end")
    p.add_argument("--target", type=float, default=1.3)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="balance-"))
    try:
        results = {rate: run(args, rate, root / f"rate{rate}") for rate in args.rates.split(",")}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.recipe}, aux loss off, {args.steps} steps, {args.config}\n")
    print(f"| bias update rate | load max/mean, steps 1-{args.window} | load max/mean, last {args.window} "
          f"steps | under {args.target} from step | final loss | bias spread, step {args.steps // 2} | "
          f"bias spread, step {args.steps} |")
    print("|---|---|---|---|---|---|---|")
    for rate, rows in results.items():
        loads = [r["expert_load_max_over_mean"] for r in rows]
        first = statistics.mean(loads[:args.window])
        last = statistics.mean(loads[-args.window:])
        mid, end = (rows[args.steps // 2 - 1].get("expert_bias_range"),
                    rows[-1].get("expert_bias_range"))
        print(f"| {rate} | {first:.3f} | {last:.3f} | {settled(loads, args.target) or 'never'} | "
              f"{rows[-1]['loss']:.4f} | {mid if mid is None else f'{mid:.4f}'} | "
              f"{end if end is None else f'{end:.4f}'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
