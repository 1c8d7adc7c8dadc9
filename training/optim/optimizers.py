"""Optimizer pieces around DeepSpeed: weight-decay groups, a CPU LAMB, and LR scaling.

- `param_groups`: AdamW-style decoupled weight decay on matrices only (norms, biases and
  embeddings go to a `"no_decay"` group unless the JSON's top-level `"no_decay_group": false`
  asks to decay everything, `split_no_decay_group`); each group carries the `"name"` key
  DeepSpeed's MoE utilities index by. Under muP
  (`model.mup_base_hidden_size`) the hidden matrices form a third group with an `"lr_scale"`
  of 1/m, which `apply_group_lr_scales` turns into the group's own lr.
- `Lamb`: a pure-torch LAMB for the CPU accelerator, where DeepSpeed's `FusedLamb` has no kernel.
  `maybe_build_client_optimizer` builds it when the JSON asks for `Lamb` on CPU.
- `scale_lr` / `apply_lr_scaling`: scale the peak lr with the global batch (none, linear, sqrt), as
  the DeepSpeed JSON's `"lr_scaling": {"rule": ..., "base_batch_size": ...}` block asks.
"""

import copy
import math
from typing import Iterable, List, Optional, Tuple

import torch
from torch import nn

from model import mup
from model.config import TransformerConfig, is_int

LR_SCALING_RULES = ("none", "linear", "sqrt")

# FusedLamb's constructor keywords that mean the same here; anything else is refused by name.
_LAMB_KEYS = ("lr", "betas", "eps", "weight_decay", "bias_correction", "eps_inside_sqrt", "max_coeff",
              "min_coeff", "always_adapt")


def _no_decay(name: str, param: torch.Tensor) -> bool:
    """Norm gains, biases and embeddings are not decayed; matrices and stacked experts are.

    Vectors (ndim < 2) are norms and biases. Embedding rows are looked up, not multiplied, so
    decay would only shrink rare tokens; `embed` in the name catches them despite being 2-D.
    A tied `lm_head` shares the embedding's tensor and `named_parameters` reports it once, under
    `embed_tokens`, so a tied head is not decayed either.
    """
    # A parameter partitioned at construction (ZeRO-3's zero.Init) is an empty 1-D tensor until
    # gathered; DeepSpeed keeps its shape as ``ds_shape``.
    ndim = len(getattr(param, "ds_shape", param.shape))
    return ndim < 2 or "embed" in name or name.endswith("norm.weight")


def param_groups(model: nn.Module, weight_decay: float, cfg: Optional[TransformerConfig] = None,
                 no_decay_group: bool = True) -> List[dict]:
    """Split trainable parameters into a decayed and a non-decayed group (and, under muP, the
    hidden matrices into a third).

    Decayed: `q_proj`/`k_proj`/`v_proj`/`o_proj`, `gate_proj`/`up_proj`/`down_proj`, the router
    `gate`, 3-D stacked `experts.*` weights, an untied `lm_head`. Not decayed: `*_layernorm`,
    `norm`, biases, `embed_tokens`.

    Args:
        model: the module to train (names as in HF Llama / Mixtral).
        weight_decay: the decay of the decayed group (the JSON `optimizer.params.weight_decay`).
        cfg: the model's config; with `mup_base_hidden_size` set, the decayed matrices that
            `model.mup.is_hidden` names go to a last group `"decay_mup_hidden"` with
            `"lr_scale": 1/m` (last, so that group 0, whose lr the trainer logs, has the base lr).
        no_decay_group: False decays every parameter, norms, biases and embeddings too, as a
            plain `AdamW(model.parameters())` does (the JSON's `"no_decay_group"`).

    Returns:
        Up to three groups, `{"params", "weight_decay", "name": "decay" | "no_decay" |
        "decay_mup_hidden"[, "lr_scale"]}`; an empty group is left out (DeepSpeed's ZeRO cannot
        partition an empty group). Without muP: the two groups `"decay"` and `"no_decay"`.
    """
    use_mup = cfg is not None and cfg.mup_base_hidden_size is not None
    decay, no_decay, hidden = [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if no_decay_group and _no_decay(name, param):
            no_decay.append(param)
        else:
            (hidden if use_mup and mup.is_hidden(name) else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": float(weight_decay), "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]
    if use_mup:
        groups.append({"params": hidden, "weight_decay": float(weight_decay), "name": "decay_mup_hidden",
                       "lr_scale": 1.0 / mup.width_mult(cfg)})
    return [g for g in groups if g["params"]]


def apply_group_lr_scales(ds_config: dict, groups: List[dict]) -> dict:
    """Give each param group with an `"lr_scale"` (muP's hidden group) its own lr, and keep the
    per-group ratios under every scheduler.

    Sets `group["lr"] = optimizer.params.lr * lr_scale` on every group (the optimizer DeepSpeed
    builds from the JSON, or ours, keeps a group's own lr). Our schedulers and DeepSpeed's
    `WarmupCosineLR` multiply each group's initial lr, so they keep the ratios as they are;
    DeepSpeed's `WarmupLR`, `WarmupDecayLR`, `OneCycle` and `LRRangeTest` set absolute lrs,
    so their lr params (`warmup_max_lr`, ...) become per-group lists scaled the same way.
    Call it after `apply_lr_scaling` and `resolve_auto`, before `deepspeed.initialize`.

    Args:
        ds_config: the final DeepSpeed config (not modified).
        groups: from `param_groups`; modified in place.

    Returns:
        A copy of the config with per-group scheduler lrs; the config itself when no group has
        an `lr_scale`.

    Raises:
        ValueError: muP groups but no `optimizer.params.lr` to scale.
    """
    scales = [g.get("lr_scale", 1.0) for g in groups]
    if all(s == 1.0 for s in scales):
        return ds_config
    out = copy.deepcopy(ds_config)
    lr = ((out.get("optimizer") or {}).get("params") or {}).get("lr")
    if not isinstance(lr, (int, float)) or isinstance(lr, bool):
        raise ValueError(f"ds_config.optimizer.params.lr ({lr!r}) must be a number under muP "
                         f"(model.mup_base_hidden_size): set the base learning rate")
    for group, scale in zip(groups, scales):
        group["lr"] = lr * scale
    sched_params = (out.get("scheduler") or {}).get("params") or {}
    for key in _SCHEDULER_LR_KEYS:
        value = sched_params.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            sched_params[key] = [value * s for s in scales]
    return out


def split_no_decay_group(ds_config: dict) -> Tuple[dict, bool]:
    """Take the JSON's optional top-level `"no_decay_group"` (default true) out of the config.

    True keeps norms, biases and embeddings out of the decay (`param_groups`'s `"no_decay"`
    group); false decays every parameter. DeepSpeed has no such key, so it is removed before
    `deepspeed.initialize`; `validate_ds_config` has checked that it is a boolean.

    Returns:
        `(a copy of the config without the key, its value)`.
    """
    out = copy.deepcopy(ds_config)
    return out, bool(out.pop("no_decay_group", True))


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning", Algorithm 2).

    Semantics are those of the paper and NVIDIA apex `FusedLAMB`: per parameter tensor,

        m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
        m_hat = m / (1 - b1^t);  v_hat = v / (1 - b2^t)          (if bias_correction)
        u = m_hat / (sqrt(v_hat) + eps) + weight_decay * p       (decoupled decay, as AdamW)
        r = clamp(||p|| / ||u||, min_coeff, max_coeff), or 1 if either norm is 0
        p = p - lr * r * u

    Two deliberate choices, both documented in docs/batch-size-and-lamb.md (LAMB):
    - DeepSpeed's `FusedLamb` computes `r` from the *uncorrected* moments and applies the bias
      correction as a step-size factor `sqrt(1 - b2^t) / (1 - b1^t)` outside `r`, which scales early
      updates down (0.15x at step 12, 0.31x at step 100 with betas (0.9, 0.999)); this class
      follows the paper, so CPU and GPU runs differ early on.
    - As in apex, the trust ratio applies only to groups with weight decay (norms and biases get
      plain Adam updates, as in the BERT LAMB recipe), unless `always_adapt=True`
      (apex's `use_nvlamb`; DeepSpeed's `FusedLamb` always adapts).
    The clamp bounds are FusedLamb's defaults. bf16/fp16 params get fp32 math and moments.

    Args:
        params: parameters or param groups.
        lr: learning rate.
        betas: moment decay rates (b1, b2).
        eps: denominator term.
        weight_decay: decoupled weight decay, inside the trust-ratio update.
        bias_correction: divide the moments by (1 - b^t).
        eps_inside_sqrt: use sqrt(v_hat + eps) instead of sqrt(v_hat) + eps (FusedLamb's option).
        max_coeff: upper clamp of the trust ratio.
        min_coeff: lower clamp of the trust ratio.
        always_adapt: apply the trust ratio to groups without weight decay too.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, bias_correction: bool = True,
                 eps_inside_sqrt: bool = False, max_coeff: float = 10.0, min_coeff: float = 0.01,
                 always_adapt: bool = False):
        if lr <= 0:
            raise ValueError(f"lr: {lr} must be > 0 (set a positive learning rate)")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas: {tuple(betas)} must lie in [0, 1) (e.g. [0.9, 0.999])")
        if not 0 < min_coeff <= max_coeff:
            raise ValueError(f"min_coeff, max_coeff: {min_coeff}, {max_coeff} need 0 < min_coeff <= max_coeff")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, eps_inside_sqrt=eps_inside_sqrt, max_coeff=max_coeff,
                        min_coeff=min_coeff, always_adapt=always_adapt)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        """Apply one update to every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            wd = group["weight_decay"]
            adapt = wd != 0 or group["always_adapt"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                # Half-precision params get fp32 math and moments; fp32/fp64 keep their own dtype.
                dtype = torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype)
                state["step"] += 1
                t = state["step"]
                g = p.grad.to(dtype)
                w = p.to(dtype)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                c1 = 1 - b1**t if group["bias_correction"] else 1.0
                c2 = 1 - b2**t if group["bias_correction"] else 1.0
                v_hat = v / c2
                denom = (v_hat + group["eps"]).sqrt() if group["eps_inside_sqrt"] else v_hat.sqrt() + group["eps"]
                update = (m / c1) / denom
                if wd != 0:
                    update.add_(w, alpha=wd)
                ratio = 1.0
                if adapt:
                    w_norm = w.norm().item()
                    u_norm = update.norm().item()
                    if w_norm > 0 and u_norm > 0:
                        ratio = min(max(w_norm / u_norm, group["min_coeff"]), group["max_coeff"])
                p.copy_(w - group["lr"] * ratio * update)
        return loss


def scale_lr(base_lr: float, base_batch: int, batch: int, rule: str) -> float:
    """Scale a learning rate tuned at `base_batch` to the global batch `batch`.

    Args:
        base_lr: the lr that was tuned.
        base_batch: the global batch (sequences) it was tuned at.
        batch: the global batch of this run (`train_batch_size`).
        rule: "none" (keep), "linear" (Goyal et al. 2017, for SGD), or "sqrt" (the Adam/LAMB
            rule, Krizhevsky 2014 / You et al. 2019).

    Returns:
        The scaled lr.

    Raises:
        ValueError: unknown rule or non-positive batch sizes.
    """
    if rule not in LR_SCALING_RULES:
        raise ValueError(f"lr_scaling.rule: {rule!r} is not a rule (use one of {list(LR_SCALING_RULES)})")
    for key, value in (("base_batch_size", base_batch), ("train_batch_size", batch)):
        if not is_int(value, 1):
            raise ValueError(f"lr_scaling.{key}: {value!r} must be an integer >= 1 (set the global batch size)")
    if rule == "linear":
        return base_lr * batch / base_batch
    if rule == "sqrt":
        return base_lr * math.sqrt(batch / base_batch)
    return base_lr


# Absolute learning rates inside DeepSpeed's scheduler params, scaled with optimizer.params.lr.
# Ours and WarmupCosineLR are ratios of the optimizer lr and need nothing.
_SCHEDULER_LR_KEYS = ("warmup_min_lr", "warmup_max_lr", "cycle_min_lr", "cycle_max_lr", "lr_range_test_min_lr")


def apply_lr_scaling(ds_config: dict) -> dict:
    """Scale the config's peak lr to its global batch, and drop the `lr_scaling` block.

    The rule is the JSON's optional top-level block `"lr_scaling": {"rule": "sqrt",
    "base_batch_size": 64}`: `optimizer.params.lr` and the absolute lrs in DeepSpeed's scheduler
    params (`warmup_min_lr`, `warmup_max_lr`, `cycle_min_lr`, `cycle_max_lr`,
    `lr_range_test_min_lr`) are multiplied by `scale_lr(1, base_batch_size, train_batch_size,
    rule)`. Call it after `validate_ds_config` (which derives `train_batch_size` and checks the
    block) and before `resolve_auto` (so that `warmup_max_lr: "auto"` copies the scaled lr).

    Args:
        ds_config: a validated DeepSpeed config dict (not modified).

    Returns:
        A deep copy without `lr_scaling`, with the lrs scaled.

    Raises:
        ValueError: a bad rule or batch size.
    """
    out = copy.deepcopy(ds_config)
    block = out.pop("lr_scaling", None)
    if not block or block.get("rule", "none") == "none":
        return out
    factor = scale_lr(1.0, block.get("base_batch_size"), out.get("train_batch_size"), block["rule"])
    opt_params = (out.get("optimizer") or {}).get("params") or {}
    if isinstance(opt_params.get("lr"), (int, float)):
        opt_params["lr"] = opt_params["lr"] * factor
    sched_params = (out.get("scheduler") or {}).get("params") or {}
    for key in _SCHEDULER_LR_KEYS:
        if isinstance(sched_params.get(key), (int, float)) and not isinstance(sched_params[key], bool):
            sched_params[key] = sched_params[key] * factor
    return out


def _zero_stage(ds_config: dict) -> int:
    return int((ds_config.get("zero_optimization") or {}).get("stage", 0))


def maybe_build_client_optimizer(ds_config: dict, param_groups: List[dict],
                                 device_type: str) -> Tuple[Optional[torch.optim.Optimizer], dict]:
    """Build the optimizer ourselves where DeepSpeed cannot on this accelerator.

    That is `Lamb` on "cpu" (DeepSpeed's `FusedLamb` has no CPU kernel). The JSON's
    optimizer section is then removed, since DeepSpeed refuses a client optimizer next to one, and
    the ZeRO flags a non-DeepSpeed optimizer needs are set. `Lion` on CPU without optimizer
    offload is refused with a fix, as DeepSpeed's `FusedLion` would fail later.

    Args:
        ds_config: a validated DeepSpeed config dict (not modified).
        param_groups: from `param_groups(model, weight_decay)`.
        device_type: the accelerator's device name ("cpu", "cuda", ...).

    Returns:
        `(optimizer, config without its optimizer section)` when built here, else
        `(None, copy of config)` and DeepSpeed builds the optimizer from the JSON.

    Raises:
        ValueError: an unknown Lamb parameter, or Lion on CPU without offload.
    """
    out = copy.deepcopy(ds_config)
    section = out.get("optimizer") or {}
    name = str(section.get("type", "")).lower()
    zero = out.get("zero_optimization") or {}
    offload = (zero.get("offload_optimizer") or {}).get("device", "none") not in ("none", None)
    if device_type != "cpu" or name not in ("lamb", "lion"):
        return None, out
    if name == "lion":
        if offload:
            return None, out  # DeepSpeedCPULion runs it on CPU
        raise ValueError("ds_config.optimizer.type: 'Lion' has no CPU kernel without optimizer offload "
                         "(set zero_optimization.offload_optimizer.device to \"cpu\", or use AdamW)")
    params = dict(section.get("params") or {})
    for key in params:
        if key not in _LAMB_KEYS:
            raise ValueError(f"ds_config.optimizer.params.{key}: {params[key]!r} is not a Lamb parameter "
                             f"(remove it; known: {', '.join(_LAMB_KEYS)})")
    optimizer = Lamb(param_groups, **params)
    del out["optimizer"]
    if _zero_stage(out) > 0:
        out["zero_allow_untested_optimizer"] = True
    if offload:
        out["zero_force_ds_cpu_optimizer"] = False
    return optimizer, out
