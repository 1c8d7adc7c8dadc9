"""What a run writes beside its checkpoints: ``config.json`` and the metrics (``metrics.jsonl``,
W&B, the progress line)."""

from __future__ import annotations

import json
import platform
import subprocess
from pathlib import Path

import torch

from training.config.schema import Recipe
from training.engine.build import optimizer_summary
from training.files import REPO, atomic_write
from training.run.distributed import DistContext
from training.tracking import MFU_NOTE, Progress, Tracker

def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def resolved_config(recipe: Recipe, ds: dict, ctx: DistContext, dp_size: int, engine=None) -> dict:
    import deepspeed
    import transformers
    par = recipe.parallel
    return {
        "recipe": recipe.to_dict(),
        "ds_config": ds,
        "optimizer": optimizer_summary(engine) if engine is not None else None,
        "world": {"world_size": ctx.world_size, "data_parallel_size": dp_size,
                  "tensor_parallel_size": par.tensor_parallel_size,
                  "expert_parallel_size": par.expert_parallel_size,
                  "context_parallel_size": par.context_parallel_size, "cp_comm": par.cp_comm,
                  "pipeline_parallel_size": par.pipeline_parallel_size,
                  # ep ranks per node of the hierarchical expert exchange (0: the flat one)
                  "ep_ranks_per_node": ctx.groups.ep_per_node,
                  # the schedule class the pipeline engine's train_batch runs (null: no stages)
                  "pipeline_schedule": (type(engine._train_schedule()).__name__
                                        if engine is not None and ctx.groups.pp > 1 else None),
                  "device": str(ctx.device.type), "gpu": ctx.gpu.name if ctx.gpu else None},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "deepspeed": deepspeed.__version__, "transformers": transformers.__version__},
        "git_commit": _git_commit(),
        "mfu_definition": MFU_NOTE,
    }


def write_config(run_dir: Path, config: dict) -> None:
    atomic_write(run_dir / "config.json", json.dumps(config, indent=2) + "\n")


def build_tracking(recipe: Recipe, run_dir: Path, rank0: bool, start_step: int, config: dict | None):
    """The metrics writer (and W&B, whose run config is ``config``: rank 0's ``resolved_config``)
    and the progress line."""
    tracker = Tracker(run_dir, rank0, recipe.tracking, config,
                      resume_step=start_step if start_step else None, run_name=recipe.name,
                      router_every=recipe.train.log_every)
    progress = Progress(recipe.train.steps, recipe.train.log_every, start_step, rank0)
    return tracker, progress
