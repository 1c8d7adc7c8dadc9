"""The memory of building the model (planning/build_memory.py) and the planner's refusal of a
layout whose build does not fit. Closed forms written out here; the measured counterpart (peak
RSS of a 0.8B ZeRO-3 build on 2 ranks) is tests/training/engine/test_sharded_build.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch import estimate_memory
from planning import estimator as em
from planning import report
from planning.build_memory import build_bytes, largest_draw
from planning.memory_model import Layout
from training.config.ds_config import load_ds_config
from training.config.recipe import load_recipe

REPO = Path(__file__).resolve().parents[2]
GB = 1e9
MIXTRAL_EP1 = ["parallel.expert_parallel_size=1", "parallel.pipeline_parallel_size=1"]


def _ds(name):
    return load_ds_config(str(REPO / "ds_configs" / f"{name}.json"))


def test_build_bytes_closed_forms():
    cfg = load_recipe(REPO / "recipes" / "mixtral_8x7b.yaml", MIXTRAL_EP1).model
    psi, h, f = cfg.num_params(), cfg.hidden_size, cfg.ffn_hidden_size
    experts = 8 * h * f                          # one stacked expert projection, (E, H, I)
    tile = h * (f // 64)                         # one init tile of it: (1, H, I/64)
    # Without zero.Init every rank holds its whole shard in fp32: 187 GB per rank.
    old = build_bytes(cfg, Layout(64), _ds("zero2"))
    assert old["params"] == 4 * psi and round(old["params"] / GB) == 187
    assert old["draw"] == 4 * (experts + tile) and old["host"] == 4 * psi + 4 * (experts + tile)
    assert old["device"] == 0
    # ZeRO-3 bf16: a 1/64 partition in bf16 on the GPU, the expert module (3 projections) whole
    # there while it is created and broadcast, one fp32 projection (and a tile) drawn on the host.
    new = build_bytes(cfg, Layout(64), _ds("zero3"))
    assert new["params"] == pytest.approx(2 * psi / 64)
    assert new["construct"] == 2 * 2 * 3 * experts
    assert new["device"] == pytest.approx(2 * psi / 64 + 12 * experts) and new["host"] == 4 * (experts + tile)
    # Offloaded parameters: the partition is built on the host.
    off = build_bytes(cfg, Layout(64), _ds("zero3_offload"))
    assert off["host"] == pytest.approx(off["params"] + off["draw"])
    # Under tp 2 x ep 8 each rank draws only its shards: the largest is its half of the
    # vocabulary rows (plus one tile of 32000 / 64 rows), larger than its 1/16 of an expert
    # projection.
    vocab = cfg.vocab_size * h
    assert experts // 16 + tile < vocab // 2
    assert largest_draw(cfg, Layout(64, tp=2, ep=8)) == vocab // 2 + vocab // 64
    # CPU accelerator: the construction, then the draw, on top of the partition.
    assert new["cpu_peak"] == pytest.approx(new["params"] + max(new["construct"], new["draw"]))


def test_estimate_refuses_a_build_that_does_not_fit_the_host():
    recipe = load_recipe(REPO / "recipes" / "mixtral_8x7b.yaml", MIXTRAL_EP1)
    zero1 = em.estimate(recipe, _ds("zero1"), 64)
    build = zero1["build"]
    assert not build["fits"] and not zero1["fits"]
    assert build["host_per_node"] == pytest.approx(8 * build["host_per_rank"])
    assert build["host_memory"] == em.HOST_GB_PER_GPU * 8 * GB
    assert "host memory per node" in build["reason"] and "ZeRO-3" in build["reason"]
    zero3 = em.estimate(recipe, _ds("zero3"), 64)
    assert zero3["build"]["fits"] and zero3["fits"] and zero3["build"]["reason"] is None
    assert "build (before deepspeed.initialize)" in report.format_estimate(zero3)


def test_planner_refuses_layouts_whose_build_does_not_fit_and_says_why(capsys):
    """Dense 7B on 8 H100s with 200 GB of host memory: ZeRO 0-2 at tp 1 build 27.0 GB of fp32
    per rank plus the 0.5 GB embedding draw, 8 x 27.5 = 220 GB per node; ZeRO-3 builds 1/8 in
    bf16 on the GPUs and only draws on the host."""
    argv = ["--plan", "--recipe", "recipes/dense_7b.yaml", "--nodes", "1", "--gpus-per-node", "8",
            "--gpu", "h100-80gb", "--json"]
    assert estimate_memory.main(argv + ["--host-memory-gb", "200"]) == 0
    result = json.loads(capsys.readouterr().out)
    refused = {(r["zero_stage"], r["tp"], r["pp"]): r["reason"] for r in result["refused"]}
    for stage in (0, 1, 2):
        assert "220 GB of host memory per node" in refused[(stage, 1, 1)], refused
    assert all(stage != 3 for stage, _, _ in refused)
    assert result["fitting"] >= 1 and result["layouts"]
    assert all((r["zero_stage"], r["tp"], r["pp"]) not in refused for r in result["layouts"])
    table = report.format_plan(result, result["command"], "")
    assert "refused: " in table and "220 GB of host memory per node" in table
    # With the default host memory (128 GB per GPU) the same node refuses nothing.
    assert estimate_memory.main(argv) == 0
    assert json.loads(capsys.readouterr().out)["refused"] == []
