"""MoE auxiliary losses and routing statistics (docs/load-balancing.md).

Both losses are computed per MoE layer from that layer's routing and averaged over layers by the
model; they are returned, never stored in globals.
"""

from __future__ import annotations

import torch


def load_balancing_loss(probs: torch.Tensor, routed_per_expert: torch.Tensor,
                        top_k: int, total_tokens: int | None = None) -> torch.Tensor:
    """Switch/Megatron load-balancing loss, 1.0 at perfect balance.

    ``aux = E / (k*T) * sum_i count_i * mean_prob_i``, where ``count_i`` counts the (token, slot)
    assignments routed to expert i before any capacity drop, and ``mean_prob_i`` is the router
    probability of expert i averaged over the T tokens. Only ``mean_prob`` carries gradient (the
    counts come from an argmax), as in the Switch paper.

    Args:
        probs: (T, E) fp32 router probabilities.
        routed_per_expert: (E,) routed assignments per expert (sums to k*T).
        top_k: k.
        total_tokens: when ``probs`` holds one rank's share of a larger batch (expert
            parallelism), the batch's token count; ``routed_per_expert`` must then be the
            batch's counts. The result is this rank's additive share of the batch's loss.
    """
    num_tokens, num_experts = probs.shape
    total = total_tokens or num_tokens
    mean_prob = probs.sum(dim=0) / total                                        # (E,)
    counts = routed_per_expert.to(probs.dtype)
    return num_experts / (top_k * total) * torch.sum(counts * mean_prob)


def router_z_loss(logits: torch.Tensor, total_tokens: int | None = None) -> torch.Tensor:
    """ST-MoE router z-loss: ``mean over tokens of logsumexp(logits)^2`` (fp32); with
    ``total_tokens``, this rank's additive share of the batch's mean."""
    return torch.logsumexp(logits.float(), dim=-1).square().sum() / (total_tokens or logits.shape[0])


def router_entropy(probs: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of the entropy of the router distribution, in nats."""
    return -(probs * torch.log(probs.clamp_min(1e-20))).sum(dim=-1).mean()
