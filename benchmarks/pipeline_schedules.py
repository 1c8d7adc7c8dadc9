"""Kept at this path for the commands that name it: runs ``benchmarks/systems/pipeline_schedules.py``,
as ``python -m benchmarks.systems.pipeline_schedules`` does from the repository root."""

import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    runpy.run_module("benchmarks.systems.pipeline_schedules", run_name="__main__", alter_sys=True)
