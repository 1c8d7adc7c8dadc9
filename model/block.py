"""The transformer block: grouped-query attention, the SwiGLU MLP, and the pre-norm ``Block`` that
holds one of them each (its attention MLA when ``model.attention`` is mla, its FFN an MoE layer
when ``config.is_moe_layer`` says so). ``model/transformer.py`` stacks them."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from model import mup
from model.checkpointing import CheckpointPolicy
from model.config import TransformerConfig
from model.document_mask import attend
from model.mla import MLAttention
from model.moe.layer import MoEAux, MoELayer
from model.norm import RMSNorm
from model.parallel.context import context_attention
from model.parallel.groups import ParallelGroups
from model.parallel.layers import (ColumnParallelLinear, RowParallelLinear, column_parallel_linears,
                                   kv_heads_for_rank)
from model.rope import apply_rope


class Attention(nn.Module):
    """Causal grouped-query attention through ``F.scaled_dot_product_attention``; with a
    ``mask`` (document masking), only within each packed document (``model/document_mask.py``).

    Tensor parallelism splits the query heads over tp, and the kv heads too (or, with fewer kv
    heads than tp ranks, each rank keeps the one kv head its query heads use); ``o_proj`` is row
    parallel, so the block's output is summed over tp once. Under sequence parallelism the input
    is this rank's (B, S/tp, H) shard: it is gathered once for q, k and v, and the output is
    reduce-scattered back to a shard. Optional (Qwen): q/k/v biases, split with their output
    rows, and a per-head RMSNorm on q and k before RoPE, whose (hd,) weights every tp rank holds
    whole and applies to its own heads (gradient summed over tp; see ``RMSNorm``). Under
    context parallelism the rank holds S/cp tokens and attention runs over the cp group
    (``model.parallel.context.context_attention``, exchange ``parallel.cp_comm``).
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
        self.qk_logits = None     # model.qk_clip.HeadLogits under QK-clip (train.qk_clip_tau)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                mask=None) -> torch.Tensor:
        projs = (self.q_proj, self.k_proj, self.v_proj)
        q, k, v = column_parallel_linears(           # one gradient all-reduce for q, k and v
            x, [p.weight for p in projs], self.groups)
        if self.q_proj.bias is not None:               # (nh*hd/tp,) ... this rank's rows
            q, k, v = (t + p.bias for t, p in zip((q, k, v), projs))
        B, S, _ = q.shape                              # S: the whole sequence (S/cp under CP), also under SP
        q = q.view(B, S, self.num_heads, self.head_dim).transpose(1, 2)        # (B, nh, S, hd)
        k = k.view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)     # (B, nkv, S, hd)
        v = v.view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)     # (B, nkv, S, hd)
        if self.kv_select is not None:    # fewer kv heads than tp ranks: use ours
            k = k[:, self.kv_select:self.kv_select + 1]
            v = v[:, self.kv_select:self.kv_select + 1]
        if self.q_norm is not None:                    # per head, over hd
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if self.qk_logits is not None and self.training:
            self.qk_logits.record(q, k, self.scale or self.head_dim ** -0.5)
        gqa = k.shape[1] != self.num_heads
        if self.groups.cp > 1:                         # S/cp tokens here: exchange over cp
            y = context_attention(q, k, v, self.groups.cp_group, self.groups.cp_comm, self.scale, mask)
        elif mask is None:                             # one causal sequence per row
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
