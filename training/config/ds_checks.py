"""The rules a DeepSpeed JSON must pass before DeepSpeed sees it (``validate_ds_config``).

DeepSpeed reports most config mistakes late (at `deepspeed.initialize`, or as an `assert` deep in
the engine) or not at all (an unknown `warmup_type` silently becomes "log"). `validate_ds_config`
catches them up front, each as a one-line `ValueError` that names the field, the value and the
fix, and derives `train_batch_size` = micro batch x accumulation x data-parallel size. The JSON's
way from the file to the engine is ``training/config/ds_config.py``.

Lists of DeepSpeed names are copied here from 0.19.8 so that validation needs no deepspeed
import; `tests/training/config/test_ds_configs.py` checks them against the installed package.
"""

import copy
import inspect
import math
from typing import Any, Tuple

import torch

from model.checks import is_int
from training.optim.schedules import AUTO, DEEPSPEED_SCHEDULERS, OUR_SCHEDULERS, validate_scheduler

# deepspeed/runtime/config.py DEEPSPEED_OPTIMIZERS (matched case-insensitively by DeepSpeed).
DEEPSPEED_OPTIMIZERS = ("adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon")
# Removed in 0.19.8 (deepspeedai/DeepSpeed#8489); DeepSpeed would fail looking them up in torch.optim.
REMOVED_OPTIMIZERS = ("onebitadam", "zerooneadam", "onebitlamb")
# deepspeed/runtime/config.py _REMOVED_TOP_LEVEL_CONFIG_KEYS / _REMOVED_ZERO_CONFIG_KEYS, with the fix.
REMOVED_TOP_LEVEL_KEYS = {
    "amp": "Apex AMP was removed; use \"bf16\" or \"fp16\"",
    "elasticity": "elastic training was removed; set the batch keys directly",
    "curriculum_learning": "moved to data_efficiency.data_sampling.curriculum_learning",
    "eigenvalue": "eigenvalue MoQ was removed",
    "sparse_attention": "sparse attention was removed",
    "progressive_layer_drop": "progressive layer drop was removed",
    "nebula": "Nebula checkpointing was removed; the default checkpoint engine is used",
    "compression_training": "the compression library was removed",
    "quantize_training": "MoQ was removed",
    "sparse_gradients": "sparse embedding-gradient compression was removed",
    "graph_harvesting": "graph harvesting was removed",
}
REMOVED_ZERO_KEYS = {
    "mics_shard_size": "MiCS was removed; use ZeRO-3 (or ZeRO++ zero_hpz_partition_size)",
    "mics_hierarchical_params_gather": "MiCS was removed",
    "zeropp_loco_param": "LoCo-ZeRO++ was removed",
}
# Constructor keywords of DeepSpeed's schedulers (runtime/lr_schedules.py), and the required ones.
DEEPSPEED_SCHEDULER_PARAMS = {
    "LRRangeTest": ("lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate",
                    "lr_range_test_staircase"),
    "OneCycle": ("cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size", "cycle_second_step_size",
                 "cycle_first_stair_count", "cycle_second_stair_count", "decay_step_size", "cycle_momentum",
                 "cycle_min_mom", "cycle_max_mom", "decay_mom_rate"),
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
    "WarmupDecayLR": ("total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
    "WarmupCosineLR": ("total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type"),
}
_REQUIRED_SCHEDULER_PARAMS = {"OneCycle": ("cycle_min_lr", "cycle_max_lr"), "WarmupDecayLR": ("total_num_steps",),
                              "WarmupCosineLR": ("total_num_steps",)}
# torch schedulers that take callables or other schedulers, or need a metric in step().
_UNUSABLE_TORCH_SCHEDULERS = ("LambdaLR", "MultiplicativeLR", "SequentialLR", "ChainedScheduler",
                              "ReduceLROnPlateau", "LRScheduler")


def _fail(field: str, value: Any, problem: str, fix: str) -> ValueError:
    return ValueError(f"ds_config.{field}: {value!r} {problem} ({fix})")


def _object(section: dict, key: str, prefix: str = "") -> dict:
    """`section[key]` as a dict ({} when absent or null); any other value is refused."""
    value = section.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _fail(prefix + key, value, "must be an object", 'write {"key": value, ...}')
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_removed(cfg: dict) -> None:
    for key, why in REMOVED_TOP_LEVEL_KEYS.items():
        if key in cfg:
            raise _fail(key, cfg[key], f"was removed in DeepSpeed 0.19.8: {why}", f"delete \"{key}\"")
    zero = cfg.get("zero_optimization") or {}
    for key, why in REMOVED_ZERO_KEYS.items():
        if key in zero:
            raise _fail(f"zero_optimization.{key}", zero[key], f"was removed in DeepSpeed 0.19.8: {why}",
                        f"delete \"{key}\"")


def _check_zero(cfg: dict) -> int:
    zero = cfg.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise _fail("zero_optimization", zero, "must be an object", 'write {"stage": 0..3, ...}')
    stage = zero.get("stage", 0)
    if not is_int(stage, 0) or stage > 3:
        raise _fail("zero_optimization.stage", stage, "must be 0, 1, 2 or 3", "pick a ZeRO stage")
    for key, low in (("offload_param", 3), ("offload_optimizer", 1)):
        device = _object(zero, key, "zero_optimization.").get("device", "none")
        if device not in ("none", None) and stage < low:
            raise _fail(f"zero_optimization.{key}.device", device, f"needs ZeRO stage >= {low}, got {stage}",
                        f"set zero_optimization.stage to {low} or more, or drop {key}")
    return stage


def _check_batch(cfg: dict, dp_size: int) -> dict:
    """Derive train_batch_size = micro x accumulation x dp_size, or check the user's one."""
    out = copy.deepcopy(cfg)
    micro = cfg.get("train_micro_batch_size_per_gpu")
    acc = cfg.get("gradient_accumulation_steps")
    total = cfg.get("train_batch_size")
    if acc is None:
        # As DeepSpeed does: with the total and the micro batch given, accumulation is derived.
        acc = 1
        if is_int(total) and is_int(micro, 1) and total % (micro * dp_size) == 0:
            acc = max(1, total // (micro * dp_size))
    if not is_int(acc, 1):
        raise _fail("gradient_accumulation_steps", acc, "must be an integer >= 1", "use 1 for no accumulation")
    if total is not None and not is_int(total, 1):
        raise _fail("train_batch_size", total, "must be an integer >= 1", "delete it; it is derived")
    if micro is None:
        if total is None:
            raise _fail("train_micro_batch_size_per_gpu", None, "is missing",
                        "set the per-GPU micro batch, e.g. 4")
        micro, rest = divmod(total, acc * dp_size)
        if rest or micro < 1:
            raise _fail("train_batch_size", total,
                        f"is not a multiple of gradient_accumulation_steps x dp size = {acc} x {dp_size}",
                        "set train_micro_batch_size_per_gpu instead")
        out["train_micro_batch_size_per_gpu"] = micro
    if not is_int(micro, 1):
        raise _fail("train_micro_batch_size_per_gpu", micro, "must be an integer >= 1", "set e.g. 4")
    derived = micro * acc * dp_size
    if total is not None and total != derived:
        raise _fail("train_batch_size", total,
                    f"!= train_micro_batch_size_per_gpu {micro} x gradient_accumulation_steps {acc} "
                    f"x data-parallel size {dp_size} = {derived}",
                    f"delete train_batch_size so it is derived, or set it to {derived}")
    out["gradient_accumulation_steps"] = acc
    out["train_batch_size"] = derived
    return out


def _check_precision(cfg: dict) -> None:
    fp16 = _object(cfg, "fp16")
    bf16 = _object(cfg, "bf16") or _object(cfg, "bfloat16")
    if fp16.get("enabled") and bf16.get("enabled"):
        raise _fail("fp16.enabled", True, "and bf16.enabled are both true", "enable only one of them")
    if not fp16.get("enabled") or fp16.get("loss_scale", 0) != 0:
        return
    # Dynamic loss scaling (loss_scale 0): the knobs DeepSpeed's scaler reads.
    checks = (("initial_scale_power", 0, "e.g. 16 for an initial scale of 2**16"),
              ("loss_scale_window", 1, "e.g. 1000 steps without overflow before doubling"),
              ("hysteresis", 1, "e.g. 2 overflows before halving"),
              ("min_loss_scale", 1e-12, "e.g. 1"))
    for key, low, fix in checks:
        if key in fp16:
            value = fp16[key]
            integral = key != "min_loss_scale"
            if not (is_int(value) if integral else _is_number(value)) or value < low:
                raise _fail(f"fp16.{key}", value, f"must be {'an integer' if integral else 'a number'} >= {low}",
                            fix)


def _check_optimizer(cfg: dict, stage: int) -> None:
    if cfg.get("optimizer") is None:
        return
    section = _object(cfg, "optimizer")
    name = section.get("type")
    if not isinstance(name, str):
        raise _fail("optimizer.type", name, "must be a name", "e.g. \"AdamW\"")
    if name.lower() in REMOVED_OPTIMIZERS:
        raise _fail("optimizer.type", name, "was removed in DeepSpeed 0.19.8", "use \"AdamW\" or \"Lamb\"")
    known = name.lower() in DEEPSPEED_OPTIMIZERS
    torch_cls = getattr(torch.optim, name, None)
    if not known and not (inspect.isclass(torch_cls) and issubclass(torch_cls, torch.optim.Optimizer)):
        raise _fail("optimizer.type", name, "is not a DeepSpeed or torch.optim optimizer",
                    f"use one of {list(DEEPSPEED_OPTIMIZERS)} or a torch.optim class name")
    params = _object(section, "params", "optimizer.")
    if "max_grad_norm" in params:
        raise _fail("optimizer.params.max_grad_norm", params["max_grad_norm"], "is refused by DeepSpeed",
                    "use the top-level gradient_clipping")
    if "lr" in params and (not _is_number(params["lr"]) or params["lr"] <= 0):
        raise _fail("optimizer.params.lr", params["lr"], "must be > 0", "set a positive learning rate")
    if "weight_decay" in params and (not _is_number(params["weight_decay"]) or params["weight_decay"] < 0):
        raise _fail("optimizer.params.weight_decay", params["weight_decay"], "must be >= 0", "e.g. 0.1")
    if "eps" in params and (not _is_number(params["eps"]) or params["eps"] <= 0):
        raise _fail("optimizer.params.eps", params["eps"], "must be > 0", "e.g. 1e-8")
    betas = params.get("betas", [0.9, 0.999])
    if (not isinstance(betas, list) or len(betas) != 2 or not all(_is_number(b) and 0 <= b < 1 for b in betas)):
        raise _fail("optimizer.params.betas", betas, "must be two numbers in [0, 1)", "e.g. [0.9, 0.95]")
    mode = params.get("adam_w_mode", True)      # DeepSpeed builds AdamW for type AdamW whatever it says
    if not isinstance(mode, bool) or (name.lower() == "adamw" and not mode):
        raise _fail("optimizer.params.adam_w_mode", mode, "must be a boolean, and true for type \"AdamW\"",
                    "for L2 decay inside Adam use type \"Adam\" with adam_w_mode false")
    if name.lower() == "muon":
        _check_muon(cfg, params)
    if name.lower() == "lamb" and stage > 0 and not cfg.get("zero_allow_untested_optimizer"):
        # ZeRO 1-3 hand the optimizer one flat partition per param group, so LAMB's per-layer
        # trust ratio would become one ratio per group and rank, changing with the DP size.
        raise _fail("optimizer.type", name,
                    f"under ZeRO stage {stage} sees flattened partitions, so its trust ratio is not per layer",
                    "use zero_optimization.stage 0 (ds_configs/zero0_lamb.json), or set "
                    "zero_allow_untested_optimizer: true to accept per-partition ratios")


def _check_muon(cfg: dict, params: dict) -> None:
    """Muon's keys (``training/optim/muon.py``) and the settings it cannot run with."""
    from training.optim.muon import MuonSettings
    MuonSettings.from_json(params)
    if (cfg.get("fp16") or {}).get("enabled"):
        raise _fail("optimizer.type", "Muon", "is not run under fp16 here (its Newton-Schulz would meet the "
                    "loss-scaled gradient and fp16's range)", "use bf16, as ds_configs/muon.json does")
    offload = ((cfg.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device", "none")
    if offload not in ("none", None):
        raise _fail("zero_optimization.offload_optimizer.device", offload, "is not run with Muon here (the "
                    "update reads each matrix's whole gradient on the device)", "set it to \"none\"")


def _torch_scheduler_params(name: str) -> Tuple[str, ...]:
    cls = getattr(torch.optim.lr_scheduler, name, None)
    if (name in _UNUSABLE_TORCH_SCHEDULERS or not inspect.isclass(cls)
            or not issubclass(cls, torch.optim.lr_scheduler.LRScheduler)):
        return ()
    return tuple(p for p in inspect.signature(cls).parameters if p not in ("optimizer", "last_epoch", "verbose"))


def _check_scheduler(cfg: dict) -> None:
    if cfg.get("scheduler") is None:
        return
    section = _object(cfg, "scheduler")
    name = section.get("type")
    params = section.get("params") or {}
    if not isinstance(params, dict):
        raise _fail("scheduler.params", params, "must be an object", 'write {"key": value}')
    if name in OUR_SCHEDULERS:
        validate_scheduler(section)
        return
    if name in DEEPSPEED_SCHEDULERS:
        allowed = DEEPSPEED_SCHEDULER_PARAMS[name]
    else:
        allowed = _torch_scheduler_params(name) if isinstance(name, str) else ()
        if not allowed:
            raise _fail("scheduler.type", name, "is not a known scheduler",
                        f"use one of {list(DEEPSPEED_SCHEDULERS + OUR_SCHEDULERS)} or a torch.optim.lr_scheduler "
                        "class that takes only numbers")
    for key, value in params.items():
        if key not in allowed:
            raise _fail(f"scheduler.params.{key}", value, f"is not a parameter of {name}",
                        f"remove it; known: {', '.join(allowed)}")
    for key in _REQUIRED_SCHEDULER_PARAMS.get(name, ()):
        if key not in params:
            raise _fail(f"scheduler.params.{key}", None, f"is required by {name}",
                        'set it (total_num_steps may be "auto")')
    if "warmup_type" in params and params["warmup_type"] not in ("log", "linear"):
        # DeepSpeed would silently fall back to "log".
        raise _fail("scheduler.params.warmup_type", params["warmup_type"], "is not a warmup type",
                    "use \"linear\" or \"log\"")
    for key in ("total_num_steps", "warmup_num_steps"):
        value = params.get(key)
        if value is not None and value != AUTO and not is_int(value, 1):
            raise _fail(f"scheduler.params.{key}", value, "must be an integer >= 1 or \"auto\"",
                        "\"auto\" takes it from the run length")


def _check_lr_scaling(cfg: dict) -> None:
    block = cfg.get("lr_scaling")
    if block is None:
        return
    known = ("rule", "base_batch_size")
    if not isinstance(block, dict):
        raise _fail("lr_scaling", block, "must be an object", 'write {"rule": "sqrt", "base_batch_size": 256}')
    for key, value in block.items():
        if key not in known:
            raise _fail(f"lr_scaling.{key}", value, "is not an lr_scaling key", f"use {list(known)}")
    if block.get("rule") not in ("none", "linear", "sqrt"):
        raise _fail("lr_scaling.rule", block.get("rule"), "is not a rule", "use \"none\", \"linear\" or \"sqrt\"")
    base = block.get("base_batch_size")
    if not is_int(base, 1):
        raise _fail("lr_scaling.base_batch_size", base, "must be an integer >= 1",
                    "set the global batch the lr was tuned at")


def validate_ds_config(cfg: dict, dp_size: int) -> dict:
    """Check a DeepSpeed config and derive its `train_batch_size`.

    Checks: removed 0.19.8 keys; ZeRO stage and offload placement; batch keys
    (`train_batch_size` = micro x accumulation x `dp_size`, derived when absent, must match when
    set); `gradient_clipping` >= 0; fp16 and bf16 not both on, dynamic loss-scaling knobs;
    optimizer type (DeepSpeed's, torch.optim's, not a removed one), lr > 0, betas, eps,
    weight decay, no `max_grad_norm`, no LAMB under ZeRO >= 1 unless opted in; scheduler type
    (DeepSpeed's, ours, or a numeric torch one) and its parameter names; the `lr_scaling` block;
    `adam_w_mode` (a boolean, not false under type AdamW) and `no_decay_group` (a boolean).
    "auto" scheduler values are allowed (see `training.optim.schedules.resolve_auto`).

    Args:
        cfg: the parsed JSON (not modified).
        dp_size: the data-parallel size, dp = world_size / (tp x ep x cp x pp) (the ranks that
            load different samples; DeepSpeed's own group is dp x cp).

    Returns:
        A deep copy with `train_batch_size` and `gradient_accumulation_steps` filled in.

    Raises:
        ValueError: one line naming the field, the value and the fix.
    """
    if not isinstance(cfg, dict):
        raise ValueError(f"ds_config: {type(cfg).__name__} is not an object (pass the parsed JSON dict)")
    if not is_int(dp_size, 1):
        raise ValueError(f"dp_size: {dp_size!r} must be an integer >= 1 (pass the data-parallel world size)")
    _check_removed(cfg)
    stage = _check_zero(cfg)
    out = _check_batch(cfg, dp_size)
    clip = cfg.get("gradient_clipping", 1.0)
    if not _is_number(clip) or clip < 0:
        raise _fail("gradient_clipping", clip, "must be >= 0", "use 1.0, or 0 to turn clipping off")
    _check_precision(cfg)
    _check_optimizer(cfg, stage)
    _check_scheduler(cfg)
    _check_lr_scaling(cfg)
    if not isinstance(cfg.get("no_decay_group", True), bool):     # ours: training/optim/optimizers.py
        raise _fail("no_decay_group", cfg["no_decay_group"], "must be true or false",
                    "true keeps norms, biases and embeddings undecayed; false decays every parameter")
    return out
