"""Top-k router: fp32 softmax over all experts, top-k, optional renormalization, jitter.

Both MoE families use this one function; their differences are config values:

    Switch : softmax(all E) -> top-1 -> combine weight = that probability (no renormalization)
    Mixtral: softmax(all E) -> top-2 -> renormalize the two probabilities to sum to 1

The router runs in fp32 whatever the model dtype ("selective precision", Switch Transformer
section 2.4): a bf16 softmax over experts is what made the paper's bf16 runs diverge.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.parallel import comm
from model.parallel.groups import ParallelGroups
from model.parallel.layers import replicated


@dataclass
class Routing:
    """One routing decision for T tokens over E experts, k choices each."""

    logits: torch.Tensor        # (T, E) fp32 router logits
    probs: torch.Tensor         # (T, E) fp32 softmax over all experts
    expert_idx: torch.Tensor    # (T, k) int64 chosen experts, best first
    weights: torch.Tensor       # (T, k) fp32 combine weights


def route(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, normalize: bool,
          jitter: float = 0.0, training: bool = False,
          generator: torch.Generator | None = None) -> Routing:
    """Route tokens to experts.

    Args:
        x: (T, H) token activations, any dtype.
        gate_weight: (E, H) router weight.
        top_k: experts per token.
        normalize: renormalize the top-k probabilities to sum to 1 (Mixtral) or keep them (Switch).
        jitter: multiplicative noise eps; the router input is scaled by U(1-eps, 1+eps) in
            training only (Switch Transformer's "jitter noise"). Only the router sees the noise;
            the experts get the clean activations.
        training: whether the module is in training mode.
        generator: optional RNG for the jitter.

    Returns:
        The routing decision, all router math in fp32.
    """
    x32 = x.float()
    if training and jitter > 0:
        noise = torch.empty_like(x32).uniform_(1.0 - jitter, 1.0 + jitter, generator=generator)
        x32 = x32 * noise
    logits = F.linear(x32, gate_weight.float())                  # (T, E) fp32
    probs = torch.softmax(logits, dim=-1)                        # (T, E)
    weights, expert_idx = torch.topk(probs, top_k, dim=-1)       # (T, k), (T, k)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(logits=logits, probs=probs, expert_idx=expert_idx, weights=weights)


class TopKRouter(nn.Module):
    """The router's (E, H) weight and ``route`` as one module.

    The weight is only read inside this module's ``forward``, and ``forward`` returns plain
    tensors: ZeRO-3 gathers a partitioned parameter around its module's forward and, for the
    backward, hooks the module's tensor outputs (it cannot see tensors inside a dataclass).

    Args:
        hidden_size: H.
        num_experts: E.
        top_k: experts per token.
        normalize: renormalize the top-k probabilities (Mixtral) or not (Switch).
        jitter: multiplicative router-input noise in training.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, normalize: bool,
                 jitter: float = 0.0, groups=None):
        super().__init__()
        self.groups = groups or ParallelGroups()
        self.weight = replicated(nn.Parameter(torch.empty(num_experts, hidden_size)), groups)
        self.top_k, self.normalize, self.jitter = top_k, normalize, jitter

    def forward(self, x: torch.Tensor):
        """(T, H) -> (logits, probs, expert_idx, weights), as in ``Routing`` (fp32)."""
        weight = comm.sync_grad(self.weight, self.groups.ep_group)   # replicated over ep
        r = route(x, weight, self.top_k, self.normalize, self.jitter, self.training)
        return r.logits, r.probs, r.expert_idx, r.weights
