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
1/2/4/8 x activation checkpointing none/full/selective, skips what the trainer would refuse (the
same validators), refuses with its reason a layout whose build does not fit, keeps what fits and
ranks by a predicted step time (see
``step_time``), then prints the exact launch command of the best. Estimates, not measurements:
check the top choice with a short run (``mem_gb`` in metrics.jsonl).
"""

from __future__ import annotations

import dataclasses
import itertools
import shlex
from pathlib import Path

from model.checkpointing import CheckpointPolicy
from model.parallel.dims import ParallelDims
from planning import memory_model as mm
from planning.build_memory import build_bytes
from training.ds_config import check_layout, load_ds_config, validate_ds_config
from training.hardware import GPUS, GPUSpec, train_flops_per_token
from training.recipe_schema import ParallelConfig, Recipe

RESERVE_FRACTION = 0.10   # of GPU memory kept back: CUDA context/NCCL (~1-2 GB) + fragmentation
HOST_GB_PER_GPU = 128     # host memory per GPU the build may use by default: a DGX A100 (1 TB / 8)
ASSUMED_MFU = 0.45        # compute efficiency the planner's step time assumes
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
    temporaries as its CPU code path allocates them (``memory_model.optimizer_temporaries``),
    for checking the estimate against runs on CPU ranks.

    Raises:
        ValueError: what the trainer refuses (``Recipe.dims`` on ``gpus``,
            ``training.ds_config.check_layout``), an unknown GPU.
    """
    if gpu not in GPUS:
        raise ValueError(f"--gpu {gpu!r} is unknown: choose one of {', '.join(GPUS)}")
    spec, cfg, dims = GPUS[gpu], recipe.model, recipe.dims(gpus)
    layout = mm.Layout(gpus, dims.tp, dims.ep, dims.pp, dims.sp, gpus_per_node)
    ds = validate_ds_config(ds, dims.dp)
    check_layout(ds, dims)
    micro, acc = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
    stage, precision = int((ds.get("zero_optimization") or {}).get("stage", 0)), mm.precision_of(ds)
    stages = [_stage(recipe, layout, ds, s, micro, on_gpu) for s in sorted({0, layout.pp - 1})]
    worst = max(stages, key=lambda st: st["gpu_total"])
    usable = spec.memory_gb * GB * (1 - RESERVE_FRACTION)
    host_memory = (host_memory_gb or HOST_GB_PER_GPU * gpus_per_node) * GB
    build = _build(stages, stage, min(gpus, gpus_per_node), host_memory, usable)
    return {"units": "bytes", "recipe": recipe.name, "gpu": gpu, "gpu_memory": spec.memory_gb * GB,
            "reserve_fraction": RESERVE_FRACTION, "usable": usable, "gpus": gpus,
            "gpus_per_node": gpus_per_node, "tp": layout.tp, "ep": layout.ep, "pp": layout.pp,
            "sequence_parallel": layout.sp, "zero_dp": layout.dp, "zero_stage": stage,
            "precision": precision, "micro_batch": micro, "accumulation": acc,
            "seq_len": recipe.seq_len, "activation_checkpointing": recipe.train.activation_checkpointing,
            "params_total": cfg.num_params(), "params_active": cfg.num_params(active=True),
            "stages": stages, "worst": worst, "build": build,
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


def _stage(recipe: Recipe, layout: mm.Layout, ds: dict, stage: int, micro: int,
           on_gpu: bool = True) -> dict:
    cfg, zero = recipe.model, ds.get("zero_optimization") or {}
    a = mm.DTYPE_BYTES[mm.precision_of(ds)]
    params = mm.local_params(cfg, layout, stage)
    states = mm.deepspeed_model_state_bytes(params["total"], layout.dp, ds)
    acts = mm.activation_bytes(cfg, layout, micro, recipe.seq_len, a,
                               recipe.train.activation_checkpointing, stage)
    a2a = 0.0
    if cfg.moe is not None and layout.ep > 1:   # send + receive of one MoE layer: 2 k T h
        a2a = 2 * mm.routed_rows(cfg, acts["tokens_per_rank"]) * cfg.hidden_size * a
    buffers = mm.buffer_bytes(zero, int(zero.get("stage", 0)), a, params["total"],
                              params["largest_module"], layout.dp, a2a,
                              mm.optimizer_temporaries(ds, on_gpu))
    during_backward = acts["total"] + buffers["reduce_bucket"] + buffers["zero3_gather"] + a2a
    model_states = states["params"] + states["grads"] + states["optimizer"]
    return {"stage": stage, "params": params, "states": states, "activations": acts,
            "buffers": buffers, "model_states": model_states, "cpu": states["cpu"],
            "build": build_bytes(cfg, layout, ds, stage),
            "gpu_total": model_states + max(during_backward, buffers["optimizer_step"])}


# ---------------------------------------------------------------------------------------------
# Step time and planner.

def _bandwidth(spec: GPUSpec, group_span: int, gpus_per_node: int) -> float:
    """Bytes/s of a collective whose ranks span ``group_span`` consecutive ranks: NVLink at half
    its bidirectional figure inside a node, the per-GPU network figure across nodes."""
    inside = group_span <= gpus_per_node
    return (spec.nvlink_gb_s / 2 if inside else spec.network_gb_s) * GB


def _recompute_flops_per_token(cfg, seq_len: int, policy: str) -> float:
    """Forward FLOPs per token that backward repeats: 2 x matmul params recomputed, plus the
    causal attention forward (2 h s) for recomputed attention."""
    h, f, fe = cfg.hidden_size, cfg.ffn_hidden_size, cfg.expert_ffn_size
    attn = h * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    policy = CheckpointPolicy.parse(policy)
    whole = policy.whole_blocks(cfg.num_layers)
    total = 0.0
    for i in range(cfg.num_layers):
        moe = cfg.is_moe_layer(i)
        ffn = 3 * h * f
        if moe:
            ffn = cfg.moe.top_k * 3 * h * fe + h * cfg.moe.num_experts + cfg.shared_params
        if i in whole:
            total += 2 * (attn + ffn) + 2 * h * seq_len
        elif policy.name == "attention":
            total += 2 * attn + 2 * h * seq_len
        elif policy.name == "moe" and moe:
            total += 2 * ffn
        elif policy.name == "experts" and moe:
            total += 2 * cfg.moe.top_k * 3 * h * fe
    return total


def step_time(recipe: Recipe, est: dict, gpu: str) -> dict:
    """Predicted seconds per optimizer step; deliberately simple, no overlap assumed.

    - compute: (train_flops_per_token + recompute) x tokens / (GPUs x bf16 peak x ASSUMED_MFU),
      stretched by the 1F1B bubble: / (1 - (p-1)/(m+p-1)), m = accumulation steps;
    - DP: ZeRO-0/1 reduce once at the accumulation boundary (reduce-scatter + all-gather, 2 psi
      bytes per step); ZeRO-2 reduce-scatters on every micro-batch and all-gathers the updated
      parameters once ((m + 1) psi); ZeRO-3 3 psi per micro-batch (gathers in forward and
      backward, reduce-scatter); times (dp-1)/dp;
    - TP: 4 all-reduces of b s h per block per micro-batch (2 forward, 2 backward), 2(tp-1)/tp;
    - EP: all-to-all of 2 k T h per MoE layer per micro-batch, forward and backward, (ep-1)/ep;
      once more where backward recomputes the whole MoE layer (``full``, ``every_k``, ``moe``;
      not ``experts``, which recomputes only the expert FFNs between the exchanges);
    - EP, replicated parameters: every parameter outside the experts is summed over ep once
      per micro-batch (2 psi_other bytes, 2(ep-1)/ep): ZeRO-2/3 and pipelines; an upper bound
      for ZeRO-0/1, where the trainer sums once per step (``model/parallel/grad_sync.py``);
    with psi and the layers of one pipeline stage, at ``_bandwidth`` (the rank order is tp,
    ep, dp, pp from fastest: model/parallel/groups.py). Pipeline p2p traffic is ignored.
    """
    cfg, spec = recipe.model, GPUS[gpu]
    tp, ep, pp, dp, gpn = est["tp"], est["ep"], est["pp"], est["zero_dp"], est["gpus_per_node"]
    a = mm.DTYPE_BYTES[est["precision"]]
    m, seq = est["accumulation"], est["seq_len"]
    tokens = est["micro_batch"] * m * dp * seq
    flops = (train_flops_per_token(cfg, seq) + _recompute_flops_per_token(
        cfg, seq, est["activation_checkpointing"])) * tokens
    compute = flops / (est["gpus"] * spec.bf16_tflops * 1e12 * ASSUMED_MFU)
    bubble = (pp - 1) / (m + pp - 1)
    psi = max(st["params"]["total"] for st in est["stages"])
    volume = {3: 3 * m, 2: m + 1}.get(est["zero_stage"], 2)      # psi per step, see above
    dp_bytes = volume * psi * a * (dp - 1) / dp
    layers = mm.stage_layers(cfg, pp, 0)
    t_rank = est["micro_batch"] * seq / ep
    tp_bytes = 4 * len(layers) * m * t_rank * cfg.hidden_size * a * 2 * (tp - 1) / tp
    ep_bytes = 0.0
    if cfg.moe is not None:
        policy = CheckpointPolicy.parse(est["activation_checkpointing"])
        whole = policy.whole_blocks(cfg.num_layers)
        moe_layers = [i for i in layers if cfg.is_moe_layer(i)]
        redone = sum(i in whole or policy.name == "moe" for i in moe_layers)   # exchange recomputed
        ep_bytes = ((2 * len(moe_layers) + redone) * m * 2 * mm.routed_rows(cfg, t_rank)
                    * cfg.hidden_size * a * (ep - 1) / ep)
        other = max(st["params"]["other"] for st in est["stages"])
        ep_bytes += m * other * a * 2 * (ep - 1) / ep
    out = {"compute_s": compute / (1 - bubble), "bubble_fraction": bubble,
           "dp_comm_s": dp_bytes / _bandwidth(spec, tp * ep * dp, gpn),
           "tp_comm_s": tp_bytes / _bandwidth(spec, tp, gpn),
           "ep_comm_s": ep_bytes / _bandwidth(spec, tp * ep, gpn)}
    out["step_s"] = out["compute_s"] + out["dp_comm_s"] + out["tp_comm_s"] + out["ep_comm_s"]
    out["tokens_per_s_per_gpu"] = tokens / out["step_s"] / est["gpus"]
    return out


CHECKPOINTING = ("none", "full", "attention", "moe", "experts")   # the planner's candidates


def _layouts(recipe: Recipe, world: int, gpus_per_node: int):
    """Every layout the trainer accepts on ``world`` GPUs (``ParallelDims``), with tp inside a
    node and at most 8 pipeline stages. Sequence parallelism whenever tp > 1 can split the
    sequence: activations split by tp for one more all-gather per sub-layer in backward (not in
    ``step_time``: small)."""
    for tp, ep, pp in itertools.product(range(1, gpus_per_node + 1), range(1, world + 1), range(1, 9)):
        sp = tp > 1 and recipe.seq_len % tp == 0
        try:
            yield ParallelDims(tp, ep, pp, sp, world, recipe.model, recipe.seq_len)
        except ValueError:
            continue


def plan(recipe: Recipe, nodes: int, gpus_per_node: int, gpu: str, precision: str = "bf16",
         global_batch: int | None = None, top: int = 10,
         host_memory_gb: float | None = None) -> dict:
    """Enumerate layouts, keep those that fit, rank them by ``step_time``.

    Every candidate keeps the global batch (sequences per step; default PLAN_TOKENS / seq_len)
    and uses the stock ``ds_configs/zero{stage}[_fp32].json`` with its micro-batch and
    accumulation replaced; what the trainer would refuse (the recipe's checks, ``ParallelDims``,
    ``training.ds_config.check_layout``) is skipped. A layout whose build does not fit (the
    host memory per node, ``host_memory_gb``; see ``estimate``) is refused with its reason,
    once per (ZeRO stage, tp, ep, pp) in ``refused``. Returns ``{"layouts": [...best
    first...], "considered", "refused", ...}``.
    """
    world = nodes * gpus_per_node
    global_batch = global_batch or max(1, round(PLAN_TOKENS / recipe.seq_len))
    suffix = "_fp32" if precision == "fp32" else ""
    bases = {s: load_ds_config(str(REPO / "ds_configs" / f"zero{s}{suffix}.json")) for s in range(4)}
    rows, considered, refused = [], 0, {}
    for dims in _layouts(recipe, world, gpus_per_node):
        for stage, micro, policy in itertools.product(range(4), (1, 2, 4, 8), CHECKPOINTING):
            considered += 1
            if global_batch % (micro * dims.dp):
                continue
            ds = dict(bases[stage], train_micro_batch_size_per_gpu=micro,
                      gradient_accumulation_steps=global_batch // (micro * dims.dp))
            try:
                r = dataclasses.replace(
                    recipe, parallel=ParallelConfig(dims.tp, dims.ep, dims.pp, dims.sp,
                                                    recipe.parallel.expert_placement),
                    train=dataclasses.replace(recipe.train, activation_checkpointing=policy))
                est = estimate(r, ds, world, gpus_per_node, gpu, host_memory_gb)
            except ValueError:
                continue
            if not est["build"]["fits"]:
                refused.setdefault((stage, dims.tp, dims.ep, dims.pp), {
                    "zero_stage": stage, "tp": dims.tp, "ep": dims.ep, "pp": dims.pp,
                    "dp": dims.dp, "reason": est["build"]["reason"]})
            elif est["fits"]:
                rows.append({"zero_stage": stage, "tp": dims.tp, "ep": dims.ep, "pp": dims.pp,
                             "dp": dims.dp, "sp": dims.sp, "micro_batch": micro,
                             "accumulation": ds["gradient_accumulation_steps"],
                             "activation_checkpointing": policy,
                             "config": f"ds_configs/zero{stage}{suffix}.json",
                             "gpu_total": est["worst"]["gpu_total"], **step_time(r, est, gpu)})
    rows.sort(key=lambda row: (row["step_s"], row["gpu_total"]))
    return {"recipe": recipe.name, "nodes": nodes, "gpus_per_node": gpus_per_node, "gpu": gpu,
            "global_batch": global_batch, "assumed_mfu": ASSUMED_MFU, "considered": considered,
            "fitting": len(rows), "layouts": rows[:top], "refused": list(refused.values())}


def launch_command(row: dict, recipe_path: str, nodes: int, gpus_per_node: int,
                   config: str | None = None) -> str:
    """The ``deepspeed`` command line that runs layout ``row``."""
    sets = [f"parallel.tensor_parallel_size={row['tp']}", f"parallel.expert_parallel_size={row['ep']}",
            f"parallel.pipeline_parallel_size={row['pp']}",
            f"train.activation_checkpointing={row['activation_checkpointing']}"]
    if row.get("sp"):
        sets.append("parallel.sequence_parallel=true")
    return shlex.join(["deepspeed", "--num_nodes", str(nodes), "--num_gpus", str(gpus_per_node),
                       "launch/train.py", "--config", config or row["config"],
                       "--recipe", recipe_path, "--set", *sets])


# ---------------------------------------------------------------------------------------------
# Output.

def _gb(x: float) -> str:
    return f"{x / GB:8.2f}"


def format_estimate(est: dict) -> str:
    w = est["worst"]
    p, s, act, buf = w["params"], w["states"], w["activations"], w["buffers"]
    sp = "on" if est["sequence_parallel"] else "off"
    lines = [
        f"{est['recipe']}: {est['params_total'] / 1e9:.2f}B parameters "
        f"({est['params_active'] / 1e9:.2f}B active) on {est['gpus']} x {est['gpu']} "
        f"({est['gpus_per_node']} per node)",
        f"layout: tp {est['tp']} ep {est['ep']} pp {est['pp']} sp {sp} | ZeRO-{est['zero_stage']} over "
        f"dp {est['zero_dp']} (= gpus / (tp ep pp)) | {est['precision']}",
        f"batch: micro {est['micro_batch']} x seq {est['seq_len']} ({act['tokens_per_rank']:.0f} tokens "
        f"per rank), accumulation {est['accumulation']}, activation checkpointing "
        f"{est['activation_checkpointing']}",
        f"pipeline stage {w['stage']} (the heaviest): {p['total'] / 1e9:.3f}B params per rank "
        f"({p['expert'] / 1e9:.3f}B expert, {p['other'] / 1e9:.3f}B other)",
        "", "per GPU                                       GB"]
    rows = [("parameters", s["params"]), ("gradients", s["grads"]),
            ("optimizer states", s["optimizer"]),
            (f"activations ({act['in_flight_micro_batches']} micro-batch(es) in flight)", act["total"]),
            ("  blocks kept for backward", act["blocks"]),
            ("  recompute of one block/sub-layer", act["recompute"]),
            ("  final norm, fp32 logits, token ids", act["head"]),
            ("  returned logits + their fp32 grad", act["logits_transient"]),
            ("buffers: reduce bucket(s)", buf["reduce_bucket"]),
            ("buffers: ZeRO-3 gathered params", buf["zero3_gather"]),
            ("buffers: all-to-all", buf["all_to_all"]),
            ("buffers: optimizer step (no activations)", buf["optimizer_step"]),
            ("total", w["gpu_total"])]
    lines += [f"  {name:<44}{_gb(v)}" for name, v in rows]
    per_block = ", ".join(f"{k} {v / GB:.3f}" for k, v in act["per_block"].items())
    lines.append(f"  one block, one micro-batch, no checkpointing: {per_block}")
    lines.append(f"  usable: {est['gpu_memory'] / GB:.0f} GB - {est['reserve_fraction']:.0%} reserve "
                 f"(CUDA context, NCCL, fragmentation) = {est['usable'] / GB:.1f} GB -> "
                 f"{'fits' if est['fits'] else 'DOES NOT FIT'}")
    if len(est["stages"]) > 1:
        lines.append("  totals per stage: " + ", ".join(
            f"stage {st['stage']} {st['gpu_total'] / GB:.2f}" for st in est["stages"]))
    if w["cpu"]:
        lines.append(f"  CPU (offload): {w['cpu'] / GB:.2f} GB per rank, "
                     f"{est['cpu_per_node'] / GB:.1f} GB per node")
    b = est["build"]
    lines.append(f"  build (before deepspeed.initialize): {b['host_per_rank'] / GB:.2f} GB host per "
                 f"rank ({b['host_per_node'] / GB:.0f} of {b['host_memory'] / GB:.0f} GB per node), "
                 f"{b['device'] / GB:.2f} GB per GPU -> "
                 + ("fits" if b["fits"] else f"DOES NOT FIT: {b['reason']}"))
    return "\n".join(lines)


def format_plan(result: dict, command: str, note: str) -> str:
    lines = [f"{result['recipe']} on {result['nodes']} x {result['gpus_per_node']} {result['gpu']}: "
             f"{result['fitting']} of {result['considered']} layouts fit; global batch "
             f"{result['global_batch']} sequences; step time at MFU {result['assumed_mfu']} + "
             f"communication (no overlap)", "",
             " # ZeRO tp sp ep pp  dp micro  acc ckpt       mem GB  step s  comp  dp-comm tp-comm ep-comm"
             " tok/s/GPU"]
    for i, r in enumerate(result["layouts"], 1):
        lines.append(f"{i:2d} {r['zero_stage']:4d} {r['tp']:2d} {'on' if r['sp'] else '--'} {r['ep']:2d} {r['pp']:2d} {r['dp']:3d}"
                     f" {r['micro_batch']:5d} {r['accumulation']:4d} {r['activation_checkpointing']:<9}"
                     f" {r['gpu_total'] / GB:7.1f} {r['step_s']:7.2f} {r['compute_s']:5.2f}"
                     f" {r['dp_comm_s']:7.2f} {r['tp_comm_s']:7.2f} {r['ep_comm_s']:7.2f}"
                     f" {r['tokens_per_s_per_gpu']:9.0f}")
    refused = result.get("refused") or []
    if refused:
        r = refused[0]
        lines.append(f"refused: {len(refused)} (ZeRO stage, tp, ep, pp) whose build does not fit, "
                     f"e.g. ZeRO-{r['zero_stage']} tp {r['tp']} ep {r['ep']} pp {r['pp']}: {r['reason']}")
    if not result["layouts"]:
        return "\n".join(lines + ["no layout fits: add GPUs, or offload (ds_configs/zero3_offload.json)"])
    return "\n".join(lines + ["", "best:", command] + ([note] if note else []))
