"""Per-GPU communication and staging buffers next to the model states, and the optimizer's
temporaries at its step (``planning/estimator.py`` adds them to ``planning/memory_model.py``'s
model states and activations)."""

from __future__ import annotations

from planning.memory_model import FP32, ZERO_DEFAULTS, _offloaded


def optimizer_temporaries(ds: dict, on_gpu: bool = True) -> int:
    """Copies of the flat fp32 group that the optimizer's step allocates besides its states.

    torch's Adam and AdamW (``"torch_adam": true``, which DeepSpeed hands each flat group) compute
    ``exp_avg_sq.sqrt()`` into a new tensor: the foreach implementation, torch's default on a GPU,
    holds one such copy of the group (``_multi_tensor_adam``); the single-tensor one, its CPU path,
    also holds the quotient by the bias correction at the same time (two). DeepSpeed's fused Adam
    (``torch_adam`` false on a GPU) works in place. Other optimizers are not modeled.
    """
    opt = ds.get("optimizer") or {}
    if opt.get("type", "").lower() not in ("adam", "adamw"):
        return 0
    if on_gpu and not (opt.get("params") or {}).get("torch_adam", False):
        return 0
    return 1 if on_gpu else 2


def buffer_bytes(zero: dict, stage: int, a: int, psi_local: float, largest_module: float,
                 dp: int, a2a_bytes: float = 0.0, optimizer_copies: int = 0) -> dict[str, float]:
    """Communication and staging buffers (bytes) next to the model states.

    - ZeRO-1/2 with ``contiguous_gradients``: one ``reduce_bucket_size`` gradient bucket, two with
      ``overlap_comm`` (``stage_1_and_2.py:3263-3278``). The post-step all-gather
      (``allgather_bucket_size``) writes into the flat parameter buffer in place
      (``runtime/utils.py`` ``all_gather_dp_groups``): nothing extra.
    - ZeRO-3: the ``reduce_bucket_size`` bucket (``stage3.py:782``) and, while it is reduced, its
      flat copy (``reduce_scatter_coalesced`` concatenates the bucket's gradients, padded to the
      partitions, and reduce-scatters that); gathered parameters, the largest module plus the
      prefetch (``stage3_prefetch_bucket_size``, capped by ``stage3_max_live_parameters``), and the
      full 16-bit gradient of that module before its reduce-scatter (DeepSpeed's own estimator
      counts 4 bytes x largest layer for both).
    - EP: the all-to-all send and receive buffers of one MoE layer, 2 k T h a.
    - ``optimizer_step``: at the step, after the activations are freed: the fp32 copy of the
      gradient partition (ZeRO-1/2 mixed precision, 4 psi/dp) or of one ``sub_group_size``
      sub-group (ZeRO-3), plus ``optimizer_copies`` fp32 copies of that group, the optimizer's own
      temporaries (``optimizer_temporaries``); none on the GPU when the optimizer is offloaded.
    """
    z = {**ZERO_DEFAULTS, **zero}
    bucket = min(z["reduce_bucket_size"], psi_local) * a
    out = {"reduce_bucket": 0.0, "zero3_gather": 0.0, "all_to_all": a2a_bytes, "optimizer_step": 0.0}
    if stage in (1, 2) and z["contiguous_gradients"]:
        out["reduce_bucket"] = bucket * (2 if z.get("overlap_comm", False) else 1)
    group = psi_local / dp if stage else psi_local            # what one optimizer step walks
    if stage == 3:
        prefetch = min(z["stage3_prefetch_bucket_size"], z["stage3_max_live_parameters"])
        out["reduce_bucket"] = 2 * bucket                     # the bucket and its flat copy
        out["zero3_gather"] = a * (2 * largest_module + min(prefetch, psi_local))
        group = min(z["sub_group_size"], group)
        out["optimizer_step"] = FP32 * group
    elif stage in (1, 2) and a < FP32:
        out["optimizer_step"] = FP32 * group
    out["optimizer_step"] += optimizer_copies * FP32 * group
    if _offloaded(z, "offload_optimizer"):       # the step runs on the CPU copy
        out["optimizer_step"] = 0.0
    return out
