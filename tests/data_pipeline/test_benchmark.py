"""benchmarks/data_pipeline.py runs end to end at toy sizes and prints its whole table (the
figures themselves are measured by running it by hand: see its docstring)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_benchmark_prints_every_row(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "data_pipeline.py"), "--sizes-mb", "1", "2",
                           "--work-dir", str(tmp_path), "--vocab-size", "400"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    table = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    labels = [line.split("|")[1].strip() for line in table[1:]]
    assert labels == ["prepare 1 MB, 1 worker", "prepare 1 MB, 2 workers",
                      "prepare 1 MB, 1 worker, Rust encoder threads on",
                      "HF datasets load_dataset + map(num_proc=2), 1 MB",
                      "prepare: start-up before the first shard (tokenizer load, plan)",
                      "prepare 1 MB, 2 workers: peak RSS (process tree)",
                      "prepare 2 MB, 2 workers: peak RSS (process tree)",
                      "longest document (JSON line) per corpus", "peak RSS 2 MB - 1 MB",
                      "HF datasets map(num_proc=2), 1 MB: peak RSS",
                      "trainer on 1 MB prepared, 2 ranks: peak anonymous memory per rank",
                      "trainer on 1 MB prepared: launch to first step",
                      "trainer on 2 MB prepared, 2 ranks: peak anonymous memory per rank",
                      "trainer on 2 MB prepared: launch to first step",
                      "trainer peak memory per rank, 2 MB - 1 MB", "trainer launch to first step, 2 MB - 1 MB",
                      "warm restart on 2 MB: launch to first step"], labels
    assert "untouched" in table[-1], table[-1]
    for mb in (1, 2):
        corpus = tmp_path / f"corpus_{mb}MB.jsonl"
        assert mb * 1e6 <= corpus.stat().st_size < mb * 1e6 + 1.2e6     # whole documents to size
