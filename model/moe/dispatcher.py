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
        token_idx = [0, 1 | 0, 2 | 3, 1 || 2, 3]   (kept, by expert 0 | 1 | 2 || dropped)
        slot_idx  = [0, 0 | 1, 1 | 0, 1 || 0, 1]
        kept_per_expert = [2, 2, 2]

First choices outrank second choices (GShard/Megatron "position" policy), so a capacity drop never
removes a token's first expert while another token's second expert is kept.

The plan always has k*T rows, the dropped ones last: how many a capacity keeps depends on the
routing, and a size that depends on data would have to be copied to the host (a device sync) to
allocate anything. Every step here is a sort, a cumulative sum or a gather of known size; the
grouped GEMM reads only the kept rows (its offsets end at N), and ``permute``/``unpermute`` mask
the rest. Under expert parallelism the split sizes reach the host anyway, and only the N kept
rows are permuted and sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DispatchPlan:
    """Where each (token, slot) assignment goes: the kept rows grouped by expert, then the
    dropped ones."""

    token_idx: torch.Tensor           # (k*T,) int64 source token of each row
    slot_idx: torch.Tensor            # (k*T,) int64 which of the token's k choices the row is
    kept_per_expert: torch.Tensor     # (E,) int64 kept rows per expert (sums to N <= k*T)
    routed_per_expert: torch.Tensor   # (E,) int64 assignments before capacity (sums to k*T)
    row_kept: torch.Tensor | None     # (k*T,) bool, True for the first N rows; None: dropless

    @property
    def num_dropped(self) -> torch.Tensor:
        return self.routed_per_expert.sum() - self.kept_per_expert.sum()


def plan_dispatch(expert_idx: torch.Tensor, num_experts: int,
                  capacity: int | torch.Tensor | None = None) -> DispatchPlan:
    """Build the dispatch plan for a routing decision, without a device-to-host copy.

    Args:
        expert_idx: (T, k) chosen experts per token, best first.
        num_experts: E.
        capacity: slots per expert, or (E,) int64 slots of each expert (context parallelism:
            ``MoELayer._cp_capacity``), or None for dropless routing.
    """
    num_tokens, top_k = expert_idx.shape
    rows = torch.arange(top_k * num_tokens, device=expert_idx.device)     # (k*T,)
    flat_expert = expert_idx.t().reshape(-1)                               # (k*T,) slot-major
    # A stable sort keeps priority order (slot-major, then token) inside each expert's group.
    order = torch.argsort(flat_expert, stable=True)                        # (k*T,)
    # Counts by scatter-add: bincount sizes its output from the largest id (a host sync).
    routed = torch.zeros(num_experts, dtype=torch.long, device=rows.device).scatter_add_(
        0, flat_expert, torch.ones_like(flat_expert))                      # (E,)
    kept, row_kept = routed, None
    if capacity is not None:
        sorted_expert = flat_expert.gather(0, order)                       # (k*T,)
        position = rows - (torch.cumsum(routed, 0) - routed).gather(0, sorted_expert)
        if isinstance(capacity, torch.Tensor):                             # (E,) per expert
            keep, kept = position < capacity.gather(0, sorted_expert), torch.minimum(routed, capacity)
        else:
            keep, kept = position < capacity, routed.clamp(max=capacity)   # (k*T,) in sorted order
        num_kept = kept.sum()
        # Kept rows packed by expert, dropped rows after them (still in priority order): each
        # row's destination by index arithmetic, instead of a boolean mask of data-dependent size.
        dest = torch.where(keep, (torch.cumsum(kept, 0) - kept).gather(0, sorted_expert) + position,
                           num_kept + torch.cumsum(~keep, 0) - 1)          # (k*T,) a permutation
        order = torch.empty_like(order).scatter_(0, dest, order)
        row_kept = rows < num_kept
    return DispatchPlan(token_idx=order % num_tokens, slot_idx=order // num_tokens,
                        kept_per_expert=kept, routed_per_expert=routed, row_kept=row_kept)


def permute(x: torch.Tensor, plan: DispatchPlan, num_rows: int | None = None) -> torch.Tensor:
    """Gather token rows into expert-grouped order: (T, H) -> (k*T, H), the dropped rows zero.

    With ``num_rows`` (N, known on the host under expert parallelism), only the kept rows:
    (T, H) -> (N, H).
    """
    if num_rows is not None:
        return x.index_select(0, plan.token_idx[:num_rows])
    rows = x.index_select(0, plan.token_idx)
    if plan.row_kept is not None:
        # The grouped GEMM leaves the rows past its last offset unwritten, in its backward too:
        # whatever gradient reaches a dropped row is discarded here, NaN included.
        rows = torch.where(plan.row_kept.unsqueeze(-1), rows, 0.0)
    return rows


def unpermute(y: torch.Tensor, weights: torch.Tensor, plan: DispatchPlan,
              num_tokens: int) -> torch.Tensor:
    """Scale each expert output by its combine weight and sum back per token: (R, H) -> (T, H),
    for the plan's first R rows (all k*T, or the N kept ones).

    Tokens whose every slot was dropped get zeros, so the block's residual passes them through.
    """
    token_idx, slot_idx = plan.token_idx[:y.shape[0]], plan.slot_idx[:y.shape[0]]
    if plan.row_kept is not None and y.shape[0] == plan.row_kept.shape[0]:
        # Dropped rows hold whatever the grouped GEMM left there (it writes only up to its last
        # offset): mask before the product, so that neither they nor the combine weights'
        # gradient (y * grad) can carry a NaN.
        y = torch.where(plan.row_kept.unsqueeze(-1), y, 0.0)
    flat = token_idx * weights.shape[1] + slot_idx                          # (R,) into (T*k,)
    w = weights.reshape(-1).index_select(0, flat).unsqueeze(-1).to(y.dtype)   # (R, 1)
    out = y.new_zeros(num_tokens, y.shape[-1])
    return out.index_add_(0, token_idx, y * w)
