"""Summarize a gpu_suite.sh output folder as markdown for docs/PERFORMANCE.md.

    python benchmarks/gpu_figures.py OUT_DIR
"""

import json
import statistics
import sys
from pathlib import Path


def run_row(run_dir: Path) -> str:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r][5:] or rows      # skip warm-up steps
    tok = statistics.median(r["tokens_per_s"] for r in rows)
    mfu = statistics.median(r.get("mfu", float("nan")) for r in rows)
    mem = max(r.get("mem_gb", float("nan")) for r in rows)
    est = ""
    if (run_dir / "estimate.json").is_file():
        e = json.loads((run_dir / "estimate.json").read_text())
        total = e.get("worst", {}).get("gpu_total")
        est = f"{total / 1e9:.1f}" if total else ""
    return (f"| {run_dir.name} | {tok:,.0f} | {100 * mfu:.1f}% | {mem:.1f} | {est} | "
            f"{rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f} |")


def main(out: Path) -> None:
    print(f"GPU: {(out / 'gpu.txt').read_text().splitlines()[-1] if (out / 'gpu.txt').exists() else '?'}\n")
    print("| run | tokens/s | MFU (median) | peak mem GB | estimator GB | loss |")
    print("|---|---|---|---|---|---|")
    for run in sorted((out / "runs").glob("*")):
        if (run / "metrics.jsonl").is_file():
            print(run_row(run))
    for name in ("gpu_tests.txt", "moe_layer.md", "nccl.txt"):
        if (out / name).is_file():
            print(f"\n{name}:\n\n```\n{(out / name).read_text().strip()}\n```")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
