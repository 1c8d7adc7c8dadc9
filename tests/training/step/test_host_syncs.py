"""Host syncs per optimizer step from our code: at most 6, independent of the accumulation steps
and of the number of layers (tiny Mixtral, 2 data-parallel ranks, fp32 ZeRO-1).

Each call counted by ``_count_syncs_run.py`` would make a GPU wait for the host (a device-to-host
copy or a data-dependent shape). The step statistics are accumulated on the device and brought to
the host once per step; the rest are the few values the host must decide on (the skip decision,
the gradient norm). A count that grows with accumulation or depth means a sync per micro-batch
or per layer crept back in.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.runs import SMALL, ds_variant

REPO = Path(__file__).resolve().parents[3]
LIMIT = 6


# DeepSeek-V3 routing with loss-free balancing on, and gated shared experts.
MODERN = ["model.moe.score_function=sigmoid", "model.moe.n_group=4", "model.moe.topk_group=2",
          "model.moe.routed_scaling_factor=2.5", "model.moe.expert_bias_update_rate=1e-3",
          "model.moe.num_shared_experts=1", "model.moe.shared_expert_gate=true"]


def _counts(warm, tmp_path: Path, accumulation: int, layers: int, extra=()) -> list[dict]:
    name = f"acc{accumulation}-layers{layers}{'-modern' if extra else ''}"
    config = ds_variant(tmp_path, "zero1_fp32", train_micro_batch_size_per_gpu=2,
                        gradient_accumulation_steps=accumulation)
    out = tmp_path / name
    warm.script("tests/training/step/_count_syncs_run.py",
                ["--config", config, "--run-dir", str(tmp_path / f"run-{name}"), "--steps", "3", "--set",
                 *SMALL, f"model.num_layers={layers}", "eval.every=0",
                 "model.moe.router_jitter=0.0", *extra],   # tiny Mixtral's jitter (SMALL turns it on)
                tmp_path / f"{name}.log", extra_env={"SYNC_COUNTS": str(out)})
    ranks = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(2)]
    return [steps[str(s)] for steps in ranks for s in (2, 3)]     # step 1 warms up


@pytest.mark.parametrize("accumulation,layers", [(1, 2), (4, 2), (4, 4)])
def test_host_syncs_per_optimizer_step(warm_launcher, tmp_path, accumulation, layers):
    for step in _counts(warm_launcher, tmp_path, accumulation, layers):
        assert step["count"] <= LIMIT, json.dumps(step["where"], indent=1)
        # The counter sees our calls: at least the one copy of the step statistics.
        assert any(where.startswith("tolist training/step/stepper.py") for where, _ in step["where"]), step


def test_modern_routing_and_the_expert_bias_update_add_no_host_sync(warm_launcher, tmp_path):
    """Sigmoid scores, groups, the bias and its update after every step (from the statistics
    already on the device), and shared experts: the same syncs, call site by call site, as
    plain tiny Mixtral."""
    plain, modern = _counts(warm_launcher, tmp_path, 2, 2), _counts(warm_launcher, tmp_path, 2, 2, MODERN)
    assert [s["where"] for s in modern] == [s["where"] for s in plain], (plain[0], modern[0])
