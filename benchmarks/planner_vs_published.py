"""Kept at this path for the commands that name it: runs ``benchmarks/peers/planner_vs_published.py``,
as ``python -m benchmarks.peers.planner_vs_published`` does from the repository root."""

import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    runpy.run_module("benchmarks.peers.planner_vs_published", run_name="__main__", alter_sys=True)
