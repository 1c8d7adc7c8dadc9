"""Every shipped recipe whose family has a transformers counterpart exports, as shipped.

Each recipe's model is built at a reduced width (hidden 64, at most 3 layers, 8 experts, its
attention kind, routing, shared experts, MTP, tied embeddings, qk-norm and rope scaling kept;
``_reduced``), given O(1) random weights, exported by ``interop/hf_files.export_hf`` and
reloaded by transformers' Auto classes: the logits must equal ours. The recipes whose family has
no transformers counterpart are refused in one line, each for its stated reason.

Tolerance: 1e-4 absolute on logits of O(1): fp32, the same arithmetic in another order (HF's
attention and expert loops); a wrong tensor layout is off by O(1).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.interop.test_convert_hf import _randomize

RECIPES = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))
# No transformers class has these: a decoder-only Switch (HF's is a T5 encoder-decoder), and
# DeepSeek-V3's sigmoid routing with the expert bias over grouped-query attention (HF's
# DeepSeek-V3 has MLA; Qwen2-MoE routes by softmax without a bias).
NO_COUNTERPART = {"switch_base_8": "T5 encoder-decoder", "switch_base_128": "T5 encoder-decoder",
                  "tiny_switch": "T5 encoder-decoder", "deepseek_v3_style": "routes by softmax",
                  "tiny_deepseek_moe": "routes by softmax"}


def _reduced(cfg):
    """``cfg`` at test width, every structural choice kept (the module docstring)."""
    kw = dict(vocab_size=256, hidden_size=64, num_layers=min(cfg.num_layers, 3), ffn_hidden_size=64,
              max_seq_len=64, num_heads=4, num_kv_heads=4 if cfg.num_kv_heads == cfg.num_heads else 2,
              attn_head_dim=None if cfg.attn_head_dim is None else 16)
    if cfg.attention == "mla":
        kw.update(q_lora_rank=None if cfg.q_lora_rank is None else 32, kv_lora_rank=32, qk_nope_head_dim=16,
                  qk_rope_head_dim=8, v_head_dim=16)
    if cfg.rope_scaling is not None:
        kw.update(rope_original_max_seq_len=16)
    moe = cfg.moe
    if moe is not None:
        width = 32 / moe.expert_ffn_hidden_size if moe.expert_ffn_hidden_size else 1.0
        shared = moe.shared_expert_ffn_hidden_size
        kw["moe"] = dataclasses.replace(
            moe, num_experts=8, top_k=min(moe.top_k, 2), expert_ffn_hidden_size=32,
            first_k_dense=min(moe.first_k_dense, 1), n_group=min(moe.n_group, 4),
            topk_group=min(moe.topk_group, 2),
            shared_expert_ffn_hidden_size=None if shared is None else max(16, int(shared * width)))
    return dataclasses.replace(cfg, **kw).validate()


@pytest.mark.parametrize("name", RECIPES)
def test_every_shipped_recipe_exports_or_has_no_counterpart(name, tmp_path):
    from interop.hf_files import export_hf, verify_export
    from model import Transformer
    from training.config.recipe import load_recipe
    cfg = _reduced(load_recipe(f"recipes/{name}.yaml", []).model)
    model = Transformer(cfg, init_seed=0)
    _randomize(model, seed=1)
    if name in NO_COUNTERPART:
        with pytest.raises(ValueError, match=NO_COUNTERPART[name]) as err:
            export_hf(model, cfg, None, tmp_path / "hf")
        assert "\n" not in str(err.value)
        return
    export_hf(model, cfg, None, tmp_path / "hf")
    with torch.no_grad():
        scale = model.eval()(torch.arange(16)[None]).logits.std().item()
    assert scale > 0.3                                  # not a vacuous comparison
    assert verify_export(model, tmp_path / "hf") <= 1e-4, name
