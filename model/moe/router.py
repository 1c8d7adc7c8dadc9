"""Top-k router: fp32 scores (softmax or sigmoid), optional group limit and bias, top-k,
optional renormalization and scaling, jitter.

All MoE families use this one function; their differences are config values:

    Switch     : softmax(all E) -> top-1 -> combine weight = that probability (no renormalization)
    Mixtral    : softmax(all E) -> top-2 -> renormalize the two probabilities to sum to 1
    DeepSeek-V3: sigmoid per expert -> + bias (choice only) -> best topk_group of n_group groups
                 -> top-k within them -> renormalize the k unbiased scores -> x routed_scaling_factor

By default (``model.moe.router_dtype: fp32``) the router runs in fp32 whatever the model dtype
("selective precision", Switch Transformer section 2.4): a bf16 softmax over experts is what
made the paper's bf16 runs diverge. ``router_dtype: bf16`` runs it in bf16 instead, whatever
the model dtype, for comparison (``route``'s ``dtype`` says what is in which precision).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.moe.config import MoEConfig
from model.parallel.cp_layout import split_for_cp
from model.parallel.grad_sync import sum_grad_over
from model.parallel.groups import ParallelGroups
from model.parallel.layers import replicated

_MASK64 = (1 << 64) - 1


@dataclass
class Routing:
    """One routing decision for T tokens over E experts, k choices each."""

    logits: torch.Tensor        # (T, E) fp32 router logits (bf16 values with a bf16 router)
    probs: torch.Tensor         # (T, E) fp32 scores normalized over the experts (softmax: itself)
    expert_idx: torch.Tensor    # (T, k) int64 chosen experts, best first
    weights: torch.Tensor       # (T, k) fp32 combine weights (bf16 values with a bf16 router)


def route(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, normalize: bool,
          noise: torch.Tensor | None = None, score_function: str = "softmax",
          bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
          scaling: float = 1.0, dtype: torch.dtype = torch.float32) -> Routing:
    """Route tokens to experts.

    Args:
        x: (T, H) token activations, any dtype.
        gate_weight: (E, H) router weight.
        top_k: experts per token.
        normalize: renormalize the top-k scores to sum to 1 (Mixtral) or keep them (Switch).
        noise: (T, H) multiplicative jitter for the router input (``jitter_noise``), or None.
            Only the router sees it; the experts get the clean activations.
        score_function: "softmax" over the experts, or one "sigmoid" per expert. ``probs`` is
            then the sigmoid scores divided by their sum (for the balance loss and the entropy).
        bias: (E,) fp32 added to the scores to CHOOSE the experts (loss-free balancing); the
            combine weights are the unbiased scores. None: no bias.
        n_group, topk_group: group-limited routing: the E experts form n_group equal groups,
            each scored by the sum of its two best (biased) scores; the top-k is taken within
            the topk_group best groups.
        scaling: factor on the combine weights, after the renormalization.
        dtype: the router's precision (``MoEConfig.router_dtype``). ``torch.float32`` (the
            default): all router math in fp32, as below. ``torch.bfloat16``: the input (jitter
            applied in fp32 first, then rounded once) and the weight are cast to bf16, and the
            logits matmul, the softmax or sigmoid (and the sigmoid's normalization), the top-k
            choice, the renormalization and the scaling all run on bf16 tensors (the kernels
            accumulate in fp32 inside, as bf16 kernels do; every result is rounded to bf16), and
            so does their backward. Only at the end are ``logits``, ``probs`` and ``weights``
            cast to fp32 containers, exactly (they hold bf16 values): the z-loss, the balance
            loss, the router statistics and the combine step then work on those values in fp32,
            as with the fp32 router. The expert bias stays fp32 (bf16 scores + fp32 bias choose
            in fp32). This is the router Switch Transformer's selective precision takes out
            of bf16 (section 2.4, Table 2: bf16 throughout diverged, bf16 with the router in
            fp32 trained), put back in bf16 alone, the rest of the model as it is.

    Returns:
        The routing decision, all router math in ``dtype`` (fp32 by default).
    """
    xr = x.float()
    if noise is not None:
        xr = xr * noise
    # (``.to(torch.float32)`` of an fp32 tensor is the tensor itself: the default is the fp32 router.)
    logits = F.linear(xr.to(dtype), gate_weight.to(dtype))       # (T, E) in dtype
    if score_function == "softmax":
        scores = probs = torch.softmax(logits, dim=-1)           # (T, E)
    else:
        scores = torch.sigmoid(logits)                           # (T, E)
        probs = scores / scores.sum(dim=-1, keepdim=True)
    if bias is None and n_group == 1:
        weights, expert_idx = torch.topk(scores, top_k, dim=-1)  # (T, k), (T, k)
    else:
        choice = scores.detach() if bias is None else scores.detach() + bias.float()
        if n_group > 1:
            choice = _limit_to_groups(choice, n_group, topk_group)
        expert_idx = torch.topk(choice, top_k, dim=-1).indices   # (T, k) best first
        weights = scores.gather(1, expert_idx)                   # (T, k) unbiased
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    if scaling != 1.0:
        weights = weights * scaling
    if dtype != torch.float32:                                   # exact: bf16 values, fp32 tensors
        logits, probs, weights = logits.float(), probs.float(), weights.float()
    return Routing(logits=logits, probs=probs, expert_idx=expert_idx, weights=weights)


def _limit_to_groups(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """(T, E) choice scores with -inf outside each token's ``topk_group`` best groups of the
    ``n_group`` equal, contiguous groups; a group's score is the sum of its two best scores
    (DeepSeek-V3)."""
    T, E = choice.shape
    grouped = choice.view(T, n_group, E // n_group)                        # (T, G, E/G)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)              # (T, G)
    kept = group_scores.topk(topk_group, dim=-1).indices                   # (T, topk_group)
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(T, E)


def jitter_noise(shape: tuple[int, int], eps: float, device: torch.device, first_sample: int = 0,
                 num_samples: int = 1, cp: int = 1, cp_rank: int = 0) -> torch.Tensor:
    """Switch Transformer's jitter: U(1-eps, 1+eps) noise of ``shape`` (T, H), fp32, for T tokens
    made of ``num_samples`` equal sequences, the first being sample ``first_sample`` of the
    micro-batch; under context parallelism (``cp`` > 1) each of them is cp rank ``cp_rank``'s
    ``split_for_cp`` part of its sample (S/cp tokens).

    One base seed per call comes from the default CPU generator (a host draw: no device sync),
    and each sample's noise from its own stream, seeded by (base, sample index). Why:

    * Recomputation: ``torch.utils.checkpoint`` restores the default generators, and only
      them, before it re-runs a checkpointed block or MoE layer in backward, so the recomputed
      forward draws the same base and routes exactly as the first one. A generator of the
      model's own would have advanced (and under expert parallelism the recomputed exchange
      would send other rows than the first).
    * Replication over tp: the tp ranks of a group route the same tokens, and the row-parallel
      sum adds their partial outputs of the same experts, so they must draw the same noise:
      their default generators must be seeded alike, from no tp coordinate (Megatron's
      convention; the trainer also leaves out ep, whose noise is seeded per sample). A generator handed in by the caller would advance between a
      forward and its recomputation, and a seed set per micro-batch would have changed by then
      under the pipeline's 1F1B schedule (a later micro-batch's forward runs before an earlier
      one's recomputation). The model cannot verify the seeding without a collective per
      layer; ``comm.replica_divergence`` of the layers' ``MoEAux.routed_per_expert`` over tp
      does, when the trainer asks.
    * Layout: each sample's stream depends only on its index in the micro-batch, so with the
      seed also independent of the ep rank, an ep rank draws for its samples exactly what the
      unsharded model draws for them, and every tp/ep/sequence-parallel layout routes as one GPU.
      Cost: one reseed and one ``uniform_`` per local sample (1 in the Switch recipes at EP8).
    * Context parallelism: the cp ranks of a sample hold its load-balanced chunk pairs; the
      trainer's per-step seed leaves out the cp coordinate too, so they share the base seed, and
      each rank draws every local sample's whole (S, H) noise, as the single process does, and
      keeps its ``split_for_cp`` rows (a uniform draw cannot start mid-stream: on a GPU its values
      depend on the tensor's size). Cost per call: cp times this rank's share of draws, one
      transient (S, H) fp32 tensor per sample, the same draws as the single process; every token
      then gets exactly the control's noise (``tests/parallel/test_context_parallel_routing.py``;
      ``cp2-jitter-capacity-1`` in ``test_context_parallel_layouts.py``).

    Drawing the (T, H) noise on tp rank 0 and broadcasting it would need no seeding convention,
    but costs a T*H collective per MoE layer, as much as the layer's activations.

    Under ``torch.compile`` the same draws are two custom ops, opaque to the compiler (the host
    seed and the generators would break the graph): ``moe::jitter_base``, the base seed as a
    (1,) CPU tensor from the default CPU generator, a random op whose generator state a compiled
    checkpoint saves and restores as ``torch.utils.checkpoint`` does, and ``moe::jitter_noise``,
    the noise from it, deterministic, so a recomputation gives the same. Same values as eager.
    """
    if torch.compiler.is_compiling():
        base_seed = torch.ops.moe.jitter_base(torch.empty(0, device="cpu"))   # (1,) int64
        return torch.ops.moe.jitter_noise(base_seed, list(shape), eps, device, first_sample,
                                          num_samples, cp, cp_rank)
    base = int(torch.randint(1 << 62, (1,)).item())      # default CPU generator, a host value
    return _noise_from(base, shape, eps, device, first_sample, num_samples, cp, cp_rank)


def _noise_from(base: int, shape, eps: float, device: torch.device, first_sample: int,
                num_samples: int, cp: int = 1, cp_rank: int = 0) -> torch.Tensor:
    """The noise of ``num_samples`` samples from ``base``: each sample's (S, H) drawn whole from
    its own stream; under cp, its rank ``cp_rank``'s ``split_for_cp`` rows of the S = cp x S/cp."""
    gen = torch.Generator(device=device)
    local = shape[0] // num_samples                                      # S/cp tokens per sample
    noise = torch.empty((num_samples, local, shape[1]), device=device,
                        dtype=torch.float32)                             # (B, S/cp, H)
    whole = noise if cp == 1 else torch.empty((1, local * cp, shape[1]), device=device,
                                              dtype=torch.float32)        # (1, S, H) transient
    for b in range(num_samples):
        gen.manual_seed(_mix(base, first_sample + b))
        if cp == 1:
            noise[b].uniform_(1.0 - eps, 1.0 + eps, generator=gen)
        else:
            whole.uniform_(1.0 - eps, 1.0 + eps, generator=gen)
            noise[b] = split_for_cp(whole, cp, cp_rank, 1)[0]
    return noise.view(shape)                                             # (T, H)


# ``on``: an empty CPU tensor, whose device tells a compiled checkpoint which generator to save
# before the draw and restore for its recomputation (it looks for a tensor argument).
@torch.library.custom_op("moe::jitter_base", mutates_args=(), tags=torch.Tag.nondeterministic_seeded)
def _jitter_base_op(on: torch.Tensor) -> torch.Tensor:
    return torch.randint(1 << 62, (1,), device=on.device)           # (1,) int64


@_jitter_base_op.register_fake
def _(on):
    return torch.empty((1,), dtype=torch.int64, device=on.device)


@torch.library.custom_op("moe::jitter_noise", mutates_args=())
def _jitter_noise_op(base_seed: torch.Tensor, shape: list[int], eps: float, device: torch.device,
                     first_sample: int, num_samples: int, cp: int, cp_rank: int) -> torch.Tensor:
    return _noise_from(int(base_seed.item()), tuple(shape), eps, device, first_sample, num_samples,
                       cp, cp_rank)


@_jitter_noise_op.register_fake
def _(base_seed, shape, eps, device, first_sample, num_samples, cp, cp_rank):
    return torch.empty(shape, device=device, dtype=torch.float32)


def _mix(base: int, index: int) -> int:
    """SplitMix64 of (base, index): independent 63-bit seeds for neighbouring indices."""
    z = (base + 0x9E3779B97F4A7C15 * (index + 1)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class TopKRouter(nn.Module):
    """The router's (E, H) weight, its optional expert bias, and ``route`` as one module.

    The weight is a parameter of the model's dtype whatever ``moe.router_dtype``: ``route`` casts
    it (and the input) to ``math_dtype`` for its math. The weight is only read inside this
    module's ``forward``, and ``forward`` returns plain tensors: ZeRO-3 gathers a partitioned
    parameter around its module's forward and, for the backward, hooks the module's tensor
    outputs (it cannot see tensors inside a dataclass). In training with ``jitter > 0`` the
    input is scaled by ``jitter_noise`` (see there for how the noise stays the same on every tp
    rank and under recomputation).

    With ``moe.expert_bias`` the router holds ``e_score_correction_bias`` (E,), a persistent fp32
    buffer, zeros at init, replicated on every rank: it shifts the scores that choose the
    experts, never the combine weights, and changes only through ``update_bias`` (loss-free
    balancing), outside autograd, identically on every rank.

    Args:
        hidden_size: H.
        moe: the layer's MoE settings (experts, top-k, scores, groups, bias, jitter).
        groups: process groups (the weight is replicated over tp and ep).
    """

    def __init__(self, hidden_size: int, moe: MoEConfig, groups=None):
        super().__init__()
        self.groups = groups or ParallelGroups()
        # Replicated over tp x ep; the tp ranks route the same tokens (``MoELayer`` counts the
        # router's gradient once over tp), the ep ranks different ones.
        self.weight = sum_grad_over(replicated(nn.Parameter(torch.empty(moe.num_experts, hidden_size)),
                                               groups), groups, "ep")
        self.moe, self.top_k, self.jitter = moe, moe.top_k, moe.router_jitter
        self.math_dtype = torch.bfloat16 if moe.router_dtype == "bf16" else torch.float32
        bias = torch.zeros(moe.num_experts, dtype=torch.float32) if moe.expert_bias else None
        self.register_buffer("e_score_correction_bias", bias)

    def reset_bias_dtype(self) -> None:
        """Back to fp32 after a build that created every floating tensor in the training dtype
        (DeepSpeed's ``zero.Init``); the bias is zeros then, so nothing is lost."""
        if self.e_score_correction_bias is not None:
            self.e_score_correction_bias = self.e_score_correction_bias.float()

    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor) -> None:
        """Loss-free balancing (DeepSeek-V3): ``bias_i += rate * sign(mean load - load_i)``, from
        ``counts`` (E,), the step's routed assignments per expert over the whole global batch
        (the same on every rank, so every replica applies the same update)."""
        rate = self.moe.expert_bias_update_rate
        if rate == 0 or self.e_score_correction_bias is None:
            return
        load = counts.to(torch.float64)
        step = torch.sign(load.mean() - load).to(torch.float32)           # (E,) in {-1, 0, 1}
        self.e_score_correction_bias.add_(step, alpha=rate)

    def forward(self, x: torch.Tensor, first_sample: int = 0, num_samples: int = 1):
        """(T, H) -> (logits, probs, expert_idx, weights), as in ``Routing`` (fp32 tensors; the
        math in ``moe.router_dtype``, see ``route``). ``x`` holds
        ``num_samples`` equal sequences, the first being sample ``first_sample`` of the
        micro-batch (for the jitter noise; under cp, this cp rank's ``split_for_cp`` part of each)."""
        noise, g = None, self.groups
        if self.training and self.jitter > 0:
            noise = jitter_noise(tuple(x.shape), self.jitter, x.device, first_sample, num_samples,
                                 g.cp, g.cp_rank)
        moe = self.moe
        r = route(x, self.weight, self.top_k, moe.normalize_top_k, noise, moe.score_function,
                  self.e_score_correction_bias, moe.n_group, moe.topk_group,
                  moe.routed_scaling_factor, self.math_dtype)
        return r.logits, r.probs, r.expert_idx, r.weights
