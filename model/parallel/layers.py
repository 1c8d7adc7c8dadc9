"""Megatron-style tensor-parallel layers and the bookkeeping every sharded parameter carries.

Each parameter records how it was cut from its full tensor (``shard_spec``) and the blocks its
full tensor is drawn in (``draw_blocks``), so that ``init_from_full`` gives the same full weights
at any layout while each rank draws only the blocks of its shard (``model/parallel/draw.py``),
and so that checkpoints and tests can reassemble it.

Gradient-norm contract with DeepSpeed: a parameter is marked ``tensor_model_parallel`` exactly on
the ranks that are its canonical holder (rank 0 of every model-parallel axis it is replicated
over). DeepSpeed counts marked parameters on every rank plus unmarked ones on model-parallel rank
0 and sums over the model-parallel group, so every distinct shard enters the norm exactly once.

Sequence parallelism (Megatron, Korthikanti et al. 2022), when ``groups.sequence_parallel``: the
activations between tensor-parallel regions (residual stream, norms) are split along the
sequence over tp instead of replicated, cutting their memory by tp. A region is entered by an
all-gather of the sequence (instead of the identity) and left by a reduce-scatter (instead of an
all-reduce); an all-reduce is a reduce-scatter plus an all-gather, so that traffic is the same.
As in Megatron, backward gathers once more: column-parallel layers store only their input's
shard and gather it again for their weight gradients. ``column_parallel_linears``, ``enter_tp_region``
and ``leave_tp_region`` pick the collectives; the norms, whose tokens differ per tp rank under
sequence parallelism, sum their weight gradient over tp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from model.parallel import comm, weight_grad
from model.parallel.draw import (block_length, draw, fill_from_full, fill_shards, init_from_full,
                                 take_shard)
from model.parallel.grad_sync import sum_grad_over
from model.parallel.groups import ParallelGroups


def shard_param(param: nn.Parameter, groups: ParallelGroups | None, full_shape: tuple,
                spec: list[tuple[int, list[int]]], sharded_over: tuple[str, ...],
                blocks: dict[int, int] | None = None) -> nn.Parameter:
    """Attach the sharding metadata to ``param``.

    Args:
        param: the local shard.
        groups: the job's groups (None: single process).
        full_shape: shape of the unsharded tensor.
        spec: (dim, indices) pairs: this rank's shard is ``full`` indexed by ``indices`` along
            ``dim``, applied in order.
        sharded_over: model-parallel axes ("tp", "ep") across which the shards differ.
        blocks: block length of the init draw along a spec dim, where not ``block_length`` of
            its size (experts: one per block). The spec's dims, and so the blocks, must be the
            same at every layout: only the indices differ.
    """
    param.full_shape = tuple(full_shape)
    param.shard_spec = spec
    param.draw_blocks = {d: block_length(full_shape[d]) for d, _ in spec} | (blocks or {})
    replicated = [a for a in ("tp", "ep") if a not in sharded_over]
    g = groups or ParallelGroups()
    param.tensor_model_parallel = all(getattr(g, f"{a}_rank") == 0 for a in replicated)
    return param


def even_slice(size: int, parts: int, index: int) -> list[int]:
    per = size // parts
    return list(range(index * per, (index + 1) * per))


def replicated(param: nn.Parameter, groups: ParallelGroups | None) -> nn.Parameter:
    """Mark a parameter that every model-parallel rank holds whole."""
    return shard_param(param, groups, tuple(param.shape), [], ())


def check_tp_divides(name: str, value: int, tp: int, fix: str = "") -> None:
    """Raise the one-line error for a size that tensor parallelism cannot split evenly."""
    if value % tp:
        raise ValueError(f"{name} ({value}) is not divisible by parallel.tensor_parallel_size "
                         f"({tp}): {fix or f'choose a tensor_parallel_size that divides {value}'}")


def column_parallel_linears(x: torch.Tensor, weights, groups: ParallelGroups) -> tuple[torch.Tensor, ...]:
    """Apply column-parallel weights that read one input ``x`` (q, k and v; gate and up): one
    gradient all-reduce for all of them; under sequence parallelism one all-gather of the
    sequence, storing only this rank's shard for backward (``comm.gather_sequence_linears``)."""
    if groups.sequence_parallel:
        return comm.gather_sequence_linears(x, weights, groups.tp_group)
    x = comm.copy_to_region(x, groups.tp_group)
    return tuple(weight_grad.linear(x, w) for w in weights)


def enter_tp_region(x: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """The input of column-parallel layers: (B, S, H) replicated over tp, with its gradient
    summed over tp; under sequence parallelism gathered from the (B, S/tp, H) shards."""
    if groups.sequence_parallel:
        return comm.gather_sequence(x, groups.tp_group, dim=1)
    return comm.copy_to_region(x, groups.tp_group)


def leave_tp_region(x: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """Sum the partial (B, S, H) outputs of row-parallel layers over tp; under sequence
    parallelism keep this rank's (B, S/tp, H) shard of the sum."""
    if groups.sequence_parallel:
        return comm.reduce_scatter_sequence(x, groups.tp_group, dim=1)
    return comm.reduce_from_region(x, groups.tp_group)


def _sizes(groups):
    g = groups or ParallelGroups()
    return g, g.tp, g.tp_rank


class ColumnParallelLinear(nn.Module):
    """``y = x W^T (+ b)`` with W's output rows (and b's entries) split over the tp group.

    The input is replicated over tp (its gradient is summed there); the output stays sharded
    along its last dim. Weights replicated over ep (and over tp when every tp rank holds all rows)
    declare it (``sum_grad_over``): ``ReplicaGradSync`` sums their gradient there. The bias is
    cut and summed as the weight's rows.

    Args:
        in_features, out_features: full sizes.
        groups: process groups (None: single process).
        out_index: optional explicit output rows this rank holds (e.g. replicated KV heads).
        bias: add a bias (Qwen's q/k/v projections); zeros at init.
    """

    def __init__(self, in_features: int, out_features: int, groups=None, out_index=None,
                 bias: bool = False):
        super().__init__()
        g, tp, rank = _sizes(groups)
        self.groups = g
        # Replicated over tp (every rank holds all rows) yet used partially per rank: the
        # gradient must then be summed over tp.
        self.replicated_over_tp = out_index is not None and len(out_index) == out_features and tp > 1
        if out_index is None:
            check_tp_divides("output size", out_features, tp)
            out_index = even_slice(out_features, tp, rank)
        self.weight = nn.Parameter(torch.empty(len(out_index), in_features))
        # First output row held here (the vocabulary offset of an output head), on the module:
        # FSDP2 swaps parameters for DTensors, which drop attributes such as ``shard_spec``.
        self.start = out_index[0]
        sharded = ("tp",) if len(out_index) < out_features else ()
        shard_param(self.weight, g, (out_features, in_features), [(0, out_index)], sharded)
        over = ("ep", *(("tp",) if self.replicated_over_tp else ()))
        sum_grad_over(self.weight, g, *over)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(len(out_index)))
            shard_param(self.bias, g, (out_features,), [(0, out_index)], sharded)
            sum_grad_over(self.bias, g, *over)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Layers that share an input go through ``column_parallel_linears`` together."""
        y = column_parallel_linears(x, (self.weight,), self.groups)[0]
        return y if self.bias is None else y + self.bias


class ReplicatedLinear(nn.Module):
    """``y = x W^T`` with the (out, in) weight whole on every tp rank, applied to the tokens the
    rank holds: MLA's down-projections, MTP's projection. Its gradient is summed over ep, and
    over tp under sequence parallelism (the ranks see different tokens), as a norm's; without
    it every tp rank computes the same full gradient."""

    def __init__(self, in_features: int, out_features: int, groups=None):
        super().__init__()
        g = groups or ParallelGroups()
        self.weight = replicated(nn.Parameter(torch.empty(out_features, in_features)), g)
        sum_grad_over(self.weight, g, "ep", *(("tp",) if g.sequence_parallel else ()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return weight_grad.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """``y = x W^T`` with W's input columns split over tp; partial outputs summed over tp."""

    def __init__(self, in_features: int, out_features: int, groups=None):
        super().__init__()
        g, tp, rank = _sizes(groups)
        self.groups = g
        check_tp_divides("input size", in_features, tp)
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp))
        shard_param(self.weight, g, (out_features, in_features),
                    [(1, even_slice(in_features, tp, rank))], ("tp",) if tp > 1 else ())
        sum_grad_over(self.weight, g, "ep")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = weight_grad.linear(x, self.weight)
        return leave_tp_region(y, self.groups)


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary rows are split over tp; also the tied output head.

    ``forward(ids)``: each rank looks up the ids in its range, zeros the rest, and the partial
    embeddings are summed over tp (under sequence parallelism each rank keeps its (B, S/tp, H)
    shard of the sum). ``forward(h, unembed=True)``: this rank's slice of the logits, (B, S, V/tp),
    for ``cross_entropy_sum``. Tied, both calls use the one weight: its gradient is summed over
    ep once per backward (``model.parallel.grad_sync``), not once per use.
    """

    def __init__(self, vocab_size: int, hidden_size: int, groups=None):
        super().__init__()
        g, tp, rank = _sizes(groups)
        self.groups = g
        check_tp_divides("model.vocab_size", vocab_size, tp, "pad the vocabulary")
        self.start, self.end = rank * vocab_size // tp, (rank + 1) * vocab_size // tp
        self.weight = nn.Parameter(torch.empty(vocab_size // tp, hidden_size))
        shard_param(self.weight, g, (vocab_size, hidden_size),
                    [(0, list(range(self.start, self.end)))], ("tp",) if tp > 1 else ())
        sum_grad_over(self.weight, g, "ep")

    def forward(self, x: torch.Tensor, unembed: bool = False,
                weight: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.weight if weight is None else weight
        if unembed:
            return column_parallel_linears(x, (weight,), self.groups)[0]
        if self.groups.tp == 1:
            return F.embedding(x, weight)
        outside = (x < self.start) | (x >= self.end)
        local = torch.where(outside, torch.zeros_like(x), x - self.start)
        emb = F.embedding(local, weight) * (~outside).unsqueeze(-1).to(weight.dtype)
        return leave_tp_region(emb, self.groups)


class _VocabParallelCE(torch.autograd.Function):
    """Cross-entropy over logits whose vocabulary is split over ``group`` (Megatron's
    algorithm): global max and sum of exponentials by all-reduce, the target logit from the
    rank that holds it. Returns per-token losses; the backward is local (softmax - one-hot)."""

    @staticmethod
    def forward(ctx, logits, target, start, group):
        logits = logits.float()
        gmax = logits.max(dim=-1).values
        dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - gmax.unsqueeze(-1)
        vocab = logits.shape[-1]
        local_t = target - start
        inside = (local_t >= 0) & (local_t < vocab)
        local_t = torch.where(inside, local_t, torch.zeros_like(local_t))
        tgt = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) * inside
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        both = torch.stack([tgt, sum_exp])
        dist.all_reduce(both, group=group)
        tgt, sum_exp = both[0], both[1]
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local_t, inside)
        return torch.log(sum_exp) - tgt

    @staticmethod
    def backward(ctx, grad):
        softmax, local_t, inside = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local_t.unsqueeze(-1), -inside.to(g.dtype).unsqueeze(-1))
        return g * grad.unsqueeze(-1), None, None, None


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, groups=None,
                      vocab_start: int = 0, ignore_index: int = -100) -> torch.Tensor:
    """Sum of next-token cross-entropy over target tokens; ``logits`` may be a tp vocab shard."""
    g = groups or ParallelGroups()
    flat_logits, flat_labels = logits.flatten(0, -2), labels.flatten()
    if g.tp == 1:
        return F.cross_entropy(flat_logits.float(), flat_labels, ignore_index=ignore_index,
                               reduction="sum")
    valid = flat_labels != ignore_index
    target = torch.where(valid, flat_labels, torch.zeros_like(flat_labels))
    losses = _VocabParallelCE.apply(flat_logits, target, vocab_start, g.tp_group)
    return (losses * valid).sum()


def kv_heads_for_rank(num_kv_heads: int, groups) -> tuple[list[int], int | None]:
    """The kv heads this tp rank holds, and which of them its query heads use.

    With at least as many kv heads as tp ranks, each rank holds its share (``None``: uses all
    it holds). With fewer, every rank holds all kv heads (replicated; their gradients are summed
    over tp, each rank contributing through its query heads) and uses the one its query heads
    attend with.
    """
    g, tp, rank = _sizes(groups)
    if num_kv_heads >= tp:
        check_tp_divides("model.num_kv_heads", num_kv_heads, tp)
        return even_slice(num_kv_heads, tp, rank), None
    if tp % num_kv_heads:
        raise ValueError(f"parallel.tensor_parallel_size ({tp}) is not divisible by "
                         f"model.num_kv_heads ({num_kv_heads})")
    return list(range(num_kv_heads)), rank * num_kv_heads // tp


__all__ = ["ColumnParallelLinear", "ReplicatedLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "block_length", "check_tp_divides", "column_parallel_linears", "cross_entropy_sum",
           "draw", "enter_tp_region", "even_slice", "fill_from_full", "fill_shards",
           "init_from_full", "kv_heads_for_rank", "leave_tp_region", "replicated", "shard_param",
           "take_shard"]
