"""Conversion between this repo's models and transformers' Llama / Mixtral / Qwen2-MoE /
Qwen3-MoE (pure functions; the Qwen configs are mapped in ``interop/hf_qwen.py``).

Our parameter names are transformers' names without the ``model.`` prefix, so dense weights are a
key copy. Only the MoE experts change layout:

    ours (x @ W layout)                    transformers 5.x Mixtral/Qwen*MoeForCausalLM (W @ x)
    experts.gate_proj (E, H, I)  \\
    experts.up_proj   (E, H, I)  /  -->    experts.gate_up_proj (E, 2I, H) = cat(gate^T, up^T, dim=1)
    experts.down_proj (E, I, H)     -->    experts.down_proj    (E, H, I)  = down^T

``save_pretrained`` writes Mixtral experts to disk in the original per-expert layout
(``block_sparse_moe.experts.N.w1/w2/w3``: w1 = gate^T, w3 = up^T, w2 = down^T, each 2-D) and
``from_pretrained`` fuses them again, so these functions see only the in-memory layout. The
load-balancing coefficient is rescaled both ways (``hf_aux_loss_coef``).

The "init dir" (what ``convert_hf.py import`` writes and ``train.py --init-from`` reads) holds
``model_config.json`` (our ``cfg.to_dict()``), ``model.safetensors`` (our names) and optionally
``tokenizer/``. This module imports transformers, never deepspeed.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, MixtralConfig, PretrainedConfig

from interop import hf_deepseek, hf_qwen
from model.config import CONFIG_CLASSES, TransformerConfig, config_from_dict
from model.transformer import Transformer

__all__ = ["HF_MODEL_TYPES", "from_hf_config", "from_hf_state_dict", "hf_aux_loss_coef",
           "hf_model_type", "load_init_dir", "save_init_dir", "to_hf_config", "to_hf_state_dict"]

# model_type in an HF config.json -> our family.
HF_MODEL_TYPES = {"llama": "dense", "mixtral": "mixtral", "qwen2_moe": "mixtral", "qwen3_moe": "mixtral",
                  "deepseek_v3": "mixtral"}
SUPPORTED = ("llama (LlamaForCausalLM), mixtral (MixtralForCausalLM), qwen2_moe "
             "(Qwen2MoeForCausalLM), qwen3_moe (Qwen3MoeForCausalLM) and deepseek_v3 "
             "(DeepseekV3ForCausalLM)")
HF_NAMES = {"llama": "Llama", "mixtral": "Mixtral", "qwen2_moe": "Qwen2-MoE", "qwen3_moe": "Qwen3-MoE",
            "deepseek_v3": "DeepSeek-V3"}
INIT_CONFIG_FILE = "model_config.json"
INIT_WEIGHTS_FILE = "model.safetensors"
INIT_TOKENIZER_DIR = "tokenizer"
# HF Mixtral has no router z-loss; we keep our coefficient in config.json under the name
# transformers' SwitchTransformers uses for it (Mixtral ignores unknown attributes).
Z_LOSS_ATTR = "router_z_loss_coef"


def hf_aux_loss_coef(aux_loss_coef: float, top_k: int) -> float:
    """Our load-balancing coefficient as transformers' Mixtral ``router_aux_loss_coef``.

    Ours weighs ``E / (k T) * sum_i count_i * mean_prob_i`` (1.0 at perfect balance,
    ``model/moe/losses.py``); transformers' ``load_balancing_loss_func`` omits the 1/k (k at
    balance), so the same weighted loss needs a k times smaller coefficient there.
    """
    return aux_loss_coef / top_k

SWITCH_EXPORT_ERROR = (
    "model.family 'switch' cannot be exported to transformers: HF SwitchTransformers is a T5 "
    "encoder-decoder (relative-position buckets instead of RoPE, unscaled attention, ReLU "
    "wi/wo FFN instead of SwiGLU, integer per-sequence expert capacity) with no causal-LM class; "
    "fix: train family mixtral for an HF-loadable MoE (see docs/switch.md)")

# --------------------------------------------------------------------------- configs

def hf_model_type(cfg: TransformerConfig) -> str:
    """The transformers architecture our config exports as: dense -> llama; an MoE with q/k norms
    -> qwen3_moe, else with shared experts -> qwen2_moe, else mixtral; multi-head latent
    attention -> deepseek_v3. That target then refuses whatever else it cannot hold
    (``to_hf_config``)."""
    if cfg.mla:
        return hf_deepseek.MODEL_TYPE
    if cfg.moe is None:
        return "llama"
    if cfg.qk_norm:
        return "qwen3_moe"
    return "qwen2_moe" if cfg.moe.num_shared_experts else "mixtral"


def _refusals(cfg: TransformerConfig, target: str) -> list[tuple[bool, str]]:
    """(bad, message) for each setting of ``cfg`` HF ``target`` cannot represent."""
    name = HF_NAMES[target]
    out = [(cfg.qk_norm and target != "qwen3_moe", f"model.qk_norm is true but HF {name} has no "
            "q/k norms; fix: train with qk_norm false"),
           (cfg.qkv_bias and target in ("llama", "mixtral"), f"model.qkv_bias is true but HF "
            f"{name}'s attention_bias also biases o_proj; fix: train with qkv_bias false"),
           (cfg.mtp_depth > 0 and target != hf_deepseek.MODEL_TYPE, f"model.mtp_depth ({cfg.mtp_depth}) > 0 "
            f"but HF {name} has no multi-token-prediction layers; fix: export with --drop-mtp"),
           (cfg.mup_base_hidden_size is not None, f"model.mup_base_hidden_size "
            f"({cfg.mup_base_hidden_size}) is set but HF {name} has no muP attention scale (1/d) "
            "or output multiplier; fix: train with mup_base_hidden_size null")]
    moe, deepseek = cfg.moe, target == hf_deepseek.MODEL_TYPE
    if deepseek:
        out += hf_deepseek.refusals(cfg)
    if moe is None:
        return out
    out += [
        (moe.capacity_factor is not None, f"model.moe.capacity_factor ({moe.capacity_factor}) is set "
         f"but HF {name} is dropless; fix: train with capacity_factor null"),
        (moe.eval_capacity_factor is not None, f"model.moe.eval_capacity_factor "
         f"({moe.eval_capacity_factor}) is set but HF {name} is dropless; fix: set it to null"),
        (moe.router_jitter != 0, f"model.moe.router_jitter ({moe.router_jitter}) != 0 but HF "
         f"{name}'s router_jitter_noise also scales the experts' inputs, not only the router's "
         "(Qwen has none); fix: train with router_jitter 0"),
        (moe.expert_bias and not deepseek, f"model.moe.score_function ({moe.score_function}) / "
         f"expert_bias_update_rate ({moe.expert_bias_update_rate}): HF {name} routes by softmax "
         "with no expert bias; fix: train with score_function softmax and rate 0"),
        (moe.routed_scaling_factor != 1.0 and not deepseek, f"model.moe.routed_scaling_factor "
         f"({moe.routed_scaling_factor}) != 1 but HF {name} does not scale the combine weights"),
        (moe.n_group > 1 and not deepseek, f"model.moe.n_group ({moe.n_group}) > 1 "
         f"but HF {name} has no group-limited routing; fix: train with n_group 1"),
    ]
    if deepseek:
        return out
    if target != "mixtral":
        return out + hf_qwen.qwen_refusals(cfg, target)
    return out + [
        (not moe.normalize_top_k, "model.moe.normalize_top_k is false but HF Mixtral always "
         "renormalizes the top-k weights; fix: train with normalize_top_k true"),
        (moe.moe_layer_freq != 1, f"model.moe.moe_layer_freq ({moe.moe_layer_freq}) != 1 but HF "
         "Mixtral has an MoE FFN in every layer; fix: train with moe_layer_freq 1"),
        (moe.first_k_dense > 0, f"model.moe.first_k_dense ({moe.first_k_dense}) > 0 but HF "
         "Mixtral has an MoE FFN in every layer; fix: train with first_k_dense 0"),
    ]


def to_hf_config(cfg: TransformerConfig, dtype: torch.dtype = torch.float32) -> PretrainedConfig:
    """Our config as a transformers ``LlamaConfig`` (dense) or, for mixtral, the
    ``MixtralConfig`` / ``Qwen2MoeConfig`` / ``Qwen3MoeConfig`` that ``hf_model_type`` picks.

    Raises:
        ValueError: for the switch family and for settings the HF target cannot represent.
    """
    if cfg.family == "switch":
        raise ValueError(SWITCH_EXPORT_ERROR)
    if cfg.family not in ("dense", "mixtral"):
        raise ValueError(f"model.family ({cfg.family!r}) has no HF export: use dense or mixtral")
    target = hf_model_type(cfg)
    for bad, message in _refusals(cfg, target):
        if bad:
            raise ValueError(f"cannot export to HF {HF_NAMES[target]}: {message}")
    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len, initializer_range=cfg.init_std,
        rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters=hf_deepseek.rope_parameters(cfg), attention_dropout=0.0, dtype=dtype)
    if target == "llama":
        return LlamaConfig(**common, attention_bias=False, mlp_bias=False)
    moe = cfg.moe
    common.update(router_aux_loss_coef=hf_aux_loss_coef(moe.aux_loss_coef, moe.top_k),
                  **{Z_LOSS_ATTR: moe.z_loss_coef})
    if target == hf_deepseek.MODEL_TYPE:
        return hf_deepseek.to_config(cfg, common)
    if target != "mixtral":
        return hf_qwen.to_qwen_config(cfg, target, common)
    # No dense blocks (refused above): HF's intermediate_size is the experts' inner size.
    common["intermediate_size"] = cfg.expert_ffn_size
    return MixtralConfig(
        **common, sliding_window=None, num_local_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k, router_jitter_noise=0.0, output_router_logits=False)


def from_hf_config(hf_config: PretrainedConfig) -> TransformerConfig:
    """A transformers Llama config as our ``DenseConfig``; a Mixtral, Qwen2-MoE or Qwen3-MoE
    config as our ``MixtralConfig``.

    Raises:
        ValueError: naming the HF field for architectures or features our model does not have
            (rope scaling, biases, a sliding window shorter than the context, ...).
    """
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in HF_MODEL_TYPES:
        archs = getattr(hf_config, "architectures", None) or []
        raise ValueError(
            f"config.json model_type ({model_type!r}{', ' + '/'.join(archs) if archs else ''}) is "
            f"not supported: convert_hf imports {SUPPORTED} checkpoints only")
    h, heads = hf_config.hidden_size, hf_config.num_attention_heads

    def refuse(field: str, value, why: str) -> None:
        raise ValueError(f"config.json {field} ({value!r}) is not supported: {why}")

    if hf_config.hidden_act != "silu":
        refuse("hidden_act", hf_config.hidden_act, "our MLP is SwiGLU (silu)")
    head_dim = getattr(hf_config, "head_dim", None)
    for field in ("attention_bias", "mlp_bias"):
        if getattr(hf_config, field, False):
            refuse(field, True, "its o_proj or MLP bias has no place in our model (model.qkv_bias "
                   "covers q, k and v only)")
    if getattr(hf_config, "attention_dropout", 0.0):
        refuse("attention_dropout", hf_config.attention_dropout, "our attention has no dropout; set 0.0")
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_theta = rope.pop("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    max_seq_len = hf_config.max_position_embeddings
    common = dict(
        vocab_size=hf_config.vocab_size, hidden_size=h, num_layers=hf_config.num_hidden_layers,
        num_heads=heads, num_kv_heads=hf_config.num_key_value_heads or heads,
        ffn_hidden_size=hf_config.intermediate_size, max_seq_len=max_seq_len,
        rope_theta=float(rope_theta), norm_eps=hf_config.rms_norm_eps,
        tie_embeddings=bool(hf_config.tie_word_embeddings), init_std=hf_config.initializer_range,
        attn_head_dim=None if head_dim in (None, h // heads) else head_dim,
        **hf_deepseek.rope_fields(rope, refuse))
    if model_type == "llama":
        return CONFIG_CLASSES["dense"](**common).validate()

    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True) and window < max_seq_len:
        # A window at least as long as the context is the same as full causal attention.
        refuse("sliding_window", window, f"our attention is full causal; it must be null or >= "
               f"max_position_embeddings ({max_seq_len})")
    if getattr(hf_config, "router_jitter_noise", 0.0):
        refuse("router_jitter_noise", hf_config.router_jitter_noise, "HF's jitter also scales the "
               "experts' inputs; set it to 0.0 (our router-only jitter is model.moe.router_jitter)")
    moe_defaults = CONFIG_CLASSES["mixtral"]().moe
    if model_type == hf_deepseek.MODEL_TYPE:
        return hf_deepseek.from_config(hf_config, common, refuse, moe_defaults.z_loss_coef,
                                       Z_LOSS_ATTR).validate()
    losses = dict(  # The inverse of hf_aux_loss_coef: the same weighted loss as transformers'.
        aux_loss_coef=float(hf_config.router_aux_loss_coef) * hf_config.num_experts_per_tok,
        z_loss_coef=float(getattr(hf_config, Z_LOSS_ATTR, moe_defaults.z_loss_coef)))
    if model_type in hf_qwen.QWEN_MODEL_TYPES:
        return hf_qwen.from_qwen_config(hf_config, common, losses, refuse).validate()
    moe = dataclasses.replace(moe_defaults, num_experts=hf_config.num_local_experts,
                              top_k=hf_config.num_experts_per_tok, **losses)
    return CONFIG_CLASSES["mixtral"](**common, moe=moe).validate()


# --------------------------------------------------------------------------- state dicts

def _reference_shapes(cfg: TransformerConfig) -> dict[str, torch.Size]:
    """Our parameter names and shapes for ``cfg``, read off a model built on the meta device
    without its weight init (``init_seed=None``: shapes need no weights)."""
    with torch.device("meta"):
        model = Transformer(cfg, init_seed=None)
    return {name: p.shape for name, p in model.state_dict().items()}


def _check_keys(have, want, what: str) -> None:
    missing, unexpected = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or unexpected:
        raise ValueError(f"{what} does not match the config: missing {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                         f"{' ...' if len(unexpected) > 5 else ''}")


def _check_shape(name: str, tensor: torch.Tensor, shape, what: str) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{what} tensor {name} has shape {tuple(tensor.shape)} but the config "
                         f"implies {tuple(shape)}")


def _renames(cfg: TransformerConfig) -> dict[str, str]:
    """Our name fragment -> transformers' where they differ (Qwen2-MoE's one shared expert)."""
    return dict([hf_qwen.SHARED_EXPERT_KEYS]) if hf_model_type(cfg) == "qwen2_moe" else {}


def _rename(name: str, renames: dict[str, str]) -> str:
    for old, new in renames.items():
        name = name.replace(old, new)
    return name


def to_hf_state_dict(cfg: TransformerConfig, our_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict -> the in-memory state dict of the transformers model ``hf_model_type``
    names (Llama, Mixtral, Qwen2-MoE or Qwen3-MoE ForCausalLM).

    With tied embeddings ``lm_head.weight`` is emitted as the embedding (HF's model has both keys).
    The exact inverse of ``from_hf_state_dict``.
    """
    renames = _renames(cfg)
    shapes = _reference_shapes(cfg)
    _check_keys(our_sd, shapes, "state dict")
    if cfg.mla:                                     # DeepSeek's interleaved rotary rows
        our_sd = hf_deepseek.permute_rope_rows(cfg, our_sd, to_interleaved=True)
    out = {}
    for name, t in our_sd.items():
        _check_shape(name, t, shapes[name], "state dict")
        if name.startswith("mtp."):
            continue                                    # not a module of HF's model (hf_deepseek.mtp_to_files)
        if name.endswith("mlp.experts.up_proj"):
            continue                                                   # fused with gate_proj
        if name.endswith("mlp.experts.gate_proj"):
            up = our_sd[name.removesuffix("gate_proj") + "up_proj"]
            # (E, H, I) x2 -> (E, 2I, H)
            fused = torch.cat((t.transpose(1, 2), up.transpose(1, 2)), dim=1)
            out["model." + name.removesuffix("gate_proj") + "gate_up_proj"] = fused.contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            out["model." + name] = t.transpose(1, 2).contiguous()    # (E, I, H) -> (E, H, I)
        elif name == "lm_head.weight":
            out[name] = t
        else:
            out["model." + _rename(name, renames)] = t
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def from_hf_state_dict(cfg: TransformerConfig, hf_sd: dict[str, torch.Tensor],
                       rope_interleave: bool = False) -> dict[str, torch.Tensor]:
    """A transformers Llama/Mixtral/Qwen*MoeForCausalLM state dict (the in-memory layout, as
    ``model.state_dict()`` holds it) -> ours (contiguous tensors).

    ``lm_head.weight`` is dropped when the embeddings are tied; legacy ``rotary_emb.inv_freq``
    buffers are ignored. ``rope_interleave``: DeepSeek-V3's config flag (its rotary rows are
    permuted to ours, ``interop/hf_deepseek.py``).
    """
    hf_sd = {k: v for k, v in hf_sd.items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_embeddings:
        hf_sd.pop("lm_head.weight", None)
    shapes = _reference_shapes(cfg)
    renames = {new: old for old, new in _renames(cfg).items()}
    out = {}
    for name, t in hf_sd.items():
        name = _rename(name, renames)
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name.removeprefix("model.").removesuffix("gate_up_proj")
            gate, up = t.chunk(2, dim=1)                                 # (E, 2I, H) -> 2 x (E, I, H)
            out[prefix + "gate_proj"] = gate.transpose(1, 2).contiguous()   # (E, H, I)
            out[prefix + "up_proj"] = up.transpose(1, 2).contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            out[name.removeprefix("model.")] = t.transpose(1, 2).contiguous()  # (E, H, I) -> (E, I, H)
        elif name == "lm_head.weight":
            out[name] = t.contiguous()
        elif name.startswith("model."):
            out[name.removeprefix("model.")] = t.contiguous()
        else:
            out[name] = t                     # reported as unexpected below
    _check_keys(out, shapes, "HF checkpoint (in our names)")
    for name, t in out.items():
        _check_shape(name, t, shapes[name], "HF checkpoint (in our names)")
    if cfg.mla and rope_interleave:
        out = hf_deepseek.permute_rope_rows(cfg, out, to_interleaved=False)
    return out


# --------------------------------------------------------------------------- init dir

def save_init_dir(out_dir: Path, cfg: TransformerConfig, state_dict: dict[str, torch.Tensor],
                  tokenizer=None) -> None:
    """Write an init dir: ``model_config.json``, ``model.safetensors`` and ``tokenizer/``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / INIT_CONFIG_FILE).write_text(json.dumps(cfg.to_dict(), indent=2, sort_keys=True) + "\n")
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(out_dir / INIT_WEIGHTS_FILE),
              metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out_dir / INIT_TOKENIZER_DIR))


def load_init_dir(init_dir: Path):
    """Read an init dir written by ``convert_hf.py import``.

    Returns:
        (config, state dict in our names, tokenizer or None)

    Raises:
        FileNotFoundError: naming the missing file.
        ValueError: for a malformed ``model_config.json``.
    """
    init_dir = Path(init_dir)
    for name in (INIT_CONFIG_FILE, INIT_WEIGHTS_FILE):
        if not (init_dir / name).is_file():
            raise FileNotFoundError(
                f"--init-from {init_dir}: no {name}; fix: create the folder with "
                f"`python launch/convert_hf.py import --hf HF_DIR --out {init_dir}`")
    cfg = config_from_dict(json.loads((init_dir / INIT_CONFIG_FILE).read_text()))
    state_dict = load_file(str(init_dir / INIT_WEIGHTS_FILE))
    tokenizer = None
    if (init_dir / INIT_TOKENIZER_DIR).is_dir():
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(str(init_dir / INIT_TOKENIZER_DIR), local_files_only=True)
    return cfg, state_dict, tokenizer
