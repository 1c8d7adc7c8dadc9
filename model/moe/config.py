"""Mixture-of-experts settings (``model.moe`` in a recipe), with each family's published defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from model.checks import check_int


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
    router_dtype: Literal["fp32", "bf16"] = "fp32"
    """Precision of the router's logits and softmax: fp32 (Switch's selective precision) or bf16 (the model's)."""
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
        if self.router_dtype not in ("fp32", "bf16"):
            raise ValueError(f"{prefix}.router_dtype ({self.router_dtype!r}) must be fp32 or bf16")
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


def switch_moe() -> MoEConfig:
    # Switch Transformer (Fedus et al. 2021): top-1, raw probability as combine weight, train
    # capacity 1.25 and eval 2.0 (the paper's Table 1 / ST-MoE values), jitter 1e-2, MoE every
    # other FFN.
    return MoEConfig(num_experts=8, top_k=1, capacity_factor=1.25, eval_capacity_factor=2.0,
                     normalize_top_k=False, router_jitter=0.01, moe_layer_freq=2)


def mixtral_moe() -> MoEConfig:
    # Mixtral (Jiang et al. 2024): 8 experts, top-2 renormalized, dropless, MoE in every block.
    return MoEConfig(num_experts=8, top_k=2, capacity_factor=None, eval_capacity_factor=None,
                     normalize_top_k=True, router_jitter=0.0, moe_layer_freq=1)
