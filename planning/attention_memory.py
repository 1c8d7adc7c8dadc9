"""Multi-head latent attention's parameters and saved activations per rank (``model/mla.py``), for
``planning/memory_model.py``."""

from __future__ import annotations

from model.config import TransformerConfig

FP32 = 4


def mla_local_params(cfg: TransformerConfig, tp: int) -> tuple[int, int]:
    """(one block's attention parameters on a tp rank, its largest projection) under MLA
    (``model/mla.py``): the up-projections and o_proj split by heads, the rest whole; plus the
    block's two norms."""
    h, heads, qr, kvr = cfg.hidden_size, cfg.num_heads // tp, cfg.q_lora_rank, cfg.kv_lora_rank
    q_up = (qr or h) * heads * cfg.qk_head_dim
    kv_up = kvr * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    down = (h * qr + qr if qr else 0) + h * (kvr + cfg.qk_rope_head_dim) + kvr
    o = heads * cfg.v_head_dim * h
    return q_up + kv_up + down + o + 2 * h, max(q_up, kv_up, o, h * (kvr + cfg.qk_rope_head_dim))


def mla_activation_bytes(cfg: TransformerConfig, a: int, heads: float, tp: int = 1, sp: bool = False) -> float:
    """Bytes one token keeps for backward in an MLA block's attention on a tp rank holding
    ``heads`` heads, ``a`` bytes per activation (``model/mla.py``):

    - each latent norm as ``norm_bytes``: its fp32 input (in fp32 the down-projection's output
      itself, the rotary key's columns included), rsqrt (4) and the normalized latent (a r);
      under sequence parallelism for this rank's 1/tp of the tokens;
    - the latents the up-projections read, [c_q, c_kv, k_rot], gathered: a (r_q + r_kv + rope);
    - q, k and the attention output at the query-key width (3 a qk per head), the value
      zero-padded to that width (a qk; when not narrower, the up-projection's [k_nope, v] output
      it is a view of), the softmax's fp32 log-sum-exp (4 per head), and o_proj's input (a v per
      head)."""
    qr, kvr, rope = cfg.q_lora_rank or 0, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    norms = (FP32 * qr + FP32 + a * qr if qr else 0) + FP32 * kvr + FP32 + a * kvr
    norms += FP32 * rope if a == FP32 else 0
    qk, v = cfg.qk_head_dim, cfg.v_head_dim
    v_kept = qk if v < qk else cfg.qk_nope_head_dim + v    # unpadded: a view of [k_nope, v]
    return (norms / (tp if sp else 1) + a * (qr + kvr + rope)
            + heads * (3 * a * qk + a * v_kept + FP32 + a * v))
