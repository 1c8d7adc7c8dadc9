"""One training run as one object: preflight -> setup -> loop, read top to bottom.

    run = Run.prepare(args)     # every check (preflight.py); nothing written, no process group
    code = run.train()          # setup(), loop(), finish(): 0, 74 (a needed save failed) or 75

``setup`` builds the run in the order that keeps a refused start harmless: process groups,
tokenizer, data, model and engine, then the checkpoint directory, the resume (every registered
part of ``state``, ``training/checkpoint/state.py``), and only then ``config.json``, the tokenizer
copy and the metrics. ``loop`` is the step loop: per-step seeding, ``Stepper.train_step``,
metrics, evaluation, checkpoints, and the stop conditions (a spike stop, a preemption signal, a
failed save). ``launch/train.py`` turns what ``train`` raises into exit codes; benchmarks and
tests that need the trainer's own step call ``join_job``, ``build_model`` and ``build_stepper``
and drive the stepper themselves.

A run joins the process group it finds (several runs in one launched process group, one after
the other, as the tests do) and destroys only one it created itself.
"""

from __future__ import annotations

import os
import sys

import torch

from training import files
from training.checkpoint import resume
from training.checkpoint.layout import latest_tag, tag_for_step
from training.checkpoint.saving import SAVE_FAILED, Saver
from training.checkpoint.state import TrainState
from training.data.build import build_data, build_tokenizer
from training.engine.build import build_engine, build_model
from training.resilience import preemption, watchdog
from training.run import distributed, host, outputs
from training.run.preflight import Plan, prepare
from training.optim.muon_update import build_update as build_muon_update
from training.step.grad_compression import build_compressor
from training.step.clip_logits import build_qk_clip
from training.step.history import StepHistory
from training.step.stepper import StepContext, Stepper


class Run:
    """One run of ``plan`` on this rank (every rank builds one and calls it alike).

    Attributes (set as ``train`` and its phases go):
        plan: the validated recipe, DeepSpeed JSON, run directory and layout (``preflight.py``).
        where: where the run is, for the out-of-memory report (``planning/oom.py``).
        watchdog: this rank's step watchdog (``training/resilience/watchdog.py``).
        ctx: this rank's place in the job (``distributed.DistContext``).
        tokenizer, sampler, val_batches: the run's data (``training/data/build.py``).
        model, engine: the model at this rank's layout and its DeepSpeed engine.
        history: the spike window, token count and noise-scale EMAs (``StepHistory``).
        stepper: one optimizer step at a time (``training/step/stepper.py``).
        state: what a checkpoint carries (``TrainState``); ``start_step``: the step resumed from.
    """

    def __init__(self, plan: Plan):
        self.plan = plan
        self.where = StepContext()
        self.watchdog: watchdog.Watchdog | None = None
        self.ctx: distributed.DistContext | None = None
        self.ckpt_dir = plan.run_dir / "checkpoints"
        self.created_group = False
        self.start_step = 0
        self.signals: preemption.Preemption | None = None

    @classmethod
    def prepare(cls, args) -> Run:
        """The run the command line ``args`` asks for (``preflight.prepare``: ValueError with one
        line when anything is wrong; nothing written)."""
        return cls(prepare(args))

    def train(self) -> int:
        """The whole run under this rank's watchdog: ``setup``, ``loop``, ``finish``; returns the
        exit code."""
        plan = self.plan
        rank = int(os.environ.get("RANK", "0"))
        self.watchdog = watchdog.Watchdog(plan.run_dir, rank, plan.world_size,
                                          plan.recipe.train.hang_timeout_s, self.where)
        # Before anything that can take long (data preparation, the model build, a checkpoint
        # load): a preemption signal then is recorded, and the run saves its first step and
        # exits 75, instead of dying at once.
        self.signals = preemption.Preemption(preemption.handled(plan.recipe.train.preemption_signals),
                                             rank == 0)
        try:
            self.setup()
            code = self.loop()
            self.finish()
            return code
        except RuntimeError as err:
            if not watchdog.is_peer_lost(err):
                raise
            # A collective failed because a peer went away: name it now, while the heartbeats
            # run and the preemption handlers are in place. torchrun sends this rank SIGTERM as
            # soon as it sees the other one gone; recorded (not announced) instead of fatal, it
            # cannot cut the survey and its one line short.
            if self.signals is not None:
                self.signals.announce = False
            return self.watchdog.peer_lost(err)
        finally:
            # The preemption handlers stay until here: a launcher's SIGTERM during a preempted
            # run's teardown (torchrun ends the other ranks once one has exited 75) is recorded,
            # not fatal, so the metrics' and W&B's closing and the exit code still happen.
            if self.signals is not None:
                self.signals.close()
            self.watchdog.close()       # a caller in this process (a test) keeps no watchdog running

    # -- set-up

    def join_job(self) -> distributed.DistContext:
        """Process groups (gloo on CPU, NCCL on GPU): the default one created, or the existing
        one joined, and this rank's tp/ep/dp/pp groups."""
        recipe = self.plan.recipe
        # NCCL's own dump on a collective timeout goes beside the watchdog's (``hang/``).
        os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
                              str((self.plan.run_dir / watchdog.HANG / "fr_trace_rank_").absolute()))
        self.created_group = not torch.distributed.is_initialized()
        self.ctx = self.where.dist = distributed.init_distributed(recipe)
        host.record_memory_history(recipe.train.memory_snapshot, self.ctx.device)   # GPU, when asked
        return self.ctx

    def build_data(self) -> None:
        """The tokenizer, this rank's sampler and its validation batches (``training/data/build.py``)."""
        plan = self.plan
        self.tokenizer = build_tokenizer(plan.recipe, plan.init_from, self.ctx)
        self.sampler, self.val_batches = build_data(plan.recipe, plan.ds, self.tokenizer, plan.dp_size, self.ctx)

    def build_model(self, eos_token_id: int | None = None) -> None:
        """The model at this rank's layout (from ``--init-from``'s weights when given) and its
        DeepSpeed engine, and a fresh ``history``. ``eos_token_id`` separates documents under
        ``data.document_masking``."""
        plan, ctx = self.plan, self.ctx
        self.model = self.where.model = build_model(plan.recipe, plan.init_from, ctx.groups, plan.ds,
                                                    eos_token_id)
        self.engine = self.where.engine = build_engine(self.model, plan.ds, plan.recipe.train.steps,
                                                       ctx.groups, plan.recipe.model,
                                                       plan.recipe.parallel.pipeline_schedule)
        self.compressor = build_compressor(plan.recipe, self.engine, ctx.groups)   # PowerSGD, or None
        self.muon = build_muon_update(plan.ds, self.engine, ctx.groups)        # Muon's update, or None
        self.qk_clip = build_qk_clip(plan.recipe, self.engine.module, self.engine.zero_optimization_stage())
        if self.muon is not None and ctx.rank == 0:
            print("\n".join(self.muon.optimizer.group_lines), flush=True)
        self.history = StepHistory.for_run(plan.recipe, plan.ds, ctx, plan.dp_size)

    def build_stepper(self, signals: preemption.Preemption | None = None,
                      saver: Saver | None = None) -> Stepper:
        """The ``Stepper`` on the engine, with the run's preemption signals and checkpoint
        writer when it has them (the benchmarks drive it without)."""
        plan = self.plan
        self.stepper = Stepper(self.engine, plan.recipe, plan.ds, self.ctx, plan.dp_size, self.history,
                               self.where, preemption=signals, saver=saver, compressor=self.compressor,
                               muon=self.muon, qk_clip=self.qk_clip)
        return self.stepper

    def setup(self) -> None:
        """Everything the loop needs (called by ``train``, under the watchdog), in an order that
        leaves a refused start harmless (see the module docstring)."""
        plan, recipe, where = self.plan, self.plan.recipe, self.where
        ctx = self.join_job()
        rank0 = ctx.rank == 0
        if rank0 and (warning := host.cpu_bf16_warning(plan.ds, plan.config_path, ctx.device)):
            print(warning, file=sys.stderr, flush=True)
        self.build_data()
        self.build_model(self.tokenizer.eos_token_id)

        # What a checkpoint carries besides the engine's files, registered once: each part's
        # state_dict is saved and handed back on resume (training/checkpoint/state.py).
        self.state = TrainState(ctx.rank)
        self.state.register("data", self.sampler)          # the data order's position
        self.state.register("monitor", self.history)       # spike window, tokens, noise-scale EMAs
        if self.compressor is not None:                    # this rank's error feedback and Q
            self.state.register("grad_compression", self.compressor, per_rank=True)
        if self.muon is not None:                          # this rank's Muon momentum
            self.state.register("muon", self.muon, per_rank=True)

        if rank0:           # only now: a start refused while the data or model is built writes nothing
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        where.phase = "checkpoint load"
        step = resume.load(self.engine, self.ckpt_dir, self.state)   # same data order, same RNG seeds
        if step is not None:
            self.start_step = step
            if rank0:
                print(f"resumed from {self.ckpt_dir / tag_for_step(step)}", flush=True)
        where.phase = "start-up"
        config = outputs.resolved_config(recipe, plan.ds, ctx, plan.dp_size, self.engine) if rank0 else None
        if rank0:           # after the load: a refused resume writes nothing into the run directory
            outputs.write_config(plan.run_dir, config)
            self.tokenizer.save_pretrained(str(plan.run_dir / "tokenizer"))
        self.watchdog.attach(ctx.launch_id, nccl=ctx.device.type == "cuda")   # the start is accepted
        self.tracker, self.progress = outputs.build_tracking(recipe, plan.run_dir, rank0,
                                                             self.start_step, config)
        tcfg = recipe.train
        self.saver = Saver(self.engine, self.ckpt_dir, tcfg.keep_last, tcfg.async_save,
                           tcfg.on_save_error == "stop", progress=self.watchdog.beat,
                           wait_timeout_s=watchdog.startup_allowance(tcfg.hang_timeout_s))
        self.build_stepper(self.signals, self.saver)

    # -- the loop

    def loop(self) -> int:
        """Optimizer steps from ``start_step + 1`` to ``train.steps``; returns the exit code."""
        recipe, tcfg, ctx, where = self.plan.recipe, self.plan.recipe.train, self.ctx, self.where
        stepper, sampler, saver, dog = self.stepper, self.sampler, self.saver, self.watchdog
        rank0, code = ctx.rank == 0, 0
        for step in range(self.start_step + 1, tcfg.steps + 1):
            # Per-step seeding makes every RNG stream (router jitter, ...) a function of (seed,
            # step, pipeline and data-parallel coordinates), so a resumed run draws exactly what
            # an uninterrupted one would, and every tp x ep x cp layout draws the router noise of
            # the single-process run (``jitter_noise`` seeds each sample from its global index and
            # keeps a cp rank's chunks; tp, ep and cp are the fastest-varying rank coordinates,
            # so rank // (tp * ep * cp) drops them).
            torch.manual_seed(tcfg.seed * 1_000_003 + step * 7919
                              + ctx.rank // (ctx.groups.tp * ctx.groups.ep * ctx.groups.cp))
            where.step, where.micro_batch, where.phase = step, None, "reading the step's batches"
            row, extra = stepper.train_step(step, sampler.batches_for_step(step - 1))
            sampler.step = step
            row["tokens_by_source"] = sampler.tokens_by_source(step)    # the mixture trained on so far
            self.tracker.log(row, extra)
            self.progress.update(row)
            dog.beat(step)
            # spike_action "stop": the spiking step was skipped (no weight changed); save that
            # state. A gradient-norm spike found inside DeepSpeed's step (ZeRO 1-3, bf16) was
            # applied: stop without saving, the latest checkpoint is from before it. A
            # preemption signal on any rank: every rank saves this step and exits.
            stop, preempted = row.get("stopped"), stepper.stop_requested
            keep = bool(stop) and "skipped" in row
            if not (stop or preempted) and recipe.eval.every and (step % recipe.eval.every == 0
                                                                  or step == tcfg.steps):
                eval_loss = stepper.evaluate(self.val_batches, progress=dog.beat)
                dog.beat()
                self.tracker.log({"step": step, "eval_loss": eval_loss})
                if rank0:
                    print(f"step {step} | eval_loss {eval_loss:.4f}", flush=True)
            if stepper.saves_written:       # every rank's writer has finished: publish (all ranks)
                saver.finish()
            if keep or preempted or (not stop and tcfg.save_every and (step % tcfg.save_every == 0
                                                                       or step == tcfg.steps)):
                where.phase = "checkpoint save"
                saver.save(step, self.state, wait=bool(keep or preempted or step == tcfg.steps))
                dog.beat()
                self.tracker.log({"step": step, "save_stall_s": saver.stall_s})
            tag = saver.published if saver.published == tag_for_step(step) else None
            code, stop = (SAVE_FAILED, saver.stop_reason) if saver.stop_reason else (code, stop)
            if stop and rank0:
                print(stop_message(step, stop, self.ckpt_dir, tag), file=sys.stderr, flush=True)
            if preempted and tag and rank0:
                print(f"preempted at step {step}: {self.ckpt_dir / tag} saved; run the same command "
                      f"to resume (exit code {preemption.EXIT_CODE})", file=sys.stderr, flush=True)
                files.record_saved(preemption.EXIT_CODE, self.ckpt_dir / tag)   # for the requeue message
            if stop or preempted:
                code = code or (preemption.EXIT_CODE if preempted else 0)
                break
        dog.finishing()         # the final save's wait, the metrics' and W&B's closing
        saver.close()
        self.tracker.close()
        return code

    def finish(self) -> None:
        """After a clean run: the process group torn down if this run created it (a failed rank
        must not wait on the others there), the watchdog's heartbeat marked finished."""
        self.where.engine = self.where.model = None
        self.engine = self.model = self.stepper = None
        if self.created_group:
            distributed.shutdown()
        if self.watchdog is not None:
            self.watchdog.close("finished")


def stop_message(step: int, reason: str, ckpt_dir, tag: str | None) -> str:
    """The line a run that stops early prints: with ``tag`` (a spike stop's save of the weights
    from before the step) what to change; without, where the same command resumes."""
    if tag:
        return (f"stopping at step {step}: {reason}; the step was skipped and {ckpt_dir / tag} "
                f"holds the weights from before it; change the settings (e.g. a lower lr or --set "
                f"train.spike_action=skip) and run the command again to resume")
    latest = latest_tag(ckpt_dir) or "the first step (no checkpoint yet)"
    return f"stopping at step {step}: {reason} and run the same command to resume from {latest}"
