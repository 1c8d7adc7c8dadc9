"""The MoE feed-forward layer: route -> permute -> grouped experts -> unpermute.

Every step of the routing decision is visible in ``forward``; the pieces live in ``router.py``,
``dispatcher.py``, ``experts.py`` and ``losses.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from model.config import MoEConfig
from model.moe import dispatcher, losses
from model.moe.experts import GroupedExperts
from model.moe.router import Routing, TopKRouter


@dataclass
class MoEAux:
    """Auxiliary outputs of one MoE layer (losses unweighted; the model applies coefficients)."""

    aux_loss: torch.Tensor            # scalar, 1.0 at perfect balance
    z_loss: torch.Tensor              # scalar
    tokens_per_expert: torch.Tensor   # (E,) routed assignments before capacity
    dropped_frac: torch.Tensor        # scalar, dropped assignments / (k*T)
    entropy: torch.Tensor             # scalar, mean router entropy in nats

    @property
    def load_max_over_mean(self) -> torch.Tensor:
        counts = self.tokens_per_expert.float()
        return counts.max() / counts.mean().clamp_min(1e-9)


class MoELayer(nn.Module):
    """Mixture-of-experts SwiGLU FFN (Switch or Mixtral semantics, chosen by ``moe``).

    Args:
        moe: routing settings (experts, top-k, capacity, jitter, renormalization).
        hidden_size: H.
        ffn_hidden_size: I, inner size of each expert.
    """

    def __init__(self, moe: MoEConfig, hidden_size: int, ffn_hidden_size: int):
        super().__init__()
        self.moe = moe
        self.gate = TopKRouter(hidden_size, moe.num_experts, moe.top_k, moe.normalize_top_k,
                               moe.router_jitter)
        self.experts = GroupedExperts(moe.num_experts, hidden_size, ffn_hidden_size)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, MoEAux]:
        """(B, S, H) -> (B, S, H) and the layer's auxiliary outputs."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                        # (T, H)
        num_tokens = x.shape[0]
        routing = Routing(*self.gate(x))
        capacity = self.moe.capacity(num_tokens, self.training)
        plan = dispatcher.plan_dispatch(routing.expert_idx, self.moe.num_experts, capacity)
        y = self.experts(dispatcher.permute(x, plan), plan.tokens_per_expert)   # (N, H)
        out = dispatcher.unpermute(y, routing.weights, plan, num_tokens)        # (T, H)
        aux = MoEAux(
            aux_loss=losses.load_balancing_loss(routing.probs, plan.routed_per_expert,
                                                self.moe.top_k),
            z_loss=losses.router_z_loss(routing.logits),
            tokens_per_expert=plan.routed_per_expert.detach(),
            dropped_frac=(plan.num_dropped.float() / (self.moe.top_k * num_tokens)).detach(),
            entropy=losses.router_entropy(routing.probs).detach())
        return out.reshape(shape), aux
