"""Document masking for packed windows (Megatron's ``reset_attention_mask`` and
``reset_position_ids``).

The trainer packs documents into fixed windows with a separator token (the tokenizer's EOS)
after each one, so a window holds the tail of one document, whole documents and the head of
the next. With ``TransformerConfig.document_separator_id`` set, a token attends only to the
earlier tokens of its own document and its RoPE position counts from that document's first
token, so a document's logits inside a window are its logits alone. The separator belongs to
the document it ends; the next document starts at the token after it. Everything is derived
on the device from ``input_ids`` (a cumulative sum of the separator): no host sync, and the
batches are the same with and without masking. (With RoPE, q.k depends only on the distance
between two positions, so inside the mask the restart changes roundings only: a document's
cos/sin tables, rounded to the training dtype, are then those it gets alone.)

Kernels are PyTorch's own. On CUDA, ``flex_attention`` (compiled) with a ``BlockMask``, which
skips the blocks lying wholly outside the causal same-document region; elsewhere
``scaled_dot_product_attention`` with a boolean (B, 1, S, S) mask. Without a separator the
model calls SDPA with ``is_causal=True`` and none of this runs.

Shapes: B rows of the micro-batch (this ep rank's rows), S positions of the whole window (also
under sequence parallelism: RoPE and attention see the gathered sequence), nh query heads held
by this rank, hd head width.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

try:        # torch >= 2.5
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:                                        # pragma: no cover - older torch
    create_block_mask = flex_attention = None

KERNELS = ("sdpa", "flex")


def document_ids(input_ids: torch.Tensor, separator: int) -> torch.Tensor:
    """(B, S) int32: which document of its window each token belongs to, 0 at the window's
    start; a separator closes its document (the count of separators strictly before it)."""
    ends = input_ids == separator                                                  # (B, S)
    return ends.cumsum(1, dtype=torch.int32) - ends.int()                          # (B, S)


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, S) int64: each token's position inside its document (0 at its first token)."""
    pos = torch.arange(doc_ids.shape[1], device=doc_ids.device).expand(doc_ids.shape)   # (B, S)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)                                 # (B, S)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(starts, pos, 0).cummax(1).values      # (B, S) index of its first token
    return pos - first


def default_kernel(device: torch.device) -> str:
    """``flex`` on CUDA where torch has it, else ``sdpa``."""
    return "flex" if device.type == "cuda" and flex_attention is not None else "sdpa"


def attention_mask(doc_ids: torch.Tensor, kernel: str | None = None):
    """What ``attend`` takes for these documents: query t sees key s when s <= t and both lie in
    the same document. ``kernel``: sdpa (a (B, 1, S, S) bool tensor, True = attend) or flex (a
    ``BlockMask`` over (B, any head, S, S)); None = ``default_kernel``."""
    kernel = kernel or default_kernel(doc_ids.device)
    if kernel not in KERNELS:
        raise ValueError(f"attention kernel {kernel!r} must be one of {', '.join(KERNELS)}")
    B, S = doc_ids.shape
    if kernel == "flex":
        if flex_attention is None:
            raise ValueError(f"the flex kernel needs torch >= 2.5 (this is {torch.__version__})")

        def same_document_causal(b, h, q, kv):
            return (q >= kv) & (doc_ids[b, q] == doc_ids[b, kv])
        return create_block_mask(same_document_causal, B, None, S, S, device=doc_ids.device)
    causal = torch.ones(S, S, dtype=torch.bool, device=doc_ids.device).tril()              # (S, S)
    same = doc_ids[:, :, None] == doc_ids[:, None, :]                                   # (B, S, S)
    return (same & causal)[:, None]                                                  # (B, 1, S, S)


def attention_inputs(rotary, seq_len: int, x: torch.Tensor, doc_ids: torch.Tensor | None = None):
    """(rope, mask) for the blocks of a window whose residual stream is ``x``: RoPE for positions
    0..S-1 and plain causal attention (mask None); or, with (B, S) ``doc_ids``, RoPE for the
    positions inside each document and the same-document mask. ``rotary``: the model's
    ``RotaryEmbedding``."""
    if doc_ids is None:
        return rotary(seq_len, x.device, x.dtype), None
    return (rotary(seq_len, x.device, x.dtype, document_positions(doc_ids)),
            attention_mask(doc_ids))


@functools.cache
def _compiled_flex():
    # flex_attention is fused only when compiled; eager it materializes the scores (fine on CPU
    # for tests, where SDPA is the default anyway).
    return torch.compile(flex_attention, dynamic=False)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float | None,
           enable_gqa: bool) -> torch.Tensor:
    """Attention of (B, nh, S, hd) queries over (B, nkv, S, hd) keys and values under ``mask``
    (from ``attention_mask``): (B, nh, S, hd)."""
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=enable_gqa)
    flex = _compiled_flex() if q.is_cuda else flex_attention
    return flex(q, k, v, block_mask=mask, scale=scale, enable_gqa=enable_gqa)
