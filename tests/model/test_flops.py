"""FLOPs per token (``model/flops.py``): the attention term counts the heads' widths."""

from __future__ import annotations

import pytest

from model import flops


def test_attention_flops_count_the_heads_widths_not_the_hidden_size():
    """Qwen3-30B-A3B: 32 heads x 128 = 4096 query-key and value width against hidden 2048. The
    attention term is 3 L s (w_qk + w_v) causal and twice that whole; counting it with the hidden
    size undercounts it by half (10.5% of the model's FLOPs per token at s = 4096)."""
    from planning.cost_layout import Shape
    from training.config.recipe import load_recipe
    cfg = load_recipe("recipes/qwen3_30b_a3b.yaml").model
    assert (cfg.num_heads * cfg.head_dim, cfg.hidden_size) == (4096, 2048)
    assert flops.attention_widths(cfg) == (4096, 4096)
    s, L = 4096, cfg.num_layers
    matmul = 6 * flops.matmul_params_per_token(cfg)
    causal, whole = (flops.train_flops_per_token(cfg, s, causal=c) for c in (True, False))
    assert causal - matmul == 3 * L * s * (4096 + 4096) and whole - matmul == 2 * (causal - matmul)
    assert (causal - matmul - 6 * L * 2048 * s) / causal == pytest.approx(0.1047, abs=1e-4)   # missed
    shape = Shape.from_config(cfg)                                  # the planner counts the same
    assert shape.flops_per_token(s) == causal and shape.flops_per_token(s, causal=False) == whole
    # A model whose heads span the hidden size: the familiar 6 L h s and 12 L h s.
    tiny = load_recipe(None).model
    assert flops.train_flops_per_token(tiny, 128) - 6 * flops.matmul_params_per_token(tiny) == \
        6 * tiny.num_layers * tiny.hidden_size * 128
