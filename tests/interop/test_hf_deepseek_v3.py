"""launch/convert_hf.py, model/mla.py and interop/hf_deepseek.py against transformers' DeepSeek-V3.

Tiny fp32 ``DeepseekV3ForCausalLM`` on CPU with eager attention: vocab 128, hidden 64, 4 heads of
multi-head latent attention (kv latent 24, query latent 20 or a full q_proj, 16 + 8 query/key
dims, 12 value dims), YaRN x4 over an original context of 16 with DeepSeek's mscale and
mscale_all_dim, block 0 dense (``first_k_dense_replace`` 1), 8 sigmoid-scored experts in 4 groups
of which 2 are kept, top-2 renormalized and scaled by 2.5, one shared expert, a random expert
bias; DeepSeek's interleaved rotary rows (and the rotate-half layout, ``rope_interleave`` false).

Tolerance for logits and losses: 1e-5, as tests/interop/test_convert_hf.py and for the same
reason: both sides compute in fp32 with different but equivalent op orders (SDPA vs eager
attention, one grouped GEMM vs a loop of per-expert linears), ~1e-7 relative per op, ~1e-6 on
O(1) logits (measured 1.3e-6); a layout mistake (rotary rows not permuted, the YaRN factor
missing from cos/sin or from the softmax scale, the latent norm's epsilon, the expert bias used
for the weights) moves them by 1e-3 to O(1).
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from safetensors import safe_open
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

from interop import hf as hf_interop
from launch import convert_hf
from model.config import MixtralConfig, MoEConfig
from model.transformer import Transformer
from tests.interop.test_convert_hf import (_assert_export_loss, _assert_same_logits, _error_line, _fake_run,
                                           _ids, _randomize, _reimport, _tiny_tokenizer)

TOL = 1e-5
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
HF_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
               n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
               first_k_dense_replace=1, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
               v_head_dim=12, max_position_embeddings=64, rms_norm_eps=1e-6, rope_parameters=YARN,
               routed_scaling_factor=2.5, norm_topk_prob=True, num_nextn_predict_layers=0,
               dtype="float32", attn_implementation="eager")


def _hf_tiny(**overrides) -> DeepseekV3ForCausalLM:
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**HF_TINY, **overrides}))
    _randomize(model, seed=3)              # norms ~1 +- 0.1, matrices 0.1 x N(0, 1)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for layer in model.model.layers[1:]:   # a bias that changes the choice, not the weights
            layer.mlp.gate.e_score_correction_bias.copy_(0.05 * torch.randn(8, generator=g))
    return model.eval()


@pytest.mark.parametrize("q_lora_rank,interleave", [(20, True), (None, False)])
def test_import_matches_transformers(tmp_path, q_lora_rank, interleave):
    hf_model = _hf_tiny(q_lora_rank=q_lora_rank, rope_interleave=interleave)
    hf_model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    assert convert_hf.main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "init")]) == 0

    cfg, sd, _ = hf_interop.load_init_dir(tmp_path / "init")
    moe = cfg.moe
    assert (cfg.family, cfg.attention, cfg.q_lora_rank, cfg.kv_lora_rank) == ("mixtral", "mla", q_lora_rank, 24)
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.rope_dim) == (16, 8, 12, 8)
    assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_original_max_seq_len) == ("yarn", 4.0, 16)
    assert (moe.score_function, moe.n_group, moe.topk_group, moe.routed_scaling_factor) == ("sigmoid", 4, 2, 2.5)
    assert (moe.first_k_dense, moe.num_shared_experts, moe.expert_ffn_hidden_size) == (1, 1, 32)
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert cfg.num_params() == sum(t.numel() for n, t in sd.items() if "e_score_correction_bias" not in n)
    _assert_same_logits(hf_model, cfg, sd)
    # The expert bias is in use: without it the routing, and so the logits, differ.
    unbiased = {k: torch.zeros_like(v) if "e_score_correction_bias" in k else v for k, v in sd.items()}
    with pytest.raises(AssertionError):
        _assert_same_logits(hf_model, cfg, unbiased)


def test_yarn_and_interleave_are_load_bearing():
    """Each layout detail moves the logits by far more than TOL, so the test above can fail:
    rotary rows left interleaved, YaRN off; and the match holds at a model epsilon of 1e-2
    (the latent norms keep DeepSeek's 1e-6)."""
    hf_model = _hf_tiny(q_lora_rank=20, rms_norm_eps=1e-2)
    cfg = hf_interop.from_hf_config(hf_model.config)
    sd = hf_interop.from_hf_state_dict(cfg, hf_model.state_dict(), rope_interleave=True)
    unpermuted = hf_interop.from_hf_state_dict(cfg, hf_model.state_dict(), rope_interleave=False)
    no_yarn = dataclasses.replace(cfg, rope_scaling=None, rope_factor=1.0, rope_original_max_seq_len=None,
                                  yarn_mscale=None, yarn_mscale_all_dim=None).validate()
    ids = _ids()
    with torch.no_grad():
        want = hf_model(ids).logits
        for c, state, off in ((cfg, sd, False), (cfg, unpermuted, True), (no_yarn, sd, True)):
            ours = Transformer(c, init_seed=None)
            ours.load_state_dict(state)
            diff = (ours.eval()(ids).logits - want).abs().max().item()
            assert diff > 100 * TOL if off else diff <= TOL, (c.rope_scaling, diff)


def test_yarn_on_a_gqa_family_matches_transformers():
    """YaRN is a RoPE option of every family: a Llama with YaRN x4 (cos/sin x 0.1 ln 4 + 1)."""
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rope_parameters={k: YARN[k] for k in ("rope_type", "rope_theta", "factor",
                                                               "original_max_position_embeddings")},
                         dtype="float32", attn_implementation="eager")
    torch.manual_seed(0)
    hf_model = LlamaForCausalLM(config)
    _randomize(hf_model, seed=3)
    cfg = hf_interop.from_hf_config(config)
    assert (cfg.family, cfg.rope_scaling, cfg.yarn_mscale) == ("dense", "yarn", None)
    _assert_same_logits(hf_model.eval(), cfg, hf_interop.from_hf_state_dict(cfg, hf_model.state_dict()))
    assert hf_interop.to_hf_config(cfg).rope_parameters["rope_type"] == "yarn"


OURS = MixtralConfig(
    vocab_size=320, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=4, ffn_hidden_size=96,
    max_seq_len=64, norm_eps=1e-6, init_std=0.03, attention="mla", q_lora_rank=20, kv_lora_rank=24,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, rope_scaling="yarn", rope_factor=4.0,
    rope_original_max_seq_len=16, yarn_mscale=1.0, yarn_mscale_all_dim=1.0, mtp_depth=1, mtp_loss_coef=0.2,
    moe=MoEConfig(num_experts=8, top_k=2, score_function="sigmoid", n_group=4, topk_group=2,
                  routed_scaling_factor=2.5, first_k_dense=1, num_shared_experts=1,
                  expert_ffn_hidden_size=32, aux_loss_coef=0.02, z_loss_coef=0.003))


def test_export_then_import_is_identity(tmp_path, monkeypatch):
    """Ours (with one MTP module) -> convert_hf export (safetensors + tokenizer) -> transformers
    loads DeepseekV3ForCausalLM with the same loss, the MTP layer where DeepSeek keeps it (its
    unexpected keys ignored) -> convert_hf import -> the same config and weights, bit for bit."""
    cfg = OURS.validate()
    assert hf_interop.hf_model_type(cfg) == "deepseek_v3"
    ours = Transformer(cfg)
    _randomize(ours, seed=5)
    for j, bias in ours.expert_biases():
        bias.copy_(0.05 * torch.randn(8, generator=torch.Generator().manual_seed(j)))
    ours.eval()
    tokenizer = _tiny_tokenizer()
    _fake_run(monkeypatch, ours, cfg, tokenizer)
    hf_dir, init_dir = tmp_path / "hf", tmp_path / "init"
    assert convert_hf.main(["export", "--run-dir", str(tmp_path), "--out", str(hf_dir), "--verify"]) == 0

    written = json.loads((hf_dir / "config.json").read_text())
    assert (written["model_type"], written["rope_interleave"], written["rope_parameters"]["rope_type"]) == (
        "deepseek_v3", True, "yarn")
    _assert_export_loss(hf_dir, ours, DeepseekV3ForCausalLM, tokenizer)
    assert written["num_nextn_predict_layers"] == 1
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        mtp = sorted(k for k in f.keys() if k.startswith("model.layers.3."))
    assert {"model.layers.3.eh_proj.weight", "model.layers.3.shared_head.norm.weight",
            "model.layers.3.shared_head.head.weight", "model.layers.3.mlp.experts.7.down_proj.weight",
            "model.layers.3.self_attn.kv_b_proj.weight"} <= set(mtp)
    _reimport(hf_dir, init_dir, ours, cfg)

    # --drop-mtp: the main model alone, imported back without MTP.
    assert convert_hf.main(["export", "--run-dir", str(tmp_path), "--out", str(tmp_path / "hf2"), "--drop-mtp"]) == 0
    assert json.loads((tmp_path / "hf2" / "config.json").read_text())["num_nextn_predict_layers"] == 0
    assert convert_hf.main(["import", "--hf", str(tmp_path / "hf2"), "--out", str(tmp_path / "init2")]) == 0
    cfg3, sd3, _ = hf_interop.load_init_dir(tmp_path / "init2")
    assert cfg3 == dataclasses.replace(cfg, mtp_depth=0)
    assert sd3.keys() == {k for k in ours.state_dict() if not k.startswith("mtp.")}


@pytest.mark.parametrize("model_kwargs,moe_kwargs,reason", [
    ({}, dict(score_function="softmax"), "score_function.*sigmoid"),
    ({}, dict(num_shared_experts=0), "ungated shared experts"),
    ({}, dict(shared_expert_gate=True), "ungated shared experts"),
    ({}, dict(moe_layer_freq=2), "moe_layer_freq"),
    ({}, dict(capacity_factor=1.25), "capacity_factor.*dropless"),
])
def test_features_deepseek_cannot_represent_refused(model_kwargs, moe_kwargs, reason):
    cfg = dataclasses.replace(OURS, moe=dataclasses.replace(OURS.moe, **moe_kwargs), **model_kwargs).validate()
    with pytest.raises(ValueError, match=f"cannot export to HF DeepSeek-V3: .*{reason}"):
        hf_interop.to_hf_config(cfg)


def test_mtp_exports_only_to_deepseek_or_dropped():
    cfg = MixtralConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                        ffn_hidden_size=96, max_seq_len=64, mtp_depth=1).validate()
    with pytest.raises(ValueError, match=r"cannot export to HF Mixtral: model.mtp_depth \(1\) > 0 .*--drop-mtp"):
        hf_interop.to_hf_config(cfg)
    assert hf_interop.to_hf_config(dataclasses.replace(cfg, mtp_depth=0)).model_type == "mixtral"


def test_export_refusal_is_one_line(tmp_path, monkeypatch, capsys):
    cfg = dataclasses.replace(OURS, moe=dataclasses.replace(OURS.moe, score_function="softmax")).validate()
    _fake_run(monkeypatch, Transformer(cfg), cfg, None)
    assert convert_hf.main(["export", "--run-dir", str(tmp_path), "--out", str(tmp_path / "hf")]) == 2
    assert _error_line(capsys).startswith("convert_hf.py export: error: cannot export to HF DeepSeek-V3: "
                                          "model.moe.score_function")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("overrides,field", [
    (dict(attention_bias=True), "attention_bias"),
    (dict(rope_parameters={**YARN, "attention_factor": 1.3}), "rope_parameters"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}), "rope_parameters"),
    (dict(n_shared_experts=0), "n_shared_experts"),
])
def test_unsupported_deepseek_features_refused_on_import(tmp_path, capsys, overrides, field):
    with pytest.raises(ValueError, match=f"config.json {field} "):
        hf_interop.from_hf_config(DeepseekV3Config(**{**HF_TINY, **overrides}))
    if field == "attention_bias":             # through the CLI: one line, exit 2, nothing written
        _hf_tiny(**overrides).save_pretrained(tmp_path / "hf")
        assert convert_hf.main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "o")]) == 2
        assert "attention_bias" in _error_line(capsys) and not (tmp_path / "o").exists()


@pytest.mark.parametrize("kwargs,message", [
    (dict(kv_lora_rank=8), "model.kv_lora_rank (8) is an MLA key but model.attention is gqa"),
    (dict(attention="mla", kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
          num_kv_heads=2), "model.num_kv_heads (2) does not go with model.attention mla"),
    (dict(attention="mla", kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=3, v_head_dim=4,
          num_kv_heads=4), "model.qk_rope_head_dim (3) must be even"),
    (dict(attention="mla", kv_lora_rank=8, qk_nope_head_dim=4, v_head_dim=4, num_kv_heads=4),
     "model.qk_rope_head_dim (None) must be an integer >= 1"),
    (dict(rope_factor=4.0), "model.rope_factor / rope_original_max_seq_len are set but model.rope_scaling is null"),
    (dict(rope_scaling="yarn", rope_factor=4.0), "model.rope_original_max_seq_len (None) must be an integer"),
])
def test_bad_mla_and_yarn_keys_are_one_line(kwargs, message):
    base = dict(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
                ffn_hidden_size=96, max_seq_len=64)
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        MixtralConfig(**{**base, **kwargs}).validate()
