"""One decoder-only transformer for the dense, Switch and Mixtral families.

Pre-norm blocks: ``x + attn(norm(x))`` then ``x + ffn(norm(x))``, where the FFN is a SwiGLU MLP or
an MoE layer as ``config.is_moe_layer(i)`` decides. Parameter names follow transformers' Llama and
Mixtral (``embed_tokens``, ``layers.N.self_attn.q_proj``, ``mlp.gate`` ...), so converting to and
from HF checkpoints is a key copy (plus the expert-weight layout, see ``moe/experts.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from model.checkpointing import CheckpointPolicy
from model import mup
from model.config import TransformerConfig
from model.document_mask import attend, attention_inputs, document_ids
from model.mla import MLAttention
from model.moe.layer import MoEAux, MoELayer, load_balancing_losses
from model.parallel.grad_sync import ReplicaGradSync
from model.norm import RMSNorm
from model.parallel.groups import ParallelGroups
from model.parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                   column_parallel_linears, cross_entropy_sum, init_from_full,
                                   kv_heads_for_rank)
from model.rope import apply_rope, rotary_for

IGNORE_INDEX = -100


class Attention(nn.Module):
    """Causal grouped-query attention through ``F.scaled_dot_product_attention``; with a
    ``mask`` (document masking), only within each packed document (``model/document_mask.py``).

    Tensor parallelism splits the query heads over tp, and the kv heads too (or, with fewer kv
    heads than tp ranks, each rank keeps the one kv head its query heads use); ``o_proj`` is row
    parallel, so the block's output is summed over tp once. Under sequence parallelism the input
    is this rank's (B, S/tp, H) shard: it is gathered once for q, k and v, and the output is
    reduce-scattered back to a shard. Optional (Qwen): q/k/v biases, split with their output
    rows, and a per-head RMSNorm on q and k before RoPE, whose (hd,) weights every tp rank holds
    whole and applies to its own heads (gradient summed over tp; see ``RMSNorm``).
    """

    def __init__(self, cfg: TransformerConfig, groups: ParallelGroups | None = None):
        super().__init__()
        g = groups or ParallelGroups()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.head_dim = cfg.num_heads // g.tp, hd       # local query heads
        kv_heads, self.kv_select = kv_heads_for_rank(cfg.num_kv_heads, g)
        kv_rows = [h * hd + i for h in kv_heads for i in range(hd)]
        self.num_kv_heads = len(kv_heads)                              # kv heads held here
        bias = cfg.qkv_bias
        self.q_proj = ColumnParallelLinear(h, cfg.num_heads * hd, g, bias=bias)
        self.k_proj = ColumnParallelLinear(h, cfg.num_kv_heads * hd, g, out_index=kv_rows, bias=bias)
        self.v_proj = ColumnParallelLinear(h, cfg.num_kv_heads * hd, g, out_index=kv_rows, bias=bias)
        self.o_proj = RowParallelLinear(cfg.num_heads * hd, h, g)
        self.q_norm = RMSNorm(hd, cfg.norm_eps, g, per_head=True) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.norm_eps, g, per_head=True) if cfg.qk_norm else None
        self.groups = g
        self.scale = mup.attention_scale(cfg)          # None: SDPA's 1/sqrt(hd)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                mask=None) -> torch.Tensor:
        projs = (self.q_proj, self.k_proj, self.v_proj)
        q, k, v = column_parallel_linears(           # one gradient all-reduce for q, k and v
            x, [p.weight for p in projs], self.groups)
        if self.q_proj.bias is not None:               # (nh*hd/tp,) ... this rank's rows
            q, k, v = (t + p.bias for t, p in zip((q, k, v), projs))
        B, S, _ = q.shape                              # S: the whole sequence, also under SP
        q = q.view(B, S, self.num_heads, self.head_dim).transpose(1, 2)        # (B, nh, S, hd)
        k = k.view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)     # (B, nkv, S, hd)
        v = v.view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)     # (B, nkv, S, hd)
        if self.kv_select is not None:    # fewer kv heads than tp ranks: use ours
            k = k[:, self.kv_select:self.kv_select + 1]
            v = v[:, self.kv_select:self.kv_select + 1]
        if self.q_norm is not None:                    # per head, over hd
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        gqa = k.shape[1] != self.num_heads
        if mask is None:                               # one causal sequence per row
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=gqa)
        else:                                          # packed documents apart
            y = attend(q, k, v, mask, self.scale, gqa)
        y = y.transpose(1, 2).reshape(B, S, self.num_heads * self.head_dim)               # (B, S, nh*hd)
        return self.o_proj(y)


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``; gate/up column parallel, down row
    parallel over tp."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, groups: ParallelGroups | None = None):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden_size, ffn_hidden_size, groups)
        self.up_proj = ColumnParallelLinear(hidden_size, ffn_hidden_size, groups)
        self.down_proj = RowParallelLinear(ffn_hidden_size, hidden_size, groups)
        self.groups = groups or ParallelGroups()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = column_parallel_linears(           # one gradient all-reduce for gate and up
            x, [p.weight for p in (self.gate_proj, self.up_proj)], self.groups)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm transformer block; its FFN is an MLP or an MoE layer."""

    def __init__(self, cfg: TransformerConfig, layer_idx: int, groups: ParallelGroups | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, groups)
        self.self_attn = MLAttention(cfg, groups) if cfg.mla else Attention(cfg, groups)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, groups)
        self.is_moe = cfg.is_moe_layer(layer_idx)
        if self.is_moe:
            self.mlp = MoELayer(cfg.moe, cfg.hidden_size, cfg.expert_ffn_size, groups)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.ffn_hidden_size, groups)

        # Selective activation checkpointing: recompute one sub-layer in backward.
        self.checkpoint_attention = False
        self.checkpoint_ffn = False

    def set_checkpointing(self, policy: CheckpointPolicy) -> None:
        """Recompute a sub-layer in backward under the ``attention`` and ``moe`` policies, or
        only the expert FFNs under ``experts`` (the whole-block policies are applied by the
        caller, see ``CheckpointPolicy.whole_blocks``)."""
        self.checkpoint_attention = policy.name == "attention"
        self.checkpoint_ffn = policy.name == "moe" and self.is_moe
        if self.is_moe:
            self.mlp.checkpoint_experts = policy.name == "experts"

    def _attention(self, x, rope, mask):
        return self.self_attn(self.input_layernorm(x), rope, mask)

    def _ffn(self, x):
        if self.is_moe:
            return self.mlp(self.post_attention_layernorm(x))
        return self.mlp(self.post_attention_layernorm(x)), None

    def forward(self, x: torch.Tensor, rope, mask=None) -> tuple[torch.Tensor, MoEAux | None]:
        """``rope`` and ``mask`` from ``attention_inputs`` (mask None: causal)."""
        if self.checkpoint_attention and self.training:
            x = x + torch.utils.checkpoint.checkpoint(self._attention, x, rope, mask, use_reentrant=False)
        else:
            x = x + self._attention(x, rope, mask)
        if self.checkpoint_ffn and self.training:
            y, aux = torch.utils.checkpoint.checkpoint(self._ffn, x, use_reentrant=False)
        else:
            y, aux = self._ffn(x)
        return x + y, aux


def init_std_for(cfg: TransformerConfig):
    """name -> the std of the parameter's init: ``init_std`` for every matrix, residual-output
    projections scaled by 1/sqrt(2 * num_layers) (GPT-2 / Megatron) so the residual stream's
    variance does not grow with depth; None (ones) for norms, the q/k norms too; 0 for biases."""
    std = cfg.init_std
    out_std = std / math.sqrt(2 * cfg.num_layers)

    def std_for(name: str) -> float | None:
        if name.endswith("norm.weight"):
            return None
        if name.endswith(".bias"):
            return 0.0                                                  # Normal(0, 0): zeros
        if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
            return out_std * mup.init_scale(cfg, name)                  # 1.0 without muP
        return std * mup.init_scale(cfg, name)
    return std_for


@torch.no_grad()
def init_weights(module: nn.Module, cfg: TransformerConfig, seed: int, write=None) -> None:
    """Normal(0, std) per element, std by ``init_std_for``. Each full tensor is defined from
    (seed, name) in blocks along its sharded dims and this rank draws only the blocks of its
    shard (``model/parallel/draw.py``), so every layout starts from the same model; ``module``
    may be any part of the model whose parameter names are the Transformer's (e.g. a pipeline
    stage's layer). ``write``: how a shard is stored, see ``model.parallel.draw.fill_shards``."""
    init_from_full(module, init_std_for(cfg), seed, write)


def expert_parallel_rows(t: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """This ep rank's rows of a micro-batch, (B, ...) -> (B/ep, ...): expert-parallel ranks
    split each micro-batch between them (each routes its own tokens)."""
    ep = groups.ep
    if ep == 1:
        return t
    if t.shape[0] % ep:
        raise ValueError(f"micro-batch size ({t.shape[0]}) is not divisible by "
                         f"parallel.expert_parallel_size ({ep})")
    part = t.shape[0] // ep
    return t[groups.ep_rank * part:(groups.ep_rank + 1) * part]


def sequence_length(x: torch.Tensor, groups: ParallelGroups) -> int:
    """Full sequence length of a (B, S, H) residual-stream tensor between blocks (under sequence
    parallelism it holds S/tp positions), for the RoPE tables."""
    return x.shape[1] * (groups.tp if groups.sequence_parallel else 1)


@dataclass
class TransformerOutput:
    """What the model returns; the trainer combines the losses (see ``total_loss``)."""

    logits: torch.Tensor                      # (B, S, V)
    ce_sum: torch.Tensor | None = None        # sum of next-token cross-entropy over target tokens
    num_target_tokens: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None      # load-balancing loss averaged over MoE layers
    z_loss: torch.Tensor | None = None        # router z-loss averaged over MoE layers
    moe_aux: list[MoEAux] = field(default_factory=list)   # per MoE layer, in layer order

    @property
    def loss(self) -> torch.Tensor:
        """Mean next-token cross-entropy over this batch's target tokens (no auxiliary losses)."""
        return self.ce_sum / self.num_target_tokens.clamp_min(1)


class Transformer(nn.Module):
    """Decoder-only language model for the dense, Switch and Mixtral families.

    Args:
        cfg: a validated ``DenseConfig``, ``SwitchConfig`` or ``MixtralConfig``.
        groups: process groups for tensor/expert parallelism (None: single process). Under
            expert parallelism each ep rank takes its slice of the micro-batch; under tensor
            parallelism ``logits`` is this rank's vocabulary shard (for every position, also
            under sequence parallelism, whose sequence shards live only between the layers).
        init_seed: seed of the weight init; the full weights are the same at any layout.
            None leaves the parameters uninitialized for the caller (a partitioned build
            initializes them after construction with ``reset_parameters(seed, write)``).
    """

    def __init__(self, cfg: TransformerConfig, groups: ParallelGroups | None = None,
                 init_seed: int | None = 0):
        super().__init__()
        self.cfg = cfg
        self.groups = groups or ParallelGroups()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, groups)
        self.layers = nn.ModuleList(Block(cfg, i, groups) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, groups)
        self.lm_head = None if cfg.tie_embeddings else ColumnParallelLinear(cfg.hidden_size, cfg.vocab_size, groups)
        self.rotary = rotary_for(cfg)
        self.checkpoint_blocks: set[int] = set()    # blocks recomputed whole in backward
        if init_seed is not None:
            self.reset_parameters(init_seed)
        # Sums the gradients of replicated parameters over tp/ep, per parameter in its hook; the
        # trainer switches it to one bucketed sum per step where DeepSpeed allows it.
        self.grad_sync = ReplicaGradSync(self, self.groups)

    def set_activation_checkpointing(self, policy: str) -> None:
        """Choose what backward recomputes instead of storing: a ``train.activation_checkpointing``
        policy (none, full, attention, moe, experts, every_k:<k>; see ``model/checkpointing.py``).
        """
        policy = CheckpointPolicy.parse(policy)
        self.checkpoint_blocks = policy.whole_blocks(self.cfg.num_layers)
        for layer in self.layers:
            layer.set_checkpointing(policy)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0, write=None) -> None:
        """See ``init_weights``: every layout starts from the same model."""
        init_weights(self, self.cfg, seed, write)

    def reset_buffers(self) -> None:
        """Recompute the derived fp32 buffers (RoPE frequencies) and put the expert biases back
        in fp32 after a build that created them in another dtype."""
        self.rotary.reset()
        for layer in self.layers:
            if layer.is_moe:
                layer.mlp.gate.reset_bias_dtype()

    @torch.no_grad()
    def update_expert_bias(self, counts: torch.Tensor) -> None:
        """Loss-free balancing after an optimizer step (``TopKRouter.update_bias``): ``counts``
        (L_moe, E), the step's routed assignments per MoE layer (in layer order) and expert,
        summed over every micro-batch and every rank that sees different tokens. A no-op when
        ``model.moe.expert_bias_update_rate`` is 0."""
        moe_layers = [layer.mlp for layer in self.layers if layer.is_moe]
        for mlp, layer_counts in zip(moe_layers, counts.unbind(0), strict=True):
            mlp.gate.update_bias(layer_counts)

    def expert_biases(self) -> list[tuple[int, torch.Tensor]]:
        """(MoE layer index, (E,) expert bias) of each router that holds one (loss-free
        balancing), in layer order."""
        moe_layers = [layer.mlp for layer in self.layers if layer.is_moe]
        return [(j, mlp.gate.e_score_correction_bias) for j, mlp in enumerate(moe_layers)
                if mlp.gate.e_score_correction_bias is not None]

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> TransformerOutput:
        """input_ids, labels: (B, S); labels already shifted (position t predicts labels[t]),
        ``-100`` where no target."""
        input_ids = expert_parallel_rows(input_ids, self.groups)
        labels = expert_parallel_rows(labels, self.groups) if labels is not None else None
        if self.groups.sequence_parallel and input_ids.shape[1] % self.groups.tp:
            raise ValueError(f"sequence length ({input_ids.shape[1]}) is not divisible by "
                             f"parallel.tensor_parallel_size ({self.groups.tp}) under "
                             f"parallel.sequence_parallel")
        x = self.embed_tokens(input_ids)                        # (B, S, H); S/tp under SP
        sep = self.cfg.document_separator_id
        docs = None if sep is None else document_ids(input_ids, sep)          # (B, S)
        rope, mask = attention_inputs(self.rotary, input_ids.shape[1], x, docs)
        moe_aux = []
        for layer_idx, layer in enumerate(self.layers):
            if self.training and layer_idx in self.checkpoint_blocks:
                x, aux = torch.utils.checkpoint.checkpoint(layer, x, rope, mask, use_reentrant=False)
            else:
                x, aux = layer(x, rope, mask)
            if aux is not None:
                moe_aux.append(aux)
        x = self.norm(x)
        if self.lm_head is None:
            logits = self.embed_tokens(x, unembed=True)                       # (B, S, V/tp)
        else:
            logits = self.lm_head(x)
        logits = mup.scale_logits(self.cfg, logits)                          # x 1/m under muP
        out = TransformerOutput(logits=logits, moe_aux=moe_aux)
        if moe_aux:
            # Per-rank contributions: under expert parallelism they sum over the ep group to the
            # micro-batch's values (see MoEAux).
            out.aux_loss = load_balancing_losses(moe_aux, self.groups, self.cfg.moe.global_balance).mean()
            out.z_loss = torch.stack([a.z_loss for a in moe_aux]).mean()
        if labels is not None:
            head = self.embed_tokens if self.lm_head is None else self.lm_head
            out.ce_sum = cross_entropy_sum(logits, labels, self.groups, head.start, IGNORE_INDEX)
            out.num_target_tokens = (labels != IGNORE_INDEX).sum()
        return out

    def router_loss(self, out: TransformerOutput) -> torch.Tensor:
        """``aux_loss_coef * aux + z_loss_coef * z`` (zero for dense models)."""
        if out.aux_loss is None:
            return out.logits.new_zeros((), dtype=torch.float32)
        moe = self.cfg.moe
        return moe.aux_loss_coef * out.aux_loss + moe.z_loss_coef * out.z_loss
