"""The trainer's side of recipe key ``parallel.grad_compression`` (``docs/communication.md``,
"Gradient compression").

The key is checked against the layout and the DeepSpeed JSON when the JSON is resolved
(``training.config.ds_config.apply_grad_compression``; ``bf16`` sets DeepSpeed's
``communication_data_type``, and DeepSpeed's reductions cast to bf16 and back).
``powersgd`` replaces DeepSpeed's data-parallel all-reduce at ZeRO-0 fp32 (the only setting it is
accepted at): the engine's ``enable_backward_allreduce`` is turned off, and ``Stepper`` calls
``exchange`` (below: ``PowerSGD.reduce``, ``model/parallel/powersgd.py``) after the step's last
backward, before the gradient norm and the clip. A step skipped before it (a non-finite loss, a loss spike) does not
call it. A gradient-norm spike (``train.grad_spike_factor`` with ``spike_action`` skip or stop)
is known only after it, from the exchanged gradients' global norm (the same on every rank): the
reduction is then tentative, and ``commit`` keeps or ``rollback`` drops the new error feedback,
Q and count once the decision is known. Either way a skipped step leaves the state as it was.
Each rank's state goes into the checkpoint (``trainer_state_rank<r>.pt``) under
``grad_compression``; a resume at another data-parallel size reshards it
(``PowerSGD.load_other_world``: the errors' mean over the ranks kept, Q and the count carried
over) with one warning line.

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
    # Without pipeline stages (refused with them) the rank order there is member x (tp x ep) +
    # mp_rank at any dp size: the checkpoint files a resume at another dp size reads.
    mp = groups.tp * groups.ep
    return PowerSGD(params, groups.dp_cp_group, groups.dp * groups.cp, rank=par.powersgd_rank,
                    start_steps=par.powersgd_start_steps,
                    error_feedback=par.powersgd_error_feedback, seed=recipe.train.seed,
                    member=groups.get_data_parallel_rank(),
                    member_rank=lambda i: i * mp + groups.mp_rank)


def exchange(compressor: PowerSGD, decision, prepare, recipe) -> None:
    """PowerSGD's exchange of the step's gradients around ``prepare(decision)`` (the gradient
    norm, the skip decision and the clip: ``Stepper._prepare_last_step``). A step skipped before
    it (a loss spike, a non-finite loss) does not reduce. Under a gradient-norm spike test that
    can skip (``train.grad_spike_factor``, ``spike_action`` skip or stop) the reduction is
    tentative until ``prepare`` has decided from the global norm (the same on every rank): a
    skipped step leaves the count, Q and the error feedback as they were."""
    if decision.skip_reason is None:
        train = recipe.train
        tentative = train.grad_spike_factor is not None and train.spike_action != "log"
        compressor.reduce(tentative=tentative)
        decision.exchange_bytes = compressor.last_bytes
        prepare(decision)
        if tentative:
            (compressor.commit if decision.skip_reason is None else compressor.rollback)()
    else:
        prepare(decision)
