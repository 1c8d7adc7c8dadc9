"""QK-clip, the "Clip" of Kimi K2's MuonClip (arXiv 2507.20534, section 2.1), on this repo's
attention (grouped-query and MLA).

Each attention head h records the largest pre-softmax logit it produced in a training step,
``S_h = max over the step's tokens and causal pairs (i >= j) of scale * q_i . k_j``
(``HeadLogits.record``, in the forward; the trainer takes the maximum over micro-batches and over
every rank). After the optimizer step, a head with ``S_h > tau`` has its query and key weights
scaled so that the same logits would be ``tau``: ``gamma_h = tau / S_h`` (``clip_factors``), and
``row_scales`` says by how much each row of which weight:

- Grouped-query attention: the key rows of kv head g are shared by the query heads of its group,
  so they take ``sqrt(min over the group of gamma)`` and each query head's rows take the rest,
  ``gamma_h / sqrt(min gamma)``: every head's logits scale by exactly its own ``gamma_h`` (1 for a
  head that did not exceed tau). With one query head per kv head this is the paper's
  ``sqrt(gamma_h)`` on both. q and k biases scale with their rows.
- MLA: per head, the query's and key's head-specific non-rotary parts (``q_b_proj``/``q_proj``'s
  nope rows, ``kv_b_proj``'s key rows) take ``sqrt(gamma_h)``, the query's rotary rows take
  ``gamma_h``, and the rotary key, shared by all heads (``kv_a_proj_with_mqa``), is not touched;
  the values are not touched.

Measuring ``S_h`` costs one extra q k^T per head per forward, (B, S, S) in fp32 one head at a
time, which the fused attention kernels do not return. Refused (``training/config``): with
``model.qk_norm`` (the norm after the projection would undo the scaling), context parallelism
and document masking (the pairs a head attends to are not all on this rank or not all causal).
"""

from __future__ import annotations

import torch


class HeadLogits:
    """The running per-head maximum logit of one attention module's local heads, over the
    forwards in training mode since the last ``take``."""

    def __init__(self, num_heads: int):
        self.num_heads = num_heads
        self.value: torch.Tensor | None = None

    @torch.no_grad()
    def record(self, q: torch.Tensor, k: torch.Tensor, scale: float) -> None:
        """``q`` (B, nh, S, d), ``k`` (B, nkv, S, d) after RoPE (a query head h uses kv head
        h // (nh / nkv), as SDPA's ``enable_gqa``); causal pairs only."""
        nh, rep, s = q.shape[1], q.shape[1] // k.shape[1], q.shape[2]
        future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        out = torch.empty(nh, dtype=torch.float32, device=q.device)
        for h in range(nh):
            logits = (q[:, h].float() @ k[:, h // rep].float().mT) * scale         # (B, S, S)
            out[h] = logits.masked_fill(future, float("-inf")).amax()
        self.value = out if self.value is None else torch.maximum(self.value, out)

    def take(self, device) -> torch.Tensor:
        """The maximum since the last call ((nh,); -inf without a forward), and start again."""
        value = self.value if self.value is not None else torch.full((self.num_heads,), float("-inf"), device=device)
        self.value = None
        return value


def clip_factors(max_logits: torch.Tensor, tau: float) -> torch.Tensor:
    """``gamma_h = min(1, tau / S_h)`` of every head (1 where ``S_h <= tau`` or no logit was seen)."""
    gamma = tau / max_logits.clamp(min=tau)
    return torch.where(torch.isfinite(max_logits), gamma, torch.ones_like(gamma))


def _rows(param: torch.nn.Parameter) -> torch.Tensor:
    """This rank's rows of ``param`` as indices into the full weight's rows (tp splits rows)."""
    for dim, idx in getattr(param, "shard_spec", []):
        if dim == 0:
            return torch.tensor(idx, dtype=torch.long)
    return torch.arange(param.full_shape[0] if hasattr(param, "full_shape") else param.shape[0])


def row_scales(attn, gamma: torch.Tensor) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(parameter, per-row factor over this rank's rows) of every weight and bias QK-clip scales
    in ``attn`` (``model.block.Attention`` or ``model.mla.MLAttention``), from ``gamma`` over all
    of the layer's heads (the module docstring)."""
    out = []

    def add(linear, per_full_row: torch.Tensor) -> None:
        rows = _rows(linear.weight).to(per_full_row.device)
        scale = per_full_row[rows]
        out.append((linear.weight, scale))
        if getattr(linear, "bias", None) is not None:
            out.append((linear.bias, scale))

    if hasattr(attn, "kv_b_proj"):                     # MLA
        nope, rope, v = attn.nope, attn.rope, attn.v_dim
        root = gamma.sqrt()
        q_rows = torch.cat([root[:, None].expand(-1, nope), gamma[:, None].expand(-1, rope)], dim=1).reshape(-1)
        kv_rows = torch.cat([root[:, None].expand(-1, nope), torch.ones_like(gamma)[:, None].expand(-1, v)],
                            dim=1).reshape(-1)
        add(attn.q_b_proj if attn.q_rank else attn.q_proj, q_rows)
        add(attn.kv_b_proj, kv_rows)
        return out
    hd = attn.head_dim
    num_kv = attn.k_proj.weight.full_shape[0] // hd if hasattr(attn.k_proj.weight, "full_shape") else attn.num_kv_heads
    k_scale = gamma.view(num_kv, -1).amin(dim=1).sqrt()                        # (nkv,)
    q_scale = gamma / k_scale.repeat_interleave(gamma.numel() // num_kv)       # (nh,)
    add(attn.q_proj, q_scale.repeat_interleave(hd))
    add(attn.k_proj, k_scale.repeat_interleave(hd))
    return out
