"""Compute of one layer and one micro-batch on one rank: GEMMs by shape, attention by kernel,
memory-bound work fused or eager, and what recomputation repeats (``planning/cost_model.py`` puts
the step together; the constants' sources are in docs/planning.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from planning.cost_layout import ACT_BYTES, Layout, Recompute, Shape
from planning.hardware import TILE_M, TILE_N, Device

BACKWARD_GEMMS = 2           # a GEMM's backward is two GEMMs of its size: input grad, weight grad
# Flash attention's backward is counted as 2.5x the forward's FLOPs (it recomputes QK^T): the
# count of the FlashAttention papers' benchmarks, whose TFLOP/s the device fractions are.
ATTENTION_BWD_FLOPS = 2.5
# Memory-bound elementwise work per token and layer, in activation-sized reads + writes, counted
# op by op below (``elementwise_bytes``). Eager PyTorch runs each op as its own kernel and
# materializes every intermediate. Counted on model/transformer.py's ops, bytes per element,
# eager vs fused: RMSNorm in fp32 (upcast, pow, mean, scale, downcast, weight) 36 vs 4; rotary
# (two products, a negation, a concatenation, a sum) 20 vs 4; SwiGLU 10 vs 6; residual adds 6 vs
# 6. At Llama-3.1-8B's widths that is 3.1x the fused bytes per layer: EAGER_FACTOR.
EAGER_FACTOR = 3.0
BACKWARD_ELEMENTWISE = 2.0   # backward of an elementwise op reads its saved input and the grad
# Cross-entropy over the logits, bytes per logit: fused (bf16 logits written, read once by the
# fused loss, its bf16 grad written): 6; eager fp32 (upcast, log-softmax, gather, and the same
# backward): 28.
CE_BYTES_FUSED, CE_BYTES_EAGER = 6, 28
# A GEMM tile's fixed cost (pipeline fill, epilogue) in units of reduction length. DeepSeek's
# DeepGEMM table (FP8 on H800, M = 4096; README at a6d97a1) falls from 1358 TFLOP/s at K = 16384
# to 1025 at K = 2048 and 590 at K = 512: k / (k + 800) reproduces it within 5%. A bf16 tile
# spends twice as long per k on the tensor cores as an FP8 one for the same fixed cost: 400.
K_OVERHEAD = 400.0
MAMF_K = 13312.0             # k of H100's maximum-achievable-matmul shape (2048 x 2048 x 13312)
# Clock a GPU sustains at its power limit over a training run, as a share of the boost clock the
# short maximum-achievable-matmul runs see: NVIDIA rates A100's HPL peak at the 1305 MHz it
# sustains at its power limit, not its 1410 MHz boost (glennklockwood.com/garden/peak-FLOPS).
SUSTAINED_CLOCK = 1305 / 1410



def gemm_seconds(m: float, n: float, k: float, device: Device, groups: int = 1) -> float:
    """One (grouped) GEMM, ``groups`` problems of [m, k] x [k, n], on ``device``.

    Time is the larger of its FLOPs at the device's large-GEMM rate, scaled by tile and wave
    quantization and by the reduction length, and its operands' bytes at HBM bandwidth (small
    GEMMs are memory-bound). The output is cut into TILE_M x TILE_N tiles, one per SM per wave;
    when there are fewer tiles than SMs the reduction is split (split-K) over up to the idle
    SMs, 1,024 of k per split. Each tile pays a fixed prologue and epilogue worth K_OVERHEAD of
    reduction length (``k_efficiency``).
    """
    m, n, k = max(m, 0.0), max(n, 0.0), max(k, 0.0)
    if m == 0 or n == 0 or k == 0:
        return 0.0
    tiles = groups * math.ceil(m / TILE_M) * math.ceil(n / TILE_N)
    splits = max(1, min(device.sms // tiles, int(k // 1024))) if tiles < device.sms else 1
    waves = math.ceil(tiles * splits / device.sms)
    quantization = groups * m * n * splits / (waves * device.sms * TILE_M * TILE_N)
    rate = device.peak_flops * device.gemm_fraction * SUSTAINED_CLOCK * k_efficiency(k / splits)
    compute = 2.0 * groups * m * n * k / (rate * min(1.0, quantization))
    memory = ACT_BYTES * groups * (m * k + k * n + m * n) / device.hbm_bytes_s
    return max(compute, memory)


def k_efficiency(k: float) -> float:
    """A GEMM tile's useful share at reduction length k, relative to the maximum-achievable
    shape's (k = MAMF_K): k / (k + K_OVERHEAD), normalized there."""
    return (k / (k + K_OVERHEAD)) / (MAMF_K / (MAMF_K + K_OVERHEAD))


def gemm_fwd_bwd(m: float, n: float, k: float, device: Device, groups: int = 1) -> tuple[float, float]:
    """(forward, backward) seconds: backward is the input grad [m, n] x [n, k] and the weight
    grad [k, m] x [m, n] (whose output is k x n, the reduction over m)."""
    fwd = gemm_seconds(m, n, k, device, groups)
    bwd = gemm_seconds(m, k, n, device, groups) + gemm_seconds(k, n, m, device, groups)
    return fwd, bwd


def attention_flops(shape: Shape, layout: Layout) -> float:
    """Causal attention forward FLOPs of one micro-batch on one rank: QK^T and PV, 4 s^2 d per
    head and sequence, halved by the mask; heads split by tp, the sequence by cp."""
    seqs = layout.micro_batch / (layout.ep if layout.ep_splits_batch else 1)
    return 4.0 * seqs * layout.seq_len ** 2 * shape.head_dim * shape.heads / layout.tp / 2 / layout.cp


def attention_seconds(shape: Shape, layout: Layout, device: Device) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core: the device's fractions for the
    layout's kernel (FA2's where the device has no other, e.g. FA3 on an A100)."""
    fwd, bwd = device.attention.get(layout.attention, device.attention["fa2"])
    f = attention_flops(shape, layout)
    peak = device.peak_flops * SUSTAINED_CLOCK
    return f / (peak * fwd), ATTENTION_BWD_FLOPS * f / (peak * bwd)


def routed_rows(shape: Shape, layout: Layout) -> float:
    """Rows the busiest rank's local experts compute per MoE layer and micro-batch: each of the
    T tokens entering the layer on a rank goes to k experts (T / tp of them under Megatron's
    sequence parallelism with experts not split by tp), spread over ep ranks, times imbalance."""
    t = layout.tokens / (layout.tp if layout.sp and layout.expert_tp == 1 and layout.tp > 1 else 1)
    return t * shape.top_k * layout.moe_imbalance


def elementwise_bytes(shape: Shape, layout: Layout, moe: bool) -> float:
    """Forward bytes of one layer's memory-bound ops on one rank: two norms and two residual
    adds on the (sequence-parallel) hidden states, rotary on q and k, the gated activation, and
    for MoE the permutation to and from expert order; the fused count, times EAGER_FACTOR for
    what runs unfused."""
    a, h, t = ACT_BYTES, shape.hidden, layout.tokens
    eager = 1.0 if layout.fused_elementwise else EAGER_FACTOR
    fused_permute = layout.fused_elementwise if layout.fused_permute is None else layout.fused_permute
    t_seq = t / layout.tp if layout.sp else t
    qk = (shape.heads + shape.kv_heads) * shape.head_dim / layout.tp
    total = t_seq * h * a * (2 + 2 + 3 + 3)              # norm r+w twice, residual 2r+w twice
    total += t * qk * a * 2                              # rotary r+w
    up = 3 if shape.gated else 2                         # activation: r 2f w f, or r f w f
    if moe:
        rows = routed_rows(shape, layout)
        total += rows * up * shape.expert_ffn / layout.expert_tp * a
        if shape.shared_ffn:
            total += t * up * shape.shared_ffn / layout.tp * a
        permute = rows * h * a * 2 + rows * h * a + t * h * a      # permute r+w, combine r, w
        return total * eager + permute * (1.0 if fused_permute else EAGER_FACTOR)
    total += t * up * shape.ffn / layout.tp * a
    return total * eager


@dataclass
class Phases:
    """Seconds of one piece of work: forward, backward, and the forward that recompute repeats."""

    fwd: float = 0.0
    bwd: float = 0.0
    recompute: float = 0.0

    def add(self, fwd: float, bwd: float, recompute: bool = False) -> None:
        self.fwd += fwd
        self.bwd += bwd
        if recompute:
            self.recompute += fwd

    @property
    def total(self) -> float:
        return self.fwd + self.bwd + self.recompute


def _attention_core(shape: Shape, layout: Layout, device: Device) -> tuple[float, float]:
    """(forward, backward) of the attention core: a flash kernel at its fractions, or
    ``unfused``: the scores materialized (two batched GEMMs each way, the whole s x s computed)
    and a fused softmax reading and writing them (bf16: 4 bytes forward, 6 backward)."""
    if layout.attention != "unfused":
        return attention_seconds(shape, layout, device)
    seqs = layout.micro_batch / (layout.ep if layout.ep_splits_batch else 1)
    groups, s, d = max(1, round(seqs * shape.heads / layout.tp)), layout.seq_len, shape.head_dim
    q = s / layout.cp
    qk = gemm_fwd_bwd(q, s, d, device, groups)
    pv = gemm_fwd_bwd(q, d, s, device, groups)
    scores = groups * q * s * ACT_BYTES / device.hbm_bytes_s
    return qk[0] + pv[0] + 2 * scores, qk[1] + pv[1] + 3 * scores


def layer_compute(shape: Shape, layout: Layout, device: Device, layer: int) -> dict[str, Phases]:
    """Compute of one layer, one micro-batch, one rank: {"gemm", "attention", "elementwise"}."""
    h, t, tp = shape.hidden, layout.tokens, layout.tp
    rc = Recompute.parse(layout.recompute, shape.layers)
    again = layer in rc.whole
    moe = shape.is_moe(layer)
    gemm, attn, elem = Phases(), Phases(), Phases()
    q = (shape.heads + 2 * shape.kv_heads) * shape.head_dim / tp
    for m, n, k in ((t, q, h), (t, h, shape.heads * shape.head_dim / tp)):   # qkv, o
        gemm.add(*gemm_fwd_bwd(m, n, k, device), again or rc.attention)
    attn.add(*_attention_core(shape, layout, device), again or rc.core or rc.attention)
    up = 2 if shape.gated else 1
    if moe:
        rows, etp = routed_rows(shape, layout), layout.expert_tp
        local = max(1, shape.experts // layout.ep)
        gemm.add(*gemm_fwd_bwd(t, shape.experts, h, device), again or rc.moe)         # router
        for m, n, k in ((rows / local, up * shape.expert_ffn / etp, h),
                        (rows / local, h, shape.expert_ffn / etp)):
            gemm.add(*gemm_fwd_bwd(m, n, k, device, groups=local), again or rc.moe or rc.experts)
        if shape.shared_ffn:
            for m, n, k in ((t, up * shape.shared_ffn / tp, h), (t, h, shape.shared_ffn / tp)):
                gemm.add(*gemm_fwd_bwd(m, n, k, device), again or rc.moe)
    else:
        for m, n, k in ((t, up * shape.ffn / tp, h), (t, h, shape.ffn / tp)):
            gemm.add(*gemm_fwd_bwd(m, n, k, device), again)
    if rc.gemm_share and not again:
        gemm.recompute += rc.gemm_share * gemm.fwd
    e = elementwise_bytes(shape, layout, moe) / device.hbm_bytes_s
    elem.add(e, BACKWARD_ELEMENTWISE * e, again or rc.elementwise or (moe and rc.moe))
    return {"gemm": gemm, "attention": attn, "elementwise": elem}


def attention_gemms(shape: Shape, layout: Layout, device: Device) -> float:
    """Forward + backward seconds of one layer's q/k/v and output projections."""
    t, tp, h = layout.tokens, layout.tp, shape.hidden
    q = (shape.heads + 2 * shape.kv_heads) * shape.head_dim / tp
    return sum(sum(gemm_fwd_bwd(m, n, k, device))
               for m, n, k in ((t, q, h), (t, h, shape.heads * shape.head_dim / tp)))


def head_compute(shape: Shape, layout: Layout, device: Device) -> Phases:
    """The output head and cross-entropy of one micro-batch (the last pipeline stage)."""
    t, v = layout.tokens, shape.vocab / layout.tp
    out = Phases()
    out.add(*gemm_fwd_bwd(t, v, shape.hidden, device))
    fused = layout.fused_elementwise if layout.fused_loss is None else layout.fused_loss
    ce = (CE_BYTES_FUSED if fused else CE_BYTES_EAGER) * t * v
    out.add(ce / 2 / device.hbm_bytes_s, ce / 2 / device.hbm_bytes_s)
    return out
