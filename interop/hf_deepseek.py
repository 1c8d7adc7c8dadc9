"""transformers' DeepSeek-V3 (``DeepseekV3ForCausalLM``) <-> ours (pure functions, used by ``interop/hf.py``).

DeepSeek-V3 is our ``mixtral`` family with multi-head latent attention (``model.attention: mla``)
and DeepSeek's routing, each of which ours holds:

    DeepSeek-V3 config field                 ours
    q_lora_rank, kv_lora_rank                model.q_lora_rank, kv_lora_rank
    qk_nope_head_dim, qk_rope_head_dim,      model.qk_nope_head_dim, qk_rope_head_dim, v_head_dim
      v_head_dim
    rope_parameters (default or yarn)        model.rope_scaling, rope_factor, rope_original_max_seq_len,
                                               yarn_beta_fast/slow, yarn_mscale, yarn_mscale_all_dim
    n_routed_experts, num_experts_per_tok    model.moe.num_experts, top_k
    moe_intermediate_size                    model.moe.expert_ffn_hidden_size
    intermediate_size                        model.ffn_hidden_size (the first_k dense blocks)
    first_k_dense_replace                    model.moe.first_k_dense (then every block is MoE)
    n_shared_experts                         model.moe.num_shared_experts (x the experts' size, ungated)
    sigmoid scores, n_group, topk_group,     model.moe.score_function sigmoid, n_group, topk_group,
      norm_topk_prob, routed_scaling_factor    normalize_top_k, routed_scaling_factor
    mlp.gate.e_score_correction_bias         the router's expert bias (loss-free balancing)

The weights have our names. One layout differs: with ``rope_interleave`` (DeepSeek's default) the
rotary dims of each query head (the last ``qk_rope_head_dim`` rows of each head in ``q_b_proj`` /
``q_proj``) and of the shared rotary key (the last rows of ``kv_a_proj_with_mqa``) are laid out
as interleaved pairs (0, 1), (2, 3), ...; ours rotate halves (``model/rope.py``). Rotating the
pair (x_2i, x_2i+1) is rotating (x_i, x_i+d/2) after the permutation [0, 2, 4, ..., 1, 3, 5, ...]
of those rows, so import permutes them (the rotated q and k, and so the logits, are the same
bits) and export permutes back and writes ``rope_interleave: true``.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import DeepseekV3Config, PretrainedConfig

from model.config import CONFIG_CLASSES, TransformerConfig

MODEL_TYPE = "deepseek_v3"
# Where our MoE loss coefficients ride in config.json (transformers' DeepSeek-V3 has no aux loss;
# DeepSeek's own config calls its balance-loss weight aux_loss_alpha).
AUX_ATTR = "aux_loss_alpha"
# Our MTP loss weight rides in config.json under this name (transformers ignores it).
MTP_COEF_ATTR = "mtp_loss_coef"


def refusals(cfg: TransformerConfig) -> list[tuple[bool, str]]:
    """(bad, message) for what ``cfg`` has and HF DeepSeek-V3 cannot hold, beyond the settings
    every HF target refuses (``interop/hf.py``)."""
    moe = cfg.moe
    if moe is None:
        return [(True, "model.attention is mla on a dense model, but HF DeepSeek-V3 has routed "
                 "experts; fix: train family mixtral")]
    return [
        (moe.score_function != "sigmoid", f"model.moe.score_function ({moe.score_function}) but HF "
         "DeepSeek-V3 routes by sigmoid scores; fix: train with score_function sigmoid"),
        (moe.moe_layer_freq != 1, f"model.moe.moe_layer_freq ({moe.moe_layer_freq}) != 1 but HF "
         "DeepSeek-V3 has an MoE FFN in every block after first_k_dense; fix: set it to 1"),
        (moe.num_shared_experts < 1 or moe.shared_expert_gate or moe.shared_ffn_size(
            cfg.expert_ffn_size) != moe.num_shared_experts * cfg.expert_ffn_size,
         "HF DeepSeek-V3 always has ungated shared experts of num_shared_experts x the routed "
         "experts' size; fix: set num_shared_experts >= 1, shared_expert_gate false, "
         "shared_expert_ffn_hidden_size null"),
    ]


def rope_parameters(cfg: TransformerConfig) -> dict:
    """Our RoPE (plain or YaRN) as transformers' ``rope_parameters``, for every family."""
    rope = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    if cfg.rope_scaling == "yarn":
        rope.update(rope_type="yarn", factor=float(cfg.rope_factor),
                    original_max_position_embeddings=cfg.rope_original_max_seq_len,
                    beta_fast=float(cfg.yarn_beta_fast), beta_slow=float(cfg.yarn_beta_slow))
        for key, value in (("mscale", cfg.yarn_mscale), ("mscale_all_dim", cfg.yarn_mscale_all_dim)):
            if value is not None:
                rope[key] = float(value)
    return rope


def to_config(cfg: TransformerConfig, common: dict) -> PretrainedConfig:
    """Our (already checked) MLA MoE config as a ``DeepseekV3Config``; ``common``: the fields
    every HF decoder config shares (see ``interop/hf.py``)."""
    moe = cfg.moe
    drop = ("head_dim", "router_aux_loss_coef")   # DeepSeek's own names below
    fields = {k: v for k, v in common.items() if k not in drop}
    return DeepseekV3Config(
        **fields, rope_interleave=True,
        moe_intermediate_size=cfg.expert_ffn_size, n_routed_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k, n_shared_experts=moe.num_shared_experts,
        first_k_dense_replace=moe.first_k_dense, n_group=moe.n_group, topk_group=moe.topk_group,
        norm_topk_prob=moe.normalize_top_k, routed_scaling_factor=moe.routed_scaling_factor,
        q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, attention_bias=False, num_nextn_predict_layers=cfg.mtp_depth,
        **{AUX_ATTR: moe.aux_loss_coef, MTP_COEF_ATTR: cfg.mtp_loss_coef})


def rope_fields(rope: dict, refuse) -> dict:
    """Our RoPE fields from HF ``rope_parameters`` (rope_theta removed): default or yarn."""
    shown, rope = dict(rope), dict(rope)
    rope_type = rope.pop("rope_type", "default")
    if rope.pop("partial_rotary_factor", 1.0) != 1.0:
        refuse("rope_parameters", shown, "ours rotates all of a head's rotary dims")
    if rope_type == "default":
        return {}
    if rope_type != "yarn":
        refuse("rope_parameters", shown, f"ours has plain RoPE and YaRN, not {rope_type}; use a "
               f"checkpoint with rope_type 'default' or 'yarn'")
    if rope.get("attention_factor") is not None or rope.get("truncate", True) is not True:
        refuse("rope_parameters", shown, "ours derives YaRN's attention factor from mscale and "
               "truncates the correction range (transformers' defaults)")
    if not rope.get("factor") or not rope.get("original_max_position_embeddings"):
        refuse("rope_parameters", shown, "YaRN needs factor and original_max_position_embeddings")
    return dict(rope_scaling="yarn", rope_factor=float(rope["factor"]),
                rope_original_max_seq_len=int(rope["original_max_position_embeddings"]),
                yarn_beta_fast=float(rope.get("beta_fast") or 32.0),
                yarn_beta_slow=float(rope.get("beta_slow") or 1.0),
                yarn_mscale=rope.get("mscale"), yarn_mscale_all_dim=rope.get("mscale_all_dim"))


def from_config(hf_config, common: dict, refuse, z_default: float, z_attr: str) -> TransformerConfig:
    """A transformers ``DeepseekV3Config`` as our ``MixtralConfig`` with MLA.

    Args:
        common: our TransformerConfig fields read from the HF fields every decoder shares.
        refuse: (HF field, value, why) -> raises the one-line ValueError.
    """
    if hf_config.num_key_value_heads != hf_config.num_attention_heads:
        refuse("num_key_value_heads", hf_config.num_key_value_heads, "MLA has a key and value per "
               "head; it must equal num_attention_heads")
    if not hf_config.n_shared_experts:
        refuse("n_shared_experts", hf_config.n_shared_experts, "ours builds DeepSeek-V3 with >= 1 "
               "shared expert")
    defaults = CONFIG_CLASSES["mixtral"]().moe
    expert_ffn = hf_config.moe_intermediate_size
    moe = dataclasses.replace(
        defaults, num_experts=hf_config.n_routed_experts, top_k=hf_config.num_experts_per_tok,
        normalize_top_k=bool(hf_config.norm_topk_prob), first_k_dense=hf_config.first_k_dense_replace,
        expert_ffn_hidden_size=None if expert_ffn == common["ffn_hidden_size"] else expert_ffn,
        score_function="sigmoid", routed_scaling_factor=float(hf_config.routed_scaling_factor),
        n_group=hf_config.n_group, topk_group=hf_config.topk_group,
        num_shared_experts=hf_config.n_shared_experts,
        aux_loss_coef=float(getattr(hf_config, AUX_ATTR, defaults.aux_loss_coef)),
        z_loss_coef=float(getattr(hf_config, z_attr, z_default)))
    common = dict(common, attn_head_dim=None)        # HF's head_dim is the rope dims here
    return CONFIG_CLASSES["mixtral"](
        **common, moe=moe, attention="mla", q_lora_rank=hf_config.q_lora_rank,
        kv_lora_rank=hf_config.kv_lora_rank, qk_nope_head_dim=hf_config.qk_nope_head_dim,
        qk_rope_head_dim=hf_config.qk_rope_head_dim, v_head_dim=hf_config.v_head_dim,
        mtp_loss_coef=float(getattr(hf_config, MTP_COEF_ATTR, 0.3)))   # mtp_depth: set by the import


def _rope_rows(cfg: TransformerConfig, name: str, rows: int) -> torch.Tensor | None:
    """Indices of the rotary rows of weight ``name`` (None if it has none), in row order."""
    d = cfg.qk_rope_head_dim
    if name.endswith(("self_attn.q_b_proj.weight", "self_attn.q_proj.weight")):
        qk = cfg.qk_head_dim
        return torch.cat([torch.arange(h * qk + qk - d, (h + 1) * qk) for h in range(rows // qk)])
    if name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
        return torch.arange(rows - d, rows)
    return None


def permute_rope_rows(cfg: TransformerConfig, sd: dict[str, torch.Tensor],
                      to_interleaved: bool) -> dict[str, torch.Tensor]:
    """``sd`` (any names ending as ours) with the rotary rows of the q and kv_a projections
    permuted from DeepSeek's interleaved layout to rotate-half (``to_interleaved=False``) or back.
    Other tensors are passed through."""
    d = cfg.qk_rope_head_dim
    halves = torch.cat((torch.arange(0, d, 2), torch.arange(1, d, 2)))     # interleaved -> halves
    perm = halves if not to_interleaved else torch.argsort(halves)
    out = {}
    for name, t in sd.items():
        rows = _rope_rows(cfg, name, t.shape[0])
        if rows is not None:
            t = t.clone()
            groups = rows.view(-1, d)                                    # (heads, d)
            t[groups.flatten()] = t[groups[:, perm].flatten()]
        out[name] = t
    return out


# --------------------------------------------------------------------------- multi-token prediction

def mtp_to_files(cfg: TransformerConfig, our_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our MTP modules (``mtp.<k>.*``, model/mtp.py) as DeepSeek's checkpoints keep them: depth
    k + 1 as ``model.layers.<num_layers + k>.`` with ``enorm``, ``hnorm``, ``eh_proj``,
    ``shared_head.norm`` (ours ``norm``), the block's tensors by their names, the experts one
    tensor each (the on-disk layout of the main layers), and its own copies of the embedding and
    the output head (``embed_tokens``, ``shared_head.head``; ours shares the model's)."""
    sd = permute_rope_rows(cfg, {n: t for n, t in our_sd.items() if n.startswith("mtp.")}, to_interleaved=True)
    head = our_sd.get("lm_head.weight", our_sd["embed_tokens.weight"])
    out = {}
    for k in range(cfg.mtp_depth):
        src, dst = f"mtp.{k}.", f"model.layers.{cfg.num_layers + k}."
        out[dst + "embed_tokens.weight"] = our_sd["embed_tokens.weight"]
        out[dst + "shared_head.head.weight"] = head
        for name, t in sd.items():
            if not name.startswith(src):
                continue
            rest = name[len(src):].removeprefix("block.")
            if rest == "norm.weight":
                rest = "shared_head.norm.weight"
            if rest.startswith("mlp.experts."):          # (E, H, I) / (E, I, H), x @ W -> W @ x each
                for j in range(t.shape[0]):
                    out[f"{dst}mlp.experts.{j}.{rest.split('.')[-1]}.weight"] = t[j].t()
            else:
                out[dst + rest] = t
    return {n: t.contiguous() for n, t in out.items()}


def mtp_from_files(cfg: TransformerConfig, files: dict[str, torch.Tensor],
                   rope_interleave: bool) -> dict[str, torch.Tensor]:
    """The inverse of ``mtp_to_files`` for ``cfg.mtp_depth`` depths (the embedding and head
    copies dropped: ours shares the model's); rotary rows permuted when ``rope_interleave``."""
    out, experts = {}, {}
    for k in range(cfg.mtp_depth):
        src, dst = f"model.layers.{cfg.num_layers + k}.", f"mtp.{k}."
        for name, t in files.items():
            if not name.startswith(src):
                continue
            rest = name[len(src):]
            if rest in ("embed_tokens.weight", "shared_head.head.weight"):
                continue
            if rest.startswith("mlp.experts."):          # mlp.experts.<j>.<proj>.weight
                _, _, j, proj, _ = rest.split(".")
                experts.setdefault(f"{dst}block.mlp.experts.{proj}", {})[int(j)] = t.t()
            elif rest in ("enorm.weight", "hnorm.weight", "eh_proj.weight"):
                out[dst + rest] = t
            elif rest == "shared_head.norm.weight":
                out[dst + "norm.weight"] = t
            else:
                out[f"{dst}block.{rest}"] = t
    for name, per_expert in experts.items():
        out[name] = torch.stack([per_expert[j] for j in sorted(per_expert)])
    out = {n: t.contiguous() for n, t in out.items()}
    return permute_rope_rows(cfg, out, to_interleaved=False) if rope_interleave else out
