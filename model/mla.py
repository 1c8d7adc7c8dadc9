"""Multi-head latent attention (MLA), DeepSeek-V2/V3's attention (``model.attention: mla``).

Keys and values are not projected from the hidden state per head but from one compressed latent
per token, ``c_kv = norm(x W_dkv)`` of ``kv_lora_rank`` dims (DeepSeek-V3: 512 against 128 heads
x (128 + 128) dims of keys and values), which is all an inference KV cache has to keep, with one
shared RoPE key of ``qk_rope_head_dim`` dims beside it (RoPE does not commute with the
up-projection, so the rotated part is "decoupled": computed from x directly and shared by all
heads). The query optionally goes through a low-rank bottleneck too (``q_lora_rank``), which
saves activation memory in training, not cache:

    c_q   = norm(x W_dq)                      (B, S, q_lora_rank)      or no c_q: q = x W_q
    q     = c_q W_uq                          (B, S, nh, nope + rope)  per head: [q_nope, q_rot]
    [c_kv, k_rot] = x W_dkv                   (B, S, kv_lora_rank + rope)
    [k_nope, v]   = norm(c_kv) W_ukv          (B, S, nh, nope + v)
    k     = [k_nope, RoPE(k_rot) for every head],  q_rot = RoPE(q_rot)
    out   = softmax(q k^T * scale) v  W_o,     scale = (nope + rope)^-1/2 x YaRN's mscale^2

In training MLA costs more than GQA per token (two chained projections each for q and kv); its
win is at inference. Parameter names are transformers' ``DeepseekV3Attention``'s. The values are
narrower than the queries and keys (128 against 192 in DeepSeek-V3), and the fused attention
kernels (FlashAttention, and torch's CPU flash kernel) take one head width for all three, else
SDPA falls back to the math path, which keeps the (S, S) probabilities of every head for backward:
so v is zero-padded to the query-key width and the padding sliced off the output, as inference
engines do for MLA (1.5x the P V product's FLOPs at DeepSeek-V3's widths, no (S, S) memory).

Tensor parallelism splits the heads: the up-projections ``q_b_proj`` / ``q_proj`` and
``kv_b_proj`` are column parallel (each head's rows stay on one rank), ``o_proj`` row parallel;
the down-projections and the latent norms are small and every tp rank holds them whole and runs
them on the tokens it holds. The latents then enter the tensor-parallel region in one collective
(identity forward and gradient all-reduce; under sequence parallelism an all-gather of the
(B, S/tp, .) latent shards, narrower than the hidden state, as Megatron-Core does), so the
down-projections' gradients are complete on each rank, summed over tp only under sequence
parallelism, where each rank saw different tokens (as the norms).

Context parallelism: the rank holds S/cp tokens and attention runs over the cp group
(``model.parallel.context.context_attention``); the padded values give q, k and v one head
width, which the exchanges need too.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.config import TransformerConfig
from model.document_mask import attend
from model.norm import RMSNorm
from model.parallel import weight_grad
from model.parallel.context import context_attention
from model.parallel.groups import ParallelGroups
from model.parallel.layers import (ColumnParallelLinear, ReplicatedLinear, RowParallelLinear,
                                   check_tp_divides, column_parallel_linears, enter_tp_region)
from model.rope import apply_rope, yarn_softmax_factor

# The latent norms' epsilon: DeepSeek's reference code and transformers use RMSNorm's default
# 1e-6 there, not the model's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    """Causal multi-head latent attention (see the module docstring); with a ``mask`` (document
    masking) only within each packed document. ``rope``: the (cos, sin) tables over
    ``qk_rope_head_dim`` dims (``model.rope.rotary_for``)."""

    def __init__(self, cfg: TransformerConfig, groups: ParallelGroups | None = None):
        super().__init__()
        g = groups or ParallelGroups()
        h, nh = cfg.hidden_size, cfg.num_heads
        check_tp_divides("model.num_heads", nh, g.tp)
        self.num_heads = nh // g.tp                                     # local heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.q_rank, self.kv_rank = cfg.q_lora_rank, cfg.kv_lora_rank
        qk = self.nope + self.rope
        if self.q_rank:
            self.q_a_proj = ReplicatedLinear(h, self.q_rank, g)
            self.q_a_layernorm = RMSNorm(self.q_rank, LATENT_NORM_EPS, g)
            self.q_b_proj = ColumnParallelLinear(self.q_rank, nh * qk, g)
        else:
            self.q_proj = ColumnParallelLinear(h, nh * qk, g)
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, self.kv_rank + self.rope, g)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, LATENT_NORM_EPS, g)
        self.kv_b_proj = ColumnParallelLinear(self.kv_rank, nh * (self.nope + self.v_dim), g)
        self.o_proj = RowParallelLinear(nh * self.v_dim, h, g)
        self.groups = g
        self.scale = qk ** -0.5 * yarn_softmax_factor(cfg)
        self.qk_logits = None     # model.qk_clip.HeadLogits under QK-clip (train.qk_clip_tau)

    def _latents(self, x: torch.Tensor) -> list[torch.Tensor]:
        """[c_q (if q_lora_rank)], c_kv, k_rot over the whole sequence, in the tp region."""
        c_kv, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        parts = [self.kv_a_layernorm(c_kv), k_rot]                  # (B, s, r_kv), (B, s, rope)
        if self.q_rank:
            parts.insert(0, self.q_a_layernorm(self.q_a_proj(x)))   # (B, s, r_q)
        widths = [p.shape[-1] for p in parts]
        # One collective for all of them; s = S, or S/tp under sequence parallelism.
        return list(enter_tp_region(torch.cat(parts, dim=-1), self.groups).split(widths, dim=-1))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                mask=None) -> torch.Tensor:
        latents = self._latents(x)
        if self.q_rank:
            c_q, c_kv, k_rot = latents
            q = weight_grad.linear(c_q, self.q_b_proj.weight)                 # (B, S, nh*qk/tp)
        else:
            c_kv, k_rot = latents
            q = column_parallel_linears(x, (self.q_proj.weight,), self.groups)[0]
        B, S, _ = c_kv.shape                           # S: the whole sequence, also under SP
        q = q.view(B, S, self.num_heads, self.nope + self.rope).transpose(1, 2)   # (B, nh, S, qk)
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)
        kv = weight_grad.linear(c_kv, self.kv_b_proj.weight)                 # (B, S, nh*(nope+v)/tp)
        kv = kv.view(B, S, self.num_heads, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)                # (B, nh, S, nope | v)
        k_rot = apply_rope(k_rot.view(B, 1, S, self.rope), *rope)            # (B, 1, S, rope)
        q = torch.cat((q_nope, apply_rope(q_rot, *rope)), dim=-1)
        k = torch.cat((k_nope, k_rot.expand(-1, self.num_heads, -1, -1)), dim=-1)
        if self.qk_logits is not None and self.training:
            self.qk_logits.record(q, k, self.scale)
        pad = self.nope + self.rope - self.v_dim
        if pad > 0:      # fused kernels want one head width: zero value dims, sliced off below
            v = F.pad(v, (0, pad))                                           # (B, nh, S, qk)
        if self.groups.cp > 1:                         # S/cp tokens here: exchange over cp
            y = context_attention(q, k, v, self.groups.cp_group, self.groups.cp_comm, self.scale, mask)
        elif mask is None:                             # one causal sequence per row
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:                                          # packed documents apart
            y = attend(q, k, v, mask, self.scale, False)
        y = y[..., :self.v_dim].transpose(1, 2).reshape(B, S, self.num_heads * self.v_dim)  # (B, S, nh*v/tp)
        return self.o_proj(y)
