"""PyTorch FSDP2 vs DeepSpeed ZeRO-3: the same model from the same init, on the same tokens, with
the same optimizer, schedule and clipping; per-step losses (asserted equal), peak memory per rank
and step time, for each of torch's sharding strategies.

    python -m benchmarks.peers.fsdp2_vs_zero3                           # 2 gloo CPU ranks, tiny Mixtral, 12 steps
    python -m benchmarks.peers.fsdp2_vs_zero3 --models mixtral,dense --steps 12
    python -m benchmarks.peers.fsdp2_vs_zero3 --nproc 4 --strategies full,grad_op,hybrid,none
    torchrun --nproc_per_node 2 -m benchmarks.peers.fsdp2_vs_zero3      # the same, launched by hand

Strategies (``--strategies``, default ``full``), each trained beside ZeRO-3 on the same tokens:

| name | torch 2.13 | FSDP1 ``ShardingStrategy`` | DeepSpeed analogue |
|---|---|---|---|
| ``full`` | ``fully_shard`` per block, ``reshard_after_forward=True`` | ``FULL_SHARD`` | ZeRO-3 |
| ``grad_op`` | ``fully_shard`` per block, ``reshard_after_forward=False`` | ``SHARD_GRAD_OP`` | ZeRO-2 |
| ``hybrid`` | ``fully_shard`` on a 2-D mesh (2 replicas x dp/2 shards) | ``HYBRID_SHARD`` | none (ZeRO++ hpZ nearest) |
| ``none`` | ``DistributedDataParallel`` | ``NO_SHARD`` | ZeRO-0 (ZeRO-1 has no FSDP setting) |

``grad_op`` keeps each block's gathered parameters from its forward to its backward (no second
all-gather); ``hybrid`` shards within each group of dp/2 ranks and all-reduces the gradients
across the 2 groups (needs dp >= 4, even); ``none`` replicates everything and all-reduces the
gradients. FSDP2's own replicate-only wrapper is still private in torch 2.13
(``torch.distributed._composable.replicate_with_fsdp``), so ``none`` is torch's DDP.

Hardware: any CPU (2 gloo ranks on 127.0.0.1; run without torchrun, the script launches itself
with ``torchrun --nproc_per_node 2``) or GPUs (NCCL, one rank per GPU). fp32 only: the parity
check is FSDP2 and ZeRO-3 losses equal per step on the same tokens, within ``--rtol`` (default
1e-4) relative.

ZeRO-3 is the repository's own path: the recipe and ``--config`` JSON resolved as
``launch/train.py`` resolves them, the model built partitioned under ``zero.Init``
(``Run.build_model``: ``training.engine.build``), ``deepspeed.initialize`` with our weight-decay
groups and the trainer's step (``Run.build_stepper``: ``Stepper.train_step``). FSDP2 is
``fully_shard`` on every block and then on the root (``full``: parameters gathered per block in
forward and again in backward, as ZeRO-3) over the data-parallel ranks, with what DeepSpeed
builds from the same JSON: torch's ``AdamW`` over the same parameter groups,
DeepSpeed's own lr scheduler class, ``clip_grad_norm_`` at ``gradient_clipping``, and the
trainer's objective (each rank's cross-entropy sum scaled by dp / tokens of the step, plus the
router losses / accumulation steps; gradients averaged over dp by both). Only tp = ep = pp = 1:
FSDP2 with tensor or expert parallelism is out of scope here.

Peak memory: CPU has no allocator statistics, so each strategy's build and first
``--memory-steps`` steps run under ``torch.profiler`` with ``profile_memory``, whose events carry
every c10 CPU allocation and free; the peak is the maximum of their running sum (tensor bytes,
not RSS; on GPU ``torch.cuda.max_memory_allocated``). The steps after those are timed without
the profiler, one strategy after the other in an order that rotates every step, so that other
load hits all alike; the median step time is printed. Exits 1 when a step's losses differ from
ZeRO-3's by more than ``--rtol``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from itertools import accumulate
from pathlib import Path

import torch
import torch.distributed as dist

from training.run.spawn import free_port

REPO = Path(__file__).resolve().parents[2]

RECIPES = {"mixtral": "recipes/tiny_mixtral.yaml", "dense": "recipes/tiny_dense.yaml"}
# name -> (label, FSDP1 ShardingStrategy, DeepSpeed analogue); the docstring's table.
STRATEGIES = {"full": ("FSDP2 full shard", "FULL_SHARD", "ZeRO-3"),
              "grad_op": ("FSDP2 grad/opt shard", "SHARD_GRAD_OP", "ZeRO-2"),
              "hybrid": ("FSDP2 hybrid 2 x dp/2", "HYBRID_SHARD", "none (ZeRO++ hpZ nearest)"),
              "none": ("DDP (no shard)", "NO_SHARD", "ZeRO-0")}
HYBRID_REPLICAS = 2


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="ds_configs/zero3_fp32.json", help="DeepSpeed JSON (ZeRO-3, fp32)")
    p.add_argument("--models", default="mixtral", help="comma-separated subset of: mixtral, dense")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per framework")
    p.add_argument("--memory-steps", type=int, default=3, help="first steps run under the memory profiler")
    p.add_argument("--strategies", default="full",
                   help="comma-separated subset of: full (FULL_SHARD, ZeRO-3), grad_op (SHARD_GRAD_OP, "
                        "ZeRO-2), hybrid (HYBRID_SHARD, 2 replicas x dp/2 shards; dp >= 4), none "
                        "(NO_SHARD: DDP, ZeRO-0)")
    p.add_argument("--nproc", type=int, default=2, help="ranks when the script launches itself")
    p.add_argument("--rtol", type=float, default=1e-4, help="largest relative loss difference allowed")
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="recipe overrides, e.g. model.num_layers=2, and DeepSpeed JSON keys with a "
                        "ds. prefix, e.g. ds.zero_optimization.reduce_bucket_size=500000 (both sides)")
    p.add_argument("--json", default=None, help="also write the results here (rank 0)")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------
# Memory and batches.

class PeakMemory:
    """Peak tensor bytes allocated inside the ``with`` block, above its start: the CUDA
    allocator's statistics on GPU, the profiler's allocation events on CPU."""

    def __init__(self, device: torch.device):
        self.device, self.peak = device, 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            from torch.profiler import ProfilerActivity, profile
            self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
            return
        self.prof.__exit__(*exc)
        events = sorted((e for e in self.prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                        key=lambda e: e.start_ns())
        self.peak = max(accumulate((e.nbytes() for e in events), initial=0))
        del self.prof


def step_batches(cfg, ds: dict, seq: int, steps: int, dp_rank: int, dp: int, device) -> list:
    """This rank's micro-batches of every step: fixed random ids (the same global batch, cut the
    same way, for both frameworks); labels are the next ids. Drawn from a Zipf distribution
    (p ~ 1/rank) so that the loss falls as the model learns it: a mismatch in the update
    (optimizer, clipping, schedule) shows in the losses, not only one in the forward."""
    g = torch.Generator().manual_seed(0)
    micro, gas = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
    zipf = 1.0 / torch.arange(1, cfg.vocab_size + 1, dtype=torch.float64)
    out = []
    for _ in range(steps):
        n = gas * dp * micro * (seq + 1)
        ids = torch.multinomial(zipf, n, replacement=True, generator=g)
        ids = ids.view(gas, dp, micro, seq + 1)[:, dp_rank]                # (gas, micro, seq + 1)
        out.append([(t[:, :-1].to(device), t[:, 1:].to(device)) for t in ids])
    return out


# ----------------------------------------------------------------------------------------------
# The two frameworks, each one object with ``step(step, micro_batches) -> loss``.

class Zero3Run:
    """The trainer's own path (``training.run.trainer.Run``, joined to the job): partitioned
    build, ``build_engine``, ``Stepper.train_step``."""

    def __init__(self, run):
        run.build_model()
        self.model, self.stepper = run.model, run.build_stepper()

    def step(self, step: int, micro_batches) -> tuple[float, float]:
        row, _ = self.stepper.train_step(step, micro_batches)
        assert "skipped" not in row, row
        return row["loss"], row["grad_norm"]

    def full_params(self) -> dict:
        """Every parameter whole (gathered from the ZeRO-3 partitions), by name."""
        import deepspeed
        params = dict(self.model.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {n: p.detach().clone() for n, p in params.items()}


class Fsdp2Run:
    """One of torch's strategies (``STRATEGIES``: FSDP2 ``fully_shard`` per block and at the root,
    or DDP) over the data-parallel ranks, with what DeepSpeed builds from the JSON."""

    def __init__(self, recipe, ds: dict, ctx, strategy: str = "full"):
        from deepspeed.runtime import lr_schedules
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from model import Transformer
        from training.optim import optimizers
        g = ctx.groups
        self.model = Transformer(recipe.model, g, init_seed=recipe.train.seed).to(ctx.device)
        self.model.set_activation_checkpointing(recipe.train.activation_checkpointing)
        params = dict(ds["optimizer"]["params"])
        assert ds["optimizer"]["type"].lower() == "adamw" and params.pop("torch_adam", False), ds["optimizer"]
        if strategy == "none":      # DDP: the same parameter objects, gradients averaged over dp
            self.wrapped = torch.nn.parallel.DistributedDataParallel(self.model, process_group=g.dp_group)
        else:
            if strategy == "hybrid":    # (replicate, shard): world == dp here (tp = ep = pp = 1)
                mesh = init_device_mesh(ctx.device.type, (HYBRID_REPLICAS, g.dp // HYBRID_REPLICAS),
                                        mesh_dim_names=("replicate", "shard"))
            else:
                mesh = DeviceMesh.from_group(g.dp_group, ctx.device.type)
            for block in self.model.layers:
                fully_shard(block, mesh=mesh, reshard_after_forward=strategy != "grad_op")
            # The root: torch's default (None: kept after forward, backward starts with it).
            fully_shard(self.model, mesh=mesh, reshard_after_forward=False if strategy == "grad_op" else None)
            self.wrapped = self.model
        groups = optimizers.param_groups(self.model, params["weight_decay"])   # names unchanged by FSDP2
        self.opt = torch.optim.AdamW(groups, **params)                    # as DeepSpeed's torch_adam
        sched = ds.get("scheduler")
        self.sched = getattr(lr_schedules, sched["type"])(self.opt, **sched["params"]) if sched else None
        self.clip = float(ds.get("gradient_clipping", 0.0))
        self.ctx, self.dp, self.strategy = ctx, g.dp, strategy
        first = next(self.model.parameters())       # how the parameters lie: mesh shape, placements
        self.layout = ([list(first.device_mesh.shape), [repr(pl) for pl in first.placements]]
                       if hasattr(first, "placements") else "whole on every rank")
        self.tokens_per_step = ds["train_batch_size"] * recipe.seq_len

    def step(self, step: int, micro_batches) -> tuple[float, float]:
        model, gas = self.model, len(micro_batches)
        sums = torch.zeros(2, dtype=torch.float64, device=self.ctx.device)   # ce_sum, tokens
        for i, (input_ids, labels) in enumerate(micro_batches):
            # DDP all-reduces in the last micro-batch's backward only, as ZeRO-0 does.
            last = i == gas - 1 or self.strategy != "none"
            with contextlib.nullcontext() if last else self.wrapped.no_sync():
                out = self.wrapped(input_ids, labels)
                # The trainer's objective (training/step/stepper.py): exact accumulation over the step.
                loss = out.ce_sum * (self.dp / self.tokens_per_step) + model.router_loss(out) / gas
                loss.backward()
            sums += torch.stack([out.ce_sum.detach().double(), out.num_target_tokens.double()])
        # DeepSpeed's clip: grads x 1 / max(1, (norm + 1e-6) / clip); torch's: x min(1, clip / (norm + 1e-6)).
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), self.clip if self.clip > 0 else float("inf"))
        self.opt.step()
        if self.sched is not None:
            self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        dist.all_reduce(sums, group=self.ctx.groups.dp_group)
        ce, tokens = sums.tolist()
        return ce / max(tokens, 1), float(_whole(norm))

    def full_params(self) -> dict:
        """Every parameter whole (gathered from the FSDP2 shards), by name."""
        return {n: _whole(p.detach()).clone() for n, p in self.model.named_parameters()}


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (FSDP2), a plain tensor as it is (DDP)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# ----------------------------------------------------------------------------------------------
# One comparison on every rank.

def setup(model: str, args):
    """The trainer's run of ``model`` joined to the job (recipe, resolved DeepSpeed JSON and
    process groups, as ``launch/train.py`` prepares them)."""
    from training.run.preflight import plan_for
    from training.run.trainer import Run
    plan = plan_for(REPO / args.config, str(REPO / RECIPES[model]), args.set, args.steps)
    if plan.world_size != plan.dp_size:
        raise ValueError(f"parallel sizes tp x ep x pp ({plan.world_size // plan.dp_size}) must be "
                         f"1: FSDP2 with tensor, expert or pipeline parallelism is not compared here")
    stage = int((plan.ds.get("zero_optimization") or {}).get("stage", 0))
    half = any((plan.ds.get(k) or {}).get("enabled") for k in ("bf16", "fp16"))
    if stage != 3 or half:
        raise ValueError(f"--config {args.config}: stage {stage}, half precision {half}; "
                         f"the comparison needs ZeRO-3 in fp32 (ds_configs/zero3_fp32.json)")
    run = Run(plan)
    run.join_job()
    return run


def compare(model: str, args) -> dict:
    """ZeRO-3 and every strategy of ``args.strategies`` on this rank; per-step losses, peak bytes
    and step times of each."""
    run = setup(model, args)
    recipe, ds, ctx = run.plan.recipe, run.plan.ds, run.ctx
    g = ctx.groups
    batches = step_batches(recipe.model, ds, recipe.seq_len, args.steps, g.dp_rank, g.dp, ctx.device)
    names = [*args.strategies.split(","), "zero3"]
    runs, res = {}, {name: {"loss": [], "grad_norm": [], "time": []} for name in names}
    for name in names:
        gc.collect()
        with PeakMemory(ctx.device) as mem:
            runs[name] = Zero3Run(run) if name == "zero3" else Fsdp2Run(recipe, ds, ctx, name)
            for step in range(1, args.memory_steps + 1):
                _record(res[name], runs[name].step(step, batches[step - 1]))
        res[name]["peak_bytes"] = mem.peak
        res[name]["layout"] = getattr(runs[name], "layout", "ZeRO-3 partitions")
    for step in range(args.memory_steps + 1, args.steps + 1):
        k = step % len(names)
        for name in names[k:] + names[:k]:          # each strategy first in turn
            dist.barrier()
            t0 = time.perf_counter()
            _record(res[name], runs[name].step(step, batches[step - 1]))
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            res[name]["time"].append(time.perf_counter() - t0)
    # The update itself, after the last step: Adam hides any constant scale of the gradients
    # from the losses, not from the weights (a clipping mismatch moves them by ~1e-5).
    want = runs["zero3"].full_params()
    res["max_weight_diff"] = {}
    for name in names[:-1]:
        got = runs[name].full_params()
        assert want.keys() == got.keys(), (sorted(want), sorted(got))
        res["max_weight_diff"][name] = max((got[n] - w).abs().max().item() for n, w in want.items())
    res["params"] = recipe.model.num_params()
    res["world"] = ctx.world_size
    return res


def _record(res: dict, loss_and_norm: tuple[float, float]) -> None:
    res["loss"].append(loss_and_norm[0])
    res["grad_norm"].append(loss_and_norm[1])


def max_rel_diff(a: list[float], b: list[float]) -> float:
    """Largest per-step |a - b| / |b|."""
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def gather_ranks(res: dict) -> list[dict]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, res)
    return out


def report(model: str, per_rank: list[dict], args) -> tuple[str, dict]:
    """Markdown: per-step losses and grad norms against ZeRO-3's, then memory and time per rank;
    and each strategy's largest relative loss difference from ZeRO-3."""
    r0, strategies = per_rank[0], args.strategies.split(",")
    z3 = r0["zero3"]["loss"]
    diffs = {name: max_rel_diff(r0[name]["loss"], z3) for name in strategies}
    labels = {name: STRATEGIES[name][0] for name in strategies}
    lines = [f"### {model} ({r0['params'] / 1e6:.2f}M parameters), {r0['world']} ranks, "
             f"{args.config}, {args.steps} steps", "",
             "| step | ZeRO-3 loss | " + " | ".join(f"{labels[n]} loss" for n in strategies)
             + " | ZeRO-3 grad norm | " + " | ".join(f"{labels[n]} grad norm" for n in strategies) + " |",
             "|---:|" + "---:|" * (2 + 2 * len(strategies))]
    for i in range(len(z3)):
        cells = [f"{z3[i]:.6f}", *(f"{r0[n]['loss'][i]:.6f}" for n in strategies),
                 f"{r0['zero3']['grad_norm'][i]:.4f}", *(f"{r0[n]['grad_norm'][i]:.4f}" for n in strategies)]
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    lines += ["", "| strategy | FSDP1 name | DeepSpeed analogue | max relative loss difference from "
              "ZeRO-3 | weights after the last step, max abs difference |", "|---|---|---|---:|---:|"]
    lines += [f"| {labels[n]} (`{n}`) | `{STRATEGIES[n][1]}` | {STRATEGIES[n][2]} | {diffs[n]:.1e} "
              f"| {r0['max_weight_diff'][n]:.1e} |" for n in strategies]
    lines += ["", f"allowed {args.rtol:g} relative", "",
              "| rank | strategy | peak memory (MB) | median step (ms) |", "|---:|---|---:|---:|"]
    for rank, r in enumerate(per_rank):
        for name in [*strategies, "zero3"]:
            times = r[name]["time"]
            med = f"{1e3 * statistics.median(times):.1f}" if times else "-"
            label = labels.get(name, "ZeRO-3 (DeepSpeed)")
            lines.append(f"| {rank} | {label} | {r[name]['peak_bytes'] / 1e6:.2f} | {med} |")
    return "\n".join(lines), diffs


def run_distributed(args) -> int:
    from training.run import distributed
    results, text, worst = {}, [], 0.0
    for model in args.models.split(","):
        per_rank = gather_ranks(compare(model, args))
        table, diffs = report(model, per_rank, args)
        results[model] = {"ranks": per_rank, "max_rel_diff": diffs}
        text.append(table)
        worst = max(worst, *diffs.values())
    if dist.get_rank() == 0:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads per rank; peak memory: "
              f"tensor bytes above the start, over the build and the first {args.memory_steps} "
              f"steps; step time: median of the later steps\n")
        print("\n\n".join(text))
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    distributed.shutdown()
    if worst > args.rtol:
        print(f"FAIL: FSDP2 (or DDP) and ZeRO-3 losses differ by {worst:.1e} relative (> {args.rtol:g})",
              file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    bad = [m for m in args.models.split(",") if m not in RECIPES]
    if bad or not 1 <= args.memory_steps < args.steps:
        print(f"error: --models {bad} not in {list(RECIPES)}, or --memory-steps "
              f"({args.memory_steps}) not in [1, --steps)", file=sys.stderr)
        return 2
    strategies = args.strategies.split(",")
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad or len(set(strategies)) != len(strategies):
        print(f"error: --strategies {args.strategies}: each once, of {', '.join(STRATEGIES)}", file=sys.stderr)
        return 2
    ranks = int(os.environ.get("WORLD_SIZE", args.nproc))
    if "hybrid" in strategies and (ranks < 2 * HYBRID_REPLICAS or ranks % HYBRID_REPLICAS):
        print(f"error: --strategies hybrid shards over ranks / {HYBRID_REPLICAS} and replicates "
              f"{HYBRID_REPLICAS}x: needs an even number of ranks >= {2 * HYBRID_REPLICAS} "
              f"(got {ranks}): use --nproc 4", file=sys.stderr)
        return 2
    if "RANK" in os.environ:
        return run_distributed(args)
    env = dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR", WANDB_MODE="disabled")
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
           "--master_port", str(free_port()), "-m", "benchmarks.peers.fsdp2_vs_zero3", *_without_nproc(argv if argv is not None else sys.argv[1:])]
    return subprocess.run(cmd, cwd=REPO, env=env).returncode


def _without_nproc(argv: list[str]) -> list[str]:
    """The arguments less ``--nproc N``, which torchrun would take as its own ``--nproc_per_node``."""
    out, skip = [], False
    for a in argv:
        if not skip and a != "--nproc" and not a.startswith("--nproc="):
            out.append(a)
        skip = a == "--nproc"
    return out



if __name__ == "__main__":
    from training.run.distributed import exit_now
    exit_now(main())        # no interpreter finalization, where gloo's threads can abort a finished run
