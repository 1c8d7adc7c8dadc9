"""Train a dense, Switch or Mixtral transformer with DeepSpeed.

    deepspeed [launcher args] launch/train.py --config DS_JSON [--recipe RECIPE.yaml]
              [--run-dir DIR] [--steps N] [--set dotted.key=value ...] [--init-from DIR]

Also runs as ``torchrun --nproc_per_node N launch/train.py ...`` and as plain
``python launch/train.py ...`` (one process). Everything the run needs is validated before any
process group is created or any file written; a bad input is one line on stderr and exit code 2.
Out of memory is one line too, exit code 3, with a report and the next layout to try in the run
directory (``planning/oom.py``). Checkpoints are written in the background
(``training/saving.py``; a needed save that fails is exit code 74). The same command with the same
run directory resumes from the newest checkpoint that matches its manifest
(``training/manifest.py``) with the same data order and RNG streams, or stops with one line
(exit code 2) when none matches. A preemption signal (``train.preemption_signals``) makes every
rank save its step and exit with code 75 (``training/preemption.py``). A rank lost or stopped
(no progress in ``train.hang_timeout_s``) is named in one line, exit code 76, every live rank's
stacks in the run directory (``training/watchdog.py``).

The loop is one straight line: recipe -> process groups -> data -> model -> deepspeed.initialize
-> (forward, backward, step) per micro-batch -> metrics, eval, checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from training import checkpoint, hardware, preemption, run_setup, saving, stepping, watchdog  # noqa: E402
from planning import oom  # noqa: E402
from training.preflight import Plan, prepare  # noqa: E402  (the checks before anything starts)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="DeepSpeed JSON (ZeRO, precision, batch, optimizer, scheduler)")
    p.add_argument("--recipe", default=None, help="recipe YAML (default: recipes/tiny_mixtral.yaml)")
    p.add_argument("--run-dir", default=None, help="output directory (default: runs/<recipe name>)")
    p.add_argument("--steps", type=int, default=None, help="override train.steps (optimizer steps)")
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="override recipe keys, e.g. --set train.seed=1 model.moe.top_k=1, and "
                        "DeepSpeed JSON keys with a ds. prefix, e.g. ds.optimizer.params.lr=3e-4")
    p.add_argument("--init-from", default=None,
                   help="init dir written by `convert_hf.py import` (weights + tokenizer)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def train(plan: Plan, where: stepping.StepContext, dog: watchdog.Watchdog) -> int:
    """The run; ``where`` is kept current for the out-of-memory report (``planning/oom.py``),
    ``dog`` told of every completed step and phase (``training/watchdog.py``)."""
    recipe, tcfg = plan.recipe, plan.recipe.train
    # NCCL's own dump on a collective timeout goes beside the watchdog's (``hang/``).
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
                          str((plan.run_dir / watchdog.HANG / "fr_trace_rank_").absolute()))
    ctx = where.dist = run_setup.init_distributed(recipe)   # process groups (gloo on CPU, NCCL on GPU)
    oom.record_memory_history(tcfg.memory_snapshot, ctx.device)   # GPU, when asked
    rank0 = ctx.rank == 0
    if rank0 and (warning := hardware.cpu_bf16_warning(plan.ds, plan.config_path, ctx.device)):
        print(warning, file=sys.stderr, flush=True)
    run_dir, ckpt_dir = plan.run_dir, plan.run_dir / "checkpoints"
    tokenizer = run_setup.build_tokenizer(recipe, plan.init_from, ctx)
    sampler, val_batches = run_setup.build_data(recipe, plan.ds, tokenizer, plan.dp_size, ctx)

    model = where.model = run_setup.build_model(recipe, plan.init_from, ctx.groups, plan.ds, tokenizer.eos_token_id)
    engine = where.engine = run_setup.build_engine(model, plan.ds, tcfg.steps, ctx.groups, recipe.model)

    if rank0:           # only now: a start refused while the data or model is built writes nothing
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    start_step, monitor_state = 0, None
    where.phase = "checkpoint load"
    client = checkpoint.load(engine, ckpt_dir)
    if client is not None:                             # resume: same data order, same RNG seeds
        start_step = client["step"]
        sampler.load_state_dict(client["data"])
        monitor_state = client["monitor"]
        if rank0:
            print(f"resumed from {ckpt_dir / checkpoint.tag_for_step(start_step)}", flush=True)
    where.phase = "start-up"
    config = run_setup.resolved_config(recipe, plan.ds, ctx, plan.dp_size, engine) if rank0 else None
    if rank0:           # after the load: a refused resume writes nothing into the run directory
        run_setup.write_config(run_dir, config)
        tokenizer.save_pretrained(str(run_dir / "tokenizer"))
    dog.attach(ctx.launch_id, nccl=ctx.device.type == "cuda")    # heartbeats: the start is accepted
    tracker, progress = run_setup.build_tracking(recipe, run_dir, rank0, start_step, config)
    code, preempted, signals = 0, False, preemption.Preemption(tcfg.preemption_signals, rank0)
    saver = saving.Saver(engine, ckpt_dir, tcfg.keep_last, tcfg.async_save, tcfg.on_save_error == "stop",
                         progress=dog.beat, wait_timeout_s=watchdog.startup_allowance(tcfg.hang_timeout_s))
    stepper = stepping.Stepper(engine, recipe, plan.ds, ctx, plan.dp_size, monitor_state, where, preemption=signals, saver=saver)

    for step in range(start_step + 1, tcfg.steps + 1):
        # Per-step seeding makes every RNG stream (router jitter, ...) a function of (seed, step,
        # pipeline and data-parallel coordinates), so a resumed run draws exactly what an
        # uninterrupted one would, and every tp x ep layout draws the router noise of the
        # single-process run (``jitter_noise`` seeds each sample from its global index; tp and ep
        # are the fastest-varying rank coordinates, so rank // (tp * ep) drops them).
        torch.manual_seed(tcfg.seed * 1_000_003 + step * 7919
                          + ctx.rank // (ctx.groups.tp * ctx.groups.ep))
        where.step, where.micro_batch, where.phase = step, None, "reading the step's batches"
        row, extra = stepper.train_step(step, sampler.batches_for_step(step - 1))
        sampler.step = step
        row["tokens_by_source"] = sampler.tokens_by_source(step)    # the mixture trained on so far
        tracker.log(row, extra)
        progress.update(row)
        dog.beat(step)
        # spike_action "stop": the spiking step was skipped (no weight changed); save that state.
        # A preemption signal on any rank: every rank saves this step and exits.
        stop, preempted = row.get("stopped"), stepper.stop_requested
        if not (stop or preempted) and recipe.eval.every and (step % recipe.eval.every == 0 or step == tcfg.steps):
            eval_loss = stepper.evaluate(val_batches)
            dog.beat()
            tracker.log({"step": step, "eval_loss": eval_loss})
            if rank0:
                print(f"step {step} | eval_loss {eval_loss:.4f}", flush=True)
        if stepper.saves_written:       # every rank's writer has finished: publish (all ranks)
            saver.finish()
        if stop or preempted or (tcfg.save_every and (step % tcfg.save_every == 0 or step == tcfg.steps)):
            where.phase = "checkpoint save"
            client_state = {"step": step, "data": sampler.state_dict(),
                            "monitor": stepper.monitor_state(), "tokens": row["tokens"]}
            saver.save(step, client_state, wait=bool(stop or preempted or step == tcfg.steps))
            dog.beat()
            tracker.log({"step": step, "save_stall_s": saver.stall_s})
        tag = saver.published if saver.published == checkpoint.tag_for_step(step) else None
        code, stop = (saving.SAVE_FAILED, saver.stop_reason) if saver.stop_reason else (code, stop)
        if stop and rank0:
            print(checkpoint.stop_message(step, stop, ckpt_dir, tag), file=sys.stderr, flush=True)
        if preempted and tag and rank0:
            print(f"preempted at step {step}: {ckpt_dir / tag} saved; run the same command "
                  f"to resume (exit code {preemption.EXIT_CODE})", file=sys.stderr, flush=True)
        if stop or preempted:
            code = code or (preemption.EXIT_CODE if preempted else 0)
            break
    saver.close()
    tracker.close()
    stepper.preemption.close()
    return code


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        plan = prepare(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    where = stepping.StepContext()
    dog = watchdog.Watchdog(plan.run_dir, int(os.environ.get("RANK", "0")), plan.world_size,
                            plan.recipe.train.hang_timeout_s, where)
    try:
        rc = train(plan, where, dog)
        where.engine = where.model = None
        run_setup.shutdown()       # only after a clean run: a failed rank must not wait on others
        dog.close("finished")
        return rc
    except (ValueError, FileNotFoundError) as err:   # e.g. a corrupted checkpoint found on resume
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:                      # torch.OutOfMemoryError is one
        if oom.is_out_of_memory(err):
            print(oom.report(err, plan, args, where), file=sys.stderr)   # writes <run-dir>/oom_report.md
            return oom.EXIT_CODE
        if watchdog.is_peer_lost(err):               # a collective whose peer went away
            return dog.peer_lost(err)
        raise
    finally:
        dog.close()                # a caller in this process (a test) keeps no watchdog running


if __name__ == "__main__":
    run_setup.exit_now(main())     # no interpreter finalization: see run_setup.exit_now
