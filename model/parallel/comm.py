"""Plain collectives used outside the model (trainer statistics, replica checks, barriers), and
the model's autograd communication pairs.

Every ``torch.distributed`` call of the repo lives in ``model/parallel/``; process groups are passed
explicitly, and ``None`` means a group of one rank: no communication (``ParallelGroups`` holds
``None`` for every size-1 group). ``barrier`` spans the whole job.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from model.parallel import weight_grad


def _active(group) -> bool:
    return group is not None and dist.is_available() and dist.is_initialized()


def _world() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``t`` over ``group`` in place and return it."""
    if _active(group):
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def barrier() -> None:
    """Wait for every rank of the job."""
    if _world():
        dist.barrier()


def job_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over every rank of the job in place and return it."""
    if _world():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def replica_divergence(tensors, group=None) -> torch.Tensor:
    """How far apart the copies of ``tensors`` that should be identical over ``group`` are, e.g.
    the router weights over tp (``[m.gate.weight for m in model.modules() if isinstance(m,
    MoELayer)]``), whose routing must agree on every tp rank, or the routing itself (each MoE
    layer's ``MoEAux.routed_per_expert``).

    Communicates over ``group`` with one all-reduce (MAX) of a (2, 2n) fp64 fingerprint (each
    tensor's sum and sum of squares, and their negatives), never the tensors themselves. Returns a
    0-dim fp64 tensor on the tensors' device, the largest (max - min) over the group of any
    fingerprint entry, without a host copy (put it in the step's statistics): 0.0 when the copies
    are bitwise equal (the same shapes on the same kind of device reduce in the same order), and
    otherwise the size of the drift, not an element-wise bound. Under ZeRO-3 a parameter is empty
    outside its module's forward: pass its partition (DeepSpeed's ``ds_tensor``), the same slice
    on every tp peer.
    """
    f64 = torch.float64
    tensors = [t.detach() if t.is_floating_point() else t.detach().to(f64) for t in tensors]
    fingerprint = torch.stack([torch.stack((torch.sum(t, dtype=f64),
                                            torch.linalg.vector_norm(t, dtype=f64) ** 2))
                               for t in tensors]).flatten()                 # (2n,)
    both = torch.stack((fingerprint, -fingerprint))                         # (2, 2n)
    if _active(group):
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return (both[0] + both[1]).max()                                        # max - min


def all_to_all_counts(counts: torch.Tensor, group=None) -> torch.Tensor:
    """Exchange one row of counts per destination: row j of the input goes to rank j of
    ``group``; row i of the output came from rank i. (ep, ...) -> (ep, ...)."""
    if not _active(group):
        return counts
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


# ------------------------------------------------------------------------------------------
# Autograd communication pairs (Megatron's conjugate functions). Each is the identity when the
# group has one rank, so single-process code pays nothing.

class _CopyToRegion(torch.autograd.Function):
    """Forward: identity. Backward: sum the gradient over the group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromRegion(torch.autograd.Function):
    """Forward: sum over the group. Backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# torch 2.13 renamed the flat-tensor collectives (``all_gather_into_tensor`` ->
# ``all_gather_single``, ``reduce_scatter_tensor`` -> ``reduce_scatter_single``, the old names
# now deprecated aliases); torch 2.9 has only the old ones. Looked up per call, so that a wrapper
# around ``torch.distributed`` (benchmarks/systems/comm_volume.py) sees them.
_ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
_REDUCE_SCATTER = ("reduce_scatter_single" if hasattr(dist, "reduce_scatter_single")
                   else "reduce_scatter_tensor")


def gather_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """All-gather the ranks' equal shards of ``x`` and concatenate them along ``dim`` (no autograd).

    One flat ``all_gather_into_tensor``, whose output concatenates the shards along dim 0, viewed
    as (tp, *x.shape). Our activations are (B, S, H), not Megatron's sequence-first (S, B, H), so
    moving the rank dim next to ``dim`` is free when every dim before ``dim`` has size 1 (B = 1)
    and one copy otherwise. The list API cost more: NCCL gathers into a flat buffer of its own,
    copies it out into the tp temporaries, and ``torch.cat`` copies again. gloo implements both
    flat collectives (since torch 2.2; checked on 2.13), so there is no list fallback: NCCL and
    gloo take the same path.
    """
    x = x.contiguous()
    tp = dist.get_world_size(group)
    # The concatenated form (gloo accepts no other): rank r's shard is the r-th block of dim 0.
    out = x.new_empty((tp * x.shape[0],) + tuple(x.shape[1:]))
    getattr(dist, _ALL_GATHER)(out, x, group=group)
    out = out.unflatten(0, (tp, -1))                                     # (tp, ..., shard, ...)
    return out.movedim(0, dim).flatten(dim, dim + 1)                     # (..., tp * shard, ...)


def reduce_scatter_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's chunk along ``dim`` (no autograd).

    One flat ``reduce_scatter_tensor``: rank r's chunk must be the r-th block of dim 0, so ``x``
    is viewed as (..., tp, chunk, ...) and the rank dim moved first (free when every dim before
    ``dim`` has size 1, one copy otherwise, where the list API copied each chunk and NCCL copied
    them again into a flat buffer).
    """
    tp = dist.get_world_size(group)
    blocks = x.unflatten(dim, (tp, -1)).movedim(dim, 0).contiguous()    # (tp, ..., chunk, ...)
    out = x.new_empty(blocks.shape[1:])
    getattr(dist, _REDUCE_SCATTER)(out, blocks.flatten(0, 1), group=group)   # concatenated form
    return out


class _GatherSequence(torch.autograd.Function):
    """Forward: concatenate the ranks' sequence shards along ``dim``. Backward: sum the
    gradients over the group and keep our shard (a reduce-scatter): the gathered tensor feeds
    tensor-parallel layers, so each rank's gradient of it is partial."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return gather_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_dim(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    """Forward: sum partial outputs over the group, each rank keeping its sequence shard along
    ``dim``. Backward: all-gather the shards' gradients (every rank's partial output affected
    every position)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return reduce_scatter_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_dim(grad, ctx.dim, ctx.group), None, None


class _GatherSequenceLinears(torch.autograd.Function):
    """Sequence parallelism's entry into column-parallel layers, as Megatron does it: all-gather
    the (B, S/tp, H) shard and apply each weight, but keep only the shard for backward and
    all-gather it again there for the weight gradients, so the full (B, S, H) input is never
    stored. Backward: the input gradient is summed over the layers, then reduce-scattered."""

    @staticmethod
    def forward(ctx, x, group, *weights):
        ctx.group, ctx.weights = group, weights     # the parameters themselves (deferred W)
        ctx.save_for_backward(x)
        full = gather_dim(x, 1, group)
        return tuple(F.linear(full, w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        (x,), weights, group = ctx.saved_tensors, ctx.weights, ctx.group
        grad_full = sum(g @ w for g, w in zip(grads, weights))              # (B, S, H)

        def grad_weights():     # the shard gathered again: in B, or in a deferred W
            full = gather_dim(x, 1, group).flatten(0, -2)                   # (B*S, H)
            return tuple(g.flatten(0, -2).t() @ full for g in grads)        # (out, H) each
        deferred = weight_grad.STORE.defer(weights, grad_weights)
        return (reduce_scatter_dim(grad_full, 1, group), None,
                *((None,) * len(weights) if deferred else grad_weights()))


class _GradOnFirstRank(torch.autograd.Function):
    """Forward: identity. Backward: the gradient on group rank 0, zeros elsewhere."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.first = dist.get_rank(group) == 0
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.first else torch.zeros_like(grad)), None


class _AllToAll(torch.autograd.Function):
    """Forward: send ``in_splits[j]`` rows to rank j, receive ``out_splits[i]`` rows from rank i.
    Backward: the same exchange reversed. ``wire`` (``MoEConfig.dispatch_dtype``) is how the rows
    travel: None as they are, "bf16" rounded to bfloat16 both ways, "fp8" as e4m3 with one fp32
    scale per row forward (``_to_fp8``) and bfloat16 backward (DeepSeek-V3's dispatch)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, wire=None):
        ctx.group, ctx.out_splits, ctx.in_splits, ctx.wire = group, out_splits, in_splits, wire
        return _exchange(x, out_splits, in_splits, group, wire)

    @staticmethod
    def backward(ctx, grad):
        wire = "bf16" if ctx.wire else None
        return _exchange(grad, ctx.in_splits, ctx.out_splits, ctx.group, wire), None, None, None, None


class Pending:
    """An all-to-all in flight (``all_to_all_start``): the buffers and work handles of its
    forward and, once backward has started it, of its reversed exchange."""

    def __init__(self, out_splits, in_splits, group, wire):
        self.out_splits, self.in_splits, self.group, self.wire = out_splits, in_splits, group, wire
        self.sent = self.received = self.work = self.dtype = None


def _start(x: torch.Tensor, out_splits, in_splits, group, wire) -> tuple:
    """Start ``all_to_all_single`` of ``x``'s rows in the ``wire`` format without waiting:
    (send buffer, receive buffer, work)."""
    send = x.contiguous()
    if wire == "bf16":
        send = send.to(torch.bfloat16)
    elif wire == "fp8":
        send = _to_fp8(send)
    out = send.new_empty((sum(out_splits),) + tuple(send.shape[1:]))
    work = dist.all_to_all_single(out, send, out_splits, in_splits, group=group, async_op=True)
    return send, out, work


def _decode(out: torch.Tensor, wire, dtype: torch.dtype) -> torch.Tensor:
    return _from_fp8(out, dtype) if wire == "fp8" else out.to(dtype)


class _AllToAllStart(torch.autograd.Function):
    """Forward: start the exchange (``Pending``) and return an empty token that ``_AllToAllWait``
    takes, so that autograd orders the pair. Backward: wait for the reversed exchange that
    ``_AllToAllWait``'s backward started, and return its rows as ``x``'s gradient."""

    @staticmethod
    def forward(ctx, x, pending):
        ctx.pending = pending
        pending.dtype = x.dtype
        pending.sent, pending.received, pending.work = _start(x, pending.out_splits, pending.in_splits,
                                                              pending.group, pending.wire)
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _token_grad):
        p = ctx.pending
        p.work.wait()
        grad = _decode(p.received, "bf16" if p.wire else None, p.dtype)
        p.sent = p.received = p.work = None
        return grad, None


class _AllToAllWait(torch.autograd.Function):
    """Forward: wait for the exchange ``_AllToAllStart`` began; the received rows. Backward: start
    the reversed exchange of their gradient (bf16 on the wire when the forward was compressed) and
    return at once: ``_AllToAllStart``'s backward waits for it, so that what backward computes in
    between (the shared experts' backward) overlaps it."""

    @staticmethod
    def forward(ctx, token, pending):
        ctx.pending = pending
        pending.work.wait()
        out = _decode(pending.received, pending.wire, pending.dtype)
        pending.sent = pending.received = pending.work = None
        return out

    @staticmethod
    def backward(ctx, grad):
        p = ctx.pending
        p.sent, p.received, p.work = _start(grad, p.in_splits, p.out_splits, p.group,
                                            "bf16" if p.wire else None)
        return grad.new_empty(0), None


def all_to_all_start(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group=None,
                     wire: str | None = None) -> tuple[torch.Tensor, Pending | torch.Tensor]:
    """``all_to_all`` split in two so that work can run while the rows travel:
    ``token, pending = all_to_all_start(x, ...)``, the overlapped work, then
    ``all_to_all_wait(token, pending)``, equal to ``all_to_all(x, ...)`` in value and gradient.
    Backward overlaps the reversed exchange the same way."""
    if not _active(group):
        return x, x
    pending = Pending(out_splits, in_splits, group, wire)
    return _AllToAllStart.apply(x, pending), pending


def all_to_all_wait(token: torch.Tensor, pending) -> torch.Tensor:
    """The rows ``all_to_all_start`` sent, once they have arrived (see there)."""
    if not isinstance(pending, Pending):
        return pending              # one rank: ``all_to_all_start`` handed ``x`` itself back
    return _AllToAllWait.apply(token, pending)


def _exchange(x: torch.Tensor, out_splits, in_splits, group, wire) -> torch.Tensor:
    """``all_to_all_single`` of the rows of ``x`` (N, H), sent in the ``wire`` format, returned
    in ``x``'s dtype."""
    _, out, work = _start(x, out_splits, in_splits, group, wire)
    work.wait()
    return _decode(out, wire, x.dtype)


FP8_MAX = 448.0                     # the largest finite float8 e4m3fn


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    """(N, H) -> (N, H + 4) uint8: each row scaled by its absolute max to the e4m3 range, cast
    to float8_e4m3fn, with its fp32 scale in the last 4 bytes (one payload, one all-to-all;
    uint8 because collectives do not all take float8)."""
    scale = x.detach().abs().amax(dim=1, keepdim=True).float().clamp_min(1e-12) / FP8_MAX   # (N, 1)
    q = (x.float() / scale).to(torch.float8_e4m3fn).view(torch.uint8)                     # (N, H)
    return torch.cat((q, scale.view(torch.uint8)), dim=1)


def _from_fp8(payload: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    q, scale = payload[:, :-4], payload[:, -4:].contiguous().view(torch.float32)           # (N, 1)
    return (q.view(torch.float8_e4m3fn).float() * scale).to(dtype)


def copy_to_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Identity forward, gradient summed over ``group`` backward (e.g. a column-parallel input)."""
    return _CopyToRegion.apply(x, group) if _active(group) else x


def reduce_from_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum over ``group`` forward, identity backward (e.g. a row-parallel output)."""
    return _ReduceFromRegion.apply(x, group) if _active(group) else x


def gather_sequence(x: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """Megatron sequence parallelism, entering a tensor-parallel region: all-gather the sequence
    shards along ``dim`` forward; reduce-scatter the gradient backward."""
    return _GatherSequence.apply(x, dim, group) if _active(group) else x


def reduce_scatter_sequence(x: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """Megatron sequence parallelism, leaving a tensor-parallel region: sum the partial outputs
    and keep this rank's sequence shard along ``dim`` forward; all-gather the gradient backward."""
    return _ReduceScatterSequence.apply(x, dim, group) if _active(group) else x


def gather_sequence_linears(x: torch.Tensor, weights, group) -> tuple[torch.Tensor, ...]:
    """``F.linear(gather_sequence(x), w)`` for each of ``weights``, storing only the shard ``x``
    for backward (see ``_GatherSequenceLinears``); needs a real group."""
    return _GatherSequenceLinears.apply(x, group, *weights)


def grad_counted_once(x: torch.Tensor, group=None) -> torch.Tensor:
    """Feed ``x`` to a computation replicated over ``group`` when ``x``'s gradient will later be
    summed over the group (e.g. the router on gathered tokens under sequence parallelism): every
    rank computes the same gradient, so only group rank 0's enters the sum."""
    return _GradOnFirstRank.apply(x, group) if _active(group) else x


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group=None,
               wire: str | None = None) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` with uneven splits (rows of ``x``); ``wire``: the
    payload's format (see ``_AllToAll``)."""
    return _AllToAll.apply(x, out_splits, in_splits, group, wire) if _active(group) else x

