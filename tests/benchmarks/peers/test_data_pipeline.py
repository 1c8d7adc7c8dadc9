"""benchmarks/peers/data_pipeline.py runs end to end at a toy size and prints its whole table (the
figures themselves are measured by running it by hand: see its docstring).

The script's own run is at one corpus size: every measurement it makes is real (each way of
preparing, HF datasets, the trainer's first launch and its warm restart), and every row it prints
at that size comes from them. The rows only two sizes add (the larger corpus's preparation and
trainer rows, and their differences) come from the same functions and from arithmetic on their
results: the second test runs ``main`` on 1 and 2 MB with those measurements stood in for, and
checks the table it builds. A second real size would cost one more preparation and one more
2-rank trainer launch, about 45 of the 150 CPU-seconds the two-size run took here.
"""

from __future__ import annotations

import importlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
BENCHMARK = "benchmarks.peers.data_pipeline"
ONE_SIZE = ["prepare 1 MB, 1 worker", "prepare 1 MB, 2 workers",
            "prepare 1 MB, 1 worker, Rust encoder threads on",
            "HF datasets load_dataset + map(num_proc=2), 1 MB",
            "prepare: start-up before the first shard (tokenizer load, plan)",
            "prepare 1 MB, 2 workers: peak RSS (process tree)",
            "longest document (JSON line) per corpus",
            "HF datasets map(num_proc=2), 1 MB: peak RSS",
            "trainer on 1 MB prepared, 2 ranks: peak anonymous memory per rank",
            "trainer on 1 MB prepared: launch to first step",
            "warm restart on 1 MB: launch to first step"]
TWO_SIZES = ["prepare 1 MB, 1 worker", "prepare 1 MB, 2 workers",
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
             "warm restart on 2 MB: launch to first step"]


def _table(stdout: str) -> dict[str, str]:
    table = [line for line in stdout.splitlines() if line.startswith("| ")]
    assert table[0].split("|")[1].strip() == "measurement", table
    return {line.split("|")[1].strip(): line.split("|")[2].strip() for line in table[1:]}


@pytest.fixture(scope="module")
def one_size(tmp_path_factory):
    work = tmp_path_factory.mktemp("bench")
    done = subprocess.run([sys.executable, "-m", BENCHMARK, "--sizes-mb", "1", "--work-dir", str(work),
                           "--vocab-size", "400"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return work, done.stdout


def test_benchmark_prints_every_row(one_size):
    work, stdout = one_size
    rows = _table(stdout)
    assert list(rows) == ONE_SIZE, list(rows)
    # Every value is a measurement: a number first (rates and sizes above zero).
    for label, value in rows.items():
        number = re.match(r"[+-]?\d+(\.\d+)?", value)
        assert number, (label, value)
        assert float(number.group()) > 0, (label, value)
    assert re.fullmatch(r"\d+\.\d s \(resumed; \d+ prepared files untouched\)",
                        rows["warm restart on 1 MB: launch to first step"]), rows
    corpus = work / "corpus_1MB.jsonl"
    assert 1e6 <= corpus.stat().st_size < 1e6 + 1.2e6                  # whole documents to size


def test_two_sizes_add_their_rows_and_differences(one_size, tmp_path, monkeypatch, capsys):
    """``main`` on 1 and 2 MB, the 1 MB corpus the script's run wrote, the 2 MB one made here
    (the pool of the 1 MB one repeated), and stand-ins for the measuring subprocesses
    (``run_measured``) and the trainer (``_train_once``): every row of two sizes, in order, and the
    differences computed from the measurements."""
    bench = importlib.import_module(BENCHMARK)
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(one_size[0] / "corpus_1MB.jsonl", work)
    (work / "tokenizer_400").mkdir()                     # trained already: the stand-ins ignore it
    peak_rss = {"1mb_w2": 400e6, "2mb_w2": 446e6}        # bytes, per prepared output

    def run_measured(args, env):
        child = json.loads(args[1])
        assert Path(child["corpus"]).is_file(), child
        if child["kind"] == "hf":
            return {"seconds": 4.0, "peak_rss": 900e6}
        out = Path(child["out"]).parent.name
        return {"seconds": 5.0, "shard_seconds": 2.0, "peak_rss": peak_rss.get(out, 300e6)}

    trained = []

    def train_once(prefix, tokenizer, run_dir, steps):
        trained.append((prefix.parent.name, run_dir.name, steps))
        mb = 2 if "2mb" in prefix.parent.name else 1
        return {"peak_anon": 1000e6 + 30e6 * (mb - 1), "first_step_s": 20.0 + 0.5 * (mb - 1), "ranks": 2}

    monkeypatch.setattr(bench, "run_measured", run_measured)
    monkeypatch.setattr(bench, "_train_once", train_once)
    assert bench.main(["--sizes-mb", "1", "2", "--work-dir", str(work), "--vocab-size", "400"]) == 0
    rows = _table(capsys.readouterr().out)
    assert list(rows) == TWO_SIZES, list(rows)
    assert trained == [("1mb_w2", "train_1mb", 3), ("2mb_w2", "train_2mb", 3), ("2mb_w2", "train_2mb", 6)]
    assert rows["peak RSS 2 MB - 1 MB"] == "+46 MB (goal: within 100 MB)"
    assert rows["trainer peak memory per rank, 2 MB - 1 MB"] == "+30 MB (goal: within 50 MB)"
    assert rows["trainer launch to first step, 2 MB - 1 MB"] == "+0.5 s (goal: within 2 s)"
    assert rows["prepare 2 MB, 2 workers: peak RSS (process tree)"].startswith("446 MB  (")
    for mb in (1, 2):
        corpus = work / f"corpus_{mb}MB.jsonl"
        assert mb * 1e6 <= corpus.stat().st_size < mb * 1e6 + 1.2e6     # whole documents to size
