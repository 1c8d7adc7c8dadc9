"""Attention's saved activations per token and rank, grouped-query (``model/block.py``) and
multi-head latent (``model/mla.py``, also its parameters), with context parallelism's exchanges
(``model/parallel/context.py``, ``ring.py``), for ``planning/memory_model.py``."""

from __future__ import annotations

import math

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


def _kv_held(cfg: TransformerConfig, tp: int) -> float:
    """KV heads on a tp rank: split over tp, or all of them replicated when fewer than tp."""
    return cfg.num_kv_heads / tp if cfg.num_kv_heads >= tp else cfg.num_kv_heads


def gqa_activation_bytes(cfg: TransformerConfig, a: int, tp: int = 1, norm=None) -> float:
    """Bytes one token keeps for backward in a grouped-query attention core on a tp rank: q and
    k after RoPE (a h/tp, a kv hd), v (a kv hd), SDPA's output (a h/tp; ``o_proj`` saves a view of
    it) and logsumexp (4 per local head), as flash/efficient SDPA keep them; RoPE keeps only its
    shared (S, hd) tables; q/k norms: ``norm(hd)`` per head (``memory_model.norm_bytes`` without
    the product)."""
    hd, heads = cfg.head_dim, cfg.num_heads / tp
    kv_used = cfg.num_kv_heads / tp if cfg.num_kv_heads >= tp else 1
    kv_held = _kv_held(cfg, tp)
    qk_norm = cfg.qk_norm * (heads + kv_used) * norm(hd) if cfg.qk_norm else 0.0
    return 2 * a * heads * hd + a * (kv_used + kv_held) * hd + FP32 * heads + qk_norm


def cp_attention_extra(cfg: TransformerConfig, a: int, tp: int, cp: int, cp_comm: str) -> float:
    """What one of a rank's S/cp tokens keeps for backward under context parallelism beyond the
    single-process attention (``gqa_activation_bytes``, ``mla_activation_bytes``), per tp rank's
    nh heads of query-key width d and nkv key/value heads:

    - ``a2a``: SDPA saves the exchanged q, k, v and its output, as many bytes as the local ones,
      but kv heads travel repeated to lcm(nkv, cp) (2 a d (lcm - nkv) more), and the output turned
      back into sequence shards is a second tensor, which ``o_proj`` saves (a nh d).
    - ``allgather``: the whole K and V on every rank instead of the local ones (2 a nkv d (cp - 1)
      more per local token), and the two query chunks' outputs concatenated for ``o_proj``
      (a nh d). CPU SDPA also saves a causal mask per chunk, which GPU kernels do not build: not
      counted.
    - ``p2p``: the ring's output accumulates in fp32 ((4 - a) nh d more) and is copied into
      ``o_proj``'s layout (a nh d).
    MLA (nkv = nh, d the query-key width): the value travels and is saved at width d, zero-padded,
    instead of the view of the up-projection's output (``mla_activation_bytes``' v_kept); its
    ``o_proj`` input is a slice of the output in any case, so no second copy.
    Measured against the saved tensors at CP2 and CP4 (``tests/planning/test_cp_estimates.py``)."""
    if cp == 1:
        return 0.0
    heads = cfg.num_heads / tp
    if cfg.mla:
        d = cfg.qk_head_dim
        v_kept = d if cfg.v_head_dim < d else cfg.qk_nope_head_dim + cfg.v_head_dim
        per_head = {"a2a": a * (d - v_kept), "allgather": 2 * a * d * (cp - 1) + a * (d - v_kept),
                    "p2p": (FP32 - a) * d}[cp_comm]
        return heads * per_head
    d = cfg.head_dim
    kv = _kv_held(cfg, tp)
    copy = a * heads * d                                 # o_proj's own copy of the output
    repeated = math.lcm(int(kv), cp)                     # Ulysses' kv heads after repetition
    return copy + {"a2a": 2 * a * d * (repeated - kv), "allgather": 2 * a * kv * d * (cp - 1),
                   "p2p": (FP32 - a) * heads * d}[cp_comm]
