"""benchmarks/systems/cpu_allocator.py: alternates the two settings, hands the tuned thresholds to the
child only in its tuned runs, and prints its table (the figures are measured by hand: see
docs/performance/cpu-allocator.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
# The child records which setting it ran under, in the order it ran.
CHILD = ("import os, sys; open(sys.argv[1], 'a').write(os.environ.get('MALLOC_MMAP_THRESHOLD_', '-') + ' ' "
         "+ os.environ.get('MALLOC_TRIM_THRESHOLD_', '-') + '\\n'); bytearray(1 << 26)")


def test_alternates_settings_and_prints_the_table(tmp_path, monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "123")          # the caller's value is not inherited
    log = tmp_path / "seen.txt"
    done = subprocess.run([sys.executable, "-m", "benchmarks.systems.cpu_allocator", "--pairs", "2", "--",
                           sys.executable, "-c", CHILD, str(log)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert log.read_text().splitlines() == ["- -", "4294967296 68719476736"] * 2
    table = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert [row.split("|")[1].strip() for row in table[1:]] == [
        "glibc defaults", "MALLOC_MMAP_THRESHOLD_ + MALLOC_TRIM_THRESHOLD_", "tuned / default"]
    assert table[-1].count("x |") == 3
