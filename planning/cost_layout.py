"""What the cost model prices: the model's shape, the layout it runs at, and what recomputation
repeats (``planning/cost_model.py`` puts them together).

Conventions: per rank, per micro-batch unless a name says ``step``; bytes; seconds. Tokens a
rank's dense layers compute per micro-batch: ``T = micro_batch x seq_len / cp`` (Megatron,
torchtitan: expert parallelism is carved out of data parallelism) or that divided by ``ep``
(this trainer, ``ep_splits_batch``: the ep ranks of a data-parallel replica split its
micro-batch). Rank order, fastest first: tp, cp, ep, dp, pp (this trainer: tp, ep, cp, dp, pp,
``model/parallel/groups.py``), which sets which groups stay inside a node.
"""

from __future__ import annotations

from dataclasses import dataclass

from model.checkpointing import CheckpointPolicy
from model.config import TransformerConfig
from planning.hardware import ATTENTION_KERNELS

ACT_BYTES = 2                # bf16 activations


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
    attn_params: int = 0            # attention matmul weights per layer when not GQA's (MLA); 0: GQA
    v_head_dim: int = 0             # value width per head when not head_dim (MLA); 0: head_dim
    mtp: int = 0                    # multi-token prediction depths: a block, projection and head each
    latent: int = 0                 # MLA: width of the latents entering the tp region; 0: GQA
    latent_q: bool = True           # MLA: the query from a latent (q_lora_rank), not the hidden state

    @classmethod
    def from_config(cls, cfg: TransformerConfig) -> "Shape":
        moe = cfg.moe
        extra = {}
        if moe is not None:
            extra = dict(experts=moe.num_experts, top_k=moe.top_k, expert_ffn=cfg.expert_ffn_size,
                         shared_ffn=moe.shared_ffn_size(cfg.expert_ffn_size),   # all shared, in all
                         shared_gate=bool(moe.num_shared_experts and moe.shared_expert_gate),
                         first_dense=moe.first_k_dense, moe_every=moe.moe_layer_freq)
        if cfg.mla:      # head_dim: the query-key width; every head has its own key and value
            extra.update(attn_params=cfg.attention_matmul_params, v_head_dim=cfg.v_head_dim,
                         latent=(cfg.q_lora_rank or 0) + cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                         latent_q=bool(cfg.q_lora_rank))
        extra["mtp"] = cfg.mtp_depth
        return cls(cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.qk_head_dim,
                   cfg.ffn_hidden_size, cfg.vocab_size, **extra)

    def matmul_params_per_token(self) -> float:
        """Matmul weights a token passes through: attention, the FFN or its k experts with the
        router and shared experts, and the output head (the input embedding is a lookup)."""
        h, up = self.hidden, 3 if self.gated else 2
        attn = self.attn_params or h * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        total = self.vocab * h + self.mtp * (2 * h * h + self.vocab * h)
        for i in range(self.layers + self.mtp):
            total += attn
            if self.is_moe(i):
                total += self.top_k * up * h * self.expert_ffn + h * self.experts + \
                    up * h * self.shared_ffn + h * self.shared_gate
            else:
                total += up * h * self.ffn
        return total

    def flops_per_token(self, seq_len: int, causal: bool = True) -> float:
        """Model FLOPs per token, the two MFU conventions: 6 x matmul weights + attention
        3 L s (w_qk + w_v) (causal: the mask halves the score and value products) or 6 L s
        (w_qk + w_v) (whole), w = heads x the query-key and value widths (6 L h s and 12 L h s when
        they are the hidden size; ``model.flops.train_flops_per_token``)."""
        width = self.heads * (self.head_dim + (self.v_head_dim or self.head_dim))   # w_qk + w_v
        return 6.0 * self.matmul_params_per_token() + (3.0 if causal else 6.0) * \
            (self.layers + self.mtp) * width * seq_len

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
    cp_comm: str = "a2a"            # its attention exchange: a2a (Ulysses) | allgather | p2p (ring)
    ep: int = 1
    etp: int | None = None          # experts' tensor parallelism (None: tp, as this trainer)
    pp: int = 1
    vpp: int = 1                    # virtual stages per pipeline rank (interleaved 1F1B)
    schedule: str = "1f1b"          # pipeline schedule: 1f1b | gpipe (same bubble) | zb-h1
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
    grad_exchange_scale: float = 1.0    # elements sent per gradient element (PowerSGD: < 1; ZeRO-0)
    dispatch_bytes: int = ACT_BYTES  # the all-to-all payload per element (fp8: 1)
    a2a_node_dedup: bool = False    # DeepEP: a token crosses to a remote node once, then NVLink
    moe_imbalance: float = 1.0      # the busiest EP rank's routed rows over the mean
    muon_ns_flops: float = 0.0      # Muon: Newton-Schulz FLOPs per step on the busiest rank (planning/muon_cost.py)
    muon_comm_bytes: float = 0.0    # Muon: its gradient reduce, update broadcast and tp gather, bytes per rank
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
        if self.schedule not in ("1f1b", "gpipe", "zb-h1") or (self.schedule != "1f1b" and self.vpp > 1):
            raise ValueError(f"pipeline schedule {self.schedule!r} (vpp {self.vpp}): one of 1f1b, "
                             f"gpipe, zb-h1, and only 1f1b interleaves virtual stages")
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
        if self.cp_comm not in ("a2a", "allgather", "p2p"):
            raise ValueError(f"cp_comm {self.cp_comm!r}: one of a2a, allgather, p2p")
        if self.cp > 1 and self.cp_comm == "a2a" and (shape.heads // self.tp) % self.cp:
            raise ValueError(f"cp {self.cp} does not divide the {shape.heads // self.tp} query heads "
                             f"of a tp rank (a2a splits them)")
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
