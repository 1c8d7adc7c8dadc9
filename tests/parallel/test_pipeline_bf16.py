"""The pipeline schedules in bf16 at ZeRO-1, under both optimizers DeepSpeed 0.19.8 picks there,
with ``overlap_comm`` off and on: GPipe and ZB-H1 equal DeepSpeed's 1F1B step for step.

The optimizers: ``ds_configs/zero1.json`` gets ``DeepSpeedZeroOptimizer``, which accumulates
the micro-batches' bf16 gradients in ``.grad`` until the ``ReduceGrads`` instruction; with
``"data_types": {"grad_accum_dtype": "fp32"}`` it gets ``BF16_Optimizer``, which zeroes
``.grad`` before every backward and adds it into fp32 accumulators after it, so ZB-H1's
deferred weight gradients go straight into those accumulators
(``training.engine.pipe_schedules.fp32_accumulator_sink``; without it they are lost: the grad
norm fell from 0.699 to 0.488 at step 1, measured). fp32 ZeRO-1 with ``overlap_comm`` too.

Layouts, 4 gloo ranks in one launched process group: PP2 x DP2 (the data-parallel reduction
after the deferred gradients) and PP2 x TP2 (the tensor-parallel replicas' sums of a deferred
gradient), tiny Mixtral, micro-batch 2 x accumulation 4, 3 steps.

Tolerance: relative 1e-6 on the loss and the grad norm (measured: bitwise equal). The three
schedules run the same micro-batches through the same kernels, and every gradient reaches its
accumulator in micro-batch order (a deferred W adds the same bf16 product, in the same order,
that the plain backward would have), so nothing but the schedule's order of independent work
differs. A W lost or counted twice moves the grad norm by about 30%, far outside bf16's own
rounding (2^-8 relative) and this bound.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.runs import ds_variant, rows

COMMON = ["model.moe.router_jitter=0.0", "parallel.pipeline_parallel_size=2", "eval.every=0",
          "train.log_every=1"]
LAYOUTS = {"pp2xdp2": [], "pp2xtp2": ["parallel.tensor_parallel_size=2"]}
# (layout, settings name, schedules): 1f1b first, the reference of the others.
CASES = [("pp2xdp2", "bf16", ("1f1b", "gpipe", "zb-h1")),
         ("pp2xdp2", "bf16-overlap", ("1f1b", "gpipe", "zb-h1")),
         ("pp2xdp2", "bf16-fp32accum", ("1f1b", "gpipe", "zb-h1")),
         ("pp2xdp2", "fp32-overlap", ("1f1b", "zb-h1")),
         ("pp2xtp2", "bf16", ("1f1b", "gpipe", "zb-h1")),
         ("pp2xtp2", "bf16-fp32accum", ("1f1b", "zb-h1"))]
RTOL = 1e-6


def _config(tmp: Path, name: str) -> str:
    base = "zero1_fp32" if name.startswith("fp32") else "zero1"
    path = Path(ds_variant(tmp, base, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4))
    ds = json.loads(path.read_text())
    ds["zero_optimization"]["overlap_comm"] = name.endswith("overlap")
    if name.endswith("fp32accum"):
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
    out = tmp / f"{name}.json"
    out.write_text(json.dumps(ds))
    return str(out)


@pytest.fixture(scope="module")
def runs(warm_launcher, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("pipe-bf16")
    batch = [(tmp / f"{layout}-{name}-{schedule}", _config(tmp, name),
              COMMON + LAYOUTS[layout] + [f"parallel.pipeline_schedule={schedule}"])
             for layout, name, schedules in CASES for schedule in schedules]
    warm_launcher.launch_many(batch, nproc=4, steps=3, timeout=1200)
    return tmp


@pytest.mark.parametrize("layout, name, schedules", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_gpipe_and_zb_h1_equal_1f1b_step_for_step(runs, layout, name, schedules):
    reference, *others = [rows(runs / f"{layout}-{name}-{s}") for s in schedules]
    assert [r["step"] for r in reference] == [1, 2, 3]
    assert all("skipped" not in r for r in reference), reference
    for schedule, other in zip(schedules[1:], others):
        assert [r["step"] for r in other] == [1, 2, 3], (schedule, other)
        for a, b in zip(reference, other):
            for key in ("loss", "grad_norm"):
                assert b[key] == pytest.approx(a[key], rel=RTOL), (schedule, key, a, b)
    log = (runs / f"{layout}-{name}-{schedules[-1]}.log").read_text()
    # The optimizer DeepSpeed picked: BF16_Optimizer announces itself.
    assert ("begin bf16_optimizer" in log) == name.endswith("fp32accum"), log[-2000:]
