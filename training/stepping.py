"""One optimizer step and one evaluation pass on a DeepSpeed engine, with exact accumulation.

Exact gradient accumulation: the cross-entropy of every micro-batch is divided by the number of
target tokens of the WHOLE optimizer step (all micro-batches, all data-parallel ranks), not by its
own token count. DeepSpeed averages gradients over the data-parallel group, so each micro-batch's
loss is ``ce_sum * dp_size / step_tokens`` and the engine is told not to divide by the
accumulation steps again. Micro-batch 1 x accumulation 4 then produces the same gradient as
micro-batch 4 x accumulation 1.

The router losses are per micro-batch means (as in Switch/Megatron: the balance statistics are
taken over the tokens of one forward pass), averaged over micro-batches and ranks. The step's
statistics stay on the compute device in one vector, are summed over the ranks that see
different tokens once, and reach the host once (one ``.tolist()``), before the last backward:
the skip decision needs the step's loss on every rank.

With pipeline stages, ``engine.train_batch`` runs DeepSpeed's 1F1B schedule over the step's
micro-batches; the same objective is built on the last stage (``training/pipeline.py``) and the
statistics, the skip decision and the lr are taken in a hook before the optimizer step.

``StepContext`` says where the trainer is (step, micro-batch, phase) for the out-of-memory report
(``planning/oom.py``): ``Stepper`` and ``launch/train.py`` update it as they go.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from model.moe.layer import start_balance_step
from model.parallel import comm
from training import noise_scale
from training.ds_config import replica_sync_mode
from training.step_stats import NOISE, StatsLayout


@dataclass
class StepContext:
    """Where the trainer is, kept current as it runs, for the out-of-memory report.

    ``launch/train.py`` hands over the objects as it builds them and marks checkpoint loads and
    saves; ``Stepper`` marks each micro-batch's forward and backward, the optimizer step, the
    pipeline schedule and evaluation. Plain attribute writes: the report reads them after the
    error has unwound the stack.
    """

    phase: str = "start-up"
    step: int | None = None
    micro_batch: int | None = None        # 1-based, within ``step``; None outside a micro-batch
    micro_batches: int | None = None
    dist: object = None                   # training.run_setup.DistContext: rank, device, GPU
    model: torch.nn.Module | None = None  # its parameters and gradients are named in the report
    engine: object = None                 # its optimizer's states and buffers too


def _schedule_position(scheduler) -> int | None:
    """How many times an lr scheduler has stepped (DeepSpeed's or torch's), None without one."""
    if scheduler is None:
        return None
    return getattr(scheduler, "last_batch_iteration", getattr(scheduler, "last_epoch", None))


class SpikeMonitor:
    """Flags a loss above ``factor`` x the running mean of the last ``window`` finite losses."""

    def __init__(self, factor: float, window: int, state: dict | None = None):
        self.factor, self.window = factor, window
        self.history: list[float] = list((state or {}).get("history", []))

    def is_spike(self, loss: float) -> bool:
        # Judge only once the window has filled: early-training losses fall too fast to compare.
        if len(self.history) < self.window:
            return False
        return loss > self.factor * (sum(self.history) / len(self.history))

    def record(self, loss: float) -> None:
        self.history = (self.history + [loss])[-self.window:]

    def state(self) -> dict:
        return {"history": self.history}


class Stepper:
    """Runs training steps and evaluation on ``engine`` and returns metric rows.

    Statistics are summed over the batch group (every rank that sees different tokens: expert
    and data parallel); tensor-parallel peers hold identical values.

    Args:
        engine: the DeepSpeed engine (``PipelineEngine`` with pipeline stages).
        recipe: the run's recipe (``train`` section: spike handling).
        ds: the resolved DeepSpeed config (batch sizes, ZeRO stage, precision).
        ctx: ``training.run_setup.DistContext`` (device and process groups).
        dp_size: the data-parallel size (the loss is scaled by it, see the module docstring).
        monitor_state: the loss-spike monitor and token count of a resumed run.
        where: the ``StepContext`` to keep current (a private one when None).
    """

    def __init__(self, engine, recipe, ds: dict, ctx, dp_size: int, monitor_state: dict | None = None,
                 where: StepContext | None = None):
        self.engine, self.recipe, self.ctx = engine, recipe, ctx
        self.where = where if where is not None else StepContext()
        self.dp_size, self.tokens_per_step = dp_size, ds["train_batch_size"] * recipe.seq_len
        self.model = engine.module
        self.cfg = self.model.cfg
        self.zero_stage = int(ds.get("zero_optimization", {}).get("stage", 0))
        self.half = ds.get("bf16", {}).get("enabled", False) or ds.get("fp16", {}).get("enabled", False)
        self.spikes = SpikeMonitor(recipe.train.spike_factor, recipe.train.spike_window, monitor_state)
        self.tokens_seen = (monitor_state or {}).get("tokens", 0)
        self.flops_per_token = ctx.flops_per_token(self.cfg, recipe)
        self.moe_blocks = [i for i in range(self.cfg.num_layers) if self.cfg.is_moe_layer(i)]
        moe = self.cfg.moe
        self.stats = StatsLayout(len(self.moe_blocks), moe.num_experts if moe else 0,
                                 bool(moe and moe.expert_bias))      # training/step_stats.py
        self.pipeline = ctx.groups.pp > 1
        self.preemption = None          # a training.preemption.Preemption, set by the trainer
        self.stop_requested = False     # a rank got a preemption signal before this step's end
        self.saver, self.saves_written = None, True     # training.saving.Saver, set by the trainer
        self.grad_sync = None if self.pipeline else self.model.grad_sync
        self.noise = noise_scale.for_run(recipe, ds, ctx, dp_size, monitor_state)
        if self.grad_sync is not None:
            self.grad_sync.mode = replica_sync_mode(ds)
        if self.pipeline:
            from training import pipeline
            gas = ds["gradient_accumulation_steps"]
            # DeepSpeed divides the last stage's loss by gas: undo it (see training/pipeline.py).
            self.model.loss_fn.ce_scale = dp_size * gas / self.tokens_per_step
            pipeline.before_optimizer_step(engine, lambda: self._pipeline_before_step(gas))
            if self.zero_stage == 0 and not self.half:
                pipeline.clip_fp32_with_norm(engine, lambda: self._grad_norm_local)

    def monitor_state(self) -> dict:
        noise = {"noise_scale": self.noise.state()} if self.noise else {}
        return {**self.spikes.state(), "tokens": self.tokens_seen, **noise}

    def _stats_vector(self, device: torch.device) -> torch.Tensor:
        """The step's statistics on the device (``training/step_stats.py``), holding the expert
        biases this step routes with (the same on every rank that holds a layer)."""
        stats = self.stats.new(device)
        self.stats.add_expert_biases(stats, self.model.expert_biases(),
                                     self.ctx.groups.dp * self.ctx.groups.ep)   # the batch group
        return stats

    def _check_router_replicas(self, step: int, stats: torch.Tensor) -> None:
        """Every ``train.log_every`` steps, put into the statistics how far the router weights,
        replicated over tp x ep, have drifted apart (0.0 when bitwise equal; one small
        all-reduce, no host copy). Routing that differs between tp peers would sum partial
        outputs of different experts."""
        groups = self.ctx.groups
        if not self.moe_blocks or groups.tp * groups.ep == 1 or step % self.recipe.train.log_every:
            return
        gates = [getattr(m.weight, "ds_tensor", m.weight) for name, m in self.model.named_modules()
                 if name.endswith("mlp.gate")]
        stats[-1] += comm.replica_divergence(gates, groups.mp_group)

    def train_step(self, step: int, batches) -> tuple[dict, dict]:
        """Forward/backward every micro-batch of ``step`` and take the optimizer step."""
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
            where.micro_batch, where.phase = i + 1, "forward"
            loss = self._forward(input_ids, labels, stats, gas)
            if i == gas - 1:
                # Global statistics before the last backward, so that the skip decision (lr 0 for
                # this step) is the same on every rank.
                self._check_router_replicas(step, stats)
                self._reduced = comm.all_reduce_sum(stats, self.ctx.batch_group)
                values = self._to_host(self._reduced)
                step_loss = values[0] / max(values[1], 1)
                skip_reason = self._skip_reason(step_loss, values[2] > 0)
            where.phase = "backward"
            if self.grad_sync is not None:   # "step" mode sums the replicas' gradients once, here
                self.grad_sync.boundary = i == gas - 1
            engine.backward(loss, scale_wrt_gas=False)
            if i == 0 and self.noise:    # .grad: this micro-batch's gradient (gas >= 2)
                self.noise.measure(self.model, stats[NOISE])
            if i == gas - 1:
                saved_lr = self._prepare_last_step(skip_reason)
                where.phase = "optimizer step"
            engine.step()
        return self._finish_step(step, values, step_loss, saved_lr, skip_reason, t0)

    def _forward(self, input_ids, labels, stats: torch.Tensor, gas: int) -> torch.Tensor:
        """One micro-batch's loss; its statistics are added to ``stats``. The model's output
        (with the logits) is released on return, before the backward and the next forward."""
        out = self.engine(input_ids.to(self.ctx.device), labels.to(self.ctx.device))
        loss = out.ce_sum * (self.dp_size / self.tokens_per_step) + self.model.router_loss(out) / gas
        self.stats.add_micro_batch(stats, out, loss.detach(), gas)
        return loss

    def _finish_step(self, step, values, step_loss, saved_lr, skip_reason, t0) -> tuple[dict, dict]:
        engine = self.engine
        applied = engine.was_step_applied() and skip_reason is None
        if saved_lr is not None and _schedule_position(engine.lr_scheduler) == self._sched_before:
            # No scheduler, or it did not step (DeepSpeed skips it with the optimizer step on
            # an overflow): put back the lr we zeroed, or the next step would run at lr 0.
            for group, lr in zip(engine.optimizer.param_groups, saved_lr):
                group["lr"] = lr
        if skip_reason is None:
            self.spikes.record(step_loss)
        if applied:
            self._update_expert_bias()
        return self._row(step, values, step_loss, applied, skip_reason, time.time() - t0)

    def _update_expert_bias(self) -> None:
        """Loss-free balancing after an applied step: the routed counts of the step, summed over
        the micro-batches and the batch group (and the stages) in ``_reduced``, the same on every
        rank, update each rank's copy of its layers' biases alike: device ops, no host copy, no
        collective (``Transformer.update_expert_bias``; a pipeline stage updates its own)."""
        moe = self.cfg.moe
        if moe is None or moe.expert_bias_update_rate == 0:
            return
        counts = self._reduced[self.stats.counts]            # (L x E,) float64
        self.model.update_expert_bias(counts.view(self.stats.layers, self.stats.experts))

    def _pipeline_train_step(self, step: int, batches) -> tuple[dict, dict]:
        """The step through DeepSpeed's 1F1B pipeline schedule; ``_pipeline_before_step`` runs
        inside ``train_batch`` after the last backward."""
        t0 = time.time()
        self.where.phase = "pipeline schedule (1F1B)"
        self.model.reset_stats()
        self._decided = None
        self.engine.train_batch(iter(batches))
        return self._finish_step(step, *self._decided, t0)

    def _pipeline_before_step(self, gas: int) -> None:
        # Every value lives on one stage (the losses on the last, each MoE layer's on its own):
        # sum over the ranks that see different tokens, then over the stages.
        stats = self._stats_vector(self.ctx.device)
        self.model.add_step_stats(stats, gas, self.stats)   # device-side adds (training/pipeline.py)
        self._check_router_replicas(self.where.step, stats)
        comm.all_reduce_sum(stats, self.ctx.batch_group)
        self._reduced = comm.all_reduce_sum(stats, self.ctx.groups.pp_group)
        values = self._to_host(self._reduced)
        step_loss = values[0] / max(values[1], 1)
        skip_reason = self._skip_reason(step_loss, values[2] > 0)
        saved_lr = self._prepare_last_step(skip_reason)
        self.where.phase = "optimizer step"
        self._decided = (values, step_loss, saved_lr, skip_reason)

    def _to_host(self, stats: torch.Tensor) -> list[float]:
        """The step's one host copy: the summed statistics, and in the same all-reduce over the
        job the ranks that got a preemption signal (all stop after the same step;
        ``training/preemption.py``) and those whose checkpoint writer is still busy (all publish
        the save together; ``training/saving.py``). Sets ``stop_requested``, ``saves_written``."""
        signalled = self.preemption is not None and self.preemption.received is not None
        flags = torch.tensor([signalled, self.saver is not None and self.saver.writing],
                             dtype=stats.dtype, device=stats.device)
        values = torch.cat((stats, comm.job_sum(flags))).tolist()
        self.saves_written, self.stop_requested = values.pop() == 0, values.pop() > 0
        return values

    def _skip_reason(self, step_loss: float, nonfinite: bool) -> str | None:
        self._spike = False
        if nonfinite or not math.isfinite(step_loss):
            return "non-finite loss"
        if self.spikes.is_spike(step_loss):
            self._spike = True
            if self.recipe.train.spike_action != "log":
                return f"loss spike ({step_loss:.4f})"
        return None

    def _prepare_last_step(self, skip_reason: str | None) -> list[float] | None:
        """Before the optimizer step: record lr; on a skip, make the update a no-op.

        With lr 0 AdamW changes no weight (decoupled decay is lr * wd * p); non-finite gradients
        are also zeroed at ZeRO-0 (ZeRO 1-3 and half precision skip them natively).
        """
        lrs = [g["lr"] for g in self.engine.optimizer.param_groups]
        self._sched_before = _schedule_position(self.engine.lr_scheduler)
        self._lr = lrs[0]
        if skip_reason is None:
            self._grad_norm_local = self._local_grad_norm() if self.zero_stage == 0 and not self.half else None
            return None
        self._grad_norm_local = None
        if self.zero_stage == 0:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.zero_()
        for g in self.engine.optimizer.param_groups:
            g["lr"] = 0.0
        return lrs

    def _local_grad_norm(self) -> float:
        # ZeRO-0 fp32 hands a plain torch optimizer full, already-averaged gradients; DeepSpeed
        # does not report their norm there, so compute it (before clipping, as it does
        # elsewhere): every shard counted once on its canonical holder (the
        # ``tensor_model_parallel`` mark, see model/parallel/layers.py), summed over tp x ep.
        # Pipeline stages hold different layers (summed over pp); a tied weight's copy on a
        # later stage is marked ``ds_pipe_replicated`` by DeepSpeed and counted once.
        sq = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        for p in self.model.parameters():
            if (p.grad is not None and getattr(p, "tensor_model_parallel", True)
                    and not getattr(p, "ds_pipe_replicated", False)):
                sq += p.grad.double().pow(2).sum()
        comm.all_reduce_sum(sq, self.ctx.groups.mp_group)
        return float(comm.all_reduce_sum(sq, self.ctx.groups.pp_group)) ** 0.5

    def _row(self, step, values, step_loss, applied, skip_reason, step_time) -> tuple[dict, dict]:
        gn = self.engine.get_global_grad_norm()
        if gn is None:
            gn = self._grad_norm_local
        gn = float(gn) if gn is not None else None
        self.tokens_seen += int(values[1])
        row = {"step": step, "loss": step_loss, "lr": self._lr,
               "grad_norm": gn if gn is not None and math.isfinite(gn) else None,
               "tokens": self.tokens_seen, "tokens_per_s": values[1] / step_time,
               "step_time_s": step_time}
        if self.noise:
            row.update(self.noise.row(values[NOISE], row["grad_norm"], applied))
        extra = {}
        if self.moe_blocks:
            moe_row, extra = self.stats.moe_metrics(values, self.dp_size, self.moe_blocks)
            row.update(moe_row)
        groups = self.ctx.groups
        if self.moe_blocks and groups.tp * groups.ep > 1 and step % self.recipe.train.log_every == 0:
            row["router_divergence"] = values[-1]     # 0.0: router replicas bitwise equal
        if self._spike:
            row["spike"] = True     # logged in every case; skipped or stopped when asked
        if not applied:
            row["skipped"] = skip_reason or "optimizer skipped the step (overflow)"
        if skip_reason and skip_reason.startswith("loss spike") and self.recipe.train.spike_action == "stop":
            row["stopped"] = skip_reason
        self.ctx.add_gpu_metrics(row, self.flops_per_token)
        return row, extra

    @torch.no_grad()
    def evaluate(self, batches) -> float:
        """Mean next-token loss over the validation batches (summed over data-parallel ranks)."""
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
        self.engine.train()
        total, tokens = comm.all_reduce_sum(sums, self.ctx.batch_group).tolist()
        return total / max(tokens, 1)
