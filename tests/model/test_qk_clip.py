"""QK-clip's measurement and scaling (``model/qk_clip.py``) on the real attention modules: after
the clip, the same batch gives every head that passed tau exactly tau as its largest logit, and
every other head exactly what it gave before (one layer: a clip in one layer changes the
input of the next), for grouped-query attention with shared kv heads
and for MLA with and without the query latent."""

from __future__ import annotations

import pytest
import torch

from model import Transformer, TransformerConfig
from model.qk_clip import HeadLogits, clip_factors, row_scales

BASE = dict(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, ffn_hidden_size=48,
            max_seq_len=32)
MLA = dict(attention="mla", kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)


def _logits(model, x) -> list[torch.Tensor]:
    model(x, x)
    return [m.qk_logits.take("cpu") for m in _attns(model)]


def _attns(model):
    return [m for m in model.modules() if hasattr(m, "qk_logits")]


def _reference_max(q, k, scale):
    """Every head's largest causal logit the plain way: the whole (B, nh, S, S) at once."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = (q @ k.mT) * scale
    s = q.shape[2]
    return logits.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf")).amax(dim=(0, 2, 3))


def test_the_recorded_maximum_is_each_heads_largest_causal_logit():
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8)
    logits = HeadLogits(4)
    logits.record(q, k, 0.3)
    logits.record(q * 0.5, k, 0.3)                  # a second micro-batch: the running maximum
    torch.testing.assert_close(logits.take("cpu"), _reference_max(q, k, 0.3))
    assert torch.isinf(logits.take("cpu")).all()    # taken: starts again


@pytest.mark.parametrize("extra", [{}, MLA, {**MLA, "q_lora_rank": 16}], ids=["gqa", "mla", "mla-q-latent"])
def test_after_the_clip_the_same_batch_gives_tau_on_the_clipped_heads_only(extra):
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(**BASE, **extra), None, init_seed=0)
    with torch.no_grad():                           # logits of a few units, different per head
        for name, p in model.named_parameters():
            if "proj" in name:
                p.mul_(8)
    for m in _attns(model):
        m.qk_logits = HeadLogits(m.num_heads)
    x = torch.randint(0, 64, (2, 32))
    before = _logits(model, x)
    tau = float(torch.cat(before).median())         # about half the heads pass it
    for m, s in zip(_attns(model), before):
        with torch.no_grad():
            for p, rows in row_scales(m, clip_factors(s, tau)):
                p.mul_(rows.view(-1, *([1] * (p.dim() - 1))))
    after = _logits(model, x)
    clipped = 0
    for b, a in zip(before, after):
        over = b > tau
        clipped += int(over.sum())
        torch.testing.assert_close(a[over], torch.full_like(a[over], tau), rtol=1e-5, atol=0)
        torch.testing.assert_close(a[~over], b[~over], rtol=1e-5, atol=0)
    assert clipped >= 1 and clipped < sum(b.numel() for b in before)


def test_clip_factors():
    got = clip_factors(torch.tensor([50.0, 100.0, 200.0, float("-inf")]), 100.0)
    assert got.tolist() == [1.0, 1.0, 0.5, 1.0]
