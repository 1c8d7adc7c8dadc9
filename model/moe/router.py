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

from model.parallel.grad_sync import sum_grad_over
from model.parallel.groups import ParallelGroups
from model.parallel.layers import replicated

_MASK64 = (1 << 64) - 1


@dataclass
class Routing:
    """One routing decision for T tokens over E experts, k choices each."""

    logits: torch.Tensor        # (T, E) fp32 router logits
    probs: torch.Tensor         # (T, E) fp32 softmax over all experts
    expert_idx: torch.Tensor    # (T, k) int64 chosen experts, best first
    weights: torch.Tensor       # (T, k) fp32 combine weights


def route(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, normalize: bool,
          noise: torch.Tensor | None = None) -> Routing:
    """Route tokens to experts.

    Args:
        x: (T, H) token activations, any dtype.
        gate_weight: (E, H) router weight.
        top_k: experts per token.
        normalize: renormalize the top-k probabilities to sum to 1 (Mixtral) or keep them (Switch).
        noise: (T, H) multiplicative jitter for the router input (``jitter_noise``), or None.
            Only the router sees it; the experts get the clean activations.

    Returns:
        The routing decision, all router math in fp32.
    """
    x32 = x.float()
    if noise is not None:
        x32 = x32 * noise
    logits = F.linear(x32, gate_weight.float())                  # (T, E) fp32
    probs = torch.softmax(logits, dim=-1)                        # (T, E)
    weights, expert_idx = torch.topk(probs, top_k, dim=-1)       # (T, k), (T, k)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(logits=logits, probs=probs, expert_idx=expert_idx, weights=weights)


def jitter_noise(shape: tuple[int, int], eps: float, device: torch.device, first_sample: int = 0,
                 num_samples: int = 1) -> torch.Tensor:
    """Switch Transformer's jitter: U(1-eps, 1+eps) noise of ``shape`` (T, H), fp32, for T tokens
    made of ``num_samples`` equal sequences, the first being sample ``first_sample`` of the
    micro-batch.

    One base seed per call comes from the default CPU generator (a host draw: no device sync),
    and each sample's noise from its own stream, seeded by (base, sample index). Why:

    * Recomputation: ``torch.utils.checkpoint`` restores the default generators, and only
      them, before it re-runs a checkpointed block or MoE layer in backward, so the recomputed
      forward draws the same base and routes exactly as the first one. A generator of the
      model's own would have advanced (and under expert parallelism the recomputed exchange
      would send other rows than the first).
    * Replication over tp: the tp ranks of a group route the same tokens, and the row-parallel
      sum adds their partial outputs of the same experts, so they must draw the same noise:
      their default generators must be seeded alike, from every rank coordinate but tp
      (Megatron's convention). A generator handed in by the caller would advance between a
      forward and its recomputation, and a seed set per micro-batch would have changed by then
      under the pipeline's 1F1B schedule (a later micro-batch's forward runs before an earlier
      one's recomputation). The model cannot verify the seeding without a collective per
      layer; ``comm.replica_divergence`` of the layers' ``MoEAux.tokens_per_expert`` over tp
      does, when the trainer asks.
    * Layout: each sample's stream depends only on its index in the micro-batch, so with the
      seed also independent of the ep rank, an ep rank draws for its samples exactly what the
      unsharded model draws for them, and every tp/ep/sequence-parallel layout routes as one GPU.
      Cost: one reseed and one ``uniform_`` per local sample (1 in the Switch recipes at EP8).

    Drawing the (T, H) noise on tp rank 0 and broadcasting it would need no seeding convention,
    but costs a T*H collective per MoE layer, as much as the layer's activations.
    """
    base = int(torch.randint(1 << 62, (1,)).item())      # default CPU generator, a host value
    gen = torch.Generator(device=device)
    noise = torch.empty((num_samples, shape[0] // num_samples, shape[1]), device=device,
                        dtype=torch.float32)                            # (B, S, H)
    for b in range(num_samples):
        gen.manual_seed(_mix(base, first_sample + b))
        noise[b].uniform_(1.0 - eps, 1.0 + eps, generator=gen)
    return noise.view(shape)                                             # (T, H)


def _mix(base: int, index: int) -> int:
    """SplitMix64 of (base, index): independent 63-bit seeds for neighbouring indices."""
    z = (base + 0x9E3779B97F4A7C15 * (index + 1)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class TopKRouter(nn.Module):
    """The router's (E, H) weight and ``route`` as one module.

    The weight is only read inside this module's ``forward``, and ``forward`` returns plain
    tensors: ZeRO-3 gathers a partitioned parameter around its module's forward and, for the
    backward, hooks the module's tensor outputs (it cannot see tensors inside a dataclass).
    In training with ``jitter > 0`` the input is scaled by ``jitter_noise`` (see there for how
    the noise stays the same on every tp rank and under recomputation).

    Args:
        hidden_size: H.
        num_experts: E.
        top_k: experts per token.
        normalize: renormalize the top-k probabilities (Mixtral) or not (Switch).
        jitter: multiplicative router-input noise in training.
        groups: process groups (the weight is replicated over tp and ep).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, normalize: bool,
                 jitter: float = 0.0, groups=None):
        super().__init__()
        self.groups = groups or ParallelGroups()
        # Replicated over tp x ep; the tp ranks route the same tokens (``MoELayer`` counts the
        # router's gradient once over tp), the ep ranks different ones.
        self.weight = sum_grad_over(replicated(nn.Parameter(torch.empty(num_experts, hidden_size)),
                                               groups), groups, "ep")
        self.top_k, self.normalize, self.jitter = top_k, normalize, jitter

    def forward(self, x: torch.Tensor, first_sample: int = 0, num_samples: int = 1):
        """(T, H) -> (logits, probs, expert_idx, weights), as in ``Routing`` (fp32). ``x`` holds
        ``num_samples`` equal sequences, the first being sample ``first_sample`` of the
        micro-batch (for the jitter noise)."""
        noise = None
        if self.training and self.jitter > 0:
            noise = jitter_noise(tuple(x.shape), self.jitter, x.device, first_sample, num_samples)
        r = route(x, self.weight, self.top_k, self.normalize, noise)
        return r.logits, r.probs, r.expert_idx, r.weights
