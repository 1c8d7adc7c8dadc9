"""Ring attention (``parallel.cp_comm = "p2p"``), the third exchange of context parallelism: see
``model/parallel/context.py`` and ``model/parallel/cp_layout.py`` for the layout, the load balancing and why it is written by hand."""

from __future__ import annotations

import torch
import torch.distributed as dist

from model.parallel.comm import _active
from model.parallel.cp_layout import _check_split, _local_attention, positions_for_cp, split_for_cp


def _block(q, k, v, scale, keep):
    """Attention of (B, nkv, g, Lq, hd) queries over (B, nkv, Lk, hd) keys under the boolean
    ``keep`` (broadcast to (B, nkv, g, Lq, Lk), True = attend), fp32 math: the output
    (B, nkv, g, Lq, hd) normalized within the block and the rows' log-sum-exp (-inf where a row
    sees nothing here)."""
    scores = (q.float() @ k.float()[:, :, None].transpose(-1, -2)).mul_(scale)  # (B, nkv, g, Lq, Lk)
    scores.masked_fill_(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                  # (B, nkv, g, Lq)
    p = scores.sub_(torch.where(torch.isinf(lse), 0.0, lse)[..., None]).exp_()   # in place
    return p @ v.float()[:, :, None], lse


def _ring_plan(rank: int, src: int, c: int):
    """Which local query rows and which of ``src``'s key rows can meet under the causal mask
    (load-balanced chunks): the block's own diagonal when src == rank; all our queries and
    src's first chunk when src < rank (its second chunk lies after both of ours); our second
    chunk and all of src's keys when src > rank. Every step but the first costs the same."""
    if src == rank:
        return slice(0, 2 * c), slice(0, 2 * c)
    if src < rank:
        return slice(0, 2 * c), slice(0, c)
    return slice(c, 2 * c), slice(0, 2 * c)


def _keep(pos, docs, rank, src, rows, cols):
    """The boolean mask of one block from the ranks' window positions ``pos`` and (B, s)
    document ids ``docs`` (None: causal only): causal, and within the document."""
    keep = pos[rank][rows][:, None] >= pos[src][cols][None, :]             # (Lq, Lk)
    if docs is None:
        return keep
    dq, dk = docs[rank][:, rows], docs[src][:, cols]                       # (B, Lq), (B, Lk)
    return (keep & (dq[:, :, None] == dk[:, None, :]))[:, None, None]      # (B, 1, 1, Lq, Lk)


def _ring_shift(t: torch.Tensor, group, nxt: int, prv: int):
    """Start sending ``t`` to global rank ``nxt`` and receiving its like from ``prv``: (buffer,
    works)."""
    buf = torch.empty_like(t)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, nxt, group),
                                    dist.P2POp(dist.irecv, buf, prv, group)])
    return buf, works


class _Ring(torch.autograd.Function):
    """Ring attention with the causal skips of the load-balanced chunks (``_ring_plan``).

    Forward: cp steps; at step i this rank holds the K/V block of cp rank (rank - i) mod cp and
    passes it on while it computes (``batch_isend_irecv``), merging each block's partial output
    by the log-sum-exp. Saves only the local q, k, v, the output and its log-sum-exp. Backward
    (FlashAttention-2's, per block): the K/V blocks go round again (the next one travelling
    while this one is computed), each followed by the gradient of its keys and values summed
    over the ranks it has visited; the last hop brings each rank its own block's, complete.
    Block math is fp32 matmuls with the block's scores materialized ((B, nh, c, 2c) or
    (B, nh, 2c, 2c) per step): a reference kernel, exact in fp32; on a GPU a fused kernel that
    returns the log-sum-exp (flash's, flex ``return_lse``) is to take its place.
    """

    @staticmethod
    def forward(ctx, q, k, v, group, scale, docs):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        B, nh, s, hd = q.shape
        nkv, c = k.shape[1], s // 2
        g = nh // nkv
        nxt = dist.get_global_rank(group, (rank + 1) % cp)
        prv = dist.get_global_rank(group, (rank - 1) % cp)
        pos = [positions_for_cp(s * cp, cp, r, q.device) for r in range(cp)]
        parts = [split_for_cp(docs, cp, r, 1) for r in range(cp)] if docs is not None else None
        qg = q.view(B, nkv, g, s, hd)
        out = q.new_zeros((B, nkv, g, s, hd), dtype=torch.float32)
        lse = q.new_full((B, nkv, g, s), float("-inf"), dtype=torch.float32)
        block = torch.stack((k, v))                                        # (2, B, nkv, s, hd)
        for i in range(cp):
            src = (rank - i) % cp
            works = None
            if i < cp - 1:
                nxt_block, works = _ring_shift(block, group, nxt, prv)
            rows, cols = _ring_plan(rank, src, c)
            o, l = _block(qg[:, :, :, rows], block[0][:, :, cols], block[1][:, :, cols], scale,
                          _keep(pos, parts, rank, src, rows, cols))
            new = torch.logaddexp(lse[..., rows], l)                       # finite: step 0 is ours
            out[..., rows, :] = (out[..., rows, :] * torch.exp(lse[..., rows] - new)[..., None]
                                 + o * torch.exp(l - new)[..., None])
            lse[..., rows] = new
            if works is not None:
                for w in works:
                    w.wait()
                block = nxt_block
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.parts, ctx.pos, ctx.ring = group, scale, parts, pos, (cp, rank, nxt, prv)
        return out.to(q.dtype).view(B, nh, s, hd)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        cp, rank, nxt, prv = ctx.ring
        B, nh, s, hd = q.shape
        nkv, c = k.shape[1], s // 2
        g, scale = nh // nkv, ctx.scale
        qg = q.view(B, nkv, g, s, hd).float()
        do = grad.reshape(B, nkv, g, s, hd).float()
        delta = (do * out).sum(-1)                                         # (B, nkv, g, s)
        dq = torch.zeros_like(qg)
        block = torch.stack((k, v))                                        # (2, B, nkv, s, hd)
        dkv = torch.zeros_like(block, dtype=torch.float32)                 # the held block's gradient
        for i in range(cp):
            src = (rank - i) % cp
            works = []
            if i < cp - 1:                                                 # the next block, meanwhile
                nxt_block, works = _ring_shift(block, ctx.group, nxt, prv)
            rows, cols = _ring_plan(rank, src, c)
            kb, vb = block[0][:, :, cols].float(), block[1][:, :, cols].float()
            qr, dor = qg[:, :, :, rows], do[:, :, :, rows]
            keep = _keep(ctx.pos, ctx.parts, rank, src, rows, cols)
            scores = (qr @ kb[:, :, None].transpose(-1, -2)).mul_(scale)   # (B, nkv, g, Lq, Lk)
            p = scores.masked_fill_(~keep, float("-inf")).sub_(lse[..., rows, None]).exp_()
            ds = (dor @ vb[:, :, None].transpose(-1, -2)).sub_(delta[..., rows, None]).mul_(p).mul_(scale)
            dq[:, :, :, rows] += ds @ kb[:, :, None]
            dkv[0][:, :, cols] += (ds.transpose(-1, -2) @ qr).sum(2)      # over the query group
            dkv[1][:, :, cols] += (p.transpose(-1, -2) @ dor).sum(2)
            # The gradient of the block we hold goes on with it (block src-1's comes in); after
            # the last step the one that comes in is our own block's, complete.
            nxt_dkv, dworks = _ring_shift(dkv, ctx.group, nxt, prv)
            for w in dworks + works:
                w.wait()
            dkv = nxt_dkv
            if i < cp - 1:
                block = nxt_block
        return (dq.view(B, nh, s, hd).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group,
                   scale: float | None = None, mask=None) -> torch.Tensor:
    """Causal attention (``cp_comm = "p2p"``) of this rank's (B, nh, s, hd) queries over the
    window's keys and values, given as (B, nkv, s, hd) shards: (B, nh, s, hd), all three in
    load-balanced order. ``mask``: None (causal) or ``cp_document_mask(..., "p2p")`` (the (B, S)
    document ids). See ``_Ring``; GQA as it is (each key block serves its query group)."""
    if not _active(group):
        return _local_attention(q, k, v, scale, mask)
    cp, nh, nkv = dist.get_world_size(group), q.shape[1], k.shape[1]
    _check_split(q.shape[2] * cp, cp, 0)
    if nh % nkv:
        raise ValueError(f"model.num_kv_heads per tp rank ({nkv}) must divide model.num_heads ({nh})")
    if mask is not None and not (isinstance(mask, torch.Tensor)
                                 and mask.shape == (q.shape[0], q.shape[2] * cp)):
        raise ValueError("ring_attention takes the (B, S) document ids of cp_document_mask(..., 'p2p')")
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    return _Ring.apply(q, k, v, group, scale, mask)


