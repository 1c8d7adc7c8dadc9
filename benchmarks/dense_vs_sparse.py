"""Kept at this path for the commands that name it: runs ``benchmarks/studies/dense_vs_sparse.py``,
as ``python -m benchmarks.studies.dense_vs_sparse`` does from the repository root."""

import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    runpy.run_module("benchmarks.studies.dense_vs_sparse", run_name="__main__", alter_sys=True)
