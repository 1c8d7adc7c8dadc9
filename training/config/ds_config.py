"""The DeepSpeed JSON from the file to what the engine gets, in one place.

``load_ds_config`` reads the file; ``resolve_ds_config`` takes it (with the command line's ``ds.``
overrides applied) through every step the trainer's preflight runs: the rules of
``training/config/ds_checks.py`` (``train_batch_size`` derived for the data-parallel size), the
optional lr scaling, the "auto" scheduler values filled from the run length, the layout checks
(``check_layout``) and recipe key ``parallel.grad_compression`` (``apply_grad_compression``). What
it returns is what ``config.json`` records and ``deepspeed.initialize`` receives.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, List, Tuple

from model.parallel.dims import ParallelDims
from training.config.ds_checks import validate_ds_config
from training.optim import muon, optimizers, schedules

if TYPE_CHECKING:
    from training.config.schema import Recipe


def _no_duplicates(pairs: List[Tuple[str, Any]]) -> dict:
    # DeepSpeed's own loader refuses duplicate keys too; json would silently keep the last one.
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def load_ds_config(path: str) -> dict:
    """Read a DeepSpeed JSON file.

    Args:
        path: the file, e.g. `ds_configs/zero3.json`.

    Returns:
        The parsed object.

    Raises:
        ValueError: missing file, invalid JSON (with line and column), duplicate key, or a top
            level that is not an object.
    """
    if not os.path.isfile(path):
        raise ValueError(f"ds_config {path}: file not found (pass an existing JSON file, e.g. ds_configs/zero3.json)")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"ds_config {path}: not UTF-8 text ({e.reason} at byte {e.start}) "
                         "(save the file as UTF-8)") from None
    try:
        cfg = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        raise ValueError(f"ds_config {path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg} "
                         "(fix the syntax there; JSON allows no comments or trailing commas)") from None
    except ValueError as e:
        raise ValueError(f"ds_config {path}: {e} (keep one of them)") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"ds_config {path}: top level is {type(cfg).__name__}, not an object "
                         "(wrap the settings in {...})")
    return cfg


def resolve_ds_config(ds: dict, recipe: Recipe, dims: ParallelDims) -> dict:
    """A parsed DeepSpeed JSON as the run at layout ``dims`` uses it: validated, with
    ``train_batch_size`` for ``dims.dp`` data-parallel ranks; the JSON's optional lr scaling applied and
    its "auto" scheduler values filled from ``recipe.train.steps`` (so that a bad schedule fails
    now and config.json records what runs); checked against the layout; with
    ``parallel.grad_compression`` applied.

    Raises:
        ValueError: one line naming the field, the value and the fix.
    """
    ds = validate_ds_config(ds, dims.dp)
    ds = schedules.resolve_auto(optimizers.apply_lr_scaling(ds), recipe.train.steps)
    _, ours = schedules.split_scheduler(ds)
    if ours is not None:
        schedules.lr_multiplier(ours, recipe.train.steps)      # validates our schedule's params
    check_layout(ds, dims)
    _check_muon_recipe(ds, recipe)
    return apply_grad_compression(ds, recipe.parallel.grad_compression, dims)


def _check_muon_recipe(ds: dict, recipe: Recipe) -> None:
    """Recipe keys that do not compose with a Muon JSON (``training/optim/muon.py``), refused in one line."""
    if not muon.is_muon_type(ds):
        return
    if recipe.model.mup_base_hidden_size is not None:
        raise ValueError("model.mup_base_hidden_size with ds_config.optimizer.type Muon: muP's 1/m hidden lr is "
                         "derived for Adam, Muon scales each matrix's update by its shape (adjust_lr_fn); "
                         "unset one of them")
    if recipe.parallel.grad_compression == "powersgd":
        raise ValueError("parallel.grad_compression powersgd with ds_config.optimizer.type Muon: both replace "
                         "the step after the data-parallel reduction; use none or bf16")


def check_layout(ds: dict, dims: ParallelDims) -> None:
    """Refuse parallel layouts that this (validated) DeepSpeed config cannot run, before anything
    starts; the degrees themselves are checked by ``ParallelDims``.

    Raises:
        ValueError: a micro-batch the expert-parallel ranks cannot split; ZeRO-0 in bf16/fp16
            under tensor/expert parallelism (wrong gradient norm); pipelines with ZeRO-2/3.
    """
    micro = ds["train_micro_batch_size_per_gpu"]
    if micro % dims.ep:
        raise ValueError(
            f"ds_config.train_micro_batch_size_per_gpu ({micro}) is not divisible by "
            f"parallel.expert_parallel_size ({dims.ep}): expert-parallel ranks split each "
            f"micro-batch between them; use a multiple of {dims.ep}")
    stage = int((ds.get("zero_optimization") or {}).get("stage", 0))
    half = any((ds.get(key) or {}).get("enabled") for key in ("bf16", "bfloat16", "fp16"))
    if stage == 0 and half and dims.tp * dims.ep > 1:
        raise ValueError(
            "ds_config: ZeRO-0 with bf16/fp16 reports a wrong gradient norm (and clips wrongly) "
            "under tensor/expert parallelism (DeepSpeed's FP16_UnfusedOptimizer skips every "
            "shard on model-parallel ranks > 0): use ds_configs/zero1.json or higher")
    if dims.pp > 1 and stage > 1:
        raise ValueError(f"ds_config: zero_optimization.stage ({stage}) with "
                         f"parallel.pipeline_parallel_size ({dims.pp}): DeepSpeed's pipeline engine "
                         f"refuses ZeRO-2/3; use ds_configs/zero1.json or zero0.json")


def apply_grad_compression(ds: dict, compression: str, dims: ParallelDims) -> dict:
    """The DeepSpeed JSON for recipe key ``parallel.grad_compression`` at layout ``dims``
    (``docs/communication.md``, "Gradient compression"): ``bf16`` sets DeepSpeed's
    ``communication_data_type`` (its reductions, all-reduce or ZeRO-3's reduce-scatter, cast the
    gradients to bf16 and back); ``powersgd`` leaves the JSON as it is (the trainer replaces
    DeepSpeed's reduction, ``build_compressor``) and runs where DeepSpeed reduces the whole
    ``.grad`` once after backward: ZeRO-0 and ZeRO-1 (without ``overlap_comm``, offload or
    ``BF16_Optimizer``), in fp32 or bf16, without pipeline stages.

    Raises:
        ValueError: one line naming the key, for a setting that cannot apply here.
    """
    if compression == "none":
        return ds
    key = f"parallel.grad_compression {compression}"
    if dims.dp * dims.cp == 1:
        raise ValueError(f"{key}: this layout has one data-parallel rank, so there is no gradient "
                         f"exchange to compress; use none (or more ranks)")
    if "communication_data_type" in ds:
        raise ValueError(f"{key} and ds_config.communication_data_type "
                         f"({ds['communication_data_type']!r}) both set the exchange: keep one of them")
    zero = ds.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0))
    fp16 = (ds.get("fp16") or {}).get("enabled")
    bf16 = any((ds.get(k) or {}).get("enabled") for k in ("bf16", "bfloat16"))
    if compression == "bf16":
        if fp16:
            raise ValueError(f"{key} applies in fp32 or bf16 (DeepSpeed's communication_data_type), "
                             f"not under fp16, whose gradients carry the loss scale: use none")
        return {**ds, "communication_data_type": "bf16"}
    why = None
    if fp16:
        why = "fp16 (its gradients carry the dynamic loss scale, which the error feedback would keep)"
    elif stage >= 2:
        why = (f"ZeRO-{stage} (it reduce-scatters each gradient inside backward's hooks: there is no "
               f"whole-gradient exchange after backward to replace)")
    elif dims.pp > 1:
        why = (f"pipeline_parallel_size {dims.pp} (the pipeline engine reduces in its own ReduceGrads "
               f"instruction)")
    elif stage == 1 and zero.get("overlap_comm"):
        why = "ZeRO-1 with overlap_comm (it reduces inside backward's hooks): set overlap_comm false"
    elif stage == 1 and (zero.get("offload_optimizer") or {}).get("device", "none") != "none":
        why = "ZeRO-1 with offload_optimizer (it moves the gradients to the CPU inside backward's hooks)"
    elif stage == 1 and bf16 and str((ds.get("data_types") or {}).get("grad_accum_dtype", "")).lower() in (
            "fp32", "float32", "float"):
        why = ("bf16 ZeRO-1 with data_types.grad_accum_dtype fp32 (DeepSpeed's BF16_Optimizer then "
               "reduces its own fp32 accumulators, not .grad): drop grad_accum_dtype")
    if why:
        raise ValueError(f"{key} runs at ZeRO-0 or ZeRO-1 in fp32 or bf16 without pipeline stages, "
                         f"where DeepSpeed's reduction after backward is the whole exchange, not at {why}: "
                         f"use ds_configs/zero0_fp32.json, zero1.json or zero1_fp32.json, or "
                         f"grad_compression bf16 / none")
    return ds


def replica_sync_mode(ds: dict) -> str:
    """How ``model.parallel.grad_sync.ReplicaGradSync`` sums the gradients of parameters replicated
    over tp/ep under DeepSpeed JSON ``ds`` (no pipeline): "step" (one bucketed all-reduce per
    group at the accumulation boundary) where DeepSpeed leaves ``.grad`` alone until backward
    returns: ZeRO-0 and ZeRO-1 without ``overlap_comm``, in fp32 (in bf16/fp16 ZeRO-0 and -1 may
    move ``.grad`` into an fp32 accumulator in their hooks). Otherwise "micro_batch": each
    parameter's gradient is summed in its hook, before DeepSpeed's hook takes it."""
    zero = ds.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0))
    half = any((ds.get(k) or {}).get("enabled") for k in ("bf16", "bfloat16", "fp16"))
    if stage <= 1 and not zero.get("overlap_comm", False) and not half:
        return "step"
    return "micro_batch"
