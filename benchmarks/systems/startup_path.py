"""How the trainer's start-up reads: the repository files it passes through, in call order.

    python -m benchmarks.systems.startup_path [--steps 1] [--list]

Runs ``launch/train.py``'s ``main`` in this process (the tiny default recipe, fp32 ZeRO-1, one
rank, a fresh run directory) under ``sys.setprofile`` and records, from ``main`` up to the first
optimizer step (the first call of a function named ``train_step``), every call of a function
defined in this repository (``launch/``, ``training/``, ``model/``, ``data_pipeline/``,
``planning/``, ``interop/``, ``analysis/``), by the file that defines it. Consecutive calls in
the same file are one stay. It prints:

- files entered: how many different files the path calls into;
- stays: how many times the path moves into a file (the length of that sequence);
- returns: stays in a file the path had already left (a reader following the start-up reopens a
  file they have read), and of those the climbs: calls back into a file that is still waiting
  further down the call stack (a callback, or a lower module calling up into the one that
  called it: the bounces a reader cannot follow top to bottom);

for every repository file, and for the trainer's own (``launch/`` and ``training/``; the same
path with the other files' stays left out), then the files in order of first entry with their
stays (``--list``: the trainer's sequence).

A measure of how the code is laid out for a reader, not of speed: the same figures on any
machine for the same code (the data preparation and tokenizer, cached under ``.cache/`` after the
first run, are reached the same way either way: their functions are called either way).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("launch", "training", "model", "data_pipeline", "planning", "interop", "analysis")
SMALL = ["model.hidden_size=64", "model.num_layers=2", "model.ffn_hidden_size=64",
         "model.max_seq_len=64", "data.seq_len=64", "data.max_bytes=1500000",
         "tokenizer.train_bytes=1500000", "eval.every=0"]


def trace_startup(argv: list[str]) -> list[tuple[str, bool]]:
    """Every Python call from ``main(argv)`` to the first ``train_step`` into a function of this
    repository: (its file, whether that file was still open further down the call stack, i.e.
    the call climbs back into a file that is waiting on this very call chain)."""
    from launch import train
    calls: list[tuple[str, bool]] = []
    stack: list[str | None] = []            # the file of every open frame (None: not ours)

    def ours(frame) -> str | None:
        path = frame.f_code.co_filename
        if not path.startswith(str(REPO)):
            return None
        rel = os.path.relpath(path, REPO)
        return rel if rel.split(os.sep)[0] in PACKAGES else None

    def profile(frame, event, arg):
        if event == "return":
            if stack:
                stack.pop()
            return
        if event != "call":
            return
        rel = ours(frame)
        if rel is not None and frame.f_code.co_name == "train_step":
            sys.setprofile(None)
            raise _FirstStep
        if rel is not None:
            caller = next((f for f in reversed(stack) if f is not None), None)
            calls.append((rel, rel != caller and rel in stack))
        stack.append(rel)

    sys.setprofile(profile)
    try:
        train.main(argv)
    except _FirstStep:
        pass
    finally:
        sys.setprofile(None)
    return calls


class _FirstStep(Exception):
    """Raised in the profiler at the first optimizer step: the start-up is over."""


def stays(calls: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
    """Consecutive calls in one file merged into one stay (a climb if its first call is one)."""
    return [c for i, c in enumerate(calls) if i == 0 or calls[i - 1][0] != c[0]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="ds_configs/zero1_fp32.json")
    p.add_argument("--list", action="store_true", help="print the trainer's sequence of stays")
    args = p.parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "disabled")
    with tempfile.TemporaryDirectory() as tmp:
        path = stays(trace_startup(["--config", args.config, "--run-dir", str(Path(tmp) / "run"),
                                    "--steps", "1", "--set", *SMALL]))
    trainer = stays([c for c in path if c[0].startswith(("launch", "training"))])
    for name, seq in (("every repository file", path), ("the trainer's files (launch/, training/)", trainer)):
        entered, stayed, returns, climbs = summary(seq)
        print(f"start-up path of launch/train.py (main to the first train_step), {name}: "
              f"{entered} files entered, {stayed} stays, {returns} returns to a file already left, "
              f"{climbs} of them climbs back into a file still waiting on the call chain")
    counts = Counter(f for f, _ in path)
    for f in dict.fromkeys(f for f, _ in path):
        print(f"  {counts[f]:3d}  {f}")
    if args.list:
        print("\n".join(f + (" (climb)" if climb else "") for f, climb in trainer))
    return 0


def summary(path: list[tuple[str, bool]]) -> tuple[int, int, int, int]:
    """(files entered, stays, returns to a file already left, climbs) of a sequence of stays."""
    seen, returns = set(), 0
    for f, _ in path:
        returns += f in seen
        seen.add(f)
    return len(seen), len(path), returns, sum(climb for _, climb in path)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)          # no interpreter finalization: gloo's threads (training/run/distributed.py)
