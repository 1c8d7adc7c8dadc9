"""Everything the trainer checks before any process group exists or any file is written.

``prepare`` validates the command line, the recipe and the DeepSpeed JSON (the layout against
the world size: ``Recipe.dims``, and ``ds_config.resolve_ds_config``), the backend and precision
against the machine, the data sources, ``--init-from`` and the run directory, and returns the
``Plan`` the run follows. Each refusal is a ValueError with one line naming the field and the
fix; ``launch/train.py`` prints it and exits 2 with the run directory untouched.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from data_pipeline.tokenizer import load_local_tokenizer
from training.checkpoint.layout import candidates, read_run_config
from training.config import ds_config
from training.config.recipe import Recipe, apply_overrides, load_recipe
from training.data import streams
from training.run.distributed import exchange_node_size


@dataclass
class Plan:
    """Everything validated before any process group or file exists."""

    recipe: Recipe
    ds: dict
    run_dir: Path
    world_size: int
    dp_size: int
    init_from: Path | None
    config_path: str | None = None      # the DeepSpeed JSON as given, for messages


def prepare(args: argparse.Namespace, outputs: bool = True) -> Plan:
    """Validate the CLI, recipe and DeepSpeed JSON; raise ValueError with a one-line message.
    ``outputs`` False: the run writes nothing (a benchmark driving the step), so its run
    directory is not checked."""
    overrides = list(args.set)
    if args.steps is not None:
        if args.steps < 1:
            raise ValueError(f"--steps: {args.steps} must be >= 1")
        overrides.append(f"train.steps={args.steps}")
    ds_sets = [o for o in overrides if o.startswith("ds.")]       # DeepSpeed JSON keys
    recipe = load_recipe(args.recipe, [o for o in overrides if not o.startswith("ds.")])
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    dims = recipe.dims(world_size)                     # the layout against the world size
    dp_size = dims.dp
    ds = apply_overrides(ds_config.load_ds_config(args.config), ds_sets, "DeepSpeed key", "ds.")
    ds = ds_config.resolve_ds_config(ds, recipe, dims)
    exchange_node_size(recipe)                         # the hierarchical exchange's nodes
    check_backend(recipe)
    check_precision(ds, args.config)
    check_pipeline_schedule(recipe, ds, args.config)
    check_data_source(recipe)
    init_from = check_init_from(args.init_from, recipe)
    run_dir = Path(args.run_dir) if args.run_dir else recipe.default_run_dir
    if outputs:
        check_run_dir(run_dir, recipe)
    return Plan(recipe, ds, run_dir, world_size, dp_size, init_from, args.config)


def plan_for(config: str, recipe: str | None = None, sets=(), steps: int | None = None,
             outputs: bool = False) -> Plan:
    """``prepare`` of the command line ``--config config --recipe recipe --set *sets --steps
    steps``, for the benchmarks and tests that drive the trainer's step in their own process."""
    return prepare(argparse.Namespace(config=str(config), recipe=recipe, run_dir=None, steps=steps,
                                      set=list(sets), init_from=None), outputs)


def check_backend(recipe: Recipe) -> None:
    """A backend for GPUs asked for on a machine without one: refused before the start."""
    backend = recipe.parallel.backend
    if backend in ("nccl", "cuda:gloo") and not torch.cuda.is_available():
        raise ValueError(f"parallel.backend {backend} needs CUDA GPUs and this machine has none: "
                         f"use auto (gloo on CPU) or gloo")


def check_precision(ds: dict, config_path: str | None) -> None:
    """fp16 on a machine without a GPU: refused before the start, in our words (DeepSpeed's CPU
    accelerator has no fp16 and would stop at engine build with its own message)."""
    if (ds.get("fp16") or {}).get("enabled") and not torch.cuda.is_available():
        raise ValueError(f"fp16.enabled: {config_path or 'the DeepSpeed JSON'} asks for fp16, which "
                         f"needs a GPU, and this machine has none: use bf16 or fp32 on a CPU "
                         f"(e.g. ds_configs/zero2.json or ds_configs/zero2_fp32.json)")


def check_pipeline_schedule(recipe: Recipe, ds: dict, config_path: str | None) -> None:
    """ZB-H1 (``training/engine/pipe_schedules.py``) runs in fp32 and bf16 under both optimizers
    DeepSpeed picks there; fp16, whose deferred gradients carry the loss scale, is not tested
    (it needs a GPU); and its autograd functions read the B / W switch, which a compiled block
    cannot. Both refused before the start."""
    if recipe.parallel.pipeline_schedule != "zb-h1":
        return
    if (ds.get("fp16") or {}).get("enabled"):
        where = config_path or "the DeepSpeed JSON"
        raise ValueError(f"parallel.pipeline_schedule zb-h1 runs in fp32 and bf16 and {where} "
                         f"enables fp16, whose loss-scaled deferred gradients are untested here (fp16 "
                         f"needs a GPU); use a bf16 config (e.g. ds_configs/zero1.json), or 1f1b / gpipe")
    if recipe.train.compile:
        raise ValueError("parallel.pipeline_schedule zb-h1 and train.compile: the deferred weight "
                         "gradients cannot run in a compiled block; set train.compile=false, or "
                         "use 1f1b / gpipe")


def check_data_source(recipe: Recipe) -> None:
    """Every ``data.source`` / ``data.val_source`` entry opens or exists, and ``tokenizer.path``
    is a tokenizer, so that bad data fails before anything is written."""
    tokenizer = load_local_tokenizer(recipe.tokenizer.path) if recipe.tokenizer.path else None
    streams.check_entries(recipe.data, recipe.model.vocab_size, tokenizer)


def check_init_from(init_from: str | None, recipe: Recipe) -> Path | None:
    if init_from is None:
        return None
    path = Path(init_from)
    if not (path / "model_config.json").is_file() or not (path / "model.safetensors").is_file():
        raise ValueError(f"--init-from {path}: not an init dir (expected model_config.json and "
                         f"model.safetensors; make one with `python launch/convert_hf.py import`)")
    from model.config import config_from_dict
    try:
        cfg = config_from_dict(json.loads((path / "model_config.json").read_text(encoding="utf-8")))
    except (ValueError, KeyError, TypeError) as e:      # bad JSON or UTF-8, missing or bad keys
        raise ValueError(f"--init-from {path}: model_config.json is invalid ({type(e).__name__}: {e}); "
                         f"re-create the init dir with `python launch/convert_hf.py import`") from None
    if cfg != recipe.model:
        raise ValueError(f"--init-from {path}: its model config differs from the recipe's model "
                         f"section (copy model_config.json's values into the recipe)")
    return path


def check_run_dir(run_dir: Path, recipe: Recipe) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"--run-dir {run_dir}: exists and is not a directory (choose another path)")
    blocker = next((p for p in run_dir.absolute().parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ValueError(f"--run-dir {run_dir}: {blocker} is a file, not a directory (choose another path)")
    saved = run_dir / "config.json"
    if candidates(run_dir / "checkpoints") and saved.is_file():
        if not same_model(read_run_config(run_dir)["recipe"]["model"], recipe):
            raise ValueError(f"--run-dir {run_dir}: holds checkpoints of a different model; "
                             f"resume with the original recipe or choose a new --run-dir")


def same_model(saved: dict, recipe: Recipe) -> bool:
    """Whether a run directory's ``config.json`` model section is the recipe's model. The section
    is rebuilt into a config first, so that fields added to the model since the run began (absent
    from an older ``config.json``) take their defaults, which leave the older model unchanged: an
    update of the repository never strands a run in progress. A key this code does not know, or a
    value it refuses, is a different model."""
    from model.config import config_from_dict
    try:
        return config_from_dict(saved) == recipe.model
    except (ValueError, TypeError):
        return False
