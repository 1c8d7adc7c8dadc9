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
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import free_port
from tests.runs import SMALL, ds_variant, env, launch, rows

REPO = Path(__file__).resolve().parents[2]


LAYERS = 4            # tiny Mixtral's own depth
ROUTED_COUNTS = "model/moe/layer.py:load_balancing_losses"


def _counts(tmp_path: Path, accumulation: int, extra=()) -> list[dict]:
    name = f"acc{accumulation}{'-modern' if extra else ''}"
    config = ds_variant(tmp_path, "zero1_fp32", train_micro_batch_size_per_gpu=2,
                        gradient_accumulation_steps=accumulation)
    out = tmp_path / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(REPO / "tests" / "training" / "_count_allreduce_run.py"),
           "--config", config, "--run-dir", str(tmp_path / f"run-{name}"), "--steps", "3",
           "--set", *SMALL, "parallel.expert_parallel_size=2", "eval.every=0",
           f"model.num_layers={LAYERS}", *extra]
    proc = subprocess.run(cmd, cwd=REPO, env={**env(), "ALLREDUCE_COUNTS": str(out)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    ranks = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(2)]
    return [steps[str(s)] for steps in ranks for s in (2, 3)]     # step 1 warms up


def test_all_reduces_per_step_barely_grow_with_accumulation(tmp_path):
    one, four = _counts(tmp_path, 1), _counts(tmp_path, 4)
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


def test_step_mode_accumulation_matches_per_micro_batch_sums(tmp_path):
    """Micro-batch 2 x accumulation 4 at EP2: fp32 ZeRO-1 (the "step" mode: one sum at the
    boundary) against fp32 ZeRO-2 (DeepSpeed's hooks take ``.grad`` every micro-batch, so the
    "micro_batch" mode sums each backward). The same losses and gradient norms to summation-order
    rounding."""
    got = {}
    for stage in (1, 2):
        config = ds_variant(tmp_path, f"zero{stage}_fp32", train_micro_batch_size_per_gpu=2,
                            gradient_accumulation_steps=4)
        run_dir = tmp_path / f"zero{stage}"
        launch(run_dir, config, nproc=2, steps=4,
               extra=["parallel.expert_parallel_size=2", "eval.every=0"])
        got[stage] = rows(run_dir)
    assert len(got[1]) == len(got[2]) == 4
    for a, b in zip(got[2], got[1]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), a["step"]


def test_the_expert_bias_update_adds_no_all_reduce(tmp_path):
    """Loss-free balancing (with sigmoid scores, groups and gated shared experts): the update
    reads the step statistics' all-reduce, so the all-reduces are the same, call site by call
    site, as plain tiny Mixtral's."""
    from tests.training.test_host_syncs import MODERN
    plain, modern = _counts(tmp_path, 2), _counts(tmp_path, 2, MODERN)
    assert [s["where"] for s in modern] == [s["where"] for s in plain], (plain[0], modern[0])
