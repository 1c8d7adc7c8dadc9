"""Model configuration: one frozen dataclass per family, with a nested MoE config.

Defaults are the published values of each family (Llama, Switch Transformer, Mixtral); recipes
override the sizes. Validation raises ``ValueError`` naming the field, the value and the fix.
YAML parsing lives outside ``model/`` (see ``training/config/recipe.py``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from model.checks import check_int, is_int
from model.moe.config import MoEConfig, mixtral_moe, switch_moe

__all__ = ["CONFIG_CLASSES", "FAMILIES", "DenseConfig", "MixtralConfig", "MoEConfig", "SwitchConfig",
           "TransformerConfig", "check_int", "config_from_dict", "is_int"]

FAMILIES = ("dense", "switch", "mixtral")


@dataclass(frozen=True)
class TransformerConfig:
    """Architecture shared by all families (pre-norm RMSNorm, RoPE, GQA attention, SwiGLU)."""

    family: ClassVar[str] = ""
    vocab_size: int = 32000
    """Vocabulary size (rows of the embedding and the output head)."""
    hidden_size: int = 4096
    """Model width."""
    num_layers: int = 32
    """Transformer blocks."""
    num_heads: int = 32
    """Query heads."""
    num_kv_heads: int = 32
    """Key/value heads (grouped-query attention when fewer than num_heads)."""
    ffn_hidden_size: int = 11008
    """SwiGLU inner size of the dense MLP and of each expert."""
    max_seq_len: int = 4096
    """Longest sequence the RoPE tables cover."""
    rope_theta: float = 10000.0
    """RoPE base."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share the input embedding with the output head."""
    init_std: float = 0.02
    """Std of the normal init of every weight matrix (output projections scaled by 1/sqrt(2L))."""
    attn_head_dim: int | None = None
    """Width of each attention head; null = hidden_size / num_heads (Qwen3: 128 at 2048 / 32 heads)."""
    qk_norm: bool = False
    """Per-head RMSNorm (head_dim weights) on q and k before RoPE (Qwen3, Qwen3-MoE)."""
    qkv_bias: bool = False
    """Bias on the q, k and v projections, not on o_proj (Qwen2, Qwen2-MoE)."""
    attention: Literal["gqa", "mla"] = "gqa"
    """gqa: grouped-query attention; mla: DeepSeek's multi-head latent attention (model/mla.py)."""
    q_lora_rank: int | None = None
    """MLA: rank of the query's low-rank projection (with its norm); null = one full q_proj."""
    kv_lora_rank: int | None = None
    """MLA: width of the compressed key-value latent (DeepSeek-V3: 512)."""
    qk_nope_head_dim: int | None = None
    """MLA: per-head query/key dims without RoPE, from the latent (DeepSeek-V3: 128)."""
    qk_rope_head_dim: int | None = None
    """MLA: per-head query dims with RoPE; the key's are one head shared by all (DeepSeek-V3: 64)."""
    v_head_dim: int | None = None
    """MLA: per-head value dims (DeepSeek-V3: 128)."""
    rope_scaling: Literal["yarn"] | None = None
    """null: plain RoPE; yarn: YaRN context extension by rope_factor (model/rope.py)."""
    rope_factor: float = 1.0
    """YaRN: the context stretch over rope_original_max_seq_len (DeepSeek-V3: 40)."""
    rope_original_max_seq_len: int | None = None
    """YaRN: the context the RoPE was trained at before the stretch (DeepSeek-V3: 4096)."""
    yarn_beta_fast: float = 32.0
    """YaRN: dims turning more than this often over the original context keep their frequency."""
    yarn_beta_slow: float = 1.0
    """YaRN: dims turning less than this often over the original context are interpolated."""
    yarn_mscale: float | None = None
    """YaRN: cos/sin x mscale(f, this) / mscale(f, yarn_mscale_all_dim) when both set, else x mscale(f)."""
    yarn_mscale_all_dim: float | None = None
    """YaRN with MLA: softmax scale x mscale(rope_factor, this)^2 (DeepSeek-V3: 1.0); null = x 1."""
    mtp_depth: int = 0
    """Multi-token prediction modules after the model, each one token further (model/mtp.py; DeepSeek-V3: 1)."""
    mtp_loss_coef: float = 0.3
    """Weight of the MTP loss, the mean over depths (DeepSeek-V3: 0.3, later 0.1)."""
    moe: MoEConfig | None = None
    """MoE settings; None for dense."""
    mup_base_hidden_size: int | None = None
    """muP (model/mup.py): the width the hyperparameters were tuned at; null = standard parametrization."""
    document_separator_id: int | None = None
    """Token ending each packed document (EOS): attention stays inside one, positions restart; null = off."""

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.hidden_size // self.num_heads

    @property
    def mla(self) -> bool:
        return self.attention == "mla"

    @property
    def rope_dim(self) -> int:
        """Dims each query and key head rotates: head_dim, or MLA's qk_rope_head_dim."""
        return self.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head: head_dim, or MLA's qk_nope_head_dim + qk_rope_head_dim."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def expert_ffn_size(self) -> int:
        """Inner size of each routed expert (``model.moe.expert_ffn_hidden_size`` or the MLP's)."""
        return (self.moe and self.moe.expert_ffn_hidden_size) or self.ffn_hidden_size

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether block ``layer_idx`` has an MoE FFN instead of a dense MLP: the one rule every
        part of the repo asks (model, pipeline stages, trainer, memory model, estimator)."""
        if self.moe is None or layer_idx < self.moe.first_k_dense:
            return False
        return (layer_idx + 1) % self.moe.moe_layer_freq == 0

    @property
    def moe_block_ids(self) -> list[int]:
        """The blocks with an MoE FFN, in order: the model's, then the MTP modules' (block
        ``num_layers + d - 1`` for depth d = 1..D, as DeepSeek numbers its MTP layer)."""
        blocks = range(self.num_layers + self.mtp_depth)
        return [i for i in blocks if self.is_moe_layer(i)]

    @property
    def num_moe_layers(self) -> int:
        """MoE layers with a router, the MTP modules' included."""
        return len(self.moe_block_ids)

    def validate(self) -> "TransformerConfig":
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "ffn_hidden_size", "max_seq_len"):
            check_int(f"model.{name}", getattr(self, name))
        check_int("model.attn_head_dim", self.attn_head_dim, optional=True)
        check_int("model.mup_base_hidden_size", self.mup_base_hidden_size, optional=True)
        check_int("model.document_separator_id", self.document_separator_id, low=0, optional=True)
        if (self.document_separator_id or 0) >= self.vocab_size:
            raise ValueError(f"model.document_separator_id ({self.document_separator_id}) is not a "
                             f"token id of model.vocab_size ({self.vocab_size}): use the tokenizer's EOS id")
        if self.attn_head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size ({self.hidden_size}) is not divisible by model.num_heads "
                f"({self.num_heads}): choose num_heads dividing hidden_size or set model.attn_head_dim")
        if self.head_dim % 2:
            raise ValueError(
                f"the head width ({self.head_dim}: model.attn_head_dim, else hidden_size/"
                f"num_heads) must be even for RoPE: change attn_head_dim, hidden_size or num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads ({self.num_heads}) is not divisible by model.num_kv_heads "
                f"({self.num_kv_heads}): choose num_kv_heads dividing num_heads")
        if self.rope_theta <= 0 or self.norm_eps <= 0 or self.init_std <= 0:
            raise ValueError("model.rope_theta, model.norm_eps and model.init_std must be > 0")
        self._validate_mla()
        self._validate_rope_scaling()
        check_int("model.mtp_depth", self.mtp_depth, low=0)
        if not 0 <= self.mtp_loss_coef < math.inf:
            raise ValueError(f"model.mtp_loss_coef ({self.mtp_loss_coef}) must be a finite number >= 0")
        if self.moe is not None:
            self.moe.validate()
            if self.moe.first_k_dense and not self.num_moe_layers:
                raise ValueError(
                    f"model.moe.first_k_dense ({self.moe.first_k_dense}) leaves no MoE block among "
                    f"the model.num_layers ({self.num_layers}) with moe_layer_freq "
                    f"({self.moe.moe_layer_freq}): lower first_k_dense or add layers")
        return self

    def _validate_mla(self) -> None:
        keys = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if self.attention not in ("gqa", "mla"):
            raise ValueError(f"model.attention ({self.attention!r}) must be gqa or mla")
        if not self.mla:
            for name in keys:
                if getattr(self, name) is not None:
                    raise ValueError(f"model.{name} ({getattr(self, name)}) is an MLA key but "
                                     f"model.attention is gqa: set model.attention: mla or remove {name}")
            return
        for name in keys:
            check_int(f"model.{name}", getattr(self, name), optional=name == "q_lora_rank")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"model.qk_rope_head_dim ({self.qk_rope_head_dim}) must be even for RoPE")
        for name, bad, fix in (
                ("num_kv_heads", self.num_kv_heads != self.num_heads, f"set it to model.num_heads "
                 f"({self.num_heads}): every MLA head has its own key and value"),
                ("attn_head_dim", self.attn_head_dim is not None, "remove it: MLA's widths are "
                 "qk_nope_head_dim, qk_rope_head_dim and v_head_dim"),
                ("qk_norm", self.qk_norm, "set it to false: MLA normalizes its latents instead"),
                ("qkv_bias", self.qkv_bias, "set it to false: MLA has no q/k/v biases"),
                ("mup_base_hidden_size", self.mup_base_hidden_size is not None, "set it to null: "
                 "muP's 1/d attention scale is defined for gqa only")):
            if bad:
                raise ValueError(f"model.{name} ({getattr(self, name)}) does not go with "
                                 f"model.attention mla: {fix}")

    def _validate_rope_scaling(self) -> None:
        if self.rope_scaling not in (None, "yarn"):
            raise ValueError(f"model.rope_scaling ({self.rope_scaling!r}) must be null or yarn")
        if self.rope_scaling is None:
            if self.rope_factor != 1.0 or self.rope_original_max_seq_len is not None:
                raise ValueError("model.rope_factor / rope_original_max_seq_len are set but "
                                 "model.rope_scaling is null: set model.rope_scaling: yarn or remove them")
            return
        check_int("model.rope_original_max_seq_len", self.rope_original_max_seq_len)
        if not 1.0 <= self.rope_factor < math.inf:
            raise ValueError(f"model.rope_factor ({self.rope_factor}) must be a number >= 1 (YaRN's "
                             f"stretch of the context)")
        if not 0 < self.yarn_beta_slow < self.yarn_beta_fast:
            raise ValueError(f"model.yarn_beta_slow ({self.yarn_beta_slow}) and yarn_beta_fast "
                             f"({self.yarn_beta_fast}) must satisfy 0 < beta_slow < beta_fast (32 and 1)")

    @property
    def shared_params(self) -> int:
        """Parameters of one MoE layer's shared FFN and its gate (active for every token)."""
        if self.moe is None or not self.moe.num_shared_experts:
            return 0
        return 3 * self.hidden_size * self.moe.shared_ffn_size(self.expert_ffn_size) + (
            self.hidden_size if self.moe.shared_expert_gate else 0)

    @property
    def attention_params(self) -> int:
        """Parameters of one block's attention: q, k, v, o and any qkv biases and q/k norms; for
        MLA the down- and up-projections, the two latent norms and o."""
        h, nh = self.hidden_size, self.num_heads
        if self.mla:
            qr, kvr = self.q_lora_rank, self.kv_lora_rank
            q = h * qr + qr + qr * nh * self.qk_head_dim if qr else h * nh * self.qk_head_dim
            kv = h * (kvr + self.qk_rope_head_dim) + kvr + kvr * nh * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + nh * self.v_head_dim * h
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return (self.hidden_size * (2 * q + 2 * kv) + (q + 2 * kv if self.qkv_bias else 0)
                + (2 * self.head_dim if self.qk_norm else 0))

    @property
    def attention_matmul_params(self) -> int:
        """The matmul weights of one block's attention (``attention_params`` without the q/k or
        latent norms and the biases): what a token's FLOPs count."""
        if self.mla:
            return self.attention_params - (self.q_lora_rank or 0) - self.kv_lora_rank
        return self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)

    def num_params(self, active: bool = False) -> int:
        """Parameter count; ``active=True`` counts only the experts a token is routed to. The MTP
        modules (their blocks, two input norms, (H, 2H) projection and final norm; they share the
        embedding and the head) count in the total, not in the active count, as DeepSeek reports
        V3 (685B with MTP; 37B activated without)."""
        h, f, L = self.hidden_size, self.ffn_hidden_size, self.num_layers
        attn = self.attention_params + 2 * h                     # and the block's two norms
        mlp = 3 * h * f
        total = self.vocab_size * h * (1 if self.tie_embeddings else 2) + h
        mtp = 0 if active else self.mtp_depth
        total += mtp * (2 * h * h + 3 * h)
        for i in range(L + mtp):
            if self.is_moe_layer(i):
                experts = self.moe.top_k if active else self.moe.num_experts
                total += (attn + experts * 3 * h * self.expert_ffn_size + h * self.moe.num_experts
                          + self.shared_params)
            else:
                total += attn + mlp
        return total

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["family"] = self.family
        return d


@dataclass(frozen=True)
class DenseConfig(TransformerConfig):
    """Llama-style dense decoder (Touvron et al. 2023; Llama-2 7B defaults)."""

    family: ClassVar[str] = "dense"

    def validate(self) -> "DenseConfig":
        if self.moe is not None:
            raise ValueError("model.moe is set but model.family is dense: remove model.moe or "
                             "choose family switch or mixtral")
        return super().validate()


@dataclass(frozen=True)
class SwitchConfig(TransformerConfig):
    """Decoder-only Switch Transformer (Fedus et al. 2021; Switch-Base-8 sizes by default)."""

    family: ClassVar[str] = "switch"
    vocab_size: int = 32128
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    num_kv_heads: int = 12
    ffn_hidden_size: int = 3072
    max_seq_len: int = 512
    moe: MoEConfig = field(default_factory=switch_moe)


@dataclass(frozen=True)
class MixtralConfig(TransformerConfig):
    """Mixtral sparse decoder (Jiang et al. 2024; Mixtral 8x7B sizes by default)."""

    family: ClassVar[str] = "mixtral"
    hidden_size: int = 4096
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 8
    ffn_hidden_size: int = 14336
    max_seq_len: int = 32768
    rope_theta: float = 1e6
    moe: MoEConfig = field(default_factory=mixtral_moe)


CONFIG_CLASSES: dict[str, type[TransformerConfig]] = {
    "dense": DenseConfig, "switch": SwitchConfig, "mixtral": MixtralConfig}


def config_from_dict(d: dict) -> TransformerConfig:
    """Rebuild a model config from ``TransformerConfig.to_dict()`` output (family included)."""
    d = dict(d)
    family = d.pop("family")
    if family not in CONFIG_CLASSES:
        raise ValueError(f"model.family ({family!r}) must be one of {', '.join(FAMILIES)}")
    moe = d.pop("moe", None)
    cls = CONFIG_CLASSES[family]
    _check_keys(d, cls, "model")
    if moe is not None:
        _check_keys(moe, MoEConfig, "model.moe")
        d["moe"] = MoEConfig(**moe)
    return cls(**d).validate()


def _check_keys(d: dict, cls, prefix: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"unknown key {prefix}.{unknown[0]} (known: {', '.join(sorted(known))})")
