"""Context parallelism's layout: which tokens each cp rank holds (causal load balancing), their
positions and document masks, and the local attention every exchange ends in; shared by
``model/parallel/context.py`` (all-to-all, all-gather) and ``model/parallel/ring.py`` (ring)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from model.document_mask import (KERNELS, attend, attention_inputs, attention_mask, create_block_mask,
                                 default_kernel, document_positions)
from model.parallel.comm import _active, gather_dim
from model.parallel.dims import CP_COMMS


# ------------------------------------------------------------------------------------------
# Load balancing: which tokens each rank holds.

def _check_split(S: int, cp: int, rank: int) -> None:
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"parallel.context_parallel_size ({cp}) must be >= 1 and the cp rank "
                         f"({rank}) below it")
    if S % (2 * cp):
        raise ValueError(f"parallel.context_parallel_size ({cp}) needs the sequence length ({S}) "
                         f"divisible by 2 x cp = {2 * cp} (two chunks per rank)")


def lb_chunks(cp: int) -> list[int]:
    """The chunks of the window in load-balanced order: [0, 2cp-1, 1, 2cp-2, ...], rank r's two
    at slots 2r and 2r+1."""
    return [i for r in range(cp) for i in (r, 2 * cp - 1 - r)]


def _natural_slots(cp: int) -> list[int]:
    """The load-balanced slot of each chunk 0..2cp-1 (the inverse of ``lb_chunks``)."""
    return [2 * n if n < cp else 2 * (2 * cp - 1 - n) + 1 for n in range(2 * cp)]


def split_for_cp(t: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s tokens of ``t``, whose ``dim`` is the whole window (S): chunks ``rank``
    and 2cp-1-``rank`` of the window cut into 2cp, concatenated (S/cp along ``dim``; a copy,
    or ``t`` itself when cp is 1)."""
    S = t.shape[dim]
    _check_split(S, cp, rank)
    if cp == 1:
        return t
    c = S // (2 * cp)
    return torch.cat((t.narrow(dim, rank * c, c), t.narrow(dim, (2 * cp - 1 - rank) * c, c)), dim)


def positions_for_cp(S: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """(S/cp,) int64: the window positions of rank ``rank``'s tokens, in its order (for RoPE and
    masks); built on ``device`` (no copy from the host)."""
    _check_split(S, cp, rank)
    c = S // (2 * cp)
    return torch.cat((torch.arange(rank * c, (rank + 1) * c, device=device),
                      torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)))


def from_cp_order(t: torch.Tensor, cp: int, dim: int = 1) -> torch.Tensor:
    """The inverse of splitting: ``t``'s ``dim`` holds the ranks' shards one after another (what
    an all-gather of ``split_for_cp``'s outputs gives); returns the window in natural order."""
    if cp == 1:
        return t
    chunks = t.split(t.shape[dim] // (2 * cp), dim)
    return torch.cat([chunks[i] for i in _natural_slots(cp)], dim)


def gather_from_cp(t: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """All-gather the ranks' ``split_for_cp`` shards of ``t`` and return the whole window in
    natural order along ``dim`` (no autograd; for tests, statistics and checkpoints)."""
    if not _active(group):
        return t
    return from_cp_order(gather_dim(t, dim, group), dist.get_world_size(group), dim)


def cp_document_positions(doc_ids: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """(B, S/cp) int64: the positions inside their documents of this rank's tokens (RoPE under
    document masking), from the window's (B, S) document ids (``document_ids``)."""
    return split_for_cp(document_positions(doc_ids), cp, rank, 1)


def cp_document_mask(doc_ids: torch.Tensor, cp: int, rank: int, cp_comm: str, kernel: str | None = None):
    """What ``cp_comm``'s attention takes as ``mask`` for these (B, S) window document ids (natural
    order, on every cp rank), so that a token sees only the earlier tokens of its document: a2a,
    the single-process mask (``attention_mask``: its heads see the whole window in natural
    order); allgather, a pair of masks, one per local chunk, each over the key prefix that chunk
    can see (bool (B, 1, c, prefix) for sdpa, a ``BlockMask`` for flex); p2p, the ids themselves
    (the ring builds each block's mask). ``kernel``: sdpa or flex (None: ``default_kernel``; the
    ring always uses its own). Build once per window, like ``attention_inputs``."""
    _check_comm(cp_comm)
    S = doc_ids.shape[1]
    _check_split(S, cp, rank)
    if cp_comm == "a2a" or cp == 1:             # one rank: the single-process mask, any cp_comm
        return attention_mask(doc_ids, kernel)
    if cp_comm == "p2p":
        return doc_ids
    kernel = kernel or default_kernel(doc_ids.device)
    c = S // (2 * cp)
    return tuple(_prefix_mask(doc_ids, start, c, kernel) for start in (rank * c, (2 * cp - 1 - rank) * c))


def cp_attention_inputs(rotary, seq_len: int, x: torch.Tensor, doc_ids: torch.Tensor | None,
                        cp: int, rank: int, cp_comm: str):
    """(rope, mask) for the blocks of cp rank ``rank``'s tokens of a ``seq_len`` window (the
    context-parallel ``attention_inputs``): RoPE at the rank's window positions
    (``positions_for_cp``) and mask None (causal); or, with the window's (B, S) ``doc_ids``,
    RoPE at the positions inside each document (``cp_document_positions``) and
    ``cp_document_mask`` for ``cp_comm``. ``x``: the rank's residual stream (device, dtype)."""
    if doc_ids is None:
        return rotary(seq_len, x.device, x.dtype, positions_for_cp(seq_len, cp, rank, x.device)), None
    return (rotary(seq_len, x.device, x.dtype, cp_document_positions(doc_ids, cp, rank)),
            cp_document_mask(doc_ids, cp, rank, cp_comm))


def cp_slice(t: torch.Tensor, groups) -> torch.Tensor:
    """This cp rank's ``split_for_cp`` slice of a whole-window (B, S) tensor (``t`` itself
    without context parallelism); ``groups``: the rank's ``ParallelGroups``."""
    return split_for_cp(t, groups.cp, groups.cp_rank) if groups.cp > 1 else t


def rank_attention_inputs(rotary, seq_len: int, x: torch.Tensor, doc_ids: torch.Tensor | None, groups):
    """(rope, mask) for this rank's blocks: ``cp_attention_inputs`` under context parallelism
    (``groups.cp`` > 1), else ``attention_inputs``. ``seq_len`` and ``doc_ids``: the whole
    window's."""
    if groups.cp > 1:
        return cp_attention_inputs(rotary, seq_len, x, doc_ids, groups.cp, groups.cp_rank,
                                   groups.cp_comm)
    return attention_inputs(rotary, seq_len, x, doc_ids)


def _prefix_mask(doc_ids: torch.Tensor, start: int, c: int, kernel: str):
    """Queries at window positions start..start+c-1 over keys 0..start+c-1, causal and within
    the document."""
    end = start + c
    if kernel == "flex":
        if create_block_mask is None:
            raise ValueError(f"the flex kernel needs torch >= 2.5 (this is {torch.__version__})")

        def same_document_causal(b, h, q, kv):
            return (q + start >= kv) & (doc_ids[b, q + start] == doc_ids[b, kv])
        return create_block_mask(same_document_causal, doc_ids.shape[0], None, c, end,
                                 device=doc_ids.device)
    if kernel != "sdpa":
        raise ValueError(f"attention kernel {kernel!r} must be one of {', '.join(KERNELS)}")
    pos = torch.arange(start, end, device=doc_ids.device)                           # (c,)
    keys = torch.arange(end, device=doc_ids.device)                                 # (end,)
    causal = pos[:, None] >= keys[None, :]                                          # (c, end)
    same = doc_ids[:, start:end, None] == doc_ids[:, None, :end]                    # (B, c, end)
    return (same & causal)[:, None]                                                 # (B, 1, c, end)


def _check_comm(cp_comm: str) -> None:
    if cp_comm not in CP_COMMS:
        raise ValueError(f"parallel.cp_comm ({cp_comm!r}) must be one of {', '.join(CP_COMMS)}")


def _local_attention(q, k, v, scale, mask):
    """One rank: the whole window in natural order."""
    gqa = k.shape[1] != q.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    return attend(q, k, v, mask, scale, gqa)


# ------------------------------------------------------------------------------------------
# Ulysses: sequence shards <-> head shards (all-to-all).
#
# The wire layout of each rank's message is (2, B, h, c, hd): its two chunks of the h heads the
# receiver keeps. The received (cp, 2, ...) buffer is then the window's 2cp chunks in
# load-balanced slot order, which one ``torch.cat`` puts in natural order; so each direction
# costs one copy before the exchange and one after, as a plain all-to-all would.
