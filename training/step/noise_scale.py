"""The gradient noise scale, from the gradient norms at two batch sizes that every step already has.

McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", appendix A: with ``G_B`` the
mean gradient over ``B`` tokens, ``E|G_B|^2 = |G|^2 + tr(Sigma) / B``. Two batch sizes give two
unbiased estimates::

    |G|^2     = (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) = (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

and the simple noise scale ``B_simple = tr(Sigma) / |G|^2`` (in tokens). Both are noisy, so the
trainer logs the two per step (``gns_grad_sq``, ``gns_trace``) and the ratio of their
bias-corrected exponential moving averages (``gradient_noise_scale``), as the paper recommends.

Where the two norms come from, at no extra communication:

- ``|G_small|``: with accumulation >= 2, after the first micro-batch's backward ``param.grad``
  holds that micro-batch's gradient on this rank; the loss was ``ce_sum * dp * cp / step_tokens``
  (``Stepper._forward``), so ``.grad = G_small / gas`` with ``G_small`` the mean-token gradient
  of ``B_small = micro-batch x seq_len`` tokens. Its squared norm is taken on the device and
  rides in the step's statistics all-reduce (the mean over data-parallel ranks: more samples of
  the same estimator).
- ``|G_big|``: the step's global gradient norm before clipping (the row's ``grad_norm``), over
  ``B_big = train_batch_size x seq_len`` tokens.

Exact only where ``.grad`` is the whole, unreduced micro-batch gradient after backward (DeepSpeed
0.19.8): tp = ep = pp = 1 (no shards, no replicas summed in hooks, no pipeline schedule), ZeRO-0
or -1 without ``overlap_comm`` (ZeRO-2/3 and ``overlap_comm`` reduce and free ``.grad`` in
backward hooks), in fp32 or in bf16 with gradients accumulated in bf16 (DeepSpeed's default;
with ``data_types.grad_accum_dtype: fp32`` ZeRO-1 moves ``.grad`` into ``param.grad_accum`` in
a hook and ZeRO-0's ``BF16_Optimizer`` into its fp32 buffers), not fp16 (whose ``.grad``
carries the dynamic loss scale). In bf16 the micro-batch gradient is the bf16 one the
optimizer accumulates, so ``|G_small|^2`` carries bf16's rounding. And not under
``parallel.grad_compression`` (``bf16`` or ``powersgd``): ``grad_norm`` is then the norm of the
compressed exchange's result, not of the step's mean gradient (bf16: the mean rounded to bf16;
PowerSGD: a rank-r approximation of the mean plus the error fed back from earlier steps, which
can be far from ``|G_big|``), so both estimates would be biased by an unknown amount.
Elsewhere nothing is logged.
"""

from __future__ import annotations

import math

import torch


BETA = 0.95     # EMA decay of both estimates: about the last 20 steps


def unavailable_reason(ds: dict, groups, grad_compression: str = "none") -> str | None:
    """Why the noise scale cannot be measured exactly under DeepSpeed JSON ``ds``, the process
    ``groups`` and recipe key ``parallel.grad_compression`` (None: it can)."""
    if grad_compression != "none":
        return (f"parallel.grad_compression {grad_compression} (grad_norm is the compressed "
                f"exchange's, not the step's mean gradient's)")
    if groups.tp * groups.ep * groups.pp > 1:
        return "tensor/expert/pipeline parallel (gradients sharded, or reduced in hooks)"
    if groups.cp > 1:
        return "context parallel (a cp rank's gradient is a part of its samples', not a small batch's)"
    zero = ds.get("zero_optimization") or {}
    if int(zero.get("stage", 0)) > 1 or zero.get("overlap_comm", False):
        return "ZeRO-2/3 or overlap_comm (DeepSpeed takes .grad in backward hooks)"
    if (ds.get("fp16") or {}).get("enabled"):
        return "fp16 (.grad carries the dynamic loss scale)"
    bf16 = any((ds.get(k) or {}).get("enabled") for k in ("bf16", "bfloat16"))
    accum = (ds.get("data_types") or {}).get("grad_accum_dtype")
    if bf16 and accum not in (None, "bf16", "bfloat16"):
        return (f"bf16 with data_types.grad_accum_dtype {accum} (DeepSpeed moves .grad into an "
                f"fp32 accumulator in hooks)")
    if int(ds.get("gradient_accumulation_steps", 1)) < 2:
        return "gradient_accumulation_steps < 2 (no micro-batch gradient before the reduction)"
    return None


def estimates(small_sq: float, b_small: float, big_sq: float, b_big: float) -> tuple[float, float]:
    """Unbiased ``(|G|^2, tr(Sigma))`` from squared gradient norms at batch sizes
    ``b_small < b_big`` (appendix A of McCandlish et al.)."""
    grad_sq = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    return grad_sq, trace


def small_batch_sq(model: torch.nn.Module, gas: int) -> torch.Tensor:
    """``|G_small|^2`` of the micro-batch just backpropagated, from ``.grad`` (``gas`` x the
    mean-token gradient's scale), as a float64 device scalar: no host copy."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    # float64 accumulation: an fp32 norm over 1e5+ elements is off by ~1e-5 on the CPU.
    norms = torch._foreach_norm(grads, dtype=torch.float64)
    return torch.stack(norms).pow(2).sum() * gas ** 2


class NoiseScale:
    """The per-step estimates and their EMAs for one run.

    Args:
        b_small: tokens of one micro-batch on one rank.
        b_big: tokens of one optimizer step (all micro-batches, all data-parallel ranks).
        gas: the gradient accumulation steps.
        dp_size: data-parallel ranks whose ``|G_small|^2`` are summed in the statistics.
    """

    def __init__(self, b_small: int, b_big: int, gas: int, dp_size: int):
        self.b_small, self.b_big, self.gas, self.dp_size = b_small, b_big, gas, dp_size
        self.ema_grad_sq, self.ema_trace, self.updates = 0.0, 0.0, 0

    def measure(self, model: torch.nn.Module, slot: torch.Tensor) -> None:
        """Add this rank's ``|G_small|^2`` into ``slot`` (a view of the statistics vector)."""
        slot += small_batch_sq(model, self.gas)

    def row(self, small_sq_sum: float, grad_norm: float | None, applied: bool) -> dict:
        """The metrics row's keys for a step: ``small_sq_sum`` is the summed slot, ``grad_norm``
        the step's global norm. A skipped step or a non-finite norm leaves the EMAs alone."""
        small_sq = small_sq_sum / self.dp_size
        if not applied or grad_norm is None or not math.isfinite(grad_norm) or not math.isfinite(small_sq):
            return {}
        grad_sq, trace = estimates(small_sq, self.b_small, grad_norm ** 2, self.b_big)
        self.updates += 1
        self.ema_grad_sq = BETA * self.ema_grad_sq + (1 - BETA) * grad_sq
        self.ema_trace = BETA * self.ema_trace + (1 - BETA) * trace
        # The bias corrections of both EMAs are equal and cancel in the ratio.
        noise = self.ema_trace / self.ema_grad_sq if self.ema_grad_sq > 0 else None
        return {"gns_grad_sq": grad_sq, "gns_trace": trace, "gradient_noise_scale": noise}

    def state_dict(self) -> dict:
        return {"ema_grad_sq": self.ema_grad_sq, "ema_trace": self.ema_trace, "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.ema_grad_sq, self.ema_trace, self.updates = (state.get("ema_grad_sq", 0.0),
                                                          state.get("ema_trace", 0.0), state.get("updates", 0))


def for_run(recipe, ds: dict, ctx, dp_size: int) -> NoiseScale | None:
    """The run's ``NoiseScale``, or None when ``train.noise_scale`` is off or the layout does not
    allow an exact measurement (``unavailable_reason``)."""
    if not recipe.train.noise_scale or unavailable_reason(ds, ctx.groups, recipe.parallel.grad_compression):
        return None
    micro, gas = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
    return NoiseScale(micro * recipe.seq_len, ds["train_batch_size"] * recipe.seq_len, gas, dp_size)
