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


def hand_over(engine):
    """What ZeRO-1 needs after the exchange, or None (ZeRO-0: its optimizer reads ``.grad``).
    ``DeepSpeedZeroOptimizer`` (bf16 ZeRO-1) takes its partition of the averaged gradients in
    its reduction's epilogue (``independent_gradient_partition_epilogue``: the partition copied
    from ``.grad``; its bucket is empty, as nothing was reduced through it): called alone, it
    keeps each rank's partition of what PowerSGD averaged, and ``engine.step`` goes on as after
    DeepSpeed's own reduction."""
    epilogue = getattr(engine.optimizer, "independent_gradient_partition_epilogue", None)
    return epilogue if int(engine.zero_optimization_stage()) == 1 else None


def exchange(stepper, decision) -> None:
    """PowerSGD's exchange of the step's gradients around ``stepper._prepare_last_step(decision)``
    (the gradient norm, the skip decision and the clip). A step skipped before it (a loss spike,
    a non-finite loss) does not reduce; its gradients are zeroed (an optimizer step at lr 0 then
    only decays AdamW's moments, as at ZeRO-0) and, at ZeRO-1, handed over. Where the trainer
    computes the gradient norm itself (fp32 ZeRO-0) a gradient-norm spike test that can skip
    (``train.grad_spike_factor``, ``spike_action`` skip or stop) decides after the exchange,
    from the global norm (the same on every rank): the reduction is then tentative, and a
    skipped step leaves the count, Q and the error feedback as they were. Elsewhere DeepSpeed
    reports the norm after its step, and a spike is logged, not skipped."""
    compressor, prepare, train = stepper.compressor, stepper._prepare_last_step, stepper.recipe.train
    after = hand_over(stepper.engine)
    if decision.skip_reason is None:
        tentative = (train.grad_spike_factor is not None and train.spike_action != "log"
                     and stepper.zero_stage == 0 and not stepper.half)
        compressor.reduce(tentative=tentative)
        decision.exchange_bytes = compressor.last_bytes
        if after is not None:
            after()
        prepare(decision)
        if tentative:
            (compressor.commit if decision.skip_reason is None else compressor.rollback)()
    else:
        prepare(decision)
        for _, p in compressor.params:
            if p.grad is not None:
                p.grad.zero_()
        if after is not None:
            after()
