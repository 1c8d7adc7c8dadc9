"""transformers' Qwen2-MoE and Qwen3-MoE configs <-> ours (pure functions, used by ``interop/hf.py``).

Both are Mixtral's dropless softmax top-k MoE with more options, each of which our ``mixtral``
family holds, so they import into it and export back from it:

    Qwen config field                        ours
    num_experts, num_experts_per_tok         model.moe.num_experts, top_k
    norm_topk_prob                           model.moe.normalize_top_k
    moe_intermediate_size                    model.moe.expert_ffn_hidden_size (null: = ffn_hidden_size)
    intermediate_size                        model.ffn_hidden_size (the dense MLP blocks)
    decoder_sparse_step                      model.moe.moe_layer_freq
    mlp_only_layers = [0, ..., k-1]          model.moe.first_k_dense = k (other lists are refused)
    head_dim                                 model.attn_head_dim (null: = hidden_size / num_heads)
    q_norm, k_norm (Qwen3-MoE, always)       model.qk_norm true
    qkv_bias (Qwen2-MoE)                     model.qkv_bias
    shared_expert, shared_expert_gate        one gated shared FFN of shared_expert_intermediate_size
    (Qwen2-MoE, always)                      (num_shared_experts 1, shared_expert_gate true)

The weights are Mixtral's names and layout plus ``self_attn.{q,k}_norm``, the q/k/v biases and
Qwen2-MoE's ``mlp.shared_expert.*`` (ours ``mlp.shared_experts.*``, see ``SHARED_EXPERT_KEYS``).
"""

from __future__ import annotations

import dataclasses

from transformers import PretrainedConfig, Qwen2MoeConfig, Qwen3MoeConfig

from model.config import CONFIG_CLASSES, TransformerConfig

QWEN_MODEL_TYPES = ("qwen2_moe", "qwen3_moe")
# (ours, transformers') parameter-name fragment of Qwen2-MoE's shared expert.
SHARED_EXPERT_KEYS = ("mlp.shared_experts.", "mlp.shared_expert.")


def qwen_refusals(cfg: TransformerConfig, model_type: str) -> list[tuple[bool, str]]:
    """(bad, message) for what ``cfg`` has and the Qwen model ``model_type`` cannot hold, beyond
    the routing rules it shares with Mixtral (``interop/hf.py``). ``hf_model_type`` picks
    Qwen3-MoE for q/k norms and Qwen2-MoE for shared experts without them."""
    moe = cfg.moe
    if model_type == "qwen3_moe":
        return [
            (cfg.qkv_bias, "model.qkv_bias is true but HF Qwen3-MoE's attention_bias also biases "
             "o_proj; fix: train with qkv_bias false"),
            (moe.num_shared_experts > 0, f"model.moe.num_shared_experts ({moe.num_shared_experts}) "
             "> 0 but HF Qwen3-MoE has no shared experts (Qwen2-MoE has one but no q/k norms); "
             "fix: train with num_shared_experts 0 or qk_norm false"),
        ]
    return [(not moe.shared_expert_gate, "model.moe.shared_expert_gate is false but HF Qwen2-MoE "
             "always gates its shared expert; fix: train with shared_expert_gate true")]


def to_qwen_config(cfg: TransformerConfig, model_type: str, common: dict) -> PretrainedConfig:
    """Our (already checked) MoE config as a ``Qwen2MoeConfig`` / ``Qwen3MoeConfig``;
    ``common``: the fields every HF decoder config shares (see ``interop/hf.py``)."""
    moe = cfg.moe
    fields = dict(
        common, intermediate_size=cfg.ffn_hidden_size, moe_intermediate_size=cfg.expert_ffn_size,
        num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
        norm_topk_prob=moe.normalize_top_k, decoder_sparse_step=moe.moe_layer_freq,
        mlp_only_layers=list(range(moe.first_k_dense)), use_sliding_window=False,
        output_router_logits=False)
    if model_type == "qwen3_moe":
        return Qwen3MoeConfig(**fields, attention_bias=False)
    return Qwen2MoeConfig(**fields, qkv_bias=cfg.qkv_bias,
                          shared_expert_intermediate_size=moe.shared_ffn_size(cfg.expert_ffn_size))


def _moe_layer_rule(hf_config, refuse) -> tuple[int, int]:
    """(first_k_dense, moe_layer_freq) giving HF's MoE blocks: block i is MoE when i is not in
    ``mlp_only_layers`` and (i + 1) % ``decoder_sparse_step`` == 0."""
    step, only = hf_config.decoder_sparse_step, set(hf_config.mlp_only_layers or ())
    layers = range(hf_config.num_hidden_layers)
    want = [i not in only and (i + 1) % step == 0 for i in layers]
    for k in range(len(layers)):
        if want == [i >= k and (i + 1) % step == 0 for i in layers]:
            return k, step
    refuse("mlp_only_layers", sorted(only), "ours can make only the first k blocks dense "
           "(model.moe.first_k_dense) besides decoder_sparse_step")
    raise AssertionError("refuse raises")


def from_qwen_config(hf_config, common: dict, losses: dict, refuse) -> TransformerConfig:
    """A transformers Qwen2-MoE / Qwen3-MoE config as our ``MixtralConfig``.

    Args:
        common: our TransformerConfig fields read from the HF fields every decoder shares.
        losses: our MoEConfig loss coefficients read from HF's (as for Mixtral).
        refuse: (HF field, value, why) -> raises the one-line ValueError.
    """
    qwen3 = hf_config.model_type == "qwen3_moe"
    if not hf_config.num_experts:
        refuse("num_experts", hf_config.num_experts, "a Qwen MoE without experts is dense; ours "
               "imports MoE checkpoints as family mixtral")
    first_k_dense, freq = _moe_layer_rule(hf_config, refuse)
    expert_ffn = hf_config.moe_intermediate_size
    shared = {}
    if not qwen3:
        size = hf_config.shared_expert_intermediate_size
        if not size:
            refuse("shared_expert_intermediate_size", size, "ours needs a shared expert of size >= 1")
        shared = dict(num_shared_experts=1, shared_expert_gate=True,
                      shared_expert_ffn_hidden_size=None if size == expert_ffn else size)
    moe = dataclasses.replace(
        CONFIG_CLASSES["mixtral"]().moe, num_experts=hf_config.num_experts,
        top_k=hf_config.num_experts_per_tok, normalize_top_k=bool(hf_config.norm_topk_prob),
        moe_layer_freq=freq, first_k_dense=first_k_dense,
        expert_ffn_hidden_size=None if expert_ffn == common["ffn_hidden_size"] else expert_ffn,
        **shared, **losses)
    return CONFIG_CLASSES["mixtral"](**common, moe=moe, qk_norm=qwen3,
                                     qkv_bias=not qwen3 and bool(hf_config.qkv_bias))
