"""The trainer's side of recipe key ``parallel.grad_compression`` (``docs/communication.md``,
"Gradient compression").

``apply_grad_compression`` (called by the preflight) checks the key against the layout and the
DeepSpeed JSON; for ``bf16`` it sets DeepSpeed's ``communication_data_type``, and DeepSpeed's
reductions cast to bf16 and back.
``powersgd`` replaces DeepSpeed's data-parallel all-reduce at ZeRO-0 fp32 (the only setting it is
accepted at): the engine's ``enable_backward_allreduce`` is turned off, and ``Stepper`` calls
``PowerSGD.reduce`` (``model/parallel/grad_compression.py``) after the step's last backward,
before the gradient norm, the skip and the clip; a skipped step does not call it, so its error
feedback and Q stay as they were. Each rank's state goes into the checkpoint
(``trainer_state_rank<r>.pt``) under ``grad_compression``.

Under expert parallelism every parameter is reduced over the data-parallel group: an expert's
replicas are the dp ranks of its ep rank, and the non-expert gradients were already summed over
ep (``model/parallel/grad_sync.py``, before backward returns).
"""

from __future__ import annotations

from model.parallel.dims import ParallelDims
from model.parallel.grad_compression import PowerSGD


def apply_grad_compression(ds: dict, compression: str, dims: ParallelDims) -> dict:
    """The DeepSpeed JSON for recipe key ``parallel.grad_compression`` at layout ``dims``
    (``docs/communication.md``, "Gradient compression"): ``bf16`` sets DeepSpeed's
    ``communication_data_type`` (its reductions cast the gradients to bf16 and back, ZeRO 0-2);
    ``powersgd`` leaves the JSON as it is (the trainer replaces DeepSpeed's reduction,
    ``build_compressor``) and runs only at ZeRO-0 in fp32 without pipeline
    stages, where DeepSpeed's all-reduce after backward is the whole exchange; ZeRO 1-3 and
    bf16/fp16 ZeRO-0 reduce inside DeepSpeed's optimizers.

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
    stage = int((ds.get("zero_optimization") or {}).get("stage", 0))
    fp16 = (ds.get("fp16") or {}).get("enabled")
    half = fp16 or any((ds.get(k) or {}).get("enabled") for k in ("bf16", "bfloat16"))
    if compression == "bf16":
        if stage == 3 or fp16:
            raise ValueError(f"{key} applies at ZeRO 0-2 in fp32 or bf16 (DeepSpeed's "
                             f"communication_data_type), not at {'fp16' if fp16 else 'ZeRO-3'}: "
                             f"use none, or a zero0/1/2 JSON")
        return {**ds, "communication_data_type": "bf16"}
    if stage != 0 or half or dims.pp > 1:
        where = (f"ZeRO-{stage}" if stage else "bf16/fp16" if half else
                 f"pipeline_parallel_size {dims.pp}")
        raise ValueError(f"{key} runs at ZeRO-0 in fp32 without pipeline stages (where DeepSpeed's "
                         f"all-reduce after backward is the whole exchange), not at {where}: use "
                         f"ds_configs/zero0_fp32.json, or grad_compression bf16 (ZeRO 0-2) / none")
    return ds


def build_compressor(recipe, engine, groups) -> PowerSGD | None:
    """The run's PowerSGD on ``engine`` (DeepSpeed's own all-reduce turned off), or None when
    ``parallel.grad_compression`` is not ``powersgd``."""
    par = recipe.parallel
    if par.grad_compression != "powersgd":
        return None
    engine.enable_backward_allreduce = False        # our reduction replaces it (see above)
    params = [(name, p) for name, p in engine.module.named_parameters() if p.requires_grad]
    # DeepSpeed's data-parallel exchange, which it replaces: over dp x cp (model/parallel/groups.py).
    return PowerSGD(params, groups.dp_cp_group, groups.dp * groups.cp, rank=par.powersgd_rank,
                    start_steps=par.powersgd_start_steps,
                    error_feedback=par.powersgd_error_feedback, seed=recipe.train.seed)
