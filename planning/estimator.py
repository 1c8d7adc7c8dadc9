"""Per-GPU memory of a training run, and a planner that picks a layout that fits.

The command is ``launch/estimate_memory.py``. The estimate prints, for the heaviest pipeline
stage: parameters, gradients and optimizer states
(ZeRO paper accounting with DeepSpeed 0.19.8's extras, see ``planning/memory_model.py``),
activations for one micro-batch per block and in total (with the recipe's activation
checkpointing), temporary buffers, and whether it fits the GPU after a reserve of
``RESERVE_FRACTION`` for the CUDA context, NCCL and allocator fragmentation. Offloaded states are
reported as CPU memory per rank and per node. The model's build, before ``deepspeed.initialize``
(``planning/build_memory.py``), must fit the node's host memory (``--host-memory-gb``, default
``HOST_GB_PER_GPU`` per GPU) and the GPU.

The planner enumerates ZeRO 0-3 x TP (up to the node size) x EP x PP (at most 8) x micro-batch
1/2/4/8 x activation checkpointing (``CHECKPOINTING``), skips what the trainer would refuse (the
same validators), refuses with its reason a layout whose build does not fit, keeps what fits and
ranks by predicted tokens/s per GPU (``step_time``: ``planning/cost_model.py`` on the cluster
of ``planning/hardware.py``), then prints the exact launch command of the best. Estimates, not
measurements: check the top choice with a short run (``mem_gb`` and ``tokens_per_s`` in
metrics.jsonl).
"""

from __future__ import annotations

import dataclasses
import itertools
import shlex
from pathlib import Path

from model.parallel.dims import ParallelDims
from planning import memory_model as mm
from planning.buffers import buffer_bytes, optimizer_temporaries
from planning.build_memory import build_bytes
from planning.muon_cost import apply_to_states, muon_elements, muon_step_terms, transient_bytes
from training.config.ds_checks import validate_ds_config
from training.config.ds_config import (apply_grad_compression, check_layout, load_ds_config,
                                       replica_sync_mode)
from planning.cost_model import Layout, Shape, step_cost
from planning.hardware import Cluster, cluster
from training.gpus import GPUS
from training.optim.muon import is_muon_type
from training.config.schema import ParallelConfig, Recipe

RESERVE_FRACTION = 0.10   # of GPU memory kept back: CUDA context/NCCL (~1-2 GB) + fragmentation
HOST_GB_PER_GPU = 128     # host memory per GPU the build may use by default: a DGX A100 (1 TB / 8)
PLAN_TOKENS = 4 * 1024 * 1024   # default global batch of the planner: 4M tokens per step
GB = 1e9
REPO = Path(__file__).resolve().parents[1]   # the stock ds_configs/ the planner starts from


# ---------------------------------------------------------------------------------------------
# Estimate.

def estimate(recipe: Recipe, ds: dict, gpus: int, gpus_per_node: int = 8,
             gpu: str = "h100-80gb", host_memory_gb: float | None = None,
             on_gpu: bool = True) -> dict:
    """Per-GPU memory (bytes) of ``recipe`` under DeepSpeed JSON ``ds`` on ``gpus`` GPUs.

    Returns a dict with the layout, ``stages`` (one estimate per distinct pipeline stage: the
    first holds the embedding and pp micro-batches in flight, the last the head and logits),
    ``worst`` (the stage with the largest total), ``build`` (the peak of building the model,
    ``planning/build_memory.py``, against ``host_memory_gb`` per node, default
    ``HOST_GB_PER_GPU`` per GPU, and the usable GPU memory; ``reason`` says why it does not
    fit) and ``fits`` (the step and the build). ``on_gpu=False`` counts the optimizer's
    temporaries as its CPU code path allocates them (``buffers.optimizer_temporaries``),
    for checking the estimate against runs on CPU ranks.

    Raises:
        ValueError: what the trainer refuses (``Recipe.dims`` on ``gpus``,
            ``training.config.ds_config.check_layout``), an unknown GPU.
    """
    if gpu not in GPUS:
        raise ValueError(f"--gpu {gpu!r} is unknown: choose one of {', '.join(GPUS)}")
    spec, cfg, dims = GPUS[gpu], recipe.model, recipe.dims(gpus)
    ds = validate_ds_config(ds, dims.dp)
    check_layout(ds, dims)
    micro, acc = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
    layout = mm.Layout(gpus, dims.tp, dims.ep, dims.pp, dims.sp, gpus_per_node,
                       schedule=recipe.parallel.pipeline_schedule, micro_batches=acc,
                       cp=dims.cp, cp_comm=dims.cp_comm)
    stage, precision = int((ds.get("zero_optimization") or {}).get("stage", 0)), mm.precision_of(ds)
    compression = powersgd_elements(recipe, layout)
    muon = muon_elements(recipe, layout) if is_muon_type(ds) else None
    stages = [_stage(recipe, layout, ds, s, micro, on_gpu, compression, muon and muon[s])
              for s in sorted({0, layout.pp - 1})]
    worst = max(stages, key=lambda st: st["gpu_total"])
    usable = spec.memory_gb * GB * (1 - RESERVE_FRACTION)
    host_memory = (host_memory_gb or HOST_GB_PER_GPU * gpus_per_node) * GB
    build = _build(stages, stage, min(gpus, gpus_per_node), host_memory, usable)
    return {"units": "bytes", "recipe": recipe.name, "gpu": gpu, "gpu_memory": spec.memory_gb * GB,
            "reserve_fraction": RESERVE_FRACTION, "usable": usable, "gpus": gpus,
            "gpus_per_node": gpus_per_node, "tp": layout.tp, "ep": layout.ep, "pp": layout.pp,
            "cp": dims.cp, "cp_comm": dims.cp_comm, "dp": dims.dp,
            "sequence_parallel": layout.sp, "zero_dp": layout.dp, "zero_stage": stage,
            "precision": precision, "micro_batch": micro, "accumulation": acc,
            "seq_len": recipe.seq_len, "activation_checkpointing": recipe.train.activation_checkpointing,
            "params_total": cfg.num_params(), "params_active": cfg.num_params(active=True),
            "stages": stages, "worst": worst, "build": build, "powersgd": compression,
            "muon": worst.get("muon"),
            "fits": worst["gpu_total"] <= usable and build["fits"],
            "cpu_per_node": worst["cpu"] * min(gpus, gpus_per_node)}


def _build(stages: list[dict], zero_stage: int, ranks_per_node: int, host_memory: float,
           usable: float) -> dict:
    """The heaviest stage's build against the node's host memory and the usable GPU memory."""
    host = max(st["build"]["host"] for st in stages)
    device = max(st["build"]["device"] for st in stages)
    worst = max(stages, key=lambda st: st["build"]["host"])["build"]
    reason = None
    if host * ranks_per_node > host_memory:
        how = ("the partition of the model as built" if zero_stage == 3 else
               "this rank's whole shard in fp32")
        reason = (f"build needs {host * ranks_per_node / GB:.0f} GB of host memory per node "
                  f"({ranks_per_node} ranks x {host / GB:.1f} GB: {how} {worst['params'] / GB:.1f} "
                  f"+ the largest tensor drawn in fp32 {worst['draw'] / GB:.1f}) > "
                  f"{host_memory / GB:.0f} GB (--host-memory-gb)"
                  + ("" if zero_stage == 3 else "; ZeRO-3 partitions the model as it is built"))
    elif device > usable:
        reason = (f"build needs {device / GB:.1f} GB per GPU (the partitions as built + the "
                  f"largest module gathered) > usable {usable / GB:.1f} GB")
    return {"host_per_rank": host, "host_per_node": host * ranks_per_node, "device": device,
            "host_memory": host_memory, "fits": reason is None, "reason": reason}


def powersgd_elements(recipe: Recipe, layout: mm.Layout) -> dict | None:
    """Under ``parallel.grad_compression: powersgd``, what PowerSGD sends and keeps per rank, in
    elements (``model.parallel.powersgd.exchange_elements``), from this rank's gradient shapes:
    the model built at its tp x ep shard on the meta device (shapes only, no memory); else None."""
    if recipe.parallel.grad_compression != "powersgd":
        return None
    key = (repr(recipe.model), layout.tp, layout.ep, layout.sp, recipe.parallel.powersgd_rank)
    if key not in _POWERSGD:        # the planner asks again for every micro-batch and policy
        _POWERSGD[key] = _powersgd_elements(recipe, layout)
    return _POWERSGD[key]


_POWERSGD: dict[tuple, dict] = {}


def _powersgd_elements(recipe: Recipe, layout: mm.Layout) -> dict:
    import torch

    from model.parallel.groups import ParallelGroups
    from model.parallel.powersgd import exchange_elements
    from model.transformer import Transformer
    with torch.device("meta"):
        model = Transformer(recipe.model, ParallelGroups(tp=layout.tp, ep=layout.ep,
                                                         sequence_parallel=layout.sp), init_seed=None)
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    return exchange_elements(shapes, recipe.parallel.powersgd_rank)


def _compression_state(recipe: Recipe, elements: dict | None) -> float:
    """PowerSGD's fp32 state per rank (it runs at ZeRO-0 fp32 only): Q, the error feedback, and
    a second error buffer where a gradient-norm spike test can skip a step after the exchange
    (``PowerSGD.reduce(tentative=True)``)."""
    if elements is None:
        return 0.0
    train, errors = recipe.train, elements["compressed"] if recipe.parallel.powersgd_error_feedback else 0
    spare = errors if train.grad_spike_factor is not None and train.spike_action != "log" else 0
    return mm.FP32 * (elements["q_state"] + errors + spare)


def _stage(recipe: Recipe, layout: mm.Layout, ds: dict, stage: int, micro: int,
           on_gpu: bool = True, compression: dict | None = None, muon: dict | None = None) -> dict:
    cfg, zero = recipe.model, ds.get("zero_optimization") or {}
    a = mm.DTYPE_BYTES[mm.precision_of(ds)]
    params = mm.local_params(cfg, layout, stage)
    states = mm.deepspeed_model_state_bytes(params["total"], layout.dp, ds)
    states["compression"] = _compression_state(recipe, compression)
    if muon is not None:       # one whole momentum instead of two partitioned moments (planning/muon_cost.py)
        zero_stage = int(zero.get("stage", 0))
        master = mm.deepspeed_state_rules(zero_stage, mm.precision_of(ds), 1, zero)["master_copy"]
        states = apply_to_states(states, muon, params["total"], layout.dp, zero_stage, master)
    acts = mm.activation_bytes(cfg, layout, micro, recipe.seq_len, a,
                               recipe.train.activation_checkpointing, stage)
    a2a = 0.0
    if cfg.moe is not None and layout.ep > 1:   # send + receive of one MoE layer: 2 k T h
        a2a = 2 * mm.routed_rows(cfg, acts["tokens_per_rank"]) * cfg.hidden_size * a
    buffers = buffer_bytes(zero, int(zero.get("stage", 0)), a, params["total"],
                              params["largest_module"], layout.dp, a2a,
                              optimizer_temporaries(ds, on_gpu))
    if muon is not None:
        buffers["optimizer_step"] = max(buffers["optimizer_step"], transient_bytes(muon))
    during_backward = acts["total"] + buffers["reduce_bucket"] + buffers["zero3_gather"] + a2a
    model_states = states["params"] + states["grads"] + states["optimizer"] + states["compression"]
    return {"stage": stage, "params": params, "states": states, "activations": acts, "muon": muon,
            "buffers": buffers, "model_states": model_states, "cpu": states["cpu"],
            "build": build_bytes(cfg, layout, ds, stage),
            "gpu_total": model_states + max(during_backward, buffers["optimizer_step"])}


# ---------------------------------------------------------------------------------------------
# Step time and planner.

def trainer_layout(recipe: Recipe, est: dict, ds: dict, moe_imbalance: float = 1.0) -> Layout:
    """The cost model's description of this trainer running ``est``'s layout under JSON ``ds``:
    ep ranks split each micro-batch, PyTorch SDPA's flash kernel (FA2), eager elementwise ops
    unless ``train.compile`` fuses each block, the recipe's pipeline schedule without
    interleaving or overlapped sends, the ep sum of replicated gradients as ``replica_sync_mode`` schedules it,
    gradient reduction overlapped with backward when ``overlap_comm`` is on
    (ZeRO-3 prefetches regardless), gradients reduced in the JSON's ``communication_data_type``
    or the training precision, the all-to-all in ``model.moe.dispatch_dtype``; the busiest
    rank's routed rows ``moe_imbalance`` times the mean. Under PowerSGD the exchange runs after
    the last backward (not overlapped) and sends its compressed steps' elements (P, Q and the
    uncompressed vectors, ``est["powersgd"]``) per gradient element; its first
    ``powersgd_start_steps`` steps, uncompressed, and the power iteration's own matmuls and QR
    (about 4 r elements' work per compressed element) are not counted."""
    zero, powersgd = ds.get("zero_optimization") or {}, est.get("powersgd")
    comm = {"fp32": 4, "fp16": 2, "bf16": 2}.get(str(ds.get("communication_data_type", "")).lower())
    dispatch = getattr(recipe.model.moe, "dispatch_dtype", None) if recipe.model.moe else None
    return Layout(world=est["gpus"], global_batch=est["micro_batch"] * est["accumulation"] * est["dp"],
                  seq_len=est["seq_len"], micro_batch=est["micro_batch"], tp=est["tp"],
                  sp=est["sequence_parallel"], ep=est["ep"], pp=est["pp"], cp=est["cp"],
                  cp_comm=est["cp_comm"],
                  zero_stage=est["zero_stage"], recompute=est["activation_checkpointing"],
                  schedule=recipe.parallel.pipeline_schedule,
                  ep_splits_batch=True, attention="fa2", fused_elementwise=recipe.train.compile,
                  replica_sync=replica_sync_mode(ds) if est["pp"] == 1 else "micro_batch",
                  overlap_dp=(bool(zero.get("overlap_comm")) or est["zero_stage"] == 3) and not powersgd,
                  grad_exchange_scale=(powersgd["plain"] + powersgd["p"] + powersgd["q"]) / powersgd["total"]
                  if powersgd else 1.0,
                  grad_reduce_bytes=comm or mm.DTYPE_BYTES[est["precision"]],
                  dispatch_bytes={"fp8": 1, "bf16": 2}.get(dispatch, mm.DTYPE_BYTES[est["precision"]]),
                  moe_imbalance=moe_imbalance, **muon_step_terms(est))


def step_time(recipe: Recipe, est: dict, ds: dict, where: Cluster,
              moe_imbalance: float = 1.0) -> dict:
    """Predicted seconds per optimizer step of ``est``'s layout on ``where``, by the cost model
    (``planning/cost_model.py``: GEMMs at shape-dependent efficiency, attention, memory-bound
    work, recomputation, TP/SP/DP/ZeRO/EP/PP communication with the overlap DeepSpeed allows,
    the 1F1B bubble), with the MFU in both conventions (attention causal and whole)."""
    shape = Shape.from_config(recipe.model)
    layout = trainer_layout(recipe, est, ds, moe_imbalance)
    cost = step_cost(shape, layout, where).as_dict()
    peak = where.device.peak_flops
    tokens = cost["tokens_per_s_per_gpu"]
    cost["mfu"] = tokens * shape.flops_per_token(layout.seq_len) / peak
    cost["mfu_full_attn"] = tokens * shape.flops_per_token(layout.seq_len, causal=False) / peak
    cost["gemm_fraction"] = where.device.gemm_fraction
    return cost


CHECKPOINTING = ("none", "full", "attention", "moe", "experts")   # the planner's candidates


LONG_CONTEXT = 16384    # the planner also tries context parallelism from this sequence length
CP_CANDIDATES = ((2, "a2a"), (2, "allgather"), (4, "a2a"), (4, "allgather"), (8, "a2a"), (8, "allgather"))


def _layouts(recipe: Recipe, world: int, gpus_per_node: int):
    """Every layout the trainer accepts on ``world`` GPUs (``ParallelDims``), with tp inside a
    node and at most 8 pipeline stages. Sequence parallelism whenever tp > 1 can split the
    sequence: activations split by tp for one more all-gather per sub-layer in backward (counted
    by the cost model's ``tp_volumes``). From ``LONG_CONTEXT`` tokens also context parallelism
    (cp 2-8, the all-to-all or the all-gather of K/V, both on SDPA's fused kernels; not the ring,
    whose block math here is a reference that materializes each block's scores)."""
    cps = ((1, "a2a"),) + (CP_CANDIDATES if recipe.seq_len >= LONG_CONTEXT else ())
    for tp, ep, pp in itertools.product(range(1, gpus_per_node + 1), range(1, world + 1), range(1, 9)):
        sp = tp > 1 and recipe.seq_len % tp == 0
        for cp, cp_comm in cps:
            try:
                yield ParallelDims(tp, ep, pp, sp, world, recipe.model, recipe.seq_len, cp, cp_comm)
            except ValueError:
                continue


def plan(recipe: Recipe, nodes: int, gpus_per_node: int, gpu: str, precision: str = "bf16",
         global_batch: int | None = None, top: int = 10,
         host_memory_gb: float | None = None, network_gbit_s: float | None = None,
         moe_imbalance: float = 1.0, gemm_fraction: float | None = None) -> dict:
    """Enumerate layouts, keep those that fit, rank them by predicted tokens/s per GPU
    (``step_time``; the same global batch for all, so the shortest step first).

    Every candidate keeps the global batch (sequences per step; default PLAN_TOKENS / seq_len)
    and uses the stock ``ds_configs/zero{stage}[_fp32].json`` with its micro-batch and
    accumulation replaced; what the trainer would refuse (the recipe's checks, ``ParallelDims``,
    ``training.config.ds_config.check_layout``) is skipped. A layout whose build does not fit (the
    host memory per node, ``host_memory_gb``; see ``estimate``) is refused with its reason,
    once per (ZeRO stage, tp, ep, pp) in ``refused``. The cluster: ``gpu`` nodes of
    ``gpus_per_node`` with ``network_gbit_s`` per node (default one 400 Gb/s NIC per GPU).
    Returns ``{"layouts": [...best first...], "considered", "refused", ...}``.
    """
    if moe_imbalance < 1:
        raise ValueError(f"--moe-imbalance {moe_imbalance}: the busiest rank's load over the "
                         f"mean is at least 1")
    where = cluster(gpu, gpus_per_node, network_gbit_s, gemm_fraction=gemm_fraction)
    world = nodes * gpus_per_node
    global_batch = global_batch or max(1, round(PLAN_TOKENS / recipe.seq_len))
    suffix = "_fp32" if precision == "fp32" else ""
    bases = {s: load_ds_config(str(REPO / "ds_configs" / f"zero{s}{suffix}.json")) for s in range(4)}
    rows, considered, refused = [], 0, {}
    # The recipe's gradient compression goes with every candidate (refused where it cannot apply).
    compression = {f.name: getattr(recipe.parallel, f.name) for f in dataclasses.fields(ParallelConfig)
                   if f.name == "grad_compression" or f.name.startswith("powersgd_")}
    for dims in _layouts(recipe, world, gpus_per_node):
        for stage, micro, policy in itertools.product(range(4), (1, 2, 4, 8), CHECKPOINTING):
            considered += 1
            if global_batch % (micro * dims.dp):
                continue
            ds = dict(bases[stage], train_micro_batch_size_per_gpu=micro,
                      gradient_accumulation_steps=global_batch // (micro * dims.dp))
            try:
                r = dataclasses.replace(
                    recipe, parallel=ParallelConfig(
                        tensor_parallel_size=dims.tp, expert_parallel_size=dims.ep,
                        pipeline_parallel_size=dims.pp, sequence_parallel=dims.sp,
                        context_parallel_size=dims.cp, cp_comm=dims.cp_comm,
                        expert_placement=recipe.parallel.expert_placement, **compression),
                    train=dataclasses.replace(recipe.train, activation_checkpointing=policy))
                apply_grad_compression(ds, r.parallel.grad_compression, dims)
                est = estimate(r, ds, world, gpus_per_node, gpu, host_memory_gb)
            except ValueError:
                continue
            if not est["build"]["fits"]:
                refused.setdefault((stage, dims.tp, dims.ep, dims.pp), {
                    "zero_stage": stage, "tp": dims.tp, "ep": dims.ep, "pp": dims.pp,
                    "dp": dims.dp, "reason": est["build"]["reason"]})
            elif est["fits"]:
                rows.append({"zero_stage": stage, "tp": dims.tp, "ep": dims.ep, "pp": dims.pp,
                             "cp": dims.cp, "cp_comm": dims.cp_comm,
                             "dp": dims.dp, "sp": dims.sp, "micro_batch": micro,
                             "accumulation": ds["gradient_accumulation_steps"],
                             "activation_checkpointing": policy,
                             "config": f"ds_configs/zero{stage}{suffix}.json",
                             "grad_compression": r.parallel.grad_compression,
                             "gpu_total": est["worst"]["gpu_total"],
                             **step_time(r, est, ds, where, moe_imbalance)})
    rows.sort(key=lambda row: (-row["tokens_per_s_per_gpu"], row["gpu_total"]))
    return {"recipe": recipe.name, "nodes": nodes, "gpus_per_node": gpus_per_node, "gpu": gpu,
            "network_gbit_s": where.network_gbit_s, "moe_imbalance": moe_imbalance,
            "global_batch": global_batch, "considered": considered,
            "fitting": len(rows), "layouts": rows[:top], "refused": list(refused.values())}


def launch_command(row: dict, recipe_path: str, nodes: int, gpus_per_node: int,
                   config: str | None = None) -> str:
    """The ``deepspeed`` command line that runs layout ``row``."""
    sets = [f"parallel.tensor_parallel_size={row['tp']}", f"parallel.expert_parallel_size={row['ep']}",
            f"parallel.pipeline_parallel_size={row['pp']}",
            f"train.activation_checkpointing={row['activation_checkpointing']}"]
    if row.get("sp"):
        sets.append("parallel.sequence_parallel=true")
    if row.get("cp", 1) > 1:
        sets += [f"parallel.context_parallel_size={row['cp']}", f"parallel.cp_comm={row['cp_comm']}"]
    if row.get("grad_compression", "none") != "none":
        sets.append(f"parallel.grad_compression={row['grad_compression']}")
    return shlex.join(["deepspeed", "--num_nodes", str(nodes), "--num_gpus", str(gpus_per_node),
                       "launch/train.py", "--config", config or row["config"],
                       "--recipe", recipe_path, "--set", *sets])
