"""Rotary position embeddings (RoPE), plain or YaRN-scaled, in the "rotate half" layout.

Plain RoPE (Su et al. 2021) rotates each pair of dims (i, i + d/2) of a query or key by
``position * theta^(-2i/d)``. YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension")
stretches a model trained at ``original_max_seq_len`` to ``factor`` times that length: the
low-frequency dims (wavelengths longer than the original context / ``beta_slow`` rotations) are
interpolated (frequency / factor), the high-frequency ones (more than ``beta_fast`` rotations
over the original context) are kept, with a linear ramp between; and the attention logits are
sharpened by ``mscale = 0.1 ln(factor) + 1``, applied to cos and sin (so to q.k twice over: the
paper's sqrt(1/t)). DeepSeek-V2/V3 split that factor: cos and sin carry
``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` and MLA's softmax scale
``mscale(factor, mscale_all_dim)^2`` (``yarn_softmax_factor``). The formulas are transformers'
``_compute_yarn_parameters`` (correction range truncated to whole dims), which the DeepSeek-V3
parity test holds us to.

DeepSeek's checkpoints lay the rotary dims of MLA out interleaved, pairs (0, 1), (2, 3), ...;
``interop/hf_deepseek.py`` permutes those weight rows to this rotate-half layout at import and
back at export, so the model has one RoPE.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from model.config import TransformerConfig


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor ``0.1 * mscale * ln(factor) + 1`` (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_softmax_factor(cfg: TransformerConfig) -> float:
    """Factor on MLA's softmax scale 1/sqrt(qk_head_dim): ``mscale(factor, mscale_all_dim)^2``
    under YaRN with ``yarn_mscale_all_dim`` set (DeepSeek-V3), else 1."""
    if cfg.rope_scaling != "yarn" or not cfg.yarn_mscale_all_dim:
        return 1.0
    return yarn_mscale(cfg.rope_factor, cfg.yarn_mscale_all_dim) ** 2


class RotaryEmbedding(nn.Module):
    """RoPE tables in the "rotate half" layout that HF Llama/Mixtral weights assume; with
    ``yarn`` (a ``TransformerConfig`` whose ``rope_scaling`` is yarn) the YaRN frequencies and
    cos/sin factor."""

    def __init__(self, head_dim: int, theta: float, yarn: TransformerConfig | None = None):
        super().__init__()
        self.head_dim, self.theta, self.yarn = head_dim, theta, yarn
        self.attention_factor = 1.0
        if yarn is not None:
            m, m_all = yarn.yarn_mscale, yarn.yarn_mscale_all_dim
            self.attention_factor = (yarn_mscale(yarn.rope_factor, m) / yarn_mscale(yarn.rope_factor, m_all)
                                     if m and m_all else yarn_mscale(yarn.rope_factor))
        # Not persistent: derived from config, and kept fp32 even when the engine casts params.
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        d = self.head_dim
        exponents = torch.arange(0, d, 2, dtype=torch.float32) / d
        if self.yarn is None:
            return 1.0 / self.theta ** exponents                                         # (hd/2,)
        cfg = self.yarn
        original = cfg.rope_original_max_seq_len

        def dim_of(rotations: float) -> float:     # the dim that turns `rotations` times over `original`
            return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

        low = max(math.floor(dim_of(cfg.yarn_beta_fast)), 0)
        high = min(math.ceil(dim_of(cfg.yarn_beta_slow)), d - 1)
        ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
        keep = 1 - ramp                            # 1: extrapolate (unchanged), 0: interpolate
        wavelengths = self.theta ** exponents
        return 1.0 / (cfg.rope_factor * wavelengths) * (1 - keep) + 1.0 / wavelengths * keep

    def reset(self) -> None:
        """Recompute the frequencies in fp32: a build that creates every floating tensor in the
        training dtype (DeepSpeed's ``zero.Init`` under bf16) has rounded them."""
        self.inv_freq = self._inv_freq().to(self.inv_freq.device)

    def forward(self, seq_len: int, device: torch.device, dtype: torch.dtype,
                positions: torch.Tensor | None = None):
        """cos, sin for positions 0..S-1, (S, hd); for (s,) ``positions`` (a context-parallel
        rank's tokens, ``model/parallel/cp_layout.py``), (s, hd); for (B, s) ``positions`` (per
        document), (B, 1, s, hd)."""
        inv_freq = self.inv_freq.to(device=device, dtype=torch.float32)
        if positions is not None and positions.dim() == 1:      # the same positions for every row
            freqs = torch.outer(positions.float(), inv_freq)                            # (s, hd/2)
        elif positions is not None:          # per document (model/document_mask.py)
            freqs = positions.float()[:, None, :, None] * inv_freq                     # (B, 1, S, hd/2)
        else:
            pos = torch.arange(seq_len, device=device, dtype=torch.float32)
            freqs = torch.outer(pos, inv_freq)                                          # (S, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)                                         # (..., hd)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def rotary_for(cfg: TransformerConfig) -> RotaryEmbedding:
    """The model's RoPE: over ``cfg.rope_dim`` dims (MLA: ``qk_rope_head_dim``), YaRN-scaled
    when ``model.rope_scaling`` is yarn."""
    return RotaryEmbedding(cfg.rope_dim, cfg.rope_theta, cfg if cfg.rope_scaling == "yarn" else None)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, nh, S, hd); cos/sin: (S, hd), or (B, 1, S, hd) per document."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
