"""Training speed end to end: our trainer vs transformers' MixtralForCausalLM, same weights, same
DeepSpeed JSON, same tokens per step.

    python -m benchmarks.peers.end_to_end                       # CPU: 1 process, fp32 ZeRO-1, tiny and mid
    python -m benchmarks.peers.end_to_end --config ds_configs/zero1.json --sizes mid --steps 30   # a GPU, bf16
    python -m benchmarks.peers.end_to_end --op-profile --sizes mid      # where forward+backward spend time
    python -m benchmarks.peers.end_to_end --compile --sizes mid         # ours with train.compile vs eager

Both models are built from one set of full weights (ours converted with ``interop/hf.py``), and
each is trained through ``deepspeed.initialize`` with the same JSON: ours by the trainer's own
``Stepper.train_step`` (the step ``launch/train.py`` runs, statistics and all), transformers' by
the plain loop a user would write (``loss = engine(input_ids, labels).loss``;
``engine.backward``; ``engine.step``), with ``output_router_logits`` so that its router loss
is trained as ours is. The sizes: ``tiny`` is ``recipes/tiny_mixtral.yaml``; ``mid`` the same
with hidden 512 (8 heads, 4 kv heads, expert ffn 512). Each step's batches are fixed random
token ids (the speed does not depend on their content beyond routing balance).

The two models are built side by side and stepped in turn (one step of ours, one of theirs), so
that other load on a shared machine hits both alike; the ratio is the median of per-step ratios.
The step-time breakdown times the engine's ``forward``, ``backward`` and ``step`` calls
(synchronizing the GPU around each); "other" is the rest of the step: the trainer's host work
and, with several ranks, communication outside those calls. Steps after ``--warmup`` count;
medians are reported. Prints a markdown table and the ratio (ours / transformers tokens/s).

``--compile``: ours with ``train.compile`` (each block compiled, ``training/engine/compile.py``) against
ours eager instead of transformers', the same weights, JSON and tokens, stepped in turn the same
way; the ratio is compiled / eager tokens/s. Compilation happens in the first step (forward and
backward graphs), inside ``--warmup``.

``--op-profile``: instead, one forward+backward of each model (loss and router loss, no
DeepSpeed, one micro-batch) under ``torch.profiler``, with the ops that took the most time.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]

SIZES = {"tiny": [], "mid": ["model.hidden_size=512", "model.num_heads=8", "model.num_kv_heads=4",
                             "model.ffn_hidden_size=512"]}


def run_parser(description: str, size: tuple[str, dict], steps_per: str) -> argparse.ArgumentParser:
    """The options of a side-by-side run (this script's and ``optimizer_step.py``'s): the JSON,
    the recipe, ``size`` (its flag and keywords), the steps (per ``steps_per``), the untimed
    first steps and the CPU threads."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--config", default="ds_configs/zero1_fp32.json", help="the DeepSpeed JSON of every model")
    p.add_argument("--recipe", default="recipes/tiny_mixtral.yaml")
    p.add_argument(size[0], **size[1])
    p.add_argument("--steps", type=int, default=12, help=f"optimizer steps per {steps_per}")
    p.add_argument("--warmup", type=int, default=2, help="first steps not counted")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    return p


def check_warmup(p: argparse.ArgumentParser, args, script: str) -> None:
    if not 0 <= args.warmup < args.steps:
        p.exit(2, f"{script}: error: --warmup ({args.warmup}) must be >= 0 and below --steps "
                  f"({args.steps}): the later steps are timed\n")


def start(args) -> None:
    """Before the first build: ``--threads``, and no wandb."""
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("WANDB_MODE", "disabled")


def finish() -> int:
    from training.run import distributed
    distributed.shutdown()
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    p = run_parser(__doc__.split("\n\n")[0], ("--sizes", dict(default="tiny,mid", help="comma-separated subset of: tiny, mid")),
                   "model")
    p.add_argument("--op-profile", action="store_true", help="profile forward+backward per op instead")
    p.add_argument("--compile", action="store_true",
                   help="ours with train.compile against ours eager, instead of against transformers")
    args = p.parse_args(argv)
    bad = [s for s in args.sizes.split(",") if s not in SIZES]
    if bad:
        p.exit(2, f"end_to_end.py: error: --sizes: {','.join(bad)} is not one of {','.join(SIZES)}\n")
    check_warmup(p, args, "end_to_end.py")
    return args


def op_profile(recipe, micro: int, device) -> None:
    """Each model's forward+backward (the loss it trains on) under the profiler, top ops."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM

    from interop import hf
    from model import Transformer
    cfg = recipe.model
    ours = Transformer(cfg, init_seed=recipe.train.seed).to(device)
    theirs = AutoModelForCausalLM.from_config(hf.to_hf_config(cfg)).to(device)
    theirs.load_state_dict(hf.to_hf_state_dict(cfg, {k: v.detach().cpu() for k, v in ours.state_dict().items()}))
    theirs.config.output_router_logits = True
    ids = _batches(cfg, micro, 1, recipe.seq_len, 1, device)[0][0][0]

    def ours_step():
        out = ours(ids, ids)
        (out.ce_sum / out.num_target_tokens + ours.router_loss(out)).backward()

    def hf_step():
        theirs(input_ids=ids, labels=ids).loss.backward()

    for name, step in (("ours", ours_step), ("transformers Mixtral", hf_step)):
        step(), step()                                       # warm-up
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]
                     if device.type == "cuda" else [ProfilerActivity.CPU]) as prof:
            step()
        print(f"\n{name}:\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))


class PhaseTimer:
    """Wall time of the engine's forward, backward and step calls (GPU synchronized)."""

    def __init__(self, engine, device: torch.device):
        self.device, self.totals = device, {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        for attr, phase in (("forward", "forward"), ("backward", "backward"), ("step", "optimizer")):
            setattr(engine, attr, self._timed(getattr(engine, attr), phase))

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _timed(self, fn, phase):
        def run(*args, **kwargs):
            self._sync()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self._sync()
            self.totals[phase] += time.perf_counter() - t0
            return out
        return run

    @contextmanager
    def step(self, rows: list):
        before = dict(self.totals)
        self._sync()
        t0 = time.perf_counter()
        yield
        self._sync()
        total = time.perf_counter() - t0
        row = {k: self.totals[k] - before[k] for k in self.totals}
        row["other"] = total - sum(row.values())
        row["total"] = total
        rows.append(row)


def _batches(cfg, micro: int, accumulation: int, seq: int, steps: int, device) -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab_size, (accumulation, micro, seq + 1), generator=g)
        out.append([(t[:, :-1].to(device), t[:, 1:].to(device)) for t in tokens])
    return out


def build_ours(run):
    """Our model through the trainer's own set-up and step (a ``training.run.trainer.Run`` that
    has joined the job: the model at its layout, its engine and ``Stepper``; its blocks compiled
    when ``train.compile``): the model, its timer and a function running one step."""
    if run.ctx is None:
        run.join_job()
    run.build_model()
    return run.model, PhaseTimer(run.engine, run.ctx.device), run.build_stepper().train_step


def build_hf(ours, cfg, ds, ctx):
    """transformers' Mixtral with our weights, in the plain DeepSpeed loop: a function running
    one step."""
    import deepspeed
    from transformers import AutoModelForCausalLM

    from interop import hf
    from training.optim import schedules
    model = AutoModelForCausalLM.from_config(hf.to_hf_config(cfg)).to(ctx.device)
    model.load_state_dict(hf.to_hf_state_dict(cfg, {k: v.detach().cpu() for k, v in ours.state_dict().items()}))
    model.config.output_router_logits = True
    ds, _ = schedules.split_scheduler(ds)
    ds = {k: v for k, v in ds.items() if k != "scheduler"}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)

    def step(_, micro_batches):
        for inputs, _labels in micro_batches:
            engine.backward(engine(input_ids=inputs, labels=inputs).loss)
            engine.step()
    return PhaseTimer(engine, ctx.device), step


def run_interleaved(run, batches, warmup, compiled: bool = False):
    """Both models built (ours, from ``run``, and transformers', or with ``compiled`` ours eager
    and ours compiled), then one step of each in turn, so that load on a shared machine hits both
    alike; returns their per-step rows (after ``warmup``)."""
    from training.run.trainer import Run
    plan = run.plan
    model, ours_timer, ours_step = build_ours(run)
    if compiled:
        train = dataclasses.replace(plan.recipe.train, compile=True)
        _, other_timer, other_step = build_ours(Run(dataclasses.replace(
            plan, recipe=dataclasses.replace(plan.recipe, train=train))))
    else:
        other_timer, other_step = build_hf(model, plan.recipe.model, plan.ds, run.ctx)
    ours_rows, other_rows = [], []
    for step, micro_batches in enumerate(batches, 1):
        with ours_timer.step(ours_rows):
            ours_step(step, micro_batches)
        with other_timer.step(other_rows):
            other_step(step, micro_batches)
    return ours_rows[warmup:], other_rows[warmup:]


def summarize(rows: list[dict], tokens_per_step: int) -> dict:
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    med["tokens_per_s"] = tokens_per_step / med["total"]
    return med


def main(argv=None) -> int:
    args = parse_args(argv)
    start(args)
    from training.run.preflight import plan_for
    from training.run.trainer import Run

    results = []
    for size in args.sizes.split(","):
        run = Run(plan_for(args.config, args.recipe, SIZES[size] + ["model.moe.router_jitter=0.0"],
                           args.steps))
        recipe, ds, ctx = run.plan.recipe, run.plan.ds, run.join_job()
        micro, acc = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
        if args.op_profile:
            op_profile(recipe, micro, ctx.device)
            continue
        batches = _batches(recipe.model, micro, acc, recipe.seq_len, args.steps, ctx.device)
        tokens = micro * acc * recipe.seq_len
        ours_rows, hf_rows = run_interleaved(run, batches, args.warmup, args.compile)
        # tokens/s ratio per step: ours / transformers, or compiled / eager (the second model).
        ratio = statistics.median(o["total"] / h["total"] if args.compile else h["total"] / o["total"]
                                  for o, h in zip(ours_rows, hf_rows))
        results.append((size, recipe.model, summarize(ours_rows, tokens), summarize(hf_rows, tokens),
                        ratio))

    if args.op_profile:
        return finish()
    print(f"config {args.config}, device {ctx.device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; medians over {args.steps - args.warmup} steps (ms)\n")
    print("| size | params | implementation | tokens/s | step | forward | backward | optimizer | other |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    other = "ours, train.compile" if args.compile else "transformers Mixtral"
    for size, cfg, ours, theirs, _ in results:
        params = f"{cfg.num_params() / 1e6:.1f}M"
        for name, m in (("ours (trainer)", ours), (other, theirs)):
            print(f"| {size} | {params} | {name} | {m['tokens_per_s']:,.0f} | {1e3 * m['total']:.1f} | "
                  f"{1e3 * m['forward']:.1f} | {1e3 * m['backward']:.1f} | {1e3 * m['optimizer']:.1f} | "
                  f"{1e3 * m['other']:.1f} |")
    print()
    for size, _, ours, theirs, ratio in results:
        if args.compile:
            print(f"{size}: compiled / eager tokens/s = {ratio:.2f} (median of per-step ratios; "
                  f"of the medians {theirs['tokens_per_s'] / ours['tokens_per_s']:.2f})")
        else:
            print(f"{size}: ours / transformers tokens/s = {ratio:.2f} (median of per-step ratios; "
                  f"of the medians {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f})")
    return finish()


if __name__ == "__main__":
    from training.run.distributed import exit_now
    exit_now(main())        # no interpreter finalization, where gloo's threads can abort a finished run
