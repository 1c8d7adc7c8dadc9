"""The next layout to try after running out of memory: a ladder of changes judged by the estimator.

``LADDER`` is ordered from the cheapest change to the most expensive one in step time: recompute
activations, shard more model state, shrink the micro-batch (same global batch), split long
sequences over more ranks (context parallelism, same global batch), split the matmuls over more
GPUs of the node (same global batch), move optimizer states to CPU memory. Each
rung is applied on top of the ones before it when the estimator (``planning/estimator.py``)
says it lowers this rank's memory, and is checked as the trainer would check it (recipe
validation, ``Recipe.dims``, ``ds_config.resolve_ds_config``); the walk stops
at the first layout that fits. Recipe changes become ``--set`` overrides; DeepSpeed changes are
applied to the user's JSON and written to ``<run-dir>/oom_next_ds_config.json``, which the
command points at.
"""

from __future__ import annotations

import copy
import json
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import torch

from planning import memory_model as mm
from planning.estimator import GB, estimate
from training.config import ds_config
from training.files import atomic_write
from training.config.recipe import apply_overrides, recipe_from_dict

LADDER = ("activation checkpointing full", "ZeRO stage + 1",
          "halve the micro-batch, double the accumulation",
          "double context parallelism (long sequences)",
          "double tensor parallelism within the node", "offload the optimizer (and ZeRO-3 params)")
LONG_SEQUENCE = 8192    # from here a sequence split over cp ranks hides its exchange behind attention
NEXT_CONFIG = "oom_next_ds_config.json"


def gpus_per_node(plan) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count() or plan.world_size))


def cost(est: dict, device: torch.device) -> tuple[float, float]:
    """(model states, activations + buffers) of the heaviest stage; on a CPU device the
    offloaded states live in the same memory."""
    w = est["worst"]
    states = w["model_states"] + (w["cpu"] if device.type != "cuda" else 0.0)
    return states, w["gpu_total"] - w["model_states"]


@dataclass
class _Candidate:
    sets: dict = field(default_factory=dict)       # recipe keys -> --set values
    json: dict = field(default_factory=dict)       # dotted DeepSpeed JSON keys -> values
    changes: list = field(default_factory=list)


def suggest(plan, args, device: torch.device, est: dict) -> dict:
    """Walk ``LADDER`` from this run's layout; return the rungs tried and the next command.

    Args:
        plan: ``training.run.preflight.Plan`` of the run that ran out of memory.
        args: its parsed command line (the suggestion repeats it with the changes).
        device: this rank's device; on a CPU, offloaded states count against the same memory.
        est: ``planning.oom``'s estimate section: ``gpu_table_entry``, ``scale`` (the estimator's
            miss on this run, applied to activations and buffers) and ``budget`` (bytes).
    """
    gpn, gpu = gpus_per_node(plan), est["gpu_table_entry"]
    build = _Builder(plan.recipe.to_dict(), ds_config.load_ds_config(args.config), plan.world_size,
                     gpn, gpu, device, est["scale"])
    current, (_, _, written, mem), rungs, fits = _walk(build, est["budget"])
    out = {"budget_gb": est["budget"] / GB, "scale": est["scale"], "rungs": rungs, "fits": fits,
           "changes": current.changes, "set": current.sets, "ds_json_changes": current.json,
           "estimate_gb": mem / GB, "config": None, "command": None}
    if not current.changes:
        out["next_try"] = ("nothing in the ladder lowers the estimate; add GPUs: "
                           + _plan_command(args, plan, gpn, gpu))
        return out
    config = args.config
    if current.json:
        config = str(Path(plan.run_dir) / NEXT_CONFIG)
        atomic_write(Path(config), json.dumps(written, indent=2) + "\n")
    out["config"] = config
    out["command"] = _command(args, plan, current.sets, config)
    sized = f"{mem / GB:.2f} of {est['budget'] / GB:.2f} GB usable by the estimate"
    if fits:
        out["summary"] = f"{'; '.join(current.changes)} ({sized})"
        out["next_try"] = f"{out['summary']}: {out['command']}"
    else:
        out["summary"] = f"no layout in the ladder fits (best: {'; '.join(current.changes)}, {sized})"
        out["next_try"] = f"{out['summary']}; add GPUs: {_plan_command(args, plan, gpn, gpu)}"
    if ((Path(plan.run_dir) / "checkpoints" / "latest").is_file()
            and (current.json or set(current.sets) - {"train.activation_checkpointing"})):
        out["note"] = ("the run directory holds checkpoints of the old ZeRO stage/batch/TP layout; "
                       "resuming them under the new one is not tested here: a new --run-dir is safe")
    return out


@dataclass
class _Builder:
    """Builds a candidate as the trainer would (recipe, DeepSpeed JSON, layout checks) and
    sizes it: ``(recipe, resolved JSON, JSON to write, estimated bytes)``."""

    base_recipe: dict
    raw_ds: dict
    world: int
    gpus_per_node: int
    gpu: str
    device: torch.device
    scale: float

    def __call__(self, c: _Candidate):
        recipe = recipe_from_dict(apply_overrides(self.base_recipe,
                                                  [f"{k}={v}" for k, v in c.sets.items()]))
        ds = copy.deepcopy(self.raw_ds)
        for key, value in c.json.items():
            *parents, last = key.split(".")
            node = ds
            for p in parents:
                node = node.setdefault(p, {})
            node[last] = value
        dims = recipe.dims(self.world)
        resolved = ds_config.resolve_ds_config(ds, recipe, dims)
        states, transient = cost(estimate(recipe, resolved, self.world, self.gpus_per_node,
                                          self.gpu), self.device)
        return recipe, resolved, ds, states + transient * self.scale


def _walk(build: _Builder, budget: float) -> tuple[_Candidate, tuple, list[dict], bool]:
    """Apply each rung of ``LADDER`` that lowers the estimate, until one fits ``budget``; return
    the last applied candidate, what ``build`` made of it, the rungs tried and whether it fits."""
    current = _Candidate()
    best = build(current)
    recipe, ds, _, mem = best
    rungs = []
    rungs_in_order = (_rung_checkpointing, _rung_zero, _rung_micro, _rung_cp, _rung_tp, _rung_offload)
    for name, rung in zip(LADDER, rungs_in_order, strict=True):
        options = rung(recipe, ds, build.world, build.gpus_per_node)   # a reason to skip, or changes
        row = {"rung": name, "change": None, "status": "skipped", "estimate_gb": None,
               "reason": options if isinstance(options, str) else None}
        rungs.append(row)
        for change, sets, keys in ([] if isinstance(options, str) else options):
            cand = _Candidate({**current.sets, **sets}, {**current.json, **keys}, current.changes + [change])
            row["change"] = change
            try:
                built = build(cand)
            except ValueError as e:
                row["reason"] = f"not a valid layout: {e}"
                continue
            row["estimate_gb"] = built[3] / GB
            if built[3] >= mem:
                row["reason"] = "does not lower the estimate"
                continue
            current, best = cand, built
            recipe, ds, _, mem = built
            row["status"], row["reason"] = "applied", None
            break
        if row["status"] == "applied" and mem <= budget:
            return current, best, rungs, True
    return current, best, rungs, False


def _rung_checkpointing(recipe, ds, world, gpn):
    if recipe.train.activation_checkpointing == "full":
        return "already full"
    return [("activation checkpointing full", {"train.activation_checkpointing": "full"}, {})]


def _rung_zero(recipe, ds, world, gpn):
    """The next stage, or the one after when the next saves nothing (ZeRO-2 holds what ZeRO-1
    holds without accumulation, see ``memory_model.deepspeed_state_rules``)."""
    stage = int((ds.get("zero_optimization") or {}).get("stage", 0))
    top = 1 if recipe.parallel.pipeline_parallel_size > 1 else 3
    if stage >= top:
        return f"already ZeRO-{stage}" + (" (the most pipelines allow)" if top == 1 else "")
    return [(f"ZeRO-{stage} -> ZeRO-{s}", {}, {"zero_optimization.stage": s})
            for s in range(stage + 1, top + 1)]


def _rung_micro(recipe, ds, world, gpn):
    micro, acc = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
    if micro < 2:
        return "micro-batch is already 1"
    return [(f"micro-batch {micro} -> {micro // 2}, accumulation {acc} -> {acc * 2}", {},
             {"train_micro_batch_size_per_gpu": micro // 2, "gradient_accumulation_steps": acc * 2})]


def _rung_cp(recipe, ds, world, gpn):
    """Split each sequence over twice the ranks (docs/context-parallelism.md): every activation
    divides by cp, the model states do not move (ZeRO shards over dp x cp either way)."""
    par, acc = recipe.parallel, ds["gradient_accumulation_steps"]
    cp, dp = par.context_parallel_size, recipe.dims(world).dp
    if recipe.seq_len < LONG_SEQUENCE:
        return f"sequence length {recipe.seq_len} is below {LONG_SEQUENCE}: tensor parallelism first"
    if dp % 2:
        return f"data-parallel size {dp} cannot be halved at a fixed world size"
    return [(f"context parallelism {cp} -> {2 * cp} ({par.cp_comm}; accumulation {acc} -> {acc * 2} "
             f"keeps the batch)", {"parallel.context_parallel_size": 2 * cp},
             {"gradient_accumulation_steps": acc * 2})]


def _rung_tp(recipe, ds, world, gpn):
    par, acc = recipe.parallel, ds["gradient_accumulation_steps"]
    tp, dp = par.tensor_parallel_size, recipe.dims(world).dp
    if 2 * tp > gpn:
        return f"tensor parallelism {2 * tp} exceeds the {gpn} GPU(s) of a node"
    if dp % 2:
        return f"data-parallel size {dp} cannot be halved at a fixed world size"
    sets = {"parallel.tensor_parallel_size": 2 * tp}
    what = f"tensor parallelism {tp} -> {2 * tp}"
    if not par.sequence_parallel and recipe.seq_len % (2 * tp) == 0:
        # Activations between the tensor-parallel regions split by tp too.
        sets["parallel.sequence_parallel"] = "true"
        what += " with sequence parallelism"
    return [(f"{what} (accumulation {acc} -> {acc * 2} keeps the batch)", sets,
             {"gradient_accumulation_steps": acc * 2})]


def _rung_offload(recipe, ds, world, gpn):
    zero = ds.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0))
    if mm._offloaded(zero, "offload_optimizer"):
        return "already offloaded"
    keys = {"zero_optimization.offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if stage == 0:
        keys["zero_optimization.stage"] = 1
    if stage == 3:
        keys["zero_optimization.offload_param"] = {"device": "cpu", "pin_memory": True}
    return [("offload the optimizer" + (" and parameters" if stage == 3 else "") + " to CPU", {}, keys)]


def _plan_command(args, plan, gpn: int, gpu: str) -> str:
    """The planner on twice the nodes (``launch/estimate_memory.py --plan``)."""
    nodes = 2 * max(1, plan.world_size // gpn)
    return shlex.join(["python", "launch/estimate_memory.py", "--plan", "--recipe",
                       args.recipe or "recipes/tiny_mixtral.yaml", "--nodes", str(nodes),
                       "--gpus-per-node", str(gpn), "--gpu", gpu])


def _command(args, plan, sets: dict, config: str) -> str:
    single = plan.world_size == 1 and "LOCAL_WORLD_SIZE" not in os.environ
    cmd = ["launch/train.py", "--config", config]
    cmd += ["--recipe", args.recipe] if args.recipe else []
    cmd += ["--run-dir", str(plan.run_dir)]
    cmd += ["--steps", str(args.steps)] if args.steps is not None else []
    cmd += ["--init-from", args.init_from] if args.init_from else []
    overrides = list(args.set) + [f"{k}={v}" for k, v in sets.items()]
    cmd += ["--set", *overrides] if overrides else []
    return ("python " if single else "deepspeed [your launcher args] ") + shlex.join(cmd)
