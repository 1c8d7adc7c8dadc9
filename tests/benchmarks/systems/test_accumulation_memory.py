"""Accumulation for memory (``benchmarks/systems/accumulation_memory.py``): through the trainer's step,
micro-batch 8 x accumulation 1, 4 x 2 and 1 x 8 (8 sequences of 128 tokens per step, tiny
Mixtral, ``zero0_fp32.json``, one process) train to the same losses while the peak falls with the
micro-batch, and the memory estimator's activation term orders them the same way.

Tolerances and why:
- losses: relative 1e-5 per step (as ``test_accumulation_is_exact``): the trainer's accumulation
  is exact (training/step/stepper.py), the aux loss is off, so only the fp32 summation order
  differs (measured 1.3e-7).
- peak: strictly falling. The activations of a micro-batch are what changes, about 39 and 34 MB
  from one split to the next (measured 134.7, 95.6, 61.2 MB), against a run-to-run spread of
  the profiler's peak of a few MB (1 x 8: 61.2 and 57.8 MB in two runs; allocations of other
  threads land in it).
- the estimator's total against the measured peak: within 0.8-1.3 (measured 1.08, 1.00, 1.11-1.17):
  a larger error would mean a term the trainer allocates is missing from the estimate.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.runs import REPO, env

SPLITS = ((8, 1), (4, 2), (1, 8))


def test_peak_memory_falls_with_the_micro_batch_at_equal_losses(tmp_path):
    out = tmp_path / "acc.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.systems.accumulation_memory", "--steps", "3",
                           "--memory-steps", "2", "--splits", ",".join(f"{m}x{g}" for m, g in SPLITS),
                           "--json", str(out), "--plot", ""], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["micro_batch"], r["accumulation"]) for r in rows] == list(SPLITS)
    assert len({r["tokens_per_step"] for r in rows}) == 1
    base = rows[0]["loss"]
    assert len(base) == 3 and base[-1] < base[0], base      # it trains
    for r in rows:
        for step, (a, b) in enumerate(zip(r["loss"], base), 1):
            assert abs(a - b) <= 1e-5 * abs(b), f"{r['split']}, step {step}: {a} vs 8x1 {b}"
        assert 0.8 <= r["estimate"]["total"] / r["peak_bytes"] <= 1.3, r
    peaks = [r["peak_bytes"] for r in rows]
    acts = [r["estimate"]["activations"] for r in rows]
    assert peaks[0] > peaks[1] > peaks[2], peaks
    assert acts[0] > acts[1] > acts[2], acts
    assert len({r["estimate"]["model_states"] for r in rows}) == 1      # only activations change


def test_bad_splits_are_one_line_and_exit_2(capsys):
    from benchmarks.systems import accumulation_memory
    assert accumulation_memory.main(["--splits", "8x1,4x1"]) == 2        # 8 vs 4 sequences per step
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--splits" in err and "same" in err, err
    assert accumulation_memory.main(["--splits", "8by1"]) == 2
    assert "MICROxACCUMULATION" in capsys.readouterr().err
