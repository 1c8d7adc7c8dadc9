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

FAMILIES = ("dense", "switch", "mixtral")


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts FFN settings shared by the Switch and Mixtral families."""

    num_experts: int = 8
    """Experts per MoE layer."""
    top_k: int = 2
    """Experts each token is routed to."""
    capacity_factor: float | None = None
    """Training capacity factor; None = dropless, a number = ceil(k*T/E*cf) slots per expert."""
    eval_capacity_factor: float | None = None
    """Capacity factor in eval mode (Switch uses a larger one than in training)."""
    normalize_top_k: bool = True
    """Renormalize the top-k probabilities to sum to 1 (Mixtral); Switch keeps the raw probability."""
    router_jitter: float = 0.0
    """Multiplicative uniform noise U(1-eps, 1+eps) on the router input in training (Switch: 0.01)."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss (Switch paper alpha = 1e-2)."""
    z_loss_coef: float = 0.001
    """Weight of the router z-loss (ST-MoE c_z = 1e-3)."""
    moe_layer_freq: int = 1
    """Every moe_layer_freq-th block has an MoE FFN (blocks freq-1, 2*freq-1, ...); the rest are MLPs."""
    first_k_dense: int = 0
    """The first first_k_dense blocks have a dense MLP whatever moe_layer_freq says (DeepSeek-V3: 3)."""
    expert_ffn_hidden_size: int | None = None
    """Inner size of each routed expert; null = model.ffn_hidden_size (fine-grained experts: smaller)."""
    score_function: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: softmax over the experts (Switch, Mixtral) or one sigmoid per expert (DeepSeek-V3)."""
    routed_scaling_factor: float = 1.0
    """Factor on the combine weights, applied after any renormalization (DeepSeek-V3: 2.5)."""
    n_group: int = 1
    """Equal groups the experts are split into for group-limited routing; 1 = no groups."""
    topk_group: int = 1
    """Groups each token may use, the best by the sum of each group's top-2 scores (with n_group > 1)."""
    balance_over: Literal["micro_batch", "global_batch"] = "micro_batch"
    """Tokens the load-balancing loss counts: each micro-batch's (over ep), or the step's so far on every rank."""
    dispatch_dtype: Literal["bf16", "fp8"] | None = None
    """Expert-parallel all-to-all payload: null = as computed; bf16; fp8 (e4m3, per-row scale, out only)."""
    expert_bias_update_rate: float = 0.0
    """Loss-free balancing: after each step bias_i += rate * sign(mean load - load_i); 0 = off."""
    num_shared_experts: int = 0
    """Always-on SwiGLU experts beside the routed ones, run as one FFN (DeepSeek, Qwen2-MoE); 0 = none."""
    shared_expert_ffn_hidden_size: int | None = None
    """Inner size of that shared FFN; null = num_shared_experts x the routed experts' inner size."""
    shared_expert_gate: bool = False
    """Scale the shared FFN's output per token by sigmoid(x @ w_gate) (Qwen2-MoE)."""

    @property
    def global_balance(self) -> bool:
        return self.balance_over == "global_batch"

    @property
    def expert_bias(self) -> bool:
        """Whether each router holds ``e_score_correction_bias``: with sigmoid scores (DeepSeek-V3
        keeps one, also frozen) or with loss-free balancing on."""
        return self.score_function == "sigmoid" or self.expert_bias_update_rate > 0

    def shared_ffn_size(self, expert_ffn_size: int) -> int:
        """Inner size of the shared FFN (0 without shared experts), given the routed experts'."""
        if not self.num_shared_experts:
            return 0
        return self.shared_expert_ffn_hidden_size or self.num_shared_experts * expert_ffn_size

    def capacity(self, num_tokens: int, training: bool) -> int | None:
        """Slots per expert for ``num_tokens`` routed tokens, or None when dropless."""
        cf = self.capacity_factor if training else self.eval_capacity_factor
        if cf is None or math.isinf(cf):
            return None
        return math.ceil(self.top_k * num_tokens / self.num_experts * cf)

    def validate(self, prefix: str = "model.moe") -> None:
        for name in ("num_experts", "top_k", "moe_layer_freq"):
            check_int(f"{prefix}.{name}", getattr(self, name))
        check_int(f"{prefix}.first_k_dense", self.first_k_dense, low=0)
        check_int(f"{prefix}.expert_ffn_hidden_size", self.expert_ffn_hidden_size, optional=True)
        if self.top_k > self.num_experts:
            raise ValueError(
                f"{prefix}.top_k ({self.top_k}) exceeds {prefix}.num_experts ({self.num_experts}): "
                f"choose top_k <= num_experts")
        for name in ("capacity_factor", "eval_capacity_factor"):
            cf = getattr(self, name)
            if cf is not None and not cf > 0:
                raise ValueError(f"{prefix}.{name} ({cf}) must be > 0, or null for dropless routing")
        if not 0.0 <= self.router_jitter < 1.0:
            raise ValueError(f"{prefix}.router_jitter ({self.router_jitter}) must be in [0, 1)")
        for name in ("aux_loss_coef", "z_loss_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"{prefix}.{name} ({getattr(self, name)}) must be >= 0")
        self._validate_routing(prefix)
        self._validate_shared(prefix)

    def _validate_routing(self, prefix: str) -> None:
        if self.dispatch_dtype not in (None, "bf16", "fp8"):
            raise ValueError(f"{prefix}.dispatch_dtype ({self.dispatch_dtype!r}) must be null, bf16 or fp8")
        if self.balance_over not in ("micro_batch", "global_batch"):
            raise ValueError(f"{prefix}.balance_over ({self.balance_over!r}) must be micro_batch or global_batch")
        if self.score_function not in ("softmax", "sigmoid"):
            raise ValueError(f"{prefix}.score_function ({self.score_function!r}) must be softmax or sigmoid")
        if not 0 < self.routed_scaling_factor < math.inf:
            raise ValueError(f"{prefix}.routed_scaling_factor ({self.routed_scaling_factor}) must be "
                             f"a finite number > 0 (1.0 leaves the combine weights as they are)")
        if not 0 <= self.expert_bias_update_rate < math.inf:
            raise ValueError(f"{prefix}.expert_bias_update_rate ({self.expert_bias_update_rate}) must "
                             f"be a finite number >= 0 (0 turns loss-free balancing off)")
        for name in ("n_group", "topk_group"):
            check_int(f"{prefix}.{name}", getattr(self, name))
        e, groups, kept = self.num_experts, self.n_group, self.topk_group
        if e % groups:
            raise ValueError(f"{prefix}.num_experts ({e}) is not divisible by {prefix}.n_group "
                             f"({groups}): choose n_group dividing num_experts")
        if groups > 1 and e // groups < 2:
            raise ValueError(f"{prefix}.n_group ({groups}) leaves {e // groups} expert per group; a "
                             f"group is scored by its top-2 experts: choose n_group <= num_experts/2")
        if kept > groups:
            raise ValueError(f"{prefix}.topk_group ({kept}) exceeds {prefix}.n_group ({groups}): "
                             f"choose topk_group <= n_group")
        if self.top_k > kept * (e // groups):
            raise ValueError(f"{prefix}.top_k ({self.top_k}) exceeds the {kept * (e // groups)} experts "
                             f"of the topk_group ({kept}) kept groups: raise topk_group or lower top_k")

    def _validate_shared(self, prefix: str) -> None:
        check_int(f"{prefix}.num_shared_experts", self.num_shared_experts, low=0)
        check_int(f"{prefix}.shared_expert_ffn_hidden_size", self.shared_expert_ffn_hidden_size,
                  optional=True)
        if not self.num_shared_experts:
            for name in ("shared_expert_ffn_hidden_size", "shared_expert_gate"):
                if getattr(self, name):
                    raise ValueError(f"{prefix}.{name} ({getattr(self, name)}) is set but "
                                     f"{prefix}.num_shared_experts is 0: set num_shared_experts "
                                     f">= 1 or remove {name}")


def _switch_moe() -> MoEConfig:
    # Switch Transformer (Fedus et al. 2021): top-1, raw probability as combine weight, train
    # capacity 1.25 and eval 2.0 (the paper's Table 1 / ST-MoE values), jitter 1e-2, MoE every
    # other FFN.
    return MoEConfig(num_experts=8, top_k=1, capacity_factor=1.25, eval_capacity_factor=2.0,
                     normalize_top_k=False, router_jitter=0.01, moe_layer_freq=2)


def _mixtral_moe() -> MoEConfig:
    # Mixtral (Jiang et al. 2024): 8 experts, top-2 renormalized, dropless, MoE in every block.
    return MoEConfig(num_experts=8, top_k=2, capacity_factor=None, eval_capacity_factor=None,
                     normalize_top_k=True, router_jitter=0.0, moe_layer_freq=1)


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
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

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
        if self.moe is not None:
            self.moe.validate()
            if self.moe.first_k_dense and not self.num_moe_layers:
                raise ValueError(
                    f"model.moe.first_k_dense ({self.moe.first_k_dense}) leaves no MoE block among "
                    f"the model.num_layers ({self.num_layers}) with moe_layer_freq "
                    f"({self.moe.moe_layer_freq}): lower first_k_dense or add layers")
        return self

    @property
    def shared_params(self) -> int:
        """Parameters of one MoE layer's shared FFN and its gate (active for every token)."""
        if self.moe is None or not self.moe.num_shared_experts:
            return 0
        return 3 * self.hidden_size * self.moe.shared_ffn_size(self.expert_ffn_size) + (
            self.hidden_size if self.moe.shared_expert_gate else 0)

    @property
    def attention_params(self) -> int:
        """Parameters of one block's attention: q, k, v, o and any qkv biases and q/k norms."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return (self.hidden_size * (2 * q + 2 * kv) + (q + 2 * kv if self.qkv_bias else 0)
                + (2 * self.head_dim if self.qk_norm else 0))

    def num_params(self, active: bool = False) -> int:
        """Parameter count; ``active=True`` counts only the experts a token is routed to."""
        h, f, L = self.hidden_size, self.ffn_hidden_size, self.num_layers
        attn = self.attention_params + 2 * h                     # and the block's two norms
        mlp = 3 * h * f
        total = self.vocab_size * h * (1 if self.tie_embeddings else 2) + h
        for i in range(L):
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
    moe: MoEConfig = field(default_factory=_switch_moe)


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
    moe: MoEConfig = field(default_factory=_mixtral_moe)


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


def is_int(value, low: int | None = None) -> bool:
    """Whether ``value`` is an int (a bool is not) and, with ``low``, at least ``low``."""
    return isinstance(value, int) and not isinstance(value, bool) and (low is None or value >= low)


def check_int(name: str, value, low: int = 1, optional: bool = False) -> None:
    """Raise the one-line error for a count that is not an integer >= ``low`` (None allowed
    when ``optional``): ``train.steps (0) must be an integer >= 1``."""
    if (value is None and optional) or is_int(value, low):
        return
    raise ValueError(f"{name} ({value!r}) must be an integer >= {low}" + (" or null" if optional else ""))
