"""Step time of one optimizer step, from the model's GEMM shapes, the layout and the cluster.

``step_cost(shape, layout, cluster)`` returns the predicted seconds of one optimizer step and its
breakdown: compute (GEMMs, attention, memory-bound elementwise work, the forward that
recomputation repeats, the optimizer update), exposed communication per kind (TP/SP, DP/ZeRO, the
EP all-to-all, pipeline sends) and the pipeline bubble. It describes hardware and layout, not one
code base: the layout says which kernels run (``attention``, ``fused_elementwise``) and what a
system overlaps (``overlap_*``), so the same model predicts a Megatron-Core run and this repo's
trainer. ``benchmarks/planner_vs_published.py`` checks it against published runs;
``docs/planning.md`` has the derivation and every constant's source.

Hand-written: the open performance models we know of (Calculon; the closed forms of the
Megatron papers) describe dense Megatron layouts, not DeepSpeed's ZeRO schedules, expert
parallelism or this trainer's layouts.

Conventions: per rank, per micro-batch unless a name says ``step``; bytes; seconds. Tokens a
rank's dense layers compute per micro-batch: ``T = micro_batch x seq_len / cp`` (Megatron,
torchtitan: expert parallelism is carved out of data parallelism) or that divided by ``ep``
(this trainer, ``ep_splits_batch``: the ep ranks of a data-parallel replica split its
micro-batch). Rank order, fastest first: tp, cp, ep, dp, pp (this trainer: tp, ep, dp, pp,
``model/parallel/groups.py``), which sets which groups stay inside a node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from model.checkpointing import CheckpointPolicy
from model.config import TransformerConfig
from planning.hardware import ATTENTION_KERNELS, TILE_M, TILE_N, Cluster, Device

ACT_BYTES = 2                # bf16 activations
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
# Adam on one parameter, bytes moved: read fp32 master, grad, m, v (16), write master, m, v (12),
# write the bf16 copy (2); the grad-norm pass reads the grad once more (4).
ADAM_BYTES = 34
ZERO3_PREFETCH_EXPOSED = 1   # ZeRO-3/FSDP: the first layer's gather of each pass is not hidden
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
# While communication is hidden under compute its kernels hold SMs: DeepEP's normal kernels use
# 20-24 of H100's 132 (deepseek-ai/DeepEP README), NCCL one per channel, so the compute under it
# runs slower; a hidden second of communication costs COMM_SM_SHARE of a second.
COMM_SM_SHARE = 24 / 132


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer as the cost model sees it (``from_config`` for this repo's)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int                        # dense layers' FFN width
    vocab: int
    gated: bool = True              # SwiGLU: gate and up projections
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0             # the shared experts' total width
    shared_gate: bool = False       # a sigmoid gate (h weights) on the shared experts' output
    first_dense: int = 0            # leading dense layers before the MoE ones
    moe_every: int = 1

    @classmethod
    def from_config(cls, cfg: TransformerConfig) -> "Shape":
        moe = cfg.moe
        extra = {}
        if moe is not None:
            extra = dict(experts=moe.num_experts, top_k=moe.top_k, expert_ffn=cfg.expert_ffn_size,
                         shared_ffn=moe.shared_ffn_size(cfg.expert_ffn_size),   # all shared, in all
                         shared_gate=bool(moe.num_shared_experts and moe.shared_expert_gate),
                         first_dense=moe.first_k_dense, moe_every=moe.moe_layer_freq)
        return cls(cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                   cfg.ffn_hidden_size, cfg.vocab_size, **extra)

    def matmul_params_per_token(self) -> float:
        """Matmul weights a token passes through: attention, the FFN or its k experts with the
        router and shared experts, and the output head (the input embedding is a lookup)."""
        h, up = self.hidden, 3 if self.gated else 2
        attn = h * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        total = self.vocab * h
        for i in range(self.layers):
            total += attn
            if self.is_moe(i):
                total += self.top_k * up * h * self.expert_ffn + h * self.experts + \
                    up * h * self.shared_ffn + h * self.shared_gate
            else:
                total += up * h * self.ffn
        return total

    def flops_per_token(self, seq_len: int, causal: bool = True) -> float:
        """Model FLOPs per token, the two MFU conventions: 6 x matmul weights + attention
        6 L h s (causal: the mask halves the score and value products) or 12 L h s (whole)."""
        return 6.0 * self.matmul_params_per_token() + (6.0 if causal else 12.0) * \
            self.layers * self.hidden * seq_len

    def is_moe(self, layer: int) -> bool:
        """The model's rule (``TransformerConfig.is_moe_layer``): past the leading dense layers,
        every ``moe_every``-th layer, counted from 1."""
        return self.experts > 0 and layer >= self.first_dense and (layer + 1) % self.moe_every == 0


@dataclass(frozen=True)
class Layout:
    """How one step runs on ``world`` GPUs."""

    world: int
    global_batch: int               # sequences per optimizer step
    seq_len: int
    micro_batch: int = 1
    tp: int = 1
    sp: bool = False                # sequence parallelism (Megatron's)
    cp: int = 1                     # context parallelism: the sequence split over cp ranks
    ep: int = 1
    etp: int | None = None          # experts' tensor parallelism (None: tp, as this trainer)
    pp: int = 1
    vpp: int = 1                    # virtual stages per pipeline rank (interleaved 1F1B)
    zero_stage: int = 1             # 0-3; FSDP is 3; Megatron's distributed optimizer is 1
    recompute: str = "none"         # a ``Recompute`` name
    ep_splits_batch: bool = False   # this trainer: ep ranks split a micro-batch (see module doc)
    replica_sync: str = "micro_batch"   # this trainer's ep sum of dense grads: or once per "step"
    attention: str = "fa2"          # fa2 (PyTorch SDPA's flash backend) | fa3 | cudnn | unfused
    fused_elementwise: bool = False  # Transformer Engine / torch.compile: one kernel per fused op
    fused_loss: bool | None = None  # a fused cross-entropy (None: as fused_elementwise)
    fused_permute: bool | None = None  # fused MoE permutation (None: as fused_elementwise)
    overlap_dp: bool = True         # gradient reduction bucketed under backward
    overlap_param_gather: bool = False  # ZeRO-1/2 parameter all-gather under the next forward
    overlap_tp: bool = False        # TP collectives overlapped with their GEMMs
    overlap_a2a: bool = False       # EP all-to-all under another micro-batch's compute
    overlap_p2p: bool = False       # pipeline sends under compute (Megatron's interleaved 1F1B)
    grad_reduce_bytes: int = 4      # gradient reduction dtype (fp32: Megatron, FSDP2 defaults)
    dispatch_bytes: int = ACT_BYTES  # the all-to-all payload per element (fp8: 1)
    a2a_node_dedup: bool = False    # DeepEP: a token crosses to a remote node once, then NVLink
    moe_imbalance: float = 1.0      # the busiest EP rank's routed rows over the mean
    stage_layers: tuple[int, ...] | None = None   # layers per pipeline rank, if not even

    @property
    def dp(self) -> int:
        per = self.tp * self.cp * self.pp * (self.ep if self.ep_splits_batch else 1)
        return self.world // per

    @property
    def accumulation(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def tokens(self) -> float:
        """T: tokens this rank's dense layers compute per micro-batch."""
        return self.micro_batch * self.seq_len / self.cp / (self.ep if self.ep_splits_batch else 1)

    def check(self, shape: Shape) -> None:
        """Raises ValueError naming the degree that does not fit."""
        per = self.tp * self.cp * self.pp * (self.ep if self.ep_splits_batch else 1)
        if self.world % per:
            raise ValueError(f"world {self.world} is not a multiple of tp x cp x pp"
                             f"{' x ep' if self.ep_splits_batch else ''} = {per}")
        if self.global_batch % (self.micro_batch * self.dp):
            raise ValueError(f"global batch {self.global_batch} is not a multiple of micro "
                             f"{self.micro_batch} x dp {self.dp}")
        if shape.experts and shape.experts % self.ep:
            raise ValueError(f"ep {self.ep} does not divide {shape.experts} experts")
        if self.ep_splits_batch and self.micro_batch % self.ep:
            raise ValueError(f"ep {self.ep} does not divide the micro-batch {self.micro_batch}: "
                             f"this trainer's ep ranks split each micro-batch")
        if not self.ep_splits_batch and (self.world // self.pp) % (self.ep * self.expert_tp):
            raise ValueError(f"ep {self.ep} x etp {self.expert_tp} does not divide the "
                             f"{self.world // self.pp} ranks of a pipeline stage")
        if self.seq_len % self.cp:
            raise ValueError(f"cp {self.cp} does not divide the sequence length {self.seq_len}")
        if shape.heads % self.tp:
            raise ValueError(f"tp {self.tp} does not divide the {shape.heads} attention heads")
        if self.attention not in ATTENTION_KERNELS + ("unfused",):
            raise ValueError(f"attention {self.attention!r}: one of "
                             f"{', '.join(ATTENTION_KERNELS + ('unfused',))}")
        try:
            Recompute.parse(self.recompute, shape.layers)
        except ValueError:
            raise ValueError(f"recompute {self.recompute!r}: one of none, full, every_k:N, "
                             f"attention, moe, experts, selective, elementwise, op") from None


# ---------------------------------------------------------------------------------------------
# Compute.

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


@dataclass(frozen=True)
class Recompute:
    """What backward computes again, per layer: the names ``Layout.recompute`` takes."""

    whole: frozenset = frozenset()   # layers recomputed whole (full, every_k:N)
    core: bool = False               # attention core (Megatron's "selective")
    attention: bool = False          # attention sub-layer (this trainer's "attention")
    moe: bool = False                # MoE layer (this trainer's "moe")
    experts: bool = False            # expert FFNs between the exchanges ("experts")
    elementwise: bool = False        # norms and activations (Megatron's recompute modules)
    gemm_share: float = 0.0          # share of the GEMM forwards recomputed

    @classmethod
    def parse(cls, name: str, layers: int) -> "Recompute":
        """``none``, ``full``, ``every_k:N``, ``attention``, ``moe``, ``experts`` (this trainer,
        ``model/checkpointing.py``); ``selective`` (Megatron: the attention core);
        ``elementwise`` (Megatron's ``--recompute-modules`` layernorm and activations); ``op``
        (torchtitan's per-op policy: every elementwise op and every other matmul)."""
        if name == "selective":
            return cls(core=True)
        if name == "elementwise":
            return cls(elementwise=True)
        if name == "op":
            return cls(elementwise=True, gemm_share=0.5)
        p = CheckpointPolicy.parse(name)
        return cls(whole=frozenset(p.whole_blocks(layers)), attention=p.name == "attention",
                   moe=p.name == "moe", experts=p.name == "experts")


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


# ---------------------------------------------------------------------------------------------
# Communication volumes (elements, as benchmarks/comm_volume.py counts them: an all-reduce or
# reduce-scatter its full tensor per rank, an all-gather this rank's shard, an all-to-all what
# a rank sends, off-rank rows included).

def tp_volumes(shape: Shape, layout: Layout, layers: range, head: bool = False,
               embedding: bool | None = None) -> dict[tuple, float]:
    """TP/SP collectives of one micro-batch on one rank over ``layers``: {(op, phase): elements}.

    Per layer, without SP: one all-reduce of T h forward after the attention and after the FFN,
    and one backward each for the gradients entering q/k/v and the FFN. With SP each becomes a
    reduce-scatter of T h plus an all-gather of the T h / tp shard, and backward gathers the
    shard once more where a column-parallel layer stored only its input's shard (q/k/v and
    gate/up; not an MoE layer, which stores no gathered input). An MoE layer whose experts are
    split by tp also sums the gradient of its (T, k) combine weights, which multiply the experts'
    tp-partial outputs (``model/moe/layer.py``): an all-reduce of T k backward. Megatron's MoE
    with experts not split by tp (etp 1) has no TP collective in its MoE layers.

    ``head`` (the last stage): the vocab-parallel output head's input grad, an all-reduce of T h
    backward (SP: its input gathered forward and again backward, T h / tp each, and the grad
    reduce-scattered, T h), and the vocab-parallel cross-entropy's statistics over all T
    tokens, all-reduces of 3 T forward (the max, then the target logit and the sum of
    exponentials). ``embedding`` (None: when ``layers`` holds layer 0, as the first stage
    does): the vocab-parallel embedding's partial lookups summed forward, an all-reduce of T h
    (SP: a reduce-scatter of T h, and backward the all-gather of its grad's T h / tp shard).
    These are the collectives ``benchmarks/comm_volume.py`` counts, element for element
    (``tests/parallel/test_comm_volume.py``).
    """
    out: dict[tuple, float] = {}
    if layout.tp == 1:
        return out
    t, h, tp = layout.tokens, shape.hidden, layout.tp

    def put(op, phase, n):
        out[(op, phase)] = out.get((op, phase), 0.0) + n

    for i in layers:
        moe = shape.is_moe(i)
        subs = [False] + ([] if moe and layout.expert_tp == 1 else [moe])   # attention, FFN
        for is_moe in subs:
            if layout.sp:
                put("reduce_scatter", "forward", t * h)
                put("all_gather", "forward", t * h / tp)
                put("reduce_scatter", "backward", t * h)
                put("all_gather", "backward", t * h / tp * (1 if is_moe else 2))
            else:
                put("all_reduce", "forward", t * h)
                put("all_reduce", "backward", t * h)
            if is_moe:
                put("all_reduce", "backward", t * shape.top_k)      # combine weights' grad
    if embedding is None:
        embedding = 0 in layers
    if embedding:
        if layout.sp:
            put("reduce_scatter", "forward", t * h)
            put("all_gather", "backward", t * h / tp)
        else:
            put("all_reduce", "forward", t * h)
    if head:
        if layout.sp:
            put("all_gather", "forward", t * h / tp)
            put("all_gather", "backward", t * h / tp)
            put("reduce_scatter", "backward", t * h)
        else:
            put("all_reduce", "backward", t * h)
        put("all_reduce", "forward", 3 * t)                         # cross-entropy statistics
    return out


def ep_volumes(shape: Shape, layout: Layout, layers: range) -> dict[tuple, float]:
    """All-to-all elements one rank sends per micro-batch over ``layers``: dispatch and combine
    each move the routed rows (k rows of h per token, dropless: no padding), forward and again
    reversed in backward, and once more forward (phase ``recompute``) where recompute repeats
    the MoE layer (``full``, ``every_k``, ``moe``; not ``experts``, which recomputes only the
    expert FFNs between the exchanges). Balanced routing (times ``moe_imbalance``): what one
    rank's combine sends back depends on how many rows its experts received, but summed over
    the ep ranks each exchange moves exactly ep k T h elements when dropless (k rows for every
    token), as ``benchmarks/comm_volume.py`` counts it."""
    out: dict[tuple, float] = {}
    if layout.ep == 1 or not shape.experts:
        return out
    rc = Recompute.parse(layout.recompute, shape.layers)
    rows = routed_rows(shape, layout) * shape.hidden
    for i in layers:
        if not shape.is_moe(i):
            continue
        for label in ("dispatch", "combine"):
            for phase in ("forward", "backward"):
                out[(label, phase)] = out.get((label, phase), 0.0) + rows
            if i in rc.whole or rc.moe:
                out[(label, "recompute")] = out.get((label, "recompute"), 0.0) + rows
    return out


def dp_volume(psi: float, dp: int, accumulation: int, zero_stage: int, grad_bytes: int,
              param_bytes: int = ACT_BYTES) -> dict[str, float]:
    """Bytes each rank sends for data parallelism in one optimizer step, for ``psi`` parameters
    replicated over ``dp`` ranks: the ZeRO paper's counts (arXiv:1910.02054, sec. 7) as
    DeepSpeed schedules them, each times (dp-1)/dp for a ring:

    - ZeRO-0: all-reduce of the gradients at the accumulation boundary, 2 psi;
    - ZeRO-1 (and Megatron's distributed optimizer): reduce-scatter of the gradients once, psi,
      then all-gather of the updated parameters, psi;
    - ZeRO-2: DeepSpeed reduce-scatters on every micro-batch (m psi), then all-gathers (psi);
    - ZeRO-3 / FSDP: per micro-batch all-gather in forward and again in backward (2 psi) and
      a reduce-scatter of the gradients (psi).
    """
    if dp <= 1 or psi <= 0:
        return {}
    m, ring = accumulation, (dp - 1) / dp
    if zero_stage == 0:
        parts = {"grad_all_reduce": 2 * psi * grad_bytes}
    elif zero_stage == 1:
        parts = {"grad_reduce_scatter": psi * grad_bytes, "param_all_gather": psi * param_bytes}
    elif zero_stage == 2:
        parts = {"grad_reduce_scatter": m * psi * grad_bytes, "param_all_gather": psi * param_bytes}
    else:
        parts = {"param_all_gather": 2 * m * psi * param_bytes,
                 "grad_reduce_scatter": m * psi * grad_bytes}
    return {k: v * ring for k, v in parts.items()}


def dp_groups(shape: Shape, layout: Layout) -> dict[str, tuple[int, int]]:
    """{"dense"|"expert": (ranks a parameter is replicated over, their stride)}.

    Megatron and torchtitan: dense parameters over dp = world / (tp cp pp), stride tp cp;
    experts over world / (etp ep pp) (expert data parallelism), stride etp ep. This trainer
    (``ep_splits_batch``): both over dp = world / (tp ep pp), stride tp ep; the dense
    parameters' sum over ep is a separate all-reduce (``step_cost``).
    """
    if layout.ep_splits_batch or not shape.experts:
        stride = layout.tp * layout.cp * (layout.ep if layout.ep_splits_batch else 1)
        return {"dense": (layout.dp, stride), "expert": (layout.dp, stride)}
    etp = layout.expert_tp
    return {"dense": (layout.dp, layout.tp * layout.cp),
            "expert": (layout.world // (etp * layout.ep * layout.pp), etp * layout.ep)}


# ---------------------------------------------------------------------------------------------
# Parameters per rank.

def local_params(shape: Shape, layout: Layout, layers: range, first: bool, last: bool) -> dict:
    """Parameters one rank holds for its ``layers``: {"dense", "expert"} (before ZeRO)."""
    h, tp = shape.hidden, layout.tp
    attn = h * shape.head_dim * (2 * shape.heads + 2 * shape.kv_heads) / tp + 2 * h
    dense = expert = 0.0
    up = 3 if shape.gated else 2
    for i in layers:
        dense += attn
        if shape.is_moe(i):
            dense += h * shape.experts + up * h * shape.shared_ffn / tp
            expert += shape.experts / layout.ep * up * h * shape.expert_ffn / layout.expert_tp
        else:
            dense += up * h * shape.ffn / tp
    dense += (first + last) * shape.vocab * h / tp
    return {"dense": dense, "expert": expert}


def stage_layer_ranges(shape: Shape, layout: Layout) -> list[range]:
    """Layers of each pipeline rank (all its virtual stages together): even, earlier ranks one
    more when pp does not divide, or ``layout.stage_layers``."""
    counts = list(layout.stage_layers) if layout.stage_layers else \
        [shape.layers // layout.pp + (r < shape.layers % layout.pp) for r in range(layout.pp)]
    if sum(counts) != shape.layers or len(counts) != layout.pp:
        raise ValueError(f"stage_layers {counts} must be pp = {layout.pp} counts summing to "
                         f"{shape.layers} layers")
    starts = [sum(counts[:r]) for r in range(layout.pp)]
    return [range(s, s + c) for s, c in zip(starts, counts)]


# ---------------------------------------------------------------------------------------------
# The step.

def _collective(cluster: Cluster, op: str, nbytes: float, size: int, stride: int,
                calls: int = 1) -> float:
    """Seconds of ``calls`` ring collectives moving ``nbytes`` in all (all-reduce /
    reduce-scatter: the full tensors; all-gather: this rank's shards) over ``size`` ranks
    ``stride`` apart: the bus-bandwidth term, and one latency per call."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    bw = cluster.busbw(size, stride)
    factor = {"all_reduce": 2 * (size - 1) / size, "reduce_scatter": (size - 1) / size,
              "all_gather": float(size - 1)}[op]
    return factor * nbytes / bw + calls * cluster.latency(size, stride)


def tp_calls(shape: Shape, layout: Layout, layer: int, phases=("forward", "backward")) -> int:
    """TP collectives one layer issues per micro-batch in ``phases`` (the calls of
    ``tp_volumes``): per sub-layer with a TP collective, one forward and one backward
    all-reduce, or under SP a reduce-scatter and an all-gather each way and the backward gather
    again where the input was stored as a shard; the combine weights' backward all-reduce of an
    MoE layer with tp-split experts."""
    if layout.tp == 1:
        return 0
    moe = shape.is_moe(layer)
    subs = [False] + ([] if moe and layout.expert_tp == 1 else [moe])
    fwd = len(subs) * (2 if layout.sp else 1)
    bwd = sum((3 if not is_moe else 2) if layout.sp else 1 for is_moe in subs) + (moe and subs[-1])
    return ("forward" in phases) * fwd + ("backward" in phases) * bwd


def all_to_all_seconds(cluster: Cluster, nbytes: float, size: int, stride: int,
                       remote: float | None = None, calls: int = 1) -> float:
    """One all-to-all in which a rank sends ``nbytes`` spread evenly over ``size`` ranks: the
    share for ranks of its own node over NVLink, the rest (``remote``, default the ranks on
    other nodes' share) over its network share, at once."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    local, nodes = cluster.placement(size, stride)
    remote = (size - local) / size if remote is None else remote
    inside = nbytes * (local - 1) / size / (cluster.device.nvlink_a2a_gb_s * 1e9)
    outside = nbytes * remote / cluster.nic_bytes_s_per_gpu if nodes > 1 else 0.0
    return max(inside, outside) + calls * cluster.latency(size, stride)


def remote_share(shape: Shape, layout: Layout, cluster: Cluster) -> float | None:
    """Share of a rank's routed rows that cross the network when a token is sent once per remote
    node (``a2a_node_dedup``, DeepEP's dispatch): the expected number of other nodes among its k
    experts, over k; experts spread evenly over the ep group's nodes, routing uniform. None
    without deduplication (every row to another node crosses)."""
    if not layout.a2a_node_dedup or not shape.experts:
        return None
    nodes = cluster.placement(layout.ep, layout.tp * layout.cp)[1]
    if nodes <= 1:
        return 0.0
    per_node, e, k = shape.experts / nodes, shape.experts, shape.top_k
    missed = math.comb(int(e - per_node), k) / math.comb(e, k)    # a given node gets none of k
    return (nodes - 1) * (1 - missed) / k


@dataclass
class StepCost:
    """The prediction for one optimizer step, seconds unless named otherwise."""

    step_s: float
    tokens_per_s_per_gpu: float
    compute_s: float                 # per micro-batch work x micro-batches on the slowest stage
    bubble_s: float
    optimizer_s: float
    exposed: dict[str, float]        # exposed communication per kind: tp, dp, ep, pp
    breakdown: dict[str, float] = field(default_factory=dict)   # compute by kind, one step
    volumes: dict[str, float] = field(default_factory=dict)     # bytes per rank per step

    def as_dict(self) -> dict:
        return {"step_s": self.step_s, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
                "compute_s": self.compute_s, "bubble_s": self.bubble_s,
                "optimizer_s": self.optimizer_s, **{f"{k}_comm_s": v for k, v in self.exposed.items()},
                "breakdown": self.breakdown, "volumes": self.volumes}


def pipeline_seconds(stage_work: list[float], micro_batches: int, vpp: int = 1) -> float:
    """Makespan of a synchronous 1F1B step with free communication: the slowest stage paces the
    m - 1 steady micro-batches, and every stage's work fills the ramp up and down (the model of
    ``benchmarks/pipeline_schedules.py``); interleaving v virtual stages per rank divides the
    ramp by v (Megatron, arXiv:2104.04473 sec. 2.2.2: bubble (p-1)/(v m)). Exact for equal
    stages; with a slower stage before a faster one it is an upper bound (DeepSpeed's schedule
    then overlaps part of the ramp: ``tests/planning/test_cost_model.py`` pins a case)."""
    if len(stage_work) == 1:
        return micro_batches * stage_work[0]
    slowest = max(stage_work)
    return (micro_batches - 1) * slowest + slowest + (sum(stage_work) - slowest) / vpp


def step_cost(shape: Shape, layout: Layout, cluster: Cluster) -> StepCost:
    """Predicted seconds of one optimizer step of ``shape`` at ``layout`` on ``cluster``."""
    layout.check(shape)
    dev, m = cluster.device, layout.accumulation
    tp, cp, ep, dp, pp = layout.tp, layout.cp, layout.ep, layout.dp, layout.pp
    a = ACT_BYTES
    stride_ep = tp * cp                    # ep after tp (and cp)
    stride_dp = tp * cp * (ep if layout.ep_splits_batch else 1)
    stride_pp = stride_dp * dp
    ranges = stage_layer_ranges(shape, layout)
    rc, memo = Recompute.parse(layout.recompute, shape.layers), {}
    per_stage, kinds, tp_exposed, ep_exposed = [], [], [], []
    for r, layers in enumerate(ranges):
        work = {"gemm": 0.0, "attention": 0.0, "elementwise": 0.0, "recompute": 0.0, "head": 0.0}
        gemm_fwd = attention_side = 0.0
        for i in layers:
            key = (shape.is_moe(i), i in rc.whole)
            if key not in memo:         # layers differ only by these
                memo[key] = (layer_compute(shape, layout, dev, i), attention_gemms(shape, layout, dev))
            c, attn_gemms = memo[key]
            for k, ph in c.items():
                work[k] += ph.fwd + ph.bwd
                work["recompute"] += ph.recompute
            gemm_fwd += c["gemm"].fwd
            attention_side += c["attention"].total + attn_gemms
        if r == pp - 1:
            work["head"] = head_compute(shape, layout, dev).total
        compute = sum(work.values())
        head = r == pp - 1
        tp_s = sum(_collective(cluster, op, n * a, tp, 1, calls=0) for (op, _), n in
                   tp_volumes(shape, layout, layers, head=head, embedding=r == 0).items())
        calls = sum(tp_calls(shape, layout, i) for i in layers) + \
            (5 if layout.sp else 3) * head + (2 if layout.sp else 1) * (r == 0)
        redone = range(0)
        if rc.whole:                # a recomputed layer repeats its forward collectives
            redone = [i for i in layers if i in rc.whole]
            tp_s += sum(_collective(cluster, op, n * a, tp, 1, calls=0) for (op, phase), n in
                        tp_volumes(shape, layout, redone, embedding=False).items()
                        if phase == "forward")
            calls += sum(tp_calls(shape, layout, i, ("forward",)) for i in redone)
        tp_s += calls * cluster.latency(tp, 1) if tp > 1 else 0.0
        if layout.overlap_tp:       # under the GEMMs they feed (forward and backward)
            hidden = min(tp_s, gemm_fwd * (1 + BACKWARD_GEMMS))
            tp_s = tp_s - hidden + COMM_SM_SHARE * hidden
        remote = remote_share(shape, layout, cluster)
        ep_s = sum(all_to_all_seconds(cluster, n * layout.dispatch_bytes, ep, stride_ep, remote,
                                      calls=0)
                   for n in ep_volumes(shape, layout, layers).values())
        if ep > 1 and shape.experts:    # dispatch and combine each way, and the recomputed ones
            moe_layers = [i for i in layers if shape.is_moe(i)]
            ep_calls = 4 * len(moe_layers) + 2 * sum(i in rc.whole or rc.moe for i in moe_layers)
            ep_s += ep_calls * cluster.latency(ep, stride_ep)
        if layout.overlap_a2a:
            # Megatron's EP overlap runs one micro-batch's dispatch and combine under another's
            # attention: what that hides, at the cost of the SMs the exchange holds meanwhile
            hidden = min(ep_s, attention_side)
            ep_s = ep_s - hidden + COMM_SM_SHARE * hidden
        pp_s = 0.0
        if pp > 1:   # activation forward and its grad backward, per boundary this rank crosses
            msg = layout.tokens * shape.hidden * a / (tp if layout.sp else 1)
            crossings = 2 * layout.vpp if 0 < r < pp - 1 else layout.vpp
            pp_s = crossings * (msg / cluster.busbw(2, stride_pp) + cluster.latency(2, stride_pp))
            if layout.overlap_p2p:
                pp_s = crossings * cluster.latency(2, stride_pp)
        per_stage.append(compute + tp_s + ep_s + pp_s)
        kinds.append((work, tp_s, ep_s, pp_s))
        tp_exposed.append(tp_s)
        ep_exposed.append(ep_s)
    slowest = max(range(pp), key=lambda r: per_stage[r])
    pipeline = pipeline_seconds(per_stage, m, layout.vpp)
    bubble = pipeline - m * per_stage[slowest]
    work, tp_s, ep_s, pp_s = kinds[slowest]
    # Each stage reduces its own gradients and steps its own optimizer after its last backward:
    # the step ends with the stage that finishes last.
    tails = [_dp_and_optimizer(shape, layout, cluster, ranges[r], r, per_stage[r],
                               sum(kinds[r][0].values())) for r in range(pp)]
    dp_exposed, optimizer, volumes = max(tails, key=lambda t: t[0] + t[1])
    step = pipeline + dp_exposed + optimizer
    tokens = layout.global_batch * layout.seq_len
    breakdown = {k: m * v for k, v in work.items()}
    exposed = {"tp": m * tp_s, "dp": dp_exposed, "ep": m * ep_s, "pp": m * pp_s}
    volumes = {"dp_bytes": sum(volumes.values()),
               "tp_bytes": m * sum(tp_volumes(shape, layout, ranges[slowest], slowest == pp - 1,
                                              slowest == 0).values()) * a,
               "ep_bytes": m * sum(ep_volumes(shape, layout, ranges[slowest]).values())
               * layout.dispatch_bytes}
    return StepCost(step, tokens / step / layout.world, m * sum(work.values()), bubble,
                    optimizer, exposed, breakdown, volumes)


def _dp_and_optimizer(shape: Shape, layout: Layout, cluster: Cluster, layers: range, stage: int,
                      micro: float, fwd_bwd: float) -> tuple[float, float, dict]:
    """(exposed data-parallel seconds, optimizer seconds, bytes per part) of one pipeline
    stage, whose micro-batch takes ``micro`` seconds (``fwd_bwd`` of it compute)."""
    m, ep, tp = layout.accumulation, layout.ep, layout.tp
    params = local_params(shape, layout, layers, stage == 0, stage == layout.pp - 1)
    groups = dp_groups(shape, layout)
    volumes, reduce_s, gather_s = {}, 0.0, 0.0
    for kind, (size, stride) in groups.items():
        vol = dp_volume(params[kind], size, m, layout.zero_stage, layout.grad_reduce_bytes)
        for part, nbytes in vol.items():
            volumes[f"{kind}_{part}"] = nbytes
            seconds = nbytes / cluster.busbw(size, stride)
            if part == "param_all_gather":
                gather_s += seconds
            else:
                reduce_s += seconds
    if layout.ep_splits_batch and ep > 1 and shape.experts:
        # this trainer: the parameters outside the experts are replicated over the ep ranks of
        # a replica, their grads summed over ep (model/parallel/grad_sync.py): once per
        # micro-batch, or once per step in its "step" mode (training.ds_config.replica_sync_mode)
        times = 1 if layout.replica_sync == "step" else m
        nbytes = times * 2 * params["dense"] * layout.grad_reduce_bytes * (ep - 1) / ep
        volumes["dense_ep_all_reduce"] = nbytes
        reduce_s += nbytes / cluster.busbw(ep, tp)
    if layout.zero_stage == 3:
        # gathers prefetched under every layer's compute: what does not fit under it shows,
        # and the first layer's gather of each pass at least
        total = reduce_s + gather_s
        first = total / max(1, 2 * m * len(layers)) * ZERO3_PREFETCH_EXPOSED
        hidden = min(total - first, m * fwd_bwd)
    else:
        window = 0.0
        if layout.overlap_dp:       # under the last micro-batch's backward; ZeRO-2: every one
            window = (m if layout.zero_stage == 2 else 1) * micro * (2 / 3)
        total = reduce_s + gather_s
        hidden = min(reduce_s, window) + (gather_s if layout.overlap_param_gather else 0.0)
    exposed = total - hidden + COMM_SM_SHARE * hidden
    optimizer = sum(params[k] / (groups[k][0] if layout.zero_stage >= 1 else 1)
                    for k in groups) * ADAM_BYTES / cluster.device.hbm_bytes_s
    return exposed, optimizer, volumes
