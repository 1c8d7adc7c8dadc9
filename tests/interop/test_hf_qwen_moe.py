"""launch/convert_hf.py and interop/hf_qwen.py against transformers' Qwen3-MoE and Qwen2-MoE.

Tiny fp32 configs on CPU with eager attention (vocab 128, hidden 64, 4 query heads over 2 kv
heads of head_dim 32, i.e. wider than hidden/heads = 16, as Qwen3's 128 at 2048/32; 8 experts of
inner size 32 besides a dense MLP of 96, top-2). Qwen3-MoE: q/k norms, renormalized top-k, block
0 dense (``mlp_only_layers`` [0] = ``first_k_dense`` 1). Qwen2-MoE: q/k/v biases, raw top-k
probabilities, a gated shared expert of 48, MoE every 2nd block (``decoder_sparse_step`` 2).

Tolerance for logits and losses: 1e-5, as tests/interop/test_convert_hf.py and for the same
reason: both sides compute in fp32 with different but equivalent op orders (SDPA vs eager
attention, one grouped GEMM vs a loop of per-expert linears), ~1e-7 relative per op, up to ~1e-6
on O(1) logits over three layers; a layout mistake (a missing norm or bias, k_norm on q, the
shared expert ungated, a dense block where HF has experts) moves them by O(0.1-1).
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from interop import hf as hf_interop
from launch import convert_hf
from model.config import MixtralConfig, MoEConfig
from model.transformer import Transformer
from tests.interop.test_convert_hf import (_assert_export_loss, _assert_same_logits, _error_line, _fake_run,
                                           _randomize, _reimport, _tiny_tokenizer)

TOL = 1e-5
HF_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
                 rms_norm_eps=1e-6, dtype="float32", rope_parameters={"rope_type": "default",
                                                                     "rope_theta": 1e6},
                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 router_aux_loss_coef=0.001, attn_implementation="eager")
HF_KINDS = {
    "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig, dict(norm_topk_prob=True, mlp_only_layers=[0])),
    "qwen2_moe": (Qwen2MoeForCausalLM, Qwen2MoeConfig, dict(
        norm_topk_prob=False, qkv_bias=True, decoder_sparse_step=2, shared_expert_intermediate_size=48)),
}


def _hf_tiny(kind: str, **overrides) -> torch.nn.Module:
    cls, config_cls, extra = HF_KINDS[kind]
    torch.manual_seed(0)
    model = cls(config_cls(**{**HF_COMMON, **extra, **overrides}))
    _randomize(model, seed=3)              # norms and biases ~1 +- 0.1, matrices 0.1 x N(0, 1)
    return model.eval()


@pytest.mark.parametrize("kind", sorted(HF_KINDS))
def test_import_matches_transformers(tmp_path, kind):
    hf_model = _hf_tiny(kind)
    hf_model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    assert convert_hf.main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "init")]) == 0

    cfg, sd, _ = hf_interop.load_init_dir(tmp_path / "init")
    moe = cfg.moe
    assert cfg.family == "mixtral" and (cfg.head_dim, cfg.attn_head_dim) == (32, 32)
    assert (cfg.ffn_hidden_size, moe.expert_ffn_hidden_size, moe.num_experts, moe.top_k) == (96, 32, 8, 2)
    assert moe.aux_loss_coef == pytest.approx(0.002)        # HF's 0.001 weighs top_k = 2 times ours
    if kind == "qwen3_moe":
        assert cfg.qk_norm and not cfg.qkv_bias and moe.normalize_top_k
        assert (moe.first_k_dense, moe.moe_layer_freq, moe.num_shared_experts) == (1, 1, 0)
        assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    else:
        assert cfg.qkv_bias and not cfg.qk_norm and not moe.normalize_top_k
        assert (moe.first_k_dense, moe.moe_layer_freq) == (0, 2)
        assert (moe.num_shared_experts, moe.shared_ffn_size(cfg.expert_ffn_size), moe.shared_expert_gate) == (1, 48, True)
        assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    _assert_same_logits(hf_model, cfg, sd)


ROUNDTRIP = {
    "qwen3_moe": MixtralConfig(
        vocab_size=320, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, ffn_hidden_size=96,
        max_seq_len=64, attn_head_dim=32, qk_norm=True, init_std=0.03,
        moe=MoEConfig(num_experts=8, top_k=2, expert_ffn_hidden_size=32, first_k_dense=1,
                      aux_loss_coef=0.02, z_loss_coef=0.003)),
    "qwen2_moe": MixtralConfig(
        vocab_size=320, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden_size=96,
        max_seq_len=64, qkv_bias=True, init_std=0.03,
        moe=MoEConfig(num_experts=8, top_k=2, normalize_top_k=False, expert_ffn_hidden_size=32,
                      moe_layer_freq=2, num_shared_experts=1, shared_expert_ffn_hidden_size=48,
                      shared_expert_gate=True)),
}


@pytest.mark.parametrize("kind", sorted(ROUNDTRIP))
def test_export_then_import_is_identity(tmp_path, monkeypatch, kind):
    """Ours -> convert_hf export (safetensors + tokenizer) -> HF loads the right class with the
    same loss -> convert_hf import -> the same config and weights, bit for bit."""
    cfg = ROUNDTRIP[kind].validate()
    assert hf_interop.hf_model_type(cfg) == kind
    ours = Transformer(cfg)
    _randomize(ours, seed=5)
    ours.eval()
    tokenizer = _tiny_tokenizer()
    _fake_run(monkeypatch, ours, cfg, tokenizer)
    hf_dir, init_dir = tmp_path / "hf", tmp_path / "init"
    assert convert_hf.main(["export", "--run-dir", str(tmp_path), "--out", str(hf_dir), "--verify"]) == 0

    assert json.loads((hf_dir / "config.json").read_text())["model_type"] == kind
    assert (hf_dir / "model.safetensors").is_file()
    text = _assert_export_loss(hf_dir, ours, HF_KINDS[kind][0], tokenizer)
    _reimport(hf_dir, init_dir, ours, cfg)
    tok2 = hf_interop.load_init_dir(init_dir)[2]
    assert tok2(text)["input_ids"] == tokenizer(text)["input_ids"]


# --------------------------------------------------------------------------- refusals

TINY = dict(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
            ffn_hidden_size=96, max_seq_len=64)


@pytest.mark.parametrize("model_kwargs,moe_kwargs,target,reason", [
    (dict(qk_norm=True, qkv_bias=True), {}, "Qwen3-MoE", "qkv_bias.*biases o_proj"),
    (dict(qk_norm=True), dict(num_shared_experts=1), "Qwen3-MoE", "num_shared_experts.*no shared"),
    (dict(qk_norm=True), dict(capacity_factor=1.25), "Qwen3-MoE", "capacity_factor.*dropless"),
    (dict(qk_norm=True), dict(score_function="sigmoid"), "Qwen3-MoE", "score_function.*no expert bias"),
    ({}, dict(num_shared_experts=1), "Qwen2-MoE", "shared_expert_gate.*always gates"),
    ({}, dict(num_shared_experts=1, shared_expert_gate=True, n_group=2), "Qwen2-MoE", "n_group"),
    (dict(qkv_bias=True), {}, "Mixtral", "qkv_bias.*biases o_proj"),
    ({}, dict(first_k_dense=1), "Mixtral", "first_k_dense.*every layer"),
])
def test_features_hf_cannot_represent_refused(model_kwargs, moe_kwargs, target, reason):
    cfg = MixtralConfig(**TINY, **model_kwargs, moe=MoEConfig(**moe_kwargs)).validate()
    with pytest.raises(ValueError, match=f"cannot export to HF {target}: .*{reason}"):
        hf_interop.to_hf_config(cfg)


def test_export_refusal_is_one_line(tmp_path, monkeypatch, capsys):
    cfg = MixtralConfig(**TINY, qk_norm=True, qkv_bias=True).validate()
    _fake_run(monkeypatch, Transformer(cfg), cfg, None)
    assert convert_hf.main(["export", "--run-dir", str(tmp_path), "--out", str(tmp_path / "hf")]) == 2
    line = _error_line(capsys)
    assert line.startswith("convert_hf.py export: error: cannot export to HF Qwen3-MoE: model.qkv_bias")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("kind,overrides,field", [
    ("qwen3_moe", dict(mlp_only_layers=[2]), "mlp_only_layers"),
    ("qwen2_moe", dict(decoder_sparse_step=1, mlp_only_layers=[0, 2]), "mlp_only_layers"),
    ("qwen3_moe", dict(attention_bias=True), "attention_bias"),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=16), "sliding_window"),
])
def test_unsupported_qwen_features_refused_on_import(tmp_path, capsys, kind, overrides, field):
    _, config_cls, extra = HF_KINDS[kind]
    hf_config = config_cls(**{**HF_COMMON, **extra, **overrides})
    with pytest.raises(ValueError, match=f"config.json {field} "):
        hf_interop.from_hf_config(hf_config)
    if field == "mlp_only_layers":            # through the CLI: one line, exit 2, nothing written
        _hf_tiny(kind, **overrides).save_pretrained(tmp_path / "hf")
        assert convert_hf.main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "o")]) == 2
        assert "mlp_only_layers" in _error_line(capsys) and not (tmp_path / "o").exists()
