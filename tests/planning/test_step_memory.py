"""A real ZeRO-3 step stays within the estimator's figure: 2 gloo ranks at EP2 and at TP2 with
sequence parallelism, tiny Mixtral widened to hidden 512 (4 layers), fp32 ZeRO-3
(``ds_configs/zero3_fp32.json`` at micro-batch 2).

``_step_memory_run.py`` profiles steps 2-4 of ``launch/train.py`` with the CPU allocator's
events (``torch.profiler``, ``profile_memory``): how far each step rose above the memory it held
at rest, split into forward+backward and the optimizer step. The estimator
(``planning/estimator.py`` with ``on_gpu=False``, which counts the CPU optimizer's temporaries)
must bound both:

- forward+backward: activations + the reduce bucket and its flat copy + ZeRO-3's gathered
  parameters (the largest module twice and the prefetch) + the all-to-all rows. The sum is an
  upper bound by construction: by the time the last bucket is reduced, where the measured peak
  sits, the activations are freed. It holds here although gloo's reduce-scatter also allocates a
  full-size output, which NCCL does not.
- optimizer step: the fp32 gradient sub-group and torch AdamW's two single-tensor temporaries
  (``exp_avg_sq.sqrt()`` and its quotient), one copy each of the same group.

Each rank's median over the three steps is asserted. The peaks are replayed from each profile's
own events: the allocator's running total carries what an earlier profile allocated into the
next one (41 MB carried so once put one rank's optimizer step at 1.25x its bound). Every step's
peak is printed with the largest allocations alive at it and the ops that made them, so that an
outlier names its cause. Each bound must also be tight enough to mean something: the median is
at least ``TIGHT[phase]`` of it (measured in two runs here: forward+backward 0.57-0.62 at EP2 and
0.54-0.57 at TP2+SP, optimizer step 0.85-0.92 and 0.90-0.95). Both terms are needed: with
the optimizer's temporaries and ZeRO-3's flat copy of the bucket left out of the estimate, the
optimizer step measured 2.6-2.8x the estimator's figure, and EP2's forward+backward 1.1-1.2x.
That the replicated weights are released after use (not kept gathered until backward) is
checked where it is visible exactly: ``tests/parallel/test_grad_sync.py`` (no saved view of a
parameter).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from planning import estimator as em
from tests.runs import SMALL, ds_variant
from training.config.ds_config import load_ds_config
from training.config.recipe import load_recipe

REPO = Path(__file__).resolve().parents[2]
WIDE = ["model.hidden_size=512", "model.num_layers=4", "model.ffn_hidden_size=256",
        "eval.every=0", "train.log_every=1"]
LAYOUTS = {"ep2": ["parallel.expert_parallel_size=2"],
           "tp2-sp": ["parallel.tensor_parallel_size=2", "parallel.sequence_parallel=true"]}
TIGHT = {"forward_backward": 0.5, "optimizer_step": 0.8}
STEPS = (2, 3, 4)                       # the profiled steps; step 1 allocates DeepSpeed's buffers


def _measure(warm, tmp_path: Path, config: str, layout: list[str]) -> list[dict]:
    out = tmp_path / "peaks"
    warm.script("tests/planning/_step_memory_run.py",
                ["--config", config, "--run-dir", str(tmp_path / "run"), "--steps", str(STEPS[-1]),
                 "--set", *SMALL, *WIDE, *layout], tmp_path / "run.log", timeout=600,
                extra_env={"STEP_MEMORY": str(out)})
    return [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_zero3_step_peak_within_the_estimate(warm_launcher, tmp_path, name):
    config = ds_variant(tmp_path, "zero3_fp32", train_micro_batch_size_per_gpu=2)
    recipe = load_recipe(REPO / "recipes" / "tiny_mixtral.yaml", SMALL + WIDE + LAYOUTS[name])
    ds = load_ds_config(config)
    ds.pop("scheduler")
    stage = em.estimate(recipe, ds, 2, gpus_per_node=2, on_gpu=False)["worst"]
    buffers = stage["buffers"]
    bound = {"forward_backward": stage["activations"]["total"] + buffers["reduce_bucket"]
             + buffers["zero3_gather"] + buffers["all_to_all"],
             "optimizer_step": buffers["optimizer_step"]}
    ranks = _measure(warm_launcher, tmp_path, config, LAYOUTS[name])
    for rank, steps in enumerate(ranks):
        for step in STEPS:
            print(name, f"rank {rank} step {step}:", ", ".join(
                f"{phase} {steps[str(step)][phase]['bytes'] / 1e6:.1f} MB of {bound[phase] / 1e6:.1f}"
                f" ({steps[str(step)][phase]['bytes'] / bound[phase]:.2f}), largest alive "
                + "; ".join(f"{b / 1e6:.1f} MB {ops}" for b, ops in steps[str(step)][phase]["largest"])
                for phase in bound))
    for steps in ranks:
        for phase in bound:
            peak = statistics.median(steps[str(step)][phase]["bytes"] for step in STEPS)
            assert TIGHT[phase] * bound[phase] <= peak <= bound[phase], (phase, peak, bound[phase])
