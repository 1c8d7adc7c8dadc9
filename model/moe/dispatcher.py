"""Token permutation for MoE dispatch: pure, local functions (no communication).

The plan sorts (token, slot) assignments by expert so that each expert's tokens are contiguous,
which is what a grouped GEMM (and, for expert parallelism, an all-to-all with per-expert split
sizes) needs. Worked example, T=4 tokens, k=2, E=3, capacity 2::

    expert_idx (T, k) = [[0, 1],     token 0 -> experts 0 (1st choice), 1 (2nd choice)
                         [0, 2],     token 1 -> experts 0, 2
                         [0, 1],     token 2 -> experts 0, 1
                         [2, 0]]     token 3 -> experts 2, 0

    assignments in priority order (all 1st choices by token, then all 2nd choices):
        (t0,e0) (t1,e0) (t2,e0) (t3,e2) | (t0,e1) (t1,e2) (t2,e1) (t3,e0)
    routed counts per expert: e0=4, e1=2, e2=2
    with capacity 2, expert 0 keeps t0, t1 (first choices first) and drops t2's and t3's slots:
        token_idx = [0, 1 | 0, 2 | 3, 1]   (grouped by expert 0 | 1 | 2)
        slot_idx  = [0, 0 | 1, 1 | 0, 1]
        tokens_per_expert (kept) = [2, 2, 2]

First choices outrank second choices (GShard/Megatron "position" policy), so a capacity drop never
removes a token's first expert while another token's second expert is kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DispatchPlan:
    """Where each kept (token, slot) assignment goes, grouped by expert."""

    token_idx: torch.Tensor           # (N,) int64 source token of each row, grouped by expert
    slot_idx: torch.Tensor            # (N,) int64 which of the token's k choices the row is
    tokens_per_expert: torch.Tensor   # (E,) int64 kept rows per expert (sums to N)
    routed_per_expert: torch.Tensor   # (E,) int64 assignments before capacity (sums to k*T)

    @property
    def num_dropped(self) -> torch.Tensor:
        return self.routed_per_expert.sum() - self.tokens_per_expert.sum()


def plan_dispatch(expert_idx: torch.Tensor, num_experts: int,
                  capacity: int | None = None) -> DispatchPlan:
    """Build the dispatch plan for a routing decision.

    Args:
        expert_idx: (T, k) chosen experts per token, best first.
        num_experts: E.
        capacity: slots per expert, or None for dropless routing.
    """
    num_tokens, top_k = expert_idx.shape
    device = expert_idx.device
    flat_expert = expert_idx.t().reshape(-1)                               # (k*T,) slot-major
    flat_token = torch.arange(num_tokens, device=device).repeat(top_k)     # (k*T,)
    flat_slot = torch.arange(top_k, device=device).repeat_interleave(num_tokens)
    # A stable sort keeps priority order (slot-major, then token) inside each expert's group.
    order = torch.argsort(flat_expert, stable=True)                        # (k*T,)
    routed = torch.bincount(flat_expert, minlength=num_experts)            # (E,)
    kept = routed
    if capacity is not None:
        group_start = torch.cumsum(routed, 0) - routed                     # (E,)
        position = torch.arange(order.numel(), device=device) - group_start[flat_expert[order]]
        order = order[position < capacity]
        kept = routed.clamp(max=capacity)
    return DispatchPlan(token_idx=flat_token[order], slot_idx=flat_slot[order],
                        tokens_per_expert=kept, routed_per_expert=routed)


def permute(x: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """Gather token rows into expert-grouped order: (T, H) -> (N, H)."""
    return x.index_select(0, plan.token_idx)


def unpermute(y: torch.Tensor, weights: torch.Tensor, plan: DispatchPlan,
              num_tokens: int) -> torch.Tensor:
    """Scale each expert output by its combine weight and sum back per token: (N, H) -> (T, H).

    Tokens whose every slot was dropped get zeros, so the block's residual passes them through.
    """
    w = weights[plan.token_idx, plan.slot_idx].unsqueeze(-1).to(y.dtype)   # (N, 1)
    out = y.new_zeros(num_tokens, y.shape[-1])
    return out.index_add_(0, plan.token_idx, y * w)
