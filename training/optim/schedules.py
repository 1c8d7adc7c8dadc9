"""Learning-rate schedules that DeepSpeed 0.19.8 lacks, selected by the JSON `scheduler.type`.

DeepSpeed builds `LRRangeTest`, `OneCycle`, `WarmupLR`, `WarmupDecayLR` and `WarmupCosineLR`
itself (`deepspeed/runtime/lr_schedules.py`). The five schedules here fill the gaps:

    WarmupStepDecayLR       warmup, then x gamma every `step_size` steps (torch's StepLR)
    WarmupExponentialLR     warmup, then x gamma every step (torch's ExponentialLR)
    WarmupInverseSqrtLR     warmup, then sqrt(timescale / (timescale + d)) (transformers')
    WarmupCosineRestartsLR  warmup, then cosine cycles (SGDR) of growing length and height
    WarmupStableDecayLR     warmup, constant, then linear / cosine / 1-sqrt decay (transformers'
                            WSD)

All of them are a `torch.optim.lr_scheduler.LambdaLR` over one multiplier of each param group's
base lr: our warmup, then the shape after the peak, taken from transformers where it has the
same one (`get_inverse_sqrt_schedule`, `get_wsd_schedule`) and floored at `min_ratio`. Cosine
cycles whose length grows by a real factor and whose height decays exist in no library, nor do
step and exponential decay with a floor (so those two are their one-line closed forms).

One step convention for all: `s` counts completed optimizer steps (LambdaLR's `last_epoch`), so
step `s` is the lr used by update `s + 1`; `T` is the run length; `W` the warmup length:

    warmup (s < W):  ratio = warmup_min_ratio + (1 - warmup_min_ratio) * (s + 1) / W
    peak step:       P = max(W, 1) - 1, the first step at ratio 1; d = s - P after it

so no update is spent at lr 0 (DeepSpeed's and transformers' warmups spend their first update at
lr 0), and a decay that ends "at the end of training" reaches its floor at the last step, s = T - 1.

The trainer's flow: `resolve_auto` (fill "auto"), `split_scheduler` (take ours out of the JSON
before `deepspeed.initialize`), then pass `lr_scheduler=lambda opt: build_scheduler(cfg, opt, T)`;
DeepSpeed calls that with its basic optimizer and steps the result once per optimizer step.
The lambdas are closures, so a checkpoint stores only the step count: a resumed run rebuilds the
schedule from its config.
"""

import copy
import math
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler
from transformers import get_inverse_sqrt_schedule, get_wsd_schedule

from model.config import is_int

OUR_SCHEDULERS = (
    "WarmupStepDecayLR",
    "WarmupExponentialLR",
    "WarmupInverseSqrtLR",
    "WarmupCosineRestartsLR",
    "WarmupStableDecayLR",
)

# Mirrors deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES (tests check it stays in sync), so
# that config validation needs no deepspeed import.
DEEPSPEED_SCHEDULERS = ("LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")

AUTO = "auto"
_REQUIRED = object()
_DECAY_TYPES = ("linear", "cosine", "1-sqrt")

_COMMON = {"total_num_steps": AUTO, "warmup_num_steps": AUTO, "warmup_min_ratio": 0.0}
# Parameters and defaults of each schedule; `_REQUIRED` marks the ones without a default.
_PARAMS = {
    "WarmupStepDecayLR": {**_COMMON, "step_size": _REQUIRED, "gamma": 0.1, "min_ratio": 0.0},
    "WarmupExponentialLR": {**_COMMON, "gamma": _REQUIRED, "min_ratio": 0.0},
    "WarmupInverseSqrtLR": {**_COMMON, "timescale": AUTO, "min_ratio": 0.0},
    "WarmupCosineRestartsLR": {**_COMMON, "cycle_num_steps": AUTO, "cycle_mult": 1.0, "cycle_decay": 1.0,
                               "min_ratio": 0.0},
    # 1-sqrt over the last 20% follows Hagele et al. 2024, "Scaling Laws and Compute-Optimal
    # Training Beyond Fixed Training Durations"; decay_num_steps, when set, wins over the fraction.
    "WarmupStableDecayLR": {**_COMMON, "decay_fraction": 0.2, "decay_num_steps": None, "decay_type": "1-sqrt",
                            "min_ratio": 0.0},
}


def auto_warmup_steps(total_steps: int) -> int:
    """The warmup length "auto" stands for: 5% of the run, at least 1 and at most 100 steps."""
    return max(1, min(100, total_steps // 20))


def _err(key: str, value: Any, problem: str, fix: str) -> ValueError:
    return ValueError(f"ds_config.scheduler.params.{key}: {value!r} {problem} ({fix})")


def _int(params: dict, key: str, low: int) -> int:
    value = params[key]
    if not is_int(value, low):
        raise _err(key, value, f"must be an integer >= {low}", f'set an integer >= {low} or "auto"')
    return value


def _float(params: dict, key: str, low: float, high: float, low_open: bool = False) -> float:
    value = params[key]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        ok = (value > low if low_open else value >= low) and value <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise _err(key, value, f"must be a number in {bracket}{low}, {high}]", "set a value in that range")
    return float(value)


def _resolve_ours(sched_type: str, params: dict, total_steps: Optional[int]) -> dict:
    """Check one of our schedules' params and fill defaults and "auto" values.

    Args:
        sched_type: one of `OUR_SCHEDULERS`.
        params: the JSON `scheduler.params` (not modified).
        total_steps: the run length; None checks the params without resolving "auto".

    Returns:
        The complete params, with "auto" replaced when `total_steps` is given.
    """
    spec = _PARAMS[sched_type]
    for key in params:
        if key not in spec:
            raise _err(key, params[key], f"is not a parameter of {sched_type}",
                       f"remove it; known: {', '.join(sorted(spec))}")
    out = {key: params.get(key, default) for key, default in spec.items()}
    for key, value in out.items():
        if value is _REQUIRED:
            raise _err(key, None, f"is required by {sched_type}", "set it in scheduler.params")
    _check_ranges(sched_type, out)
    return out if total_steps is None else _fill_auto(sched_type, out, total_steps)


def _check_ranges(sched_type: str, p: dict) -> None:
    """Every param of ours in its range ("auto" allowed where it has a meaning)."""
    if p["total_num_steps"] != AUTO:
        _int(p, "total_num_steps", 1)
    if p["warmup_num_steps"] != AUTO:
        _int(p, "warmup_num_steps", 0)
    _float(p, "warmup_min_ratio", 0.0, 1.0)
    _float(p, "min_ratio", 0.0, 1.0)
    if sched_type == "WarmupStepDecayLR":
        _int(p, "step_size", 1)
    if sched_type in ("WarmupStepDecayLR", "WarmupExponentialLR"):
        _float(p, "gamma", 0.0, 1.0, low_open=True)
    if sched_type == "WarmupInverseSqrtLR" and p["timescale"] != AUTO:
        _int(p, "timescale", 1)
    if sched_type == "WarmupCosineRestartsLR":
        if p["cycle_num_steps"] != AUTO:
            _int(p, "cycle_num_steps", 1)
        _float(p, "cycle_mult", 1.0, 1e6)
        _float(p, "cycle_decay", 0.0, 1.0, low_open=True)
    if sched_type == "WarmupStableDecayLR":
        _float(p, "decay_fraction", 0.0, 1.0)
        if p["decay_num_steps"] is not None:
            _int(p, "decay_num_steps", 0)
        if p["decay_type"] not in _DECAY_TYPES:
            raise _err("decay_type", p["decay_type"], "is not a decay type", f"use one of {list(_DECAY_TYPES)}")


def _fill_auto(sched_type: str, p: dict, total_steps: int) -> dict:
    """Replace "auto" (and the WSD decay length) with values from the run length."""
    out = dict(p)
    if out["total_num_steps"] == AUTO:
        out["total_num_steps"] = total_steps
    T = out["total_num_steps"]
    if out["warmup_num_steps"] == AUTO:
        out["warmup_num_steps"] = auto_warmup_steps(T)
    W = out["warmup_num_steps"]
    if W > T:
        raise _err("warmup_num_steps", W, f"exceeds total_num_steps {T}", "shorten the warmup")
    peak = max(W, 1) - 1
    if sched_type == "WarmupInverseSqrtLR" and out["timescale"] == AUTO:
        out["timescale"] = max(W, 1)
    if sched_type == "WarmupCosineRestartsLR" and out["cycle_num_steps"] == AUTO:
        out["cycle_num_steps"] = T - peak  # one cycle from the peak through the last step
    if sched_type == "WarmupStableDecayLR":
        if out["decay_num_steps"] is None:
            out["decay_num_steps"] = int(round(out["decay_fraction"] * T))
        if W + out["decay_num_steps"] > T:
            raise _err("decay_num_steps", out["decay_num_steps"],
                       f"plus warmup_num_steps {W} exceeds total_num_steps {T}",
                       "shorten the warmup or the decay")
    return out


def _cycle_position(d: int, first: int, mult: float) -> Tuple[int, int, int]:
    """Cycle index, position in the cycle, and cycle length for `d` steps after the peak."""
    if mult == 1.0:
        return d // first, d % first, first
    index, length = 0, first
    while d >= length:  # lengths grow geometrically, so this loop is logarithmic in d
        d -= length
        index += 1
        length = max(1, int(round(first * mult**index)))
    return index, d, length


def _our_type(sched_cfg: dict) -> str:
    sched_type = sched_cfg.get("type")
    if sched_type not in OUR_SCHEDULERS:
        raise ValueError(f"ds_config.scheduler.type: {sched_type!r} is not one of ours "
                         f"(use one of {list(OUR_SCHEDULERS)}, or let DeepSpeed build its own)")
    return sched_type


def _library_multiplier(factory: Callable, **kwargs) -> Callable[[int], float]:
    """The multiplier function of a transformers schedule (built on a throwaway optimizer)."""
    dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    return factory(dummy, **kwargs).lr_lambdas[0]


def _after_peak(sched_type: str, p: dict) -> Callable[[int], float]:
    """The multiplier at `d` steps after the peak step P (d = 0 is the peak, ratio 1)."""
    floor = p["min_ratio"]
    if sched_type == "WarmupStepDecayLR":
        return lambda d: max(floor, p["gamma"] ** (d // p["step_size"]))
    if sched_type == "WarmupExponentialLR":
        return lambda d: max(floor, p["gamma"] ** d)
    if sched_type == "WarmupInverseSqrtLR":
        # transformers': 1 / sqrt((step + timescale - warmup) / timescale), counted from the peak.
        inverse_sqrt = _library_multiplier(get_inverse_sqrt_schedule, num_warmup_steps=0,
                                           timescale=p["timescale"])
        return lambda d: max(floor, inverse_sqrt(d))
    if sched_type == "WarmupCosineRestartsLR":
        def restarts(d: int) -> float:
            index, t, length = _cycle_position(d, p["cycle_num_steps"], p["cycle_mult"])
            top = p["cycle_decay"] ** index
            return floor + (top - floor) * 0.5 * (1.0 + math.cos(math.pi * t / length))
        return restarts
    # WarmupStableDecayLR: decay over the last D steps, reaching the floor at s = T - 1.
    # transformers' WSD counts the step of an update from 1 (ours from 0), hence s + 1.
    T, W, D = p["total_num_steps"], p["warmup_num_steps"], p["decay_num_steps"]
    if D == 0:
        return lambda d: 1.0
    peak = max(W, 1) - 1
    wsd = _library_multiplier(get_wsd_schedule, num_warmup_steps=W, num_stable_steps=T - W - D,
                              num_decay_steps=D, decay_type=p["decay_type"], min_lr_ratio=floor)
    return lambda d: wsd(d + peak + 1)


def lr_multiplier(sched_cfg: dict, total_steps: int) -> Callable[[int], float]:
    """The multiplier of the base lr at each step, as a pure function of the step.

    Args:
        sched_cfg: `{"type": one of OUR_SCHEDULERS, "params": {...}}`.
        total_steps: the run length in optimizer steps (fills "auto").

    Returns:
        `f(s)` for s = completed optimizer steps (see the module docstring).

    Raises:
        ValueError: unknown type, unknown or out-of-range parameter.
    """
    sched_type = _our_type(sched_cfg)
    p = _resolve_ours(sched_type, sched_cfg.get("params") or {}, total_steps)
    W, wmin = p["warmup_num_steps"], p["warmup_min_ratio"]
    peak = max(W, 1) - 1
    after_peak = _after_peak(sched_type, p)

    def multiplier(s: int) -> float:
        if s < W:
            return wmin + (1.0 - wmin) * (s + 1) / W
        return after_peak(s - peak)

    return multiplier


def build_scheduler(sched_cfg: dict, optimizer: torch.optim.Optimizer, total_steps: int) -> LRScheduler:
    """Build one of our schedules on `optimizer`.

    Args:
        sched_cfg: the JSON `scheduler` section; its type must be in `OUR_SCHEDULERS`.
        optimizer: the optimizer whose param groups' current lr are the peak lrs. Under DeepSpeed,
            pass `lr_scheduler=lambda opt: build_scheduler(cfg, opt, total_steps)` so that it is
            the engine's basic optimizer.
        total_steps: the run length in optimizer steps.

    Returns:
        A `LambdaLR`; each group's lr is set to step 0's value on construction.

    Raises:
        ValueError: unknown type, unknown or out-of-range parameter (naming
            `scheduler.params.<key>`).
    """
    return LambdaLR(optimizer, lr_multiplier(sched_cfg, total_steps))


def validate_scheduler(sched_cfg: dict) -> None:
    """Check a `scheduler` section of ours without a run length ("auto" values stay allowed).

    Raises:
        ValueError: unknown type, unknown or out-of-range parameter.
    """
    sched_type = _our_type(sched_cfg)
    params = sched_cfg.get("params") or {}
    if not isinstance(params, dict):
        raise ValueError(f"ds_config.scheduler.params: {params!r} must be an object (write {{\"key\": value}})")
    _resolve_ours(sched_type, params, None)


def _resolve_deepspeed(sched_type: str, params: dict, total_steps: int, ds_config: dict) -> dict:
    """Fill "auto" in the params of one of DeepSpeed's own schedulers."""
    out = dict(params)
    fixed_total = params.get("total_num_steps")
    warmup = auto_warmup_steps(fixed_total if isinstance(fixed_total, int) and fixed_total > 0 else total_steps)
    for key, value in params.items():
        if value != AUTO:
            continue
        if key == "total_num_steps":
            out[key] = total_steps
        elif key == "warmup_num_steps":
            out[key] = warmup
        elif key == "warmup_max_lr":
            lr = ((ds_config.get("optimizer") or {}).get("params") or {}).get("lr")
            if not isinstance(lr, (int, float)) or isinstance(lr, bool):
                raise _err(key, value, "needs a numeric optimizer.params.lr to copy",
                           "set optimizer.params.lr or a number here")
            out[key] = lr
        elif key == "cycle_first_step_size":
            out[key] = max(1, total_steps // 2)
        elif key == "cycle_second_step_size":
            first = out.get("cycle_first_step_size", params.get(key))
            if not isinstance(first, int):
                first = max(1, total_steps // 2)
            out[key] = max(0, total_steps - first)
        else:
            raise _err(key, value, f"cannot be \"auto\" for {sched_type}",
                       "use a number; \"auto\" works for total_num_steps, warmup_num_steps, warmup_max_lr, "
                       "cycle_first_step_size and cycle_second_step_size")
    total, warm = out.get("total_num_steps"), out.get("warmup_num_steps")
    if isinstance(total, int) and isinstance(warm, int) and warm > total:
        # DeepSpeed only warns, and the run never reaches its peak lr.
        raise _err("warmup_num_steps", warm, f"exceeds total_num_steps {total}", "shorten the warmup")
    return out


def resolve_auto(ds_config: dict, total_steps: int) -> dict:
    """Replace every "auto" in the `scheduler` section with a value from the run length.

    For DeepSpeed's schedulers: `total_num_steps` -> total_steps; `warmup_num_steps` ->
    `auto_warmup_steps(total_steps)`; `warmup_max_lr` -> `optimizer.params.lr`; OneCycle's
    `cycle_first_step_size` -> total_steps // 2 and `cycle_second_step_size` -> the rest. For
    ours: the same, plus `timescale` -> the warmup and `cycle_num_steps` -> the post-warmup length,
    and every default written out, so the run directory's config shows the schedule in full.

    Args:
        ds_config: a DeepSpeed config dict (not modified).
        total_steps: the run length in optimizer steps.

    Returns:
        A deep copy with the scheduler's "auto" values filled.

    Raises:
        ValueError: "auto" where it has no meaning, or a bad parameter of ours.
    """
    if not is_int(total_steps, 1):
        raise ValueError(f"total_steps: {total_steps!r} must be an integer >= 1 (pass the run length)")
    out = copy.deepcopy(ds_config)
    sched = out.get("scheduler")
    if not sched:
        return out
    sched_type = sched.get("type")
    params = sched.get("params") or {}
    if sched_type in OUR_SCHEDULERS:
        sched["params"] = _resolve_ours(sched_type, params, total_steps)
    else:
        sched["params"] = _resolve_deepspeed(sched_type, params, total_steps, out)
    return out


def split_scheduler(ds_config: dict) -> Tuple[dict, Optional[Dict[str, Any]]]:
    """Take our scheduler out of a DeepSpeed config.

    DeepSpeed would look one of our names up in `torch.optim.lr_scheduler` and fail, so the
    trainer removes it and passes the scheduler built by `build_scheduler` instead.

    Args:
        ds_config: a DeepSpeed config dict (not modified).

    Returns:
        `(config without our scheduler section, that section)`, or `(copy of config, None)` when
        there is no scheduler or it is one DeepSpeed builds.
    """
    out = copy.deepcopy(ds_config)
    sched = out.get("scheduler")
    if sched and sched.get("type") in OUR_SCHEDULERS:
        return out, out.pop("scheduler")
    return out, None
