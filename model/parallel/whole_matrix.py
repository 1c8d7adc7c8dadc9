"""Collectives that give an optimizer step whole weight matrices, and the job-wide maximum.

Muon (``training/optim/muon_update.py``) orthogonalizes each weight matrix whole:

- ``TpShards``: a tensor-parallel weight's rows (column-parallel) or columns (row-parallel) are
  all-gathered over tp and put back exactly where the single-process matrix has them (every tp
  rank's indices along the split dim, gathered once), and this rank's part is taken back out;
- ``owner_of`` / ``reduce_to`` / ``broadcast_from``: under ZeRO one rank of a matrix's
  data-parallel group owns it; the group's gradient pieces are summed on the owner and the
  owner's update is sent back to every member.

``job_max`` is QK-clip's maximum of every head's logit over all ranks
(``training/step/clip_logits.py``). Every tensor handed to a collective is on the compute device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from model.parallel.comm import gather_dim


class TpShards:
    """Where this rank's rows or columns of a tp-split matrix sit in the whole one.

    Args:
        dim: the split dim.
        indices: this rank's indices along it (the parameter's ``shard_spec``).
        group: the tp group.
        device: the compute device (the index exchange runs there).
    """

    def __init__(self, dim: int, indices: list[int], group, device):
        self.dim, self.group = dim, group
        self.mine_idx = torch.tensor(indices, dtype=torch.long, device=device)
        self.order = gather_dim(self.mine_idx, 0, group)       # every rank's indices, rank order
        self.size = int(self.order.max()) + 1

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        """The whole matrix from every tp rank's ``x`` (its shard), each part in its place."""
        shards = gather_dim(x, self.dim, self.group)              # side by side, rank order
        shape = list(x.shape)
        shape[self.dim] = self.size
        return x.new_zeros(shape).index_copy_(self.dim, self.order, shards)

    def mine(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of the whole matrix ``x``."""
        return x.index_select(self.dim, self.mine_idx)


def group_size(group) -> int:
    return dist.get_world_size(group)


def owner_of(group, member: int) -> tuple[int, bool]:
    """The global rank of ``group``'s ``member``-th rank, and whether it is this rank."""
    owner = dist.get_global_rank(group, member)
    return owner, owner == dist.get_rank()


def rank_in(group) -> int:
    return dist.get_rank(group=group)


def reduce_to(t: torch.Tensor, owner: int, group) -> None:
    """Sum ``t`` over ``group`` into the owner's ``t`` (global rank ``owner``)."""
    dist.reduce(t, dst=owner, group=group)


def broadcast_from(t: torch.Tensor, owner: int, group) -> None:
    """Every member's ``t`` becomes the owner's."""
    dist.broadcast(t, src=owner, group=group)


def job_max(t: torch.Tensor) -> torch.Tensor:
    """The elementwise maximum of ``t`` over every rank of the job, in place."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t
