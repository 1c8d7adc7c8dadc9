"""Context parallelism: attention over a sequence split between the ranks of a ``cp`` group.

Every other layer of a block acts on each token alone, so under context parallelism each rank
holds S/cp tokens of the window and only attention exchanges anything. Three exchanges, each
equal to one process's causal attention over the whole window (tests/model/test_context_parallel.py):

    a2a        Ulysses (Jacobs et al. 2023): an all-to-all turns sequence shards of every head
               into the whole sequence of nh/cp heads, attention runs there unchanged, and a
               second all-to-all turns the output back. Each rank sends about (cp-1)/cp of its
               q, k, v and output shards per layer, the same bytes whatever cp is (more for
               kv heads repeated under GQA, see ``ulysses_attention``), but cp must divide the
               query heads (per tp rank).
    allgather  torchtitan / Megatron-Core (``cp_comm_type="all_gather"``): queries stay local,
               keys and values are all-gathered (their gradients reduce-scattered), and each of
               the rank's two query chunks attends to the key prefix it can see. Any cp; every
               rank holds (and autograd saves) the whole K and V.
    p2p        ring attention (Liu et al. 2023; Megatron-Core's default; ``model/parallel/ring.py``):
               K and V travel round the ring in cp steps, each step's partial result merged
               by its log-sum-exp, the blocks wholly above the causal diagonal skipped;
               backward sends the keys round again with their gradients. Memory holds two K/V blocks at a time.

Load balancing (Megatron-Core's; the "zigzag" of ring-flash-attention): under a causal mask the
late tokens attend to many more keys than the early ones, so a contiguous split would leave rank
0 idle. The window is cut into 2cp chunks and rank r holds chunks r and 2cp-1-r
(``split_for_cp``): every rank gets the same attention work. Local tensors are in this
"load-balanced order": rank r's first S/2cp positions are chunk r, its last S/2cp chunk
2cp-1-r (``positions_for_cp``).

Why by hand: torch's ``torch.distributed.tensor.experimental.context_parallel`` (2.13: a ring
over SDPA's fused kernels, its K/V rotated by all-gather or all-to-all, and flex attention with
all-gathered K/V and a ``BlockMask``) works on DTensor ``DeviceMesh``es by patching SDPA inside a
context manager, and its load balancers and flex path are private (underscored) API; this repo's
groups are plain process groups (model/parallel/groups.py), and it has no Ulysses head exchange
(its "alltoall" is the ring's shift) nor document masking under SDPA. DeepSpeed's Ulysses
(``DistributedAttention``) concatenates the shards in rank order (contiguous shards, not the causal
load balancing above) and has no all-gather or ring variant; Megatron-Core's and Transformer
Engine's are tied to TE's fused kernels. Here: ``torch.distributed`` only (collectives on the
tensors' device, no host syncs: every shape comes from the tensors) and SDPA / flex for the
local attention, like ``model/transformer.py``.

Document masking (``model/document_mask.py``): with packed documents a token attends only to
the earlier tokens of its document. Every cp rank holds the window's (B, S) document ids (a
cumulative sum over ``input_ids``, which every rank has); ``cp_document_mask`` turns them into
what each exchange's attention takes and ``cp_document_positions`` gives the local tokens'
positions inside their documents for RoPE.

Shapes: B rows, S positions of the whole window, s = S/cp held by this rank, c = S/2cp one chunk,
nh query heads and nkv key/value heads (those of this tp rank, when tp > 1), hd head width.
``group`` is the cp process group; ``None`` means one rank (no communication), as everywhere in
``model/parallel/``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from model.document_mask import attend
from model.parallel.comm import _active, gather_dim, reduce_scatter_dim
from model.parallel.cp_layout import (CP_COMMS, _check_comm, _check_split, _local_attention, _natural_slots,
                                      cp_attention_inputs, cp_document_mask, cp_document_positions,
                                      from_cp_order, gather_from_cp, lb_chunks, positions_for_cp,
                                      split_for_cp)
from model.parallel.ring import ring_attention

__all__ = ["CP_COMMS", "allgather_kv_attention", "context_attention", "cp_attention_inputs",
           "cp_document_mask", "cp_document_positions", "from_cp_order", "gather_from_cp", "heads_to_seq", "lb_chunks",
           "positions_for_cp", "ring_attention", "seq_to_heads", "split_for_cp", "ulysses_attention"]

def _to_heads(parts, cp: int, group) -> torch.Tensor:
    """(B, H_i, s, hd) sequence shards of each part (H_i divisible by cp) -> (B, sum H_i/cp, S, hd):
    head group r of every part, the whole window in natural order, on rank r."""
    B, _, s, hd = parts[0].shape
    c = s // 2
    send = torch.cat([p.view(B, cp, p.shape[1] // cp, 2, c, hd).permute(1, 3, 0, 2, 4, 5)
                      for p in parts], dim=3)                              # (cp, 2, B, h, c, hd)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)        # recv[i]: rank i's chunks of our heads
    slots = recv.flatten(0, 1)                                             # (2cp, B, h, c, hd)
    return torch.cat([slots[i] for i in _natural_slots(cp)], dim=2)        # (B, h, S, hd)


def _to_seq(y: torch.Tensor, heads: list[int], cp: int, group) -> tuple[torch.Tensor, ...]:
    """The inverse of ``_to_heads``: (B, sum H_i/cp, S, hd) natural order -> each part's
    (B, H_i, s, hd) sequence shard in load-balanced order."""
    B, h, S, hd = y.shape
    c = S // (2 * cp)
    chunks = y.split(c, dim=2)
    send = torch.stack([chunks[n] for n in lb_chunks(cp)])                 # (2cp, B, h, c, hd)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)        # slots 2j, 2j+1: head group j, ours
    recv = recv.view(cp, 2, B, h, c, hd)
    return tuple(part.permute(2, 0, 3, 1, 4, 5).reshape(B, cp * part.shape[3], 2 * c, hd)
                 for part in recv.split([n // cp for n in heads], dim=3))  # (B, H_i, s, hd)


class _SeqToHeads(torch.autograd.Function):
    """Forward: ``_to_heads`` of one or more tensors in one all-to-all (q, k and v together).
    Backward: the reverse all-to-all of the gradient, split back into the parts."""

    @staticmethod
    def forward(ctx, group, cp, *parts):
        ctx.group, ctx.cp, ctx.heads = group, cp, [p.shape[1] for p in parts]
        return _to_heads(parts, cp, group)

    @staticmethod
    def backward(ctx, grad):
        return (None, None, *_to_seq(grad, ctx.heads, ctx.cp, ctx.group))


class _HeadsToSeq(torch.autograd.Function):
    """Forward: ``_to_seq``. Backward: ``_to_heads`` of the gradient."""

    @staticmethod
    def forward(ctx, y, group, cp):
        ctx.group, ctx.cp = group, cp
        return _to_seq(y, [y.shape[1] * cp], cp, group)[0]

    @staticmethod
    def backward(ctx, grad):
        return _to_heads([grad], ctx.cp, ctx.group), None, None


def _check_heads(name: str, n: int, cp: int) -> None:
    if n % cp:
        raise ValueError(f"parallel.context_parallel_size ({cp}) must divide {name} per tp rank ({n}) "
                         f"for parallel.cp_comm a2a; use allgather or p2p")


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(B, nh, s, hd) this rank's tokens (load-balanced order) of every head -> (B, nh/cp, S, hd)
    the whole window, in natural order, of head group r (heads r*nh/cp ...) on cp rank r.
    Backward: the reverse all-to-all."""
    if not _active(group):
        return x
    cp = dist.get_world_size(group)
    _check_heads("model.num_heads", x.shape[1], cp)
    _check_split(x.shape[2] * cp, cp, 0)
    return _SeqToHeads.apply(group, cp, x)


def heads_to_seq(y: torch.Tensor, group) -> torch.Tensor:
    """The inverse of ``seq_to_heads``: (B, nh/cp, S, hd) -> (B, nh, s, hd)."""
    if not _active(group):
        return y
    cp = dist.get_world_size(group)
    _check_split(y.shape[2], cp, 0)
    return _HeadsToSeq.apply(y, group, cp)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group,
                      scale: float | None = None, mask=None) -> torch.Tensor:
    """Causal attention (``cp_comm = "a2a"``) of this rank's (B, nh, s, hd) queries over the
    window's keys and values, given as (B, nkv, s, hd) shards: (B, nh, s, hd), all three in
    load-balanced order. ``mask``: None (causal) or ``cp_document_mask(..., "a2a")``.

    q, k and v travel in one all-to-all and arrive in natural order, so attention is the
    single-process call (SDPA ``is_causal``, or ``attend`` under a document mask) on nh/cp heads.
    GQA: with nkv a multiple of cp each rank receives the nkv/cp kv heads its query heads use.
    Otherwise each kv head is repeated lcm(nkv, cp)/nkv times before the exchange (the kv
    heads' share of the traffic grows by that factor; the repeats' gradients are summed by
    autograd), which puts on rank r exactly the kv heads of its query heads: lcm(nkv, cp)
    divides nh because nkv and cp both do. No error for GQA, then; only cp must divide nh.
    """
    if not _active(group):
        return _local_attention(q, k, v, scale, mask)
    cp, nh, nkv = dist.get_world_size(group), q.shape[1], k.shape[1]
    _check_heads("model.num_heads", nh, cp)
    if nh % nkv:
        raise ValueError(f"model.num_kv_heads per tp rank ({nkv}) must divide model.num_heads ({nh})")
    _check_split(q.shape[2] * cp, cp, 0)
    rep = math.lcm(nkv, cp) // nkv
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)   # (B, nkv*rep, s, hd)
    hq, hk = nh // cp, k.shape[1] // cp
    qh, kh, vh = _SeqToHeads.apply(group, cp, q, k, v).split([hq, hk, hk], dim=1)  # (B, h, S, hd)
    y = _local_attention(qh, kh, vh, scale, mask)                                    # (B, hq, S, hd)
    return _HeadsToSeq.apply(y, group, cp)                                           # (B, nh, s, hd)


# ------------------------------------------------------------------------------------------
# All-gather of K and V.

class _GatherKV(torch.autograd.Function):
    """Forward: all-gather the ranks' (B, nkv, s, hd) K and V shards in one collective, returned
    as (2, B, nkv, S, hd) in natural order. Backward: sum the gradients over the group and keep
    ours (one reduce-scatter), back in load-balanced order. ``comm.gather_sequence`` is the same
    pair for one tensor in rank order; here both travel together and the chunk order is undone
    in the copy that the gather's layout needs anyway."""

    @staticmethod
    def forward(ctx, k, v, group, cp):
        ctx.group, ctx.cp = group, cp
        B, nkv, s, hd = k.shape
        c = s // 2
        k5, v5 = k.view(B, nkv, 2, c, hd), v.view(B, nkv, 2, c, hd)
        send = torch.stack([t[:, :, half] for half in (0, 1) for t in (k5, v5)])  # (4, B, nkv, c, hd)
        slots = gather_dim(send, 0, group).view(2 * cp, 2, B, nkv, c, hd)          # load-balanced
        return torch.cat([slots[i] for i in _natural_slots(cp)], dim=3)            # (2, B, nkv, S, hd)

    @staticmethod
    def backward(ctx, grad):                                                       # (2, B, nkv, S, hd)
        cp = ctx.cp
        _, B, nkv, S, hd = grad.shape
        c = S // (2 * cp)
        chunks = grad.split(c, dim=3)
        slots = torch.stack([chunks[n] for n in lb_chunks(cp)])                    # (2cp, 2, B, nkv, c, hd)
        mine = reduce_scatter_dim(slots.flatten(0, 1), 0, ctx.group).view(2, 2, B, nkv, c, hd)
        return (torch.cat((mine[0, 0], mine[1, 0]), dim=2),                        # (B, nkv, s, hd)
                torch.cat((mine[0, 1], mine[1, 1]), dim=2), None, None)


def allgather_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group,
                           scale: float | None = None, mask=None) -> torch.Tensor:
    """Causal attention (``cp_comm = "allgather"``) of this rank's (B, nh, s, hd) queries over
    the window's keys and values, given as (B, nkv, s, hd) shards: (B, nh, s, hd), all three in
    load-balanced order. ``mask``: None (causal) or ``cp_document_mask(..., "allgather")``.

    K and V are gathered in natural order; the query chunk at window positions [a, a+c) sees keys
    [0, a+c), so each of the two local chunks runs one SDPA over that key prefix with the causal
    diagonal aligned to the bottom right (``causal_lower_right``: flash on CUDA) or under its
    document mask: no (s, S) mask is built for plain causal attention, and chunk r skips the keys
    after it. GQA goes to SDPA (``enable_gqa``) as it is: nothing to split by head.
    """
    if not _active(group):
        return _local_attention(q, k, v, scale, mask)
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    _check_split(q.shape[2] * cp, cp, rank)
    if mask is not None and not (isinstance(mask, tuple) and len(mask) == 2):
        raise ValueError("allgather_kv_attention takes the mask pair of cp_document_mask(..., 'allgather')")
    kv = _GatherKV.apply(k, v, group, cp)                                  # (2, B, nkv, S, hd)
    c, gqa = q.shape[2] // 2, k.shape[1] != q.shape[1]
    masks = mask if mask is not None else (None, None)
    out = []
    for half, (start, m) in enumerate(zip((rank * c, (2 * cp - 1 - rank) * c), masks)):
        end = start + c
        qi, ki, vi = q[:, :, half * c:(half + 1) * c], kv[0, :, :, :end], kv[1, :, :, :end]
        if m is None:
            out.append(F.scaled_dot_product_attention(qi, ki, vi, attn_mask=causal_lower_right(c, end),
                                                      scale=scale, enable_gqa=gqa))
        else:
            out.append(attend(qi, ki, vi, m, scale, gqa))
    return torch.cat(out, dim=2)                                           # (B, nh, s, hd)


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, cp_comm: str,
                      scale: float | None = None, mask=None) -> torch.Tensor:
    """The attention of ``cp_comm`` (``parallel.cp_comm``: a2a, allgather or p2p); see each."""
    _check_comm(cp_comm)
    fn = {"a2a": ulysses_attention, "allgather": allgather_kv_attention, "p2p": ring_attention}[cp_comm]
    return fn(q, k, v, group, scale, mask)
