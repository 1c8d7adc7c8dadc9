"""The communication benchmarks run short: ``benchmarks/studies/grad_compression_study.py`` (one seed, two
settings, 22 steps) writes its results, summary and plot with PowerSGD's bytes below the
uncompressed exchange's; ``benchmarks/systems/shared_expert_overlap.py`` (7 steps, once each) prints its
table and exits 0 only when the losses with and without the overlap agree within 1e-6."""

from __future__ import annotations

import json

import pytest

from tests.runs import python


@pytest.mark.parametrize("config", ["zero0_fp32", "zero1"])
def test_grad_compression_study_short(tmp_path, config):
    """The study's short version, fp32 ZeRO-0 and bf16 ZeRO-1: PowerSGD rank 4 sends at most an
    eighth of the uncompressed exchange and its loss after 22 steps (10 of them compressed) is
    within 3% of the uncompressed run's (the 200-step figures: docs/communication.md)."""
    done = python("-m", "benchmarks.studies.grad_compression_study", "--out", str(tmp_path), "--steps", "22",
                  "--models", "dense", "--settings", "none,powersgd-r4", "--seeds", "1", "--config", f"ds_configs/{config}.json",
                  "--results", str(tmp_path), "--figures", str(tmp_path), timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    stem = "grad_compression" + ("" if config == "zero0_fp32" else f"_{config}")
    summary = json.loads((tmp_path / f"{stem}.json").read_text())
    none, r4 = summary["dense/none"], summary["dense/powersgd-r4"]
    assert none["gap_to_none_pct"] == 0 and r4["exchange_bytes"] * 8 <= none["exchange_bytes"]
    assert abs(r4["gap_to_none_pct"]) <= 3, r4
    assert (tmp_path / f"{stem}_loss.png").stat().st_size > 10_000
    assert "ETA" in done.stdout


def test_shared_expert_overlap_benchmark_short():
    done = python("-m", "benchmarks.systems.shared_expert_overlap", "--steps", "7", "--repeats", "1", timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["max_loss_difference"] <= 1e-6 and result["step_time_s_overlapped"] > 0
    assert "| overlapped with the dispatch |" in done.stdout
