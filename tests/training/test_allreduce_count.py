"""All-reduces per optimizer step barely grow with gradient accumulation (tiny Mixtral, 2 ranks
at EP2, fp32 ZeRO-1): the gradients of the parameters replicated over ep are summed once per
step in buckets (``ReplicaGradSync``'s "step" mode), not per parameter per micro-batch.

Counted by ``_count_allreduce_run.py`` around ``launch/train.py``: every
``torch.distributed.all_reduce`` of a step, ours and DeepSpeed's. What remains per micro-batch is
the forward's routed-count all-reduce of each MoE layer (the load-balancing loss needs the
micro-batch's counts), so the total grows by one per MoE layer per extra micro-batch; at one
layer (used here) accumulation 4 costs at most 1.5x accumulation 1 (measured 11 vs 8; at two
layers 15 vs 9). Before, every replicated parameter's gradient was all-reduced per micro-batch
(7 per block plus 3: 11 + 7 = 18 at one layer, 4 x 11 + 7 = 51 at accumulation 4).
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


LAYERS = 1
ROUTED_COUNTS = "model/moe/layer.py:MoELayer.forward"


def _counts(tmp_path: Path, accumulation: int) -> list[dict]:
    name = f"acc{accumulation}"
    config = ds_variant(tmp_path, "zero1_fp32", train_micro_batch_size_per_gpu=2,
                        gradient_accumulation_steps=accumulation)
    out = tmp_path / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(REPO / "tests" / "training" / "_count_allreduce_run.py"),
           "--config", config, "--run-dir", str(tmp_path / f"run-{name}"), "--steps", "3",
           "--set", *SMALL, "parallel.expert_parallel_size=2", "eval.every=0",
           f"model.num_layers={LAYERS}"]
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
    # Only the forward's routed counts grow with the micro-batches; the replicated gradients are
    # summed by one bucketed all-reduce per step, at any accumulation.
    for acc, steps in ((1, one), (4, four)):
        for step in steps:
            where = dict(step["where"])
            assert where.pop(ROUTED_COUNTS) == acc * LAYERS, step
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
