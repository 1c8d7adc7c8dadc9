"""FLOPs per token of a model: the count behind the trainer's ``mfu`` and ``mfu_full_attn``, the
cost model's compute time and the studies' training FLOPs (``docs/gpu-memory.md``, "MFU").

6 x the matmul parameters a token passes through (forward 2, backward 4 per multiply-add) plus the
attention scores and values, which no parameter counts.
"""

from __future__ import annotations

from model.config import TransformerConfig


def matmul_params_per_token(cfg: TransformerConfig) -> int:
    """Matmul parameters a token passes through: attention, the MLP or the k routed experts plus
    the router and any shared experts, and the output head (not the input embedding, a lookup);
    each MTP depth's block, projection and head too."""
    h, f, fe = cfg.hidden_size, cfg.ffn_hidden_size, cfg.expert_ffn_size
    attn = cfg.attention_matmul_params
    total = cfg.vocab_size * h            # output head
    total += cfg.mtp_depth * (2 * h * h + cfg.vocab_size * h)    # each MTP depth's projection and head
    for i in range(cfg.num_layers + cfg.mtp_depth):
        total += attn
        if cfg.is_moe_layer(i):
            total += cfg.moe.top_k * 3 * h * fe + h * cfg.moe.num_experts + cfg.shared_params
        else:
            total += 3 * h * f
    return total


def attention_widths(cfg: TransformerConfig) -> tuple[int, int]:
    """(heads x query-key width, heads x value width): the widths of the attention scores'
    product (Q K^T) and of the weighted sum of the values (P V), per token. Both are
    ``num_heads x head_dim`` here, which is ``hidden_size`` only when ``attn_head_dim`` is unset
    (Qwen3-30B-A3B: 32 x 128 = 4096 against hidden 2048); with MLA the query-key width is
    qk_nope_head_dim + qk_rope_head_dim and the value width v_head_dim (DeepSeek-V3: 192, 128)."""
    if cfg.mla:
        return cfg.num_heads * cfg.qk_head_dim, cfg.num_heads * cfg.v_head_dim
    return cfg.num_heads * cfg.head_dim, cfg.num_heads * cfg.head_dim


def train_flops_per_token(cfg: TransformerConfig, seq_len: int, causal: bool = True) -> float:
    """6 x active matmul params + attention scores and values, 6 x layers x seq x (heads x
    query-key width + heads x value width) (``attention_widths``; 12 x layers x hidden x seq when
    both are the hidden size), halved by the causal mask (``causal``, our ``mfu``) or whole
    (``mfu_full_attn``, torchtitan's and most published figures' count)."""
    qk, v = attention_widths(cfg)
    attention = (3.0 if causal else 6.0) * (cfg.num_layers + cfg.mtp_depth) * seq_len * (qk + v)
    return 6.0 * matmul_params_per_token(cfg) + attention
