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

from model.config import TransformerConfig
from model.moe.layer import MoEAux, MoELayer

IGNORE_INDEX = -100


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32 (as transformers' LlamaRMSNorm)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Embedding(nn.Embedding):
    """Token embedding that can also act as the tied output head.

    ``forward(h, unembed=True)`` computes ``h @ weight.T``: reading the weight inside this
    module's own forward is what lets ZeRO-3 gather it for the head as well.
    """

    def forward(self, x: torch.Tensor, unembed: bool = False) -> torch.Tensor:
        return F.linear(x, self.weight) if unembed else super().forward(x)


class RotaryEmbedding(nn.Module):
    """RoPE tables in the "rotate half" layout that HF Llama/Mixtral weights assume."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        # Not persistent: derived from config, and kept fp32 even when the engine casts params.
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, seq_len: int, device: torch.device, dtype: torch.dtype):
        pos = torch.arange(seq_len, device=device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq.to(device=device, dtype=torch.float32))  # (S, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)                                          # (S, hd)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, nh, S, hd); cos/sin: (S, hd)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    """Causal grouped-query attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)     # (B, nh, S, hd)
        k = self.k_proj(x).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, S, hd)
        v = self.v_proj(x).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, S, hd)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.num_kv_heads != self.num_heads)
        y = y.transpose(1, 2).reshape(B, S, self.num_heads * self.head_dim)               # (B, S, nh*hd)
        return self.o_proj(y)


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(ffn_hidden_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm transformer block; its FFN is an MLP or an MoE layer."""

    def __init__(self, cfg: TransformerConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.is_moe = cfg.is_moe_layer(layer_idx)
        if self.is_moe:
            self.mlp = MoELayer(cfg.moe, cfg.hidden_size, cfg.ffn_hidden_size)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.ffn_hidden_size)

        # Selective activation checkpointing: recompute one sub-layer in backward.
        self.checkpoint_attention = False
        self.checkpoint_ffn = False

    def _attention(self, x, rope):
        return self.self_attn(self.input_layernorm(x), rope)

    def _ffn(self, x):
        if self.is_moe:
            return self.mlp(self.post_attention_layernorm(x))
        return self.mlp(self.post_attention_layernorm(x)), None

    def forward(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, MoEAux | None]:
        if self.checkpoint_attention and self.training:
            x = x + torch.utils.checkpoint.checkpoint(self._attention, x, rope, use_reentrant=False)
        else:
            x = x + self._attention(x, rope)
        if self.checkpoint_ffn and self.training:
            y, aux = torch.utils.checkpoint.checkpoint(self._ffn, x, use_reentrant=False)
        else:
            y, aux = self._ffn(x)
        return x + y, aux


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
    """

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        self.checkpoint_blocks: set[int] = set()    # blocks recomputed whole in backward
        self.reset_parameters()

    def set_activation_checkpointing(self, policy: str) -> None:
        """Choose what backward recomputes instead of storing.

        ``none``; ``full`` (every block; stores only block inputs); ``attention`` (the attention
        sub-layer of every block); ``moe`` (the MoE FFN sub-layers); ``every_k:<k>`` (blocks 0, k,
        2k, ... whole).
        """
        n = self.cfg.num_layers
        full = set(range(n)) if policy == "full" else set()
        if policy.startswith("every_k:"):
            full = set(range(0, n, int(policy.split(":", 1)[1])))
        elif policy not in ("none", "full", "attention", "moe"):
            raise ValueError(f"train.activation_checkpointing ({policy!r}) must be none, full, "
                             f"attention, moe or every_k:<k>")
        self.checkpoint_blocks = full
        for layer in self.layers:
            layer.checkpoint_attention = policy == "attention"
            layer.checkpoint_ffn = policy == "moe" and layer.is_moe

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Normal(0, init_std) for every matrix; residual-output projections scaled by
        1/sqrt(2 * num_layers) (GPT-2 / Megatron) so the residual stream's variance does not grow
        with depth; norms at one."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.num_layers)
        for name, p in self.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                p.normal_(0.0, out_std, generator=generator)
            else:
                p.normal_(0.0, std, generator=generator)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> TransformerOutput:
        """input_ids, labels: (B, S); labels already shifted (position t predicts labels[t]),
        ``-100`` where no target."""
        x = self.embed_tokens(input_ids)                                   # (B, S, H)
        rope = self.rotary(input_ids.shape[1], x.device, x.dtype)
        moe_aux = []
        for layer_idx, layer in enumerate(self.layers):
            if self.training and layer_idx in self.checkpoint_blocks:
                x, aux = torch.utils.checkpoint.checkpoint(layer, x, rope, use_reentrant=False)
            else:
                x, aux = layer(x, rope)
            if aux is not None:
                moe_aux.append(aux)
        x = self.norm(x)
        logits = self.embed_tokens(x, unembed=True) if self.lm_head is None else self.lm_head(x)  # (B, S, V)
        out = TransformerOutput(logits=logits, moe_aux=moe_aux)
        if moe_aux:
            out.aux_loss = torch.stack([a.aux_loss for a in moe_aux]).mean()
            out.z_loss = torch.stack([a.z_loss for a in moe_aux]).mean()
        if labels is not None:
            out.ce_sum = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                                         ignore_index=IGNORE_INDEX, reduction="sum")
            out.num_target_tokens = (labels != IGNORE_INDEX).sum()
        return out

    def router_loss(self, out: TransformerOutput) -> torch.Tensor:
        """``aux_loss_coef * aux + z_loss_coef * z`` (zero for dense models)."""
        if out.aux_loss is None:
            return out.logits.new_zeros((), dtype=torch.float32)
        moe = self.cfg.moe
        return moe.aux_loss_coef * out.aux_loss + moe.z_loss_coef * out.z_loss
