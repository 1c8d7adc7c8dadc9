"""One training run's figures as a markdown table, for ``benchmarks/gpu_suite.sh``'s summary.

    python -m benchmarks.gpu.gpu_figures RUN_DIR [--estimate ESTIMATE.json] [--warmup 5]

From ``RUN_DIR/metrics.jsonl``: the median ``tokens_per_s``, ``mfu`` (causal attention at
6 x L x h x s) and ``mfu_full_attn`` (12 x L x h x s, as torchtitan and most published figures
count it) over the step rows after ``--warmup`` (fewer when the run is shorter: at least the last
step is kept), the peak ``mem_gb``, the loss of the first and last step; beside it the
estimator's GPU total and the planner's predicted tokens/s per GPU for the same run
(``launch/estimate_memory.py --json``: ``predicted``, from ``planning/cost_model.py``) with the
ratio measured / predicted, which calibrates the cost model's compute efficiency
(docs/planning.md, "Calibrating it on your GPU"). A figure the run did not log (no GPU: no
``mfu``, no ``mem_gb``) reads ``n/a``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

HEADER = ("| run | steps | tokens/s (median) | MFU (causal attn) | MFU (full attn) | peak mem GB "
          "| estimator GB | planner tokens/s | measured / planner | loss first -> last |\n"
          "|---|---|---|---|---|---|---|---|---|---|")


def _median(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else math.nan


def _fmt(value: float, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    return "n/a" if math.isnan(value) else f"{value * scale:{spec}}{suffix}"


def run_row(run_dir: Path, estimate: Path | None = None, warmup: int = 5) -> str:
    """The table row of one run; raises FileNotFoundError/ValueError with one line."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{metrics}: no such file (did the run start?)")
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "loss" in r and "tokens_per_s" in r]
    if not steps:
        raise ValueError(f"{metrics}: no step rows (a row with loss and tokens_per_s)")
    timed = steps[min(warmup, len(steps) - 1):]
    mem = [r["mem_gb"] for r in steps if isinstance(r.get("mem_gb"), (int, float))]
    est, predicted = "n/a", math.nan
    if estimate is not None and estimate.is_file():
        data = json.loads(estimate.read_text())
        total = (data.get("worst") or {}).get("gpu_total")
        est = f"{total / 1e9:.1f}" if total else "n/a"
        predicted = float((data.get("predicted") or {}).get("tokens_per_s_per_gpu", math.nan))
    measured = _median(timed, "tokens_per_s")
    return (f"| {run_dir.name} | {len(steps)} ({len(timed)} timed) | "
            f"{_fmt(measured, ',.0f')} | "
            f"{_fmt(_median(timed, 'mfu'), '.1f', 100, '%')} | "
            f"{_fmt(_median(timed, 'mfu_full_attn'), '.1f', 100, '%')} | "
            f"{f'{max(mem):.1f}' if mem else 'n/a'} | {est} | {_fmt(predicted, ',.0f')} | "
            f"{_fmt(measured / predicted, '.2f')} | "
            f"{steps[0]['loss']:.3f} -> {steps[-1]['loss']:.3f} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--estimate", type=Path, default=None)
    p.add_argument("--warmup", type=int, default=5, help="first step rows not timed")
    args = p.parse_args(argv)
    try:
        row = run_row(args.run_dir, args.estimate, args.warmup)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: gpu_figures.py: {err}", file=sys.stderr)
        return 2
    print(HEADER)
    print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
