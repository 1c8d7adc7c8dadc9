"""Per-GPU memory of one training step: model states under ZeRO, activations, buffers.

Pure functions of the model config, the parallel layout and the DeepSpeed JSON, used by
``planning/estimator.py`` and checked by ``tests/planning/test_estimate_memory.py`` against the
ZeRO paper's closed forms, the tensors DeepSpeed 0.19.8 actually holds per rank, and the tensors
autograd saves in ``model.Transformer``. All figures are bytes (the CLI prints GB = 1e9 bytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from model.checkpointing import CheckpointPolicy
from model.config import TransformerConfig
from model.parallel.dims import ParallelDims
from planning.attention_memory import (cp_attention_extra, gqa_activation_bytes, mla_activation_bytes,
                                       mla_local_params)

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
FP32, INT64 = 4, 8
# DeepSpeed 0.19.8 defaults (deepspeed/runtime/zero/config.py) for keys a JSON leaves out.
ZERO_DEFAULTS = {"reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8,
                 "stage3_prefetch_bucket_size": 5e7, "stage3_max_live_parameters": 1e9,
                 "sub_group_size": 1e9, "contiguous_gradients": True}


def zero_shard_group_size(world: int, tp: int, ep: int, pp: int) -> int:
    """The data-parallel size ZeRO shards and reduces over.

    This repo folds expert parallelism into DeepSpeed's model-parallel group
    (``model/parallel/groups.py``; docs/zero-and-fsdp.md says why): ZeRO's
    data-parallel group is ``world / (tp * ep * pp)`` for ALL parameters, expert and non-expert
    alike; non-expert parameters are replicated over the ep ranks, and those ranks split each
    micro-batch among themselves. (DeepSpeed's own MoE would instead shard non-expert parameters
    over ``world / (tp * pp)`` and experts over ``world / (tp * ep * pp)``.) Context parallelism
    is folded into DeepSpeed's data-parallel group (Megatron's dp x cp), so cp ranks count here:
    ZeRO shards over dp x cp = ``world / (tp * ep * pp)`` whatever cp is. Change it here only.
    Raises ``ParallelDims``'s ValueError when the degrees do not divide ``world``.
    """
    return ParallelDims(tp, ep, pp, world_size=world).dp


@dataclass(frozen=True)
class Layout:
    """Where one rank sits: world size, parallel degrees, node size, pipeline schedule."""
    world: int
    tp: int = 1
    ep: int = 1
    pp: int = 1
    sp: bool = False            # sequence parallelism: norms' activations split by tp
    gpus_per_node: int = 8
    schedule: str = "1f1b"      # parallel.pipeline_schedule: 1f1b | gpipe | zb-h1
    micro_batches: int = 1      # per optimizer step (gradient accumulation): GPipe holds them all
    cp: int = 1                 # context parallelism: each rank holds S/cp tokens of a sequence
    cp_comm: str = "a2a"        # parallel.cp_comm: a2a | allgather | p2p

    @property
    def dp(self) -> int:     # ZeRO's group: data x context parallel ranks
        return zero_shard_group_size(self.world, self.tp, self.ep, self.pp)


# ---------------------------------------------------------------------------------------------
# Model states.

def model_state_bytes(psi: float, dp: int, stage: int, precision: str = "bf16",
                      offload_optimizer: bool = False, offload_params: bool = False,
                      master_copy: bool | None = None, grads_partitioned: bool | None = None) -> dict:
    """Per-rank bytes of parameters, gradients and Adam states for ``psi`` parameters.

    ZeRO paper (arXiv:1910.02054, section 3): mixed precision keeps 2 psi of 16-bit parameters,
    2 psi of 16-bit gradients and K psi = 12 psi of optimizer states (fp32 master 4 + momentum 4
    + variance 4); plain fp32 keeps 4 + 4 and K = 8 (no master copy). Over dp ranks,
    stage 0: (2+2+K) psi; 1: 4 psi + K psi/dp; 2: 2 psi + (2+K) psi/dp; 3: (2+2+K) psi/dp.

    Args:
        master_copy: keep a 4-byte fp32 master copy (default: only in mixed precision).
        grads_partitioned: gradients held as a 1/dp partition (default: stage >= 2).
        offload_optimizer: optimizer states move to CPU memory, with the fp32 gradient
            partition DeepSpeed's CPU Adam steps on (4 psi/dp) when gradients are partitioned.
        offload_params: the ZeRO-3 parameter partitions move to CPU memory too.

    Returns:
        ``{"params", "grads", "optimizer", "cpu"}`` in bytes; ``cpu`` is this rank's CPU share.
    """
    p = DTYPE_BYTES[precision]
    master = (p < FP32) if master_copy is None else master_copy
    k = 8 + (FP32 if master else 0)
    part_grads = stage >= 2 if grads_partitioned is None else grads_partitioned
    out = {"params": p * psi / (dp if stage >= 3 else 1),
           "grads": p * psi / (dp if part_grads else 1),
           "optimizer": k * psi / (dp if stage >= 1 else 1), "cpu": 0.0}
    if offload_optimizer:
        out["cpu"] += out.pop("optimizer") + (FP32 * psi / dp if part_grads else 0.0)
        out["optimizer"] = 0.0
        if part_grads:
            out["grads"] = 0.0
    if offload_params:
        out["cpu"] += out["params"]
        out["params"] = 0.0
    return out


def deepspeed_state_rules(stage: int, precision: str, accumulation: int, zero: dict) -> dict:
    """What DeepSpeed 0.19.8 keeps beyond the paper's accounting (measured by the tests).

    - An fp32 master partition exists at every ZeRO stage >= 1 even for fp32 parameters:
      ``stage_1_and_2.py:560`` clones the partition whatever its dtype, and ``stage3.py:1163``'s
      no-copy branch compares a ``torch.device`` with a ``str``, so it never runs. Stage 0 with
      fp32 hands the model's parameters to the torch optimizer (K = 8).
    - ZeRO-1 reduces gradients bucket by bucket during backward at the accumulation boundary
      (hooks of ``stage_1_and_2.py:713``, ``:2293``): at ``gradient_accumulation_steps`` 1 a rank
      holds at most its gradient partition and a bucket; with more, the full 16-bit gradients
      between micro-batches (as in the paper).
    """
    hooks = zero.get("contiguous_gradients", True) or zero.get("overlap_comm", stage == 3)
    return {"master_copy": True if stage >= 1 else precision != "fp32",
            "grads_partitioned": stage >= 2 or (stage == 1 and accumulation == 1 and bool(hooks))}


def deepspeed_model_state_bytes(psi: float, dp: int, ds: dict) -> dict[str, float]:
    """``model_state_bytes`` with the stage, precision, offload and DeepSpeed rules of a JSON."""
    zero = ds.get("zero_optimization") or {}
    stage, precision = int(zero.get("stage", 0)), precision_of(ds)
    rules = deepspeed_state_rules(stage, precision, int(ds.get("gradient_accumulation_steps", 1)), zero)
    return model_state_bytes(psi, dp, stage, precision, _offloaded(zero, "offload_optimizer"),
                             _offloaded(zero, "offload_param"), **rules)


def precision_of(ds: dict) -> str:
    """"bf16", "fp16" or "fp32" from a DeepSpeed JSON."""
    if (ds.get("bf16") or ds.get("bfloat16") or {}).get("enabled"):
        return "bf16"
    return "fp16" if (ds.get("fp16") or {}).get("enabled") else "fp32"


def _offloaded(zero: dict, key: str) -> bool:
    return (zero.get(key) or {}).get("device", "none") not in ("none", None)


# ---------------------------------------------------------------------------------------------
# Parameters per rank.

def stage_layers(cfg: TransformerConfig, pp: int, stage: int) -> range:
    """Blocks of pipeline stage ``stage`` (contiguous, the first stages take any remainder)."""
    base, extra = divmod(cfg.num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def local_params(cfg: TransformerConfig, layout: Layout, stage: int = 0) -> dict[str, int]:
    """Parameters one rank of pipeline stage ``stage`` holds before ZeRO partitioning.

    TP shards query heads, kv heads (all kv heads on each rank when fewer than tp) with their
    biases, MLP, expert and shared-expert inner sizes, and the vocabulary; norms (q/k norms too),
    the router and the shared experts' gate are replicated. EP splits the routed experts. Stage 0
    holds the embedding; the last stage the final norm and the output head (a tied head is a
    second copy there when pp > 1). ``largest_module``: the most parameters one module owns
    directly (what ZeRO-3 gathers at once)."""
    h, hd, f, fe, tp = cfg.hidden_size, cfg.head_dim, cfg.ffn_hidden_size, cfg.expert_ffn_size, layout.tp
    kv_local = cfg.num_kv_heads // tp if cfg.num_kv_heads >= tp else cfg.num_kv_heads
    q = h * (cfg.num_heads // tp) * hd
    attn = (2 * q + 2 * h * kv_local * hd + 2 * h                     # q, o, k, v, two norms
            + (cfg.num_heads // tp + 2 * kv_local) * hd * cfg.qkv_bias + 2 * hd * cfg.qk_norm)
    if cfg.mla:   # heads split over tp; down-projections and latent norms replicated
        attn, q = mla_local_params(cfg, tp)
    vocab = math.ceil(cfg.vocab_size / tp) * h
    expert = other = 0
    largest = q
    last = stage == layout.pp - 1
    mtp = range(cfg.num_layers, cfg.num_layers + cfg.mtp_depth) if last else range(0)
    for i in [*stage_layers(cfg, layout.pp, stage), *mtp]:     # MTP's blocks: the last stage's
        other += attn
        if cfg.is_moe_layer(i):
            experts = cfg.moe.num_experts // layout.ep * 3 * h * (fe // tp)
            shared = h * (cfg.moe.shared_ffn_size(fe) // tp)           # one shared projection
            expert += experts
            other += cfg.moe.num_experts * h + 3 * shared + (h if cfg.moe.shared_expert_gate else 0)
            largest = max(largest, experts, shared)
        else:
            other += 3 * h * (f // tp)
            largest = max(largest, h * (f // tp))
    if stage == 0:
        other += vocab
    if last:      # the final norm, the head, and each MTP depth's norms and (H, 2H) projection
        other += h + (vocab if not cfg.tie_embeddings or layout.pp > 1 else 0) + len(mtp) * (2 * h * h + 3 * h)
        if mtp and layout.pp > 1 and not cfg.tie_embeddings:
            other += vocab     # the embedding's copy for the tokens ahead (training/engine/pipeline.py)
    if stage == 0 or last:
        largest = max(largest, vocab)
    return {"expert": expert, "other": other, "total": expert + other, "largest_module": largest}


# ---------------------------------------------------------------------------------------------
# Activations: what autograd saves, tensor by tensor, as model/transformer.py and model/moe/* run.

def norm_bytes(h: int, a: int, tp: int = 1, sp: bool = False, moe_input: bool = False) -> float:
    """One RMSNorm per token: its fp32 input ``x.float()`` (4h; in fp32 the residual itself),
    rsqrt (4), the normalized ``x`` that ``weight *`` saves (a h), and the product, the input
    the next matmuls save (a h). Under sequence parallelism all of it is this rank's 1/tp of
    the tokens (column-parallel layers store the shard of their input and gather it again in
    backward). Before an MoE layer the product is saved only by an fp32 router (a bf16 router
    keeps its own fp32 copy, counted with the router), and under sequence parallelism that is
    the gathered product, a h for every token."""
    split = tp if sp else 1
    own = (FP32 * h + a * h + FP32) / split
    if not moe_input:
        return own + a * h / split
    return own + (a * h if a == FP32 else 0)


def routed_rows(cfg: TransformerConfig, tokens: float) -> float:
    """Rows the experts process for ``tokens`` tokens: k T dropless; with a capacity the
    grouped GEMM is not padded, so at most min(k T, E * capacity)."""
    moe = cfg.moe
    rows = moe.top_k * tokens
    cap = moe.capacity(max(1, int(tokens)), training=True)
    return rows if cap is None else min(rows, moe.num_experts * cap)


def block_activations(cfg: TransformerConfig, layer: int, tokens: float, a: int, tp: int = 1,
                      sp: bool = False, cp: int = 1, cp_comm: str = "a2a") -> dict[str, float]:
    """Bytes one block saves for backward, for ``tokens`` tokens on this rank.

    Per token (checked tensor by tensor against ``saved_tensors_hooks`` in the tests):
    - ``norm1``, ``norm2``: see ``norm_bytes``.
    - ``attention``: ``planning/attention_memory.py`` (grouped-query or MLA, and what context
      parallelism's exchange adds: ``cp_attention_extra``; ``tokens`` are then the rank's S/cp).
    - ``mlp``: gate output (silu's input), silu output, up output, their product: 4 a F/tp.
    - MoE (fp32 router): ``router`` = input copy (4h, unless the model is fp32), logits and
      probabilities (4E each), top-k indices (8k), top-k weights and their sum (4k + 4), the
      z-loss logsumexp (4); per routed row (``routed_rows``): ``dispatch`` = token and slot
      indices (16) and the permuted row (a h); ``experts`` = gate, silu, up, product (4 a F/tp);
      ``combine`` = expert output (a h), combine weight (a), weighted output kept by
      ``index_add_`` (a h); ``shared`` (shared experts) = as ``mlp`` (4 a F_s/tp), their input
      unless an fp32 router already keeps it (a h), with a gate its output and value (a h + a).
    TP shards heads and inner sizes; sequence parallelism splits the norms (``norm_bytes``) but
    not the router or the dispatched rows: every tp rank routes the gathered tokens.
    """
    h, f, fe = cfg.hidden_size, cfg.ffn_hidden_size, cfg.expert_ffn_size
    if cfg.mla:
        attention = mla_activation_bytes(cfg, a, cfg.num_heads / tp, tp, sp)
    else:
        attention = gqa_activation_bytes(cfg, a, tp, lambda d: norm_bytes(d, a) - a * d)  # not the product
    attention += cp_attention_extra(cfg, a, tp, cp, cp_comm)
    out = {"norm1": tokens * norm_bytes(h, a, tp, sp),
           "norm2": tokens * norm_bytes(h, a, tp, sp, moe_input=cfg.is_moe_layer(layer)),
           "attention": tokens * attention}
    if not cfg.is_moe_layer(layer):
        out["mlp"] = tokens * 4 * a * f / tp
        return out
    moe, rows = cfg.moe, routed_rows(cfg, tokens)
    e, k = moe.num_experts, moe.top_k
    out["router"] = (tokens * ((FP32 * h if a != FP32 else 0) + 2 * FP32 * e + INT64 * k
                               + FP32 * k + 2 * FP32) + (FP32 * e * h if a != FP32 else 0))
    out["dispatch"] = rows * (2 * INT64 + a * h)
    out["experts"] = rows * 4 * a * fe / tp
    out["combine"] = rows * (2 * a * h + a)
    fs = moe.shared_ffn_size(fe)
    if fs:
        out["shared"] = tokens * (4 * a * fs / tp + (a * h if a != FP32 else 0)
                                  + ((a * h + a) if moe.shared_expert_gate else 0))
    return out


def head_activations(cfg: TransformerConfig, tokens: float, a: int, tp: int = 1,
                     sp: bool = False) -> dict[str, float]:
    """Final norm, the output head's fp32 softmax kept by the cross-entropy (4 V/tp per token,
    vocab-parallel under TP), and the token ids and labels (8 + 8)."""
    return {"final_norm": tokens * norm_bytes(cfg.hidden_size, a, tp, sp),
            "logits_fp32": tokens * FP32 * math.ceil(cfg.vocab_size / tp),
            "token_ids": tokens * 2 * INT64}


def mtp_extra_bytes(cfg: TransformerConfig, tokens: float, a: int, tp: int = 1, sp: bool = False) -> float:
    """One MTP depth's saved bytes besides its block (``model/mtp.py``): the two input norms (the
    hidden state's fp32 input is the final norm's own in fp32), the (2H) input of ``eh_proj``, and
    a head as the model's (``head_activations``: the shifted ids and the depth's targets)."""
    h, split = cfg.hidden_size, tp if sp else 1
    norms = 2 * (FP32 * h + a * h + FP32) - (FP32 * h if a == FP32 else 0)
    return tokens * (norms + 2 * a * h) / split + sum(head_activations(cfg, tokens, a, tp, sp).values())


def logits_transient(cfg: TransformerConfig, tokens: float, a: int, tp: int = 1) -> float:
    """Not saved by autograd, but alive at the loss: the logits the model returns (a V/tp per
    token, held by ``TransformerOutput``) and their fp32 gradient in backward (4 V/tp)."""
    return tokens * (a + FP32) * math.ceil(cfg.vocab_size / tp)


def activation_bytes(cfg: TransformerConfig, layout: Layout, micro_batch: int, seq_len: int,
                     a: int, policy: str = "none", stage: int = 0) -> dict:
    """Activation bytes on one rank of pipeline stage ``stage`` at the peak of a step: a rank
    sees ``micro_batch * seq_len / (ep cp)`` tokens (ep ranks split a micro-batch, cp ranks each
    sequence) and holds the micro-batches in flight of ``layout.schedule`` (below). Checkpointed
    blocks keep their input; backward recomputes one block (or sub-layer) at a time
    (``recompute``). ``saved``: what autograd holds after a forward; ``total`` adds recompute and logits."""
    tp, sp, cp, cp_comm = layout.tp, layout.sp, layout.cp, layout.cp_comm
    tokens = micro_batch * seq_len / layout.ep / cp
    policy = CheckpointPolicy.parse(policy)
    whole = policy.whole_blocks(cfg.num_layers)
    block_input = tokens * a * cfg.hidden_size / (tp if sp else 1)
    stored = recompute = 0.0
    layers = stage_layers(cfg, layout.pp, stage)
    last = stage == layout.pp - 1
    mtp = range(cfg.num_layers, cfg.num_layers + cfg.mtp_depth) if last else range(0)
    by_kind = {}                                                       # MoE or dense block
    for i in [*layers, *mtp]:                                          # MTP's blocks as any other
        kind = cfg.is_moe_layer(i)
        blk = by_kind.get(kind) or by_kind.setdefault(
            kind, block_activations(cfg, i, tokens, a, tp, sp, cp, cp_comm))
        full = sum(blk.values())
        if i in whole:
            redo = full
        elif policy.name == "attention":
            redo = blk["norm1"] + blk["attention"]
        elif policy.name == "moe" and "router" in blk:
            redo = full - blk["norm1"] - blk["attention"]       # norm2, router ... combine, shared
        elif policy.name == "experts" and "router" in blk:
            redo = blk["experts"]
        else:
            redo = 0.0
        # A checkpointed block or sub-layer stores its input; the experts' input is the
        # dispatched rows, which the dispatch already keeps.
        stored += full - redo + (block_input if redo and policy.name != "experts" else 0.0)
        recompute = max(recompute, redo)
    # Micro-batches held (training/engine/pipe_schedules.py): 1F1B pp - stage, GPipe all m; ZB-H1
    # also W's inputs of `stage` more on stages > 0, priced whole (an upper bound, ~0.8 measured)
    in_flight = (layout.micro_batches if layout.schedule == "gpipe" and layout.pp > 1 else
                 layout.pp if layout.schedule == "zb-h1" and stage > 0 else layout.pp - stage)
    out = {"tokens_per_rank": tokens, "in_flight_micro_batches": in_flight,
           "per_block": block_activations(cfg, layers[0], tokens, a, tp, sp, cp, cp_comm),
           "blocks": stored * in_flight, "recompute": recompute, "head": 0.0, "logits_transient": 0.0}
    if stage == 0:
        out["head"] += in_flight * tokens * INT64                      # the embedding's token ids
    if last:                                                           # labels, not the ids again
        out["head"] += sum(head_activations(cfg, tokens, a, tp, sp).values()) - tokens * INT64
        out["logits_transient"] = logits_transient(cfg, tokens, a, tp)
        out["head"] += len(mtp) * mtp_extra_bytes(cfg, tokens, a, tp, sp)
    out["saved"] = out["blocks"] + out["head"]
    out["total"] = out["saved"] + out["recompute"] + out["logits_transient"]
    return out
