"""RMSNorm, with the gradient sums its replication over model-parallel ranks needs."""

from __future__ import annotations

import torch
import torch.nn as nn

from model.parallel.groups import ParallelGroups
from model.parallel.layers import replicated
from model.parallel.grad_sync import sum_grad_over


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32 (as transformers' LlamaRMSNorm) over the last dim;
    its weight is replicated on every model-parallel rank, and its gradient summed over the ranks
    that see different tokens (ep; tp too under sequence parallelism) or, as a per-head q/k norm
    (``per_head``), different heads (ep and tp: tensor parallelism splits the heads)."""

    def __init__(self, hidden_size: int, eps: float, groups: ParallelGroups | None = None,
                 per_head: bool = False):
        super().__init__()
        self.groups = groups or ParallelGroups()
        self.weight = replicated(nn.Parameter(torch.ones(hidden_size)), groups)
        over_tp = per_head or self.groups.sequence_parallel
        sum_grad_over(self.weight, groups, "ep", *(("tp",) if over_tp else ()))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)
