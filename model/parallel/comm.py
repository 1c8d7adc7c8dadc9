"""Plain collectives used outside the model (trainer statistics, barriers).

Every ``torch.distributed`` call of the repo lives in ``model/parallel/``; process groups are passed
explicitly (None = the default group). With one process each function is the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _active(group) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``t`` over ``group`` in place and return it."""
    if _active(group):
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def all_reduce_max(t: torch.Tensor, group=None) -> torch.Tensor:
    """Element-wise max of ``t`` over ``group`` in place and return it."""
    if _active(group):
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def barrier(group=None) -> None:
    """Wait for every rank of ``group``."""
    if _active(group):
        dist.barrier(group=group)


def broadcast_object(obj, src: int = 0, group=None):
    """Return rank ``src``'s ``obj`` on every rank of ``group``."""
    if not _active(group):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]
