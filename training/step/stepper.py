"""One optimizer step and one evaluation pass on a DeepSpeed engine, with exact accumulation.

Exact gradient accumulation: the cross-entropy of every micro-batch is divided by the number of
target tokens of the WHOLE optimizer step (all micro-batches, all data-parallel ranks), not by its
own token count. DeepSpeed averages gradients over the data-parallel group, so each micro-batch's
loss is ``ce_sum * dp_size / step_tokens`` and the engine is told not to divide by the
accumulation steps again. Micro-batch 1 x accumulation 4 then produces the same gradient as
micro-batch 4 x accumulation 1. Under context parallelism DeepSpeed averages over dp x cp
(``model/parallel/groups.py``), so both the scale and the router losses (shares over ep x cp
that sum to the micro-batch's) are multiplied by cp.

The router losses are per micro-batch means (as in Switch/Megatron: the balance statistics are
taken over the tokens of one forward pass), averaged over micro-batches and ranks. The step's
statistics stay on the compute device in one vector, are summed over the ranks that see
different tokens once, and reach the host once (one ``.tolist()``), before the last backward:
the skip decision needs the step's loss on every rank.

One step (``Stepper.train_step``): the forwards add into the statistics vector; after the last
one ``_decide`` sums it, brings it to the host and decides skip or apply (a ``StepDecision``);
after the last backward ``_prepare_last_step`` records the lr and, on a skip, makes the update a
no-op (lr 0); after ``engine.step()``, ``_finish_step`` builds the metrics row. With pipeline
stages, ``engine.train_batch`` runs DeepSpeed's 1F1B schedule over the micro-batches; the same
objective is built on the last stage (``training/engine/pipeline.py``), and the hook DeepSpeed calls
before the optimizer step runs the same two functions. Every ``train.log_every`` steps the row
also names the slowest rank (``training/step/stats.py``, "Stragglers").

``StepContext`` says where the trainer is (step, micro-batch, phase) for the out-of-memory report
(``planning/oom.py``): ``Stepper`` and the run (``training/run/trainer.py``) update it as they go.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from model.moe.layer import start_balance_step
from model.parallel import comm
from training.step import grad_compression, layer_grads
from training.step.history import StepHistory, spike_fields
from training.config.ds_config import replica_sync_mode
from training.step.stats import (NOISE, BusyTime, StatsLayout, StepValues, busy_row, straggler_metrics)


@dataclass
class StepContext:
    """Where the trainer is, kept current as it runs, for the out-of-memory report.

    The run (``training/run/trainer.py``) hands over the objects and marks checkpoint loads and
    saves; ``Stepper`` marks each micro-batch's forward and backward, the optimizer step, the
    pipeline schedule and evaluation (plain writes, read after the error unwound the stack).
    """

    phase: str = "start-up"
    step: int | None = None
    micro_batch: int | None = None        # 1-based, within ``step``; None outside a micro-batch
    micro_batches: int | None = None
    dist: object = None                   # training.run.distributed.DistContext: rank, device, GPU
    model: torch.nn.Module | None = None  # its parameters and gradients are named in the report
    engine: object = None                 # its optimizer's states and buffers too


def _schedule_position(scheduler) -> int | None:
    """How many times an lr scheduler has stepped (DeepSpeed's or torch's), None without one."""
    return None if scheduler is None else getattr(scheduler, "last_batch_iteration",
                                                  getattr(scheduler, "last_epoch", None))


@dataclass
class StepDecision:
    """What one step's statistics decided: ``Stepper._decide`` fills the first fields after the last
    forward, ``Stepper._prepare_last_step`` the rest, ``Stepper._finish_step`` reads them."""

    reduced: torch.Tensor           # the statistics summed over the ranks, on the device
    values: StepValues              # its host copy
    skip_reason: str | None         # why the update is not applied; None: applied
    spike: bool                     # the loss is a spike (logged whatever ``spike_action``)
    stragglers: dict                # log steps: step_busy_s_max, step_busy_s_median, slowest_rank
    lr: float | None = None                 # the first param group's lr of the step
    saved_lr: list[float] | None = None     # a skipped step's lrs, set to 0 for its update
    sched_before: int | None = None         # the lr scheduler's position before the step
    grad_norm_local: object = None  # the trainer's norm at ZeRO-0 fp32 and under Muon (a device tensor)
    layer_sq: object = None     # per-layer squared gradient sums: a device tensor, or a host list at ZeRO-0 fp32
    grad_spike: bool = False    # the gradient norm is a spike (train.grad_spike_factor)
    exchange_bytes: int = 0     # what PowerSGD's exchange sent (0: a step skipped before it)


class Stepper:
    """Runs training steps and evaluation on ``engine`` and returns metric rows.

    Statistics are summed over the batch group (every rank that sees different tokens: expert,
    context and data parallel); tensor-parallel peers hold identical values.

    Args:
        engine: the DeepSpeed engine (``PipelineEngine`` with pipeline stages).
        recipe: the run's recipe (``train`` section: spike handling, ``log_every``).
        ds: the resolved DeepSpeed config (batch sizes, ZeRO stage, precision).
        ctx: ``training.run.distributed.DistContext`` (rank, device and process groups).
        dp_size: the data-parallel size without cp (the loss is scaled by it, see the module docstring).
        history: what a step passes on and a checkpoint keeps (``history.py``); None: a fresh one.
        where: the ``StepContext`` to keep current (a private one when None).
        preemption: the run's ``training.resilience.preemption.Preemption`` (``stop_requested`` reads it).
        saver: the run's ``training.checkpoint.saving.Saver`` (``saves_written`` reads it).
        compressor: the run's PowerSGD (``grad_compression.py``), replacing DeepSpeed's all-reduce; or None.
        muon, qk_clip: the run's ``training.optim.muon.MuonUpdate`` (run after the last backward) and
            ``training.step.clip_logits.QKClip`` (after the update), or None.
    """

    def __init__(self, engine, recipe, ds: dict, ctx, dp_size: int, history: StepHistory | None = None,
                 where: StepContext | None = None, *, preemption=None, saver=None, compressor=None, muon=None,
                 qk_clip=None):
        self.engine, self.recipe, self.ctx = engine, recipe, ctx
        self.compressor, self.muon, self.qk_clip, self.preemption = compressor, muon, qk_clip, preemption
        self.where = where if where is not None else StepContext()
        self.dp_size, self.tokens_per_step = dp_size, ds["train_batch_size"] * recipe.seq_len
        self.cp = ctx.groups.cp         # DeepSpeed averages over dp x cp (module docstring)
        self.model, self.cfg = engine.module, engine.module.cfg
        self.zero_stage = int(ds.get("zero_optimization", {}).get("stage", 0))
        self.half = ds.get("bf16", {}).get("enabled", False) or ds.get("fp16", {}).get("enabled", False)
        self.history = history if history is not None else StepHistory.for_run(recipe, ds, ctx, dp_size)
        self.flops_per_token = ctx.flops_per_token(self.cfg, recipe)
        self.moe_blocks, moe = self.cfg.moe_block_ids, self.cfg.moe      # MTP's MoE blocks last
        self.stats = StatsLayout(len(self.moe_blocks), moe.num_experts if moe else 0,
                                 bool(moe and moe.expert_bias), self.cfg.mtp_depth)   # step/stats.py
        self.busy = BusyTime(ctx.device)
        self.pipeline = ctx.groups.pp > 1
        self.saver = saver
        self.stop_requested = False     # a rank got a preemption signal before this step's end
        self.saves_written = True       # every rank's checkpoint writer has finished
        self.grad_sync = None if self.pipeline else self.model.grad_sync
        self.noise = self.history.noise
        self.layer_norms = layer_grads.LayerGradNorms(self.model, self.cfg.num_layers, self.zero_stage,
                                                      self.half, ctx.groups)
        if self.grad_sync is not None:
            self.grad_sync.mode = replica_sync_mode(ds)
        if self.pipeline:
            from training.engine import pipeline
            gas = ds["gradient_accumulation_steps"]
            # DeepSpeed divides the last stage's loss by gas: undo it (see training/engine/pipeline.py).
            self.model.loss_fn.ce_scale = dp_size * self.cp * gas / self.tokens_per_step
            # The step's decision, left by ``_pipeline_before_step`` (DeepSpeed calls it inside
            # ``train_batch``) for the clipping below and for ``_pipeline_train_step``.
            self._pipeline_decision: StepDecision | None = None
            pipeline.before_optimizer_step(engine, lambda: self._pipeline_before_step(gas))
            if self.zero_stage == 0 and not self.half:
                pipeline.clip_fp32_with_norm(engine, lambda: self._pipeline_decision.grad_norm_local)

    def train_step(self, step: int, batches) -> tuple[dict, dict]:
        """Forward/backward every micro-batch of ``step`` and take the optimizer step."""
        self.busy.start()
        where = self.where
        where.step, where.micro_batch, where.micro_batches = step, None, len(batches)
        if self.cfg.moe is not None and self.cfg.moe.global_balance:
            start_balance_step(self.model)      # global-batch balancing counts this step only
        if self.pipeline:
            return self._pipeline_train_step(step, batches)
        t0 = time.time()
        engine, gas = self.engine, len(batches)
        stats = self._stats_vector(self.ctx.device)
        for i, (input_ids, labels) in enumerate(batches):
            last = i == gas - 1
            where.micro_batch, where.phase = i + 1, "forward"
            loss = self._forward(input_ids, labels, stats, gas)
            if last:
                # Global statistics before the last backward, so that the skip decision (lr 0 for
                # this step) is the same on every rank.
                decision = self._decide(step, stats)
            where.phase = "backward"
            if self.grad_sync is not None:   # "step" mode sums the replicas' gradients once, here
                self.grad_sync.boundary = last
            engine.backward(loss, scale_wrt_gas=False)
            if i == 0 and self.noise:    # .grad: this micro-batch's gradient (gas >= 2)
                self.noise.measure(self.model, stats[NOISE])
            if last:
                if self.compressor is not None:
                    where.phase = "gradient exchange (PowerSGD)"
                    grad_compression.exchange(self, decision)
                else:
                    self._prepare_last_step(decision)
                where.phase = "optimizer step"
            engine.step()
        return self._finish_step(step, decision, t0)

    def _stats_vector(self, device: torch.device) -> torch.Tensor:
        """The step's statistics on the device (``training/step/stats.py``), with the expert biases it routes with."""
        stats = self.stats.new(device)
        g = self.ctx.groups
        self.stats.add_expert_biases(stats, self.model.expert_biases(), g.dp * g.ep * g.cp)   # the batch group
        return stats

    def _forward(self, input_ids, labels, stats: torch.Tensor, gas: int) -> torch.Tensor:
        """One micro-batch's loss; its statistics are added to ``stats``. The model's output
        (with the logits) is released on return, before the backward and the next forward."""
        out = self.engine(input_ids.to(self.ctx.device), labels.to(self.ctx.device))
        ce = out.ce_sum + self.model.mtp_objective(out)                 # MTP: model/mtp.py
        loss = ce * (self.dp_size * self.cp / self.tokens_per_step) + self.model.router_loss(out) * self.cp / gas
        self.stats.add_micro_batch(stats, out, loss.detach(), gas)
        return loss

    def _decide(self, step: int, stats: torch.Tensor) -> StepDecision:
        """After this rank's last forward (both paths): the step's statistics summed over the ranks
        that see different tokens, then over the stages (each value lives on one), brought to the
        host (``_to_host``), and whether the step is applied: the same on every rank."""
        self.busy.arrive()              # this rank's own work of the step ends here
        self._check_router_replicas(step, stats)
        comm.all_reduce_sum(stats, self.ctx.batch_group)
        comm.all_reduce_sum(stats, self.ctx.groups.pp_group)    # no pipeline stages: no-op
        values, stragglers = self._to_host(step, stats)
        skip_reason, spike = self._skip_reason(values.loss, values.nonfinite > 0)
        return StepDecision(stats, values, skip_reason, spike, stragglers)

    def _router_check_step(self, step: int) -> bool:
        return bool(self.moe_blocks) and self.ctx.groups.tp * self.ctx.groups.ep > 1 and step % self.recipe.train.log_every == 0

    def _check_router_replicas(self, step: int, stats: torch.Tensor) -> None:
        """Every ``train.log_every`` steps, put into the statistics how far the router weights,
        replicated over tp x ep, have drifted apart (0.0 when bitwise equal; one small
        all-reduce, no host copy). Routing that differs between tp peers would sum partial
        outputs of different experts."""
        if not self._router_check_step(step):
            return
        gates = [getattr(m.weight, "ds_tensor", m.weight) for name, m in self.model.named_modules()
                 if name.endswith("mlp.gate")]
        stats[self.stats.divergence] += comm.replica_divergence(gates, self.ctx.groups.mp_group)

    def _to_host(self, step: int, stats: torch.Tensor) -> tuple[StepValues, dict]:
        """The step's one host copy: the summed statistics, and in the same all-reduce over the
        job the ranks that got a preemption signal (all stop after the same step;
        ``training/resilience/preemption.py``), those whose checkpoint writer is still busy (all publish
        the save together; ``training/checkpoint/saving.py``), those whose writer failed (rank 0's
        writer stops waiting for their shares: ``Saver.peer_failed``) and, every
        ``train.log_every`` steps, every rank's mean busy seconds (``busy_row``). Sets
        ``stop_requested``, ``saves_written``; returns the statistics and the straggler metrics
        (empty off log steps)."""
        signalled = self.preemption is not None and self.preemption.received is not None
        writing = self.saver is not None and self.saver.writing
        failed = self.saver is not None and self.saver.failed
        busy = self.busy.take_mean() if step % self.recipe.train.log_every == 0 else None
        flags = [float(signalled), float(writing), float(failed)]
        if busy is not None:
            flags += busy_row(busy, self.ctx.rank, self.ctx.world_size)
        job = comm.job_sum(torch.tensor(flags, dtype=stats.dtype, device=stats.device))
        host = torch.cat((stats, job)).tolist()
        self.busy.synced()              # after the copy: a GPU's timing events have completed
        summed, (signalled_ranks, writing_ranks, failed_ranks, *busy_s) = host[:stats.numel()], host[stats.numel():]
        self.stop_requested, self.saves_written = signalled_ranks > 0, writing_ranks == 0
        if failed_ranks and self.saver is not None:
            self.saver.peer_failed()
        return self.stats.read(summed), straggler_metrics(busy_s) if busy_s else {}

    def _skip_reason(self, step_loss: float, nonfinite: bool) -> tuple[str | None, bool]:
        """Why the step is not applied (None: it is), and whether its loss is a spike."""
        if nonfinite or not math.isfinite(step_loss):
            return "non-finite loss", False
        if self.history.spikes.is_spike(step_loss):
            skip = self.recipe.train.spike_action != "log"
            return (f"loss spike ({step_loss:.4f})" if skip else None), True
        return None, False

    def _prepare_last_step(self, decision: StepDecision) -> None:
        """After the last backward, before the optimizer step: record the lr (and at ZeRO-0 fp32
        the gradient norm) in ``decision``, run Muon's update; on a skip, make the update a no-op.

        With lr 0 AdamW changes no weight (decoupled decay is lr * wd * p); non-finite gradients
        are also zeroed at ZeRO-0 (ZeRO 1-3 and half precision skip them natively).
        """
        param_groups = self.engine.optimizer.param_groups
        decision.lr = param_groups[0]["lr"]
        decision.sched_before = _schedule_position(self.engine.lr_scheduler)
        if decision.skip_reason is None:
            if self.zero_stage == 0 and not self.half:
                self._local_grad_norm(decision)
            elif self.muon is not None or self.where.step % self.recipe.train.log_every == 0 or decision.spike:
                decision.layer_sq = self.layer_norms.squares(self.ctx.device)  # read with grad_norm
            if decision.skip_reason is None:
                if self.muon is not None:       # on the raw norm: a float at ZeRO-0 fp32, else on the device
                    if decision.grad_norm_local is None:
                        decision.grad_norm_local = decision.layer_sq.sum().sqrt()
                    self.muon.apply(decision.grad_norm_local)
                return
        decision.saved_lr = [g["lr"] for g in param_groups]
        if self.zero_stage == 0:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.zero_()
        for g in param_groups:
            g["lr"] = 0.0

    def _local_grad_norm(self, decision: StepDecision) -> None:
        """ZeRO-0 fp32 hands a plain torch optimizer whole averaged gradients whose norm DeepSpeed
        does not report: compute it before clipping from the per-layer sums (``layer_grads.py``),
        read to the host once; a gradient-norm spike can be skipped here (``train.grad_spike_factor``)."""
        decision.layer_sq = self.layer_norms.squares(self.ctx.device).tolist()
        norm = decision.grad_norm_local = sum(decision.layer_sq) ** 0.5
        decision.grad_spike = self.history.grad_spike(norm)
        if decision.grad_spike and self.recipe.train.spike_action != "log":
            decision.skip_reason = f"grad-norm spike ({norm:.4g})"

    def _pipeline_train_step(self, step: int, batches) -> tuple[dict, dict]:
        """The step through DeepSpeed's pipeline schedule; ``_pipeline_before_step`` leaves the decision."""
        t0 = time.time()
        self.where.phase = "pipeline schedule (1F1B)"
        self.model.reset_stats()
        self._pipeline_decision = None
        self.engine.train_batch(iter(batches))
        return self._finish_step(step, self._pipeline_decision, t0)

    def _pipeline_before_step(self, gas: int) -> None:
        """The hook DeepSpeed calls before the optimizer step: ``_decide`` and
        ``_prepare_last_step`` on the statistics the stages stashed during the schedule."""
        stats = self._stats_vector(self.ctx.device)
        self.model.add_step_stats(stats, gas, self.stats)   # device-side adds (training/engine/pipeline.py)
        decision = self._decide(self.where.step, stats)
        self._prepare_last_step(decision)
        self.where.phase = "optimizer step"
        self._pipeline_decision = decision

    def _finish_step(self, step: int, decision: StepDecision, t0: float) -> tuple[dict, dict]:
        """Put back a skipped step's lr, record the loss, update the expert biases; the metrics row."""
        engine = self.engine
        applied = engine.was_step_applied() and decision.skip_reason is None
        if decision.saved_lr is not None and _schedule_position(engine.lr_scheduler) == decision.sched_before:
            # No scheduler, or it did not step (DeepSpeed skips it with the optimizer step on
            # an overflow): put back the lr we zeroed, or the next step would run at lr 0.
            for group, lr in zip(engine.optimizer.param_groups, decision.saved_lr):
                group["lr"] = lr
        # None at fp32 ZeRO-0: the trainer's own; under Muon, DeepSpeed's is the update's norm
        gn = None if self.muon is not None else self.engine.get_global_grad_norm()
        gn, layer_sq = layer_grads.read(gn if gn is not None else decision.grad_norm_local, decision.layer_sq)
        if not decision.grad_spike and decision.skip_reason is None and self.history.grad_spike(gn):
            decision.grad_spike = True      # known only after DeepSpeed's step: applied
        if decision.skip_reason is None:
            self.history.record(decision.values.loss, gn)
        if applied:
            self._update_expert_bias(decision.reduced)
        qk = self.qk_clip.after_step(applied, self.ctx.device) if self.qk_clip is not None else ({}, {})
        return self._row(step, decision, applied, time.time() - t0, gn, layer_sq, qk)

    def _update_expert_bias(self, reduced: torch.Tensor) -> None:
        """Loss-free balancing after an applied step: the routed counts of the step, summed over
        the micro-batches and the batch group (and the stages) in ``reduced``, the same on every
        rank, update each rank's copy of its layers' biases alike: device ops, no host copy, no
        collective (``Transformer.update_expert_bias``; a pipeline stage updates its own)."""
        moe = self.cfg.moe
        if moe is None or moe.expert_bias_update_rate == 0:
            return
        counts = reduced[self.stats.counts]            # (L x E,) float64
        self.model.update_expert_bias(counts.view(self.stats.layers, self.stats.experts))

    def _row(self, step: int, decision: StepDecision, applied: bool, step_time: float,
             gn: float | None, layer_sq: list[float] | None, qk: tuple[dict, dict]) -> tuple[dict, dict]:
        values, skip_reason = decision.values, decision.skip_reason
        self.history.tokens += int(values.tokens)
        row = {"step": step, "loss": values.loss, "lr": decision.lr, "grad_norm": gn, "tokens": self.history.tokens,
               "tokens_per_s": values.tokens / step_time, "step_time_s": step_time}
        if self.noise:
            row.update(self.noise.row(values.small_batch_grad_sq, row["grad_norm"], applied))
        if self.compressor is not None:     # what this rank sent to the data-parallel all-reduces
            row["grad_exchange_bytes"] = decision.exchange_bytes
        moe_row, extra = (self.stats.moe_metrics(values.vector, self.dp_size, self.moe_blocks)
                          if self.moe_blocks else ({}, {}))
        row.update(moe_row | qk[0])      # QK-clip: each layer's largest logit of the step
        extra.update(qk[1])
        if self.cfg.mtp_depth:      # each depth's mean cross-entropy over its targets
            row["mtp_loss"] = self.stats.mtp_losses(values.vector)
            extra.update({f"mtp_loss/depth{k}": v for k, v in enumerate(row["mtp_loss"], 1)})
        if self._router_check_step(step):
            row["router_divergence"] = values.router_divergence     # 0.0: router replicas bitwise equal
        row.update(decision.stragglers)         # every train.log_every steps: the ranks' busy times
        if layer_sq is not None and (step % self.recipe.train.log_every == 0 or decision.spike or decision.grad_spike):
            layer_grads.add_to_row(row, extra, layer_sq, self.cfg.num_layers)
        row.update(spike_fields(decision.spike, decision.grad_spike, skip_reason, applied, gn,
                                self.recipe.train.spike_action))
        self.ctx.add_gpu_metrics(row, self.flops_per_token)
        return row, extra

    @torch.no_grad()
    def evaluate(self, batches, progress=None) -> float:
        """Mean next-token loss over the validation batches (summed over data-parallel ranks);
        ``progress()`` after each batch (the watchdog: a long evaluation is progress)."""
        self.where.phase, self.where.micro_batch = "evaluation", None
        if self.pipeline:
            self.model.reset_stats()
            self.engine.eval_batch(iter(batches), num_micro_batches=len(batches))
            sums = self.model.eval_sums().to(self.ctx.device)
            comm.all_reduce_sum(sums, self.ctx.batch_group)
            total, tokens = comm.all_reduce_sum(sums, self.ctx.groups.pp_group).tolist()
            return total / max(tokens, 1)
        self.engine.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.ctx.device)
        for input_ids, labels in batches:
            out = self.engine(input_ids.to(self.ctx.device), labels.to(self.ctx.device))
            sums += torch.stack([out.ce_sum.double(), out.num_target_tokens.double()])
            if progress is not None:
                progress()
        self.engine.train()
        total, tokens = comm.all_reduce_sum(sums, self.ctx.batch_group).tolist()
        return total / max(tokens, 1)
