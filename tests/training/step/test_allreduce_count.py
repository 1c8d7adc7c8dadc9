"""All-reduces per optimizer step barely grow with gradient accumulation (tiny Mixtral with its
4 layers, 2 ranks at EP2, fp32 ZeRO-1): the gradients of the parameters replicated over ep are
summed once per step in buckets (``ReplicaGradSync``'s "step" mode), not per parameter per
micro-batch.

Counted by ``_count_allreduce_run.py`` around ``launch/train.py``: every
``torch.distributed.all_reduce`` of a step, ours and DeepSpeed's. What remains per micro-batch is
the routed-count all-reduce of the load-balancing loss (it needs the micro-batch's counts): one
per micro-batch for all MoE layers together (``load_balancing_losses``), so accumulation 4 adds
3 all-reduces at any depth. Measured at 4 layers: 12 at accumulation 4 against 9 at 1 (5 of
them DeepSpeed's, 1 the bucketed replica sum, 1 the step statistics, 1 the preemption flag). The
test fails if each MoE layer all-reduces its own counts in its forward (measured: 23 against 11
at 4 layers) or if every replicated parameter's gradient is all-reduced per micro-batch (7 per
block plus 3).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.runs import ds_variant, rows
from tests.training.step.test_host_syncs import MODERN

LAYERS = 4            # tiny Mixtral's own depth
STEPS = 4
ROUTED_COUNTS = "model/moe/layer.py:load_balancing_losses"
COUNT_RUN = "tests/training/step/_count_allreduce_run.py"


@pytest.fixture(scope="module")
def runs(warm_launcher, tmp_path_factory) -> dict[str, Path]:
    """Every run of this module, counted by ``_count_allreduce_run.py`` (which only counts: it
    changes no value): 2 ranks at EP2, micro-batch 2, 4 layers, 4 steps, eval off; fp32 ZeRO-1 at
    accumulation 1 and 4, the loss-free-balancing model at 4, and fp32 ZeRO-2 at 4. Each name maps
    to the prefix of the run's ``<prefix>.<rank>.json`` counts; its run directory is
    ``<prefix>-run``."""
    tmp = tmp_path_factory.mktemp("allreduce")
    out = {}
    warm = warm_launcher
    for name, stage, accumulation, extra in (("acc1", 1, 1, ()), ("acc4", 1, 4, ()),
                                             ("acc4-modern", 1, 4, MODERN),
                                             ("acc4-zero2", 2, 4, ())):
        out[name] = tmp / name
        config = ds_variant(tmp, f"zero{stage}_fp32", train_micro_batch_size_per_gpu=2,
                            gradient_accumulation_steps=accumulation)
        warm.launch(tmp / f"{name}-run", config, nproc=2, steps=STEPS, script=COUNT_RUN,
                    extra=["parallel.expert_parallel_size=2", "eval.every=0",
                           f"model.num_layers={LAYERS}", *extra],
                    extra_env={"ALLREDUCE_COUNTS": str(out[name])})
    return out


def _counts(runs: dict[str, Path], name: str) -> list[dict]:
    ranks = [json.loads(Path(f"{runs[name]}.{r}.json").read_text()) for r in range(2)]
    return [steps[str(s)] for steps in ranks for s in (2, 3)]     # step 1 warms up


def test_all_reduces_per_step_barely_grow_with_accumulation(runs):
    one, four = _counts(runs, "acc1"), _counts(runs, "acc4")
    print("accumulation 1:", json.dumps(one[0], indent=1))
    print("accumulation 4:", json.dumps(four[0], indent=1))
    assert len({s["count"] for s in one}) == 1 and len({s["count"] for s in four}) == 1, (one, four)
    assert four[0]["count"] <= 1.5 * one[0]["count"], (one[0], four[0])
    # Only the routed counts grow with the micro-batches, once per micro-batch whatever the
    # depth; the replicated gradients are summed by one bucketed all-reduce per step.
    for acc, steps in ((1, one), (4, four)):
        for step in steps:
            where = dict(step["where"])
            assert where.pop(ROUTED_COUNTS) == acc, step
            assert where.get("model/parallel/grad_sync.py:ReplicaGradSync.sum_accumulated") == 1, step
            assert where == {k: v for k, v in one[0]["where"] if k != ROUTED_COUNTS}, (step, one[0])


def test_step_mode_accumulation_matches_per_micro_batch_sums(runs):
    """Micro-batch 2 x accumulation 4 at EP2: fp32 ZeRO-1 (the "step" mode: one sum at the
    boundary) against fp32 ZeRO-2 (DeepSpeed's hooks take ``.grad`` every micro-batch, so the
    "micro_batch" mode sums each backward). The same losses and gradient norms to summation-order
    rounding. The ZeRO-1 run is the counted one above (4 layers, every one with replicated
    parameters to sum, rather than 2: the same comparison over more of them)."""
    got = {stage: rows(Path(f"{runs[name]}-run")) for stage, name in ((1, "acc4"), (2, "acc4-zero2"))}
    assert len(got[1]) == len(got[2]) == STEPS
    for a, b in zip(got[2], got[1]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), a["step"]


def test_the_expert_bias_update_adds_no_all_reduce(runs):
    """Loss-free balancing (with sigmoid scores, groups and gated shared experts): the update
    reads the step statistics' all-reduce, so the all-reduces are the same, call site by call
    site, as plain tiny Mixtral's (both at accumulation 4: the update happens once per step, after
    every micro-batch's counts)."""
    plain, modern = _counts(runs, "acc4"), _counts(runs, "acc4-modern")
    assert [s["where"] for s in modern] == [s["where"] for s in plain], (plain[0], modern[0])
