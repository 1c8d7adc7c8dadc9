"""The trainer's side of recipe key ``parallel.grad_compression`` (``docs/communication.md``,
"Gradient compression").

The key is checked against the layout and the DeepSpeed JSON when the JSON is resolved
(``training.config.ds_config.apply_grad_compression``; ``bf16`` sets DeepSpeed's
``communication_data_type``, and DeepSpeed's reductions cast to bf16 and back).
``powersgd`` replaces DeepSpeed's data-parallel all-reduce at ZeRO-0 fp32 (the only setting it is
accepted at): the engine's ``enable_backward_allreduce`` is turned off, and ``Stepper`` calls
``PowerSGD.reduce`` (``model/parallel/powersgd.py``) after the step's last backward,
before the gradient norm, the skip and the clip; a skipped step does not call it, so its error
feedback and Q stay as they were. Each rank's state goes into the checkpoint
(``trainer_state_rank<r>.pt``) under ``grad_compression``.

Under expert parallelism every parameter is reduced over the data-parallel group: an expert's
replicas are the dp ranks of its ep rank, and the non-expert gradients were already summed over
ep (``model/parallel/grad_sync.py``, before backward returns).
"""

from __future__ import annotations

from model.parallel.powersgd import PowerSGD


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
