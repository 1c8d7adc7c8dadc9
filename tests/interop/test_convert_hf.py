"""launch/convert_hf.py and interop/hf.py against transformers' Llama and Mixtral.

Tiny fp32 configs on CPU (vocab 128, hidden 64, 2 layers, 4 query heads over 2 kv heads, 8 experts
top-2). Tolerance for logits and losses: 1e-5. Both sides compute in fp32 with different but
equivalent op orders (SDPA vs eager attention, one grouped GEMM vs a loop of per-expert linears,
gate and up fused or not), so each op rounds differently at ~1e-7 relative; over two layers and
O(1) logits we see up to ~1e-6, while any layout mistake (a missing transpose, gate/up
swapped, wrong head grouping) gives O(0.1-1) differences.
"""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, GPT2Config, LlamaConfig,
                          LlamaForCausalLM, MixtralConfig, MixtralForCausalLM,
                          PreTrainedTokenizerFast)

from interop import hf as hf_interop
from interop import hf_files
from launch import convert_hf
from model.config import DenseConfig, MixtralConfig as OurMixtralConfig, MoEConfig, SwitchConfig
from model.transformer import IGNORE_INDEX, Transformer

TOL = 1e-5
TINY = dict(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
            ffn_hidden_size=96, max_seq_len=64)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that logits are O(1) and norms are not all ones."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if p.ndim == 1 else 0.1 * noise)


def _ids(vocab: int = 128, shape=(2, 16), seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _our_loss(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    labels = torch.cat((ids[:, 1:], torch.full_like(ids[:, :1], IGNORE_INDEX)), dim=1)  # (B, S)
    return model(ids, labels=labels).loss


def _hf_tiny(kind: str, tie: bool) -> torch.nn.Module:
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  rms_norm_eps=1e-6, tie_word_embeddings=tie, dtype="float32",
                  rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = MixtralForCausalLM(MixtralConfig(**common, num_local_experts=8, num_experts_per_tok=2,
                                                 router_aux_loss_coef=0.02))
    _randomize(model, seed=3)
    return model.eval()


def _fake_run(monkeypatch, model, cfg, tokenizer) -> None:
    """Stand in for interop.consolidate.load_run_model, so export needs no DeepSpeed checkpoint."""
    fake = types.ModuleType("interop.consolidate")
    fake.load_run_model = lambda run_dir: (model, cfg, tokenizer)
    monkeypatch.setitem(sys.modules, "interop.consolidate", fake)


def _tiny_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(["hello world, hello there", "def f(x): return x + 1",
                             "the quick brown fox jumps over the lazy dog"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                   eos_token="<|endoftext|>", pad_token="<|endoftext|>")


# --------------------------------------------------------------------------- HF -> ours

@pytest.mark.parametrize("kind,tie", [("llama", False), ("llama", True), ("mixtral", False),
                                      ("mixtral", True)])
def test_import_matches_transformers(tmp_path, kind, tie):
    hf_model = _hf_tiny(kind, tie)
    hf_model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    assert convert_hf.main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "init")]) == 0

    cfg, sd, tokenizer = hf_interop.load_init_dir(tmp_path / "init")
    assert tokenizer is None
    assert cfg.family == {"llama": "dense", "mixtral": "mixtral"}[kind]
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.tie_embeddings) == (4, 2, tie)   # GQA: 2 q per kv
    assert (cfg.rope_theta, cfg.norm_eps) == (5e5, 1e-6)
    if kind == "mixtral":     # HF's coefficient 0.02 weighs a loss top_k = 2 times ours
        assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.aux_loss_coef) == (8, 2, 0.04)
        assert cfg.moe.capacity_factor is None and cfg.moe.normalize_top_k
    assert all(t.is_contiguous() for t in sd.values())
    _assert_same_logits(hf_model, cfg, sd)


def _assert_same_logits(hf_model, cfg, sd: dict) -> None:
    """Our model built from ``cfg`` and the imported ``sd`` gives ``hf_model``'s logits (TOL)."""
    ours = Transformer(cfg)
    ours.load_state_dict(sd, strict=True)
    ours.eval()
    ids = _ids()
    with torch.no_grad():
        want = hf_model(ids).logits
        got = ours(ids).logits
    assert want.std() > 0.3                      # not a vacuous comparison
    assert (got - want).abs().max().item() <= TOL


# --------------------------------------------------------------------------- ours -> HF -> ours

ROUNDTRIP = {
    "dense": DenseConfig(**TINY, rope_theta=5e5, norm_eps=1e-6, init_std=0.01),
    "dense_tied": DenseConfig(**TINY, tie_embeddings=True),
    "mixtral": OurMixtralConfig(**TINY, init_std=0.03,
                                moe=MoEConfig(num_experts=8, top_k=2, aux_loss_coef=0.02,
                                              z_loss_coef=0.003)),
}


@pytest.mark.parametrize("name", sorted(ROUNDTRIP))
def test_export_then_import_is_identity(tmp_path, monkeypatch, name):
    cfg = ROUNDTRIP[name].validate()
    ours = Transformer(cfg)
    _randomize(ours, seed=5)
    ours.eval()
    _fake_run(monkeypatch, ours, cfg, None)
    hf_dir, init_dir = tmp_path / "hf", tmp_path / "init"
    assert convert_hf.main(["export", "--run-dir", str(tmp_path), "--out", str(hf_dir)]) == 0

    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    assert type(hf_model) is (MixtralForCausalLM if cfg.moe else LlamaForCausalLM)
    ids = _ids(seed=7)
    with torch.no_grad():
        hf_loss = hf_model(ids, labels=ids).loss        # HF shifts the labels itself
        our_loss = _our_loss(ours, ids)
    assert abs(hf_loss.item() - our_loss.item()) <= TOL

    assert json.loads(_reimport(hf_dir, init_dir, ours, cfg).read_text()) == cfg.to_dict()


def _assert_export_loss(hf_dir, ours, cls, tokenizer) -> str:
    """The exported folder loads as ``cls`` with its tokenizer (``tokenizer``'s ids), and its loss
    on a text plus random ids is ours (TOL); returns the text."""
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    assert type(hf_model) is cls
    text = "the quick brown fox jumps over the lazy dog"
    ids = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)(text, return_tensors="pt").input_ids
    assert ids.tolist() == tokenizer(text, return_tensors="pt").input_ids.tolist() and ids.shape[1] > 4
    ids = torch.cat((ids, _ids(vocab=ours.cfg.vocab_size, shape=(1, 16), seed=7)), dim=1)
    with torch.no_grad():
        hf_loss = hf_model(ids, labels=ids).loss        # HF shifts the labels itself
        our_loss = _our_loss(ours, ids)
    assert abs(hf_loss.item() - our_loss.item()) <= TOL
    return text


def _reimport(hf_dir, init_dir, ours, cfg):
    """``convert_hf.py import`` of an export gives ``cfg`` and ``ours``' weights bit for bit;
    returns the init dir's model_config.json (the tokenizer, if any, is the caller's to check)."""
    assert convert_hf.main(["import", "--hf", str(hf_dir), "--out", str(init_dir)]) == 0
    cfg2, sd2, _ = hf_interop.load_init_dir(init_dir)
    assert cfg2 == cfg
    sd = ours.state_dict()
    assert sd.keys() == sd2.keys()
    for k, v in sd.items():
        assert torch.equal(v, sd2[k]), k
    return init_dir / "model_config.json"


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_aux_loss_coef_gives_the_same_weighted_loss(top_k):
    """transformers' Mixtral load-balancing loss is top_k times ours (top_k vs 1.0 at balance):
    the exported coefficient times HF's loss equals ours times our loss, on the same router
    logits, and the import maps it back."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from model.moe.losses import load_balancing_loss
    from model.moe.router import route

    cfg = OurMixtralConfig(**TINY, moe=MoEConfig(num_experts=8, top_k=top_k, aux_loss_coef=0.02)).validate()
    g = torch.Generator().manual_seed(0)
    x, gate = torch.randn(64, 64, generator=g), torch.randn(8, 64, generator=g)   # (T, H), (E, H)
    r = route(x, gate, top_k, normalize=True)
    counts = torch.bincount(r.expert_idx.flatten(), minlength=8)                  # (E,)
    ours = cfg.moe.aux_loss_coef * load_balancing_loss(r.probs, counts, top_k)
    hf_config = hf_interop.to_hf_config(cfg)
    theirs = hf_config.router_aux_loss_coef * load_balancing_loss_func((r.logits,), 8, top_k)
    torch.testing.assert_close(theirs, ours, rtol=1e-6, atol=0)
    assert hf_interop.from_hf_config(hf_config).moe.aux_loss_coef == pytest.approx(0.02, rel=1e-15)


def test_state_dict_conversion_is_exact_inverse():
    cfg = OurMixtralConfig(**TINY).validate()
    ours = Transformer(cfg)
    sd = ours.state_dict()
    hf_sd = hf_interop.to_hf_state_dict(cfg, sd)
    hf_ref = MixtralForCausalLM(hf_interop.to_hf_config(cfg)).state_dict()
    assert {k: tuple(v.shape) for k, v in hf_sd.items()} == {k: tuple(v.shape) for k, v in hf_ref.items()}
    back = hf_interop.from_hf_state_dict(cfg, hf_sd)
    assert all(torch.equal(sd[k], back[k]) for k in sd) and sd.keys() == back.keys()
    again = hf_interop.to_hf_state_dict(cfg, back)
    assert all(torch.equal(hf_sd[k], again[k]) for k in hf_sd) and hf_sd.keys() == again.keys()


def test_bfloat16_export(tmp_path):
    cfg = DenseConfig(**TINY).validate()
    ours = Transformer(cfg)
    hf_files.export_hf(ours, cfg, None, tmp_path / "hf", dtype=torch.bfloat16)
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    w = hf_model.model.layers[1].self_attn.k_proj.weight
    assert w.dtype == torch.bfloat16
    assert torch.equal(w, ours.layers[1].self_attn.k_proj.weight.bfloat16())


@pytest.mark.parametrize("router_dtype", ["fp32", "bf16"])
def test_a_bf16_router_is_named_at_export(router_dtype, tmp_path, capsys):
    """transformers routes in fp32: a model trained with ``model.moe.router_dtype: bf16`` exports
    with the same weights and one note saying its routing arithmetic changes."""
    cfg = OurMixtralConfig(**TINY, moe=MoEConfig(num_experts=4, top_k=2, router_dtype=router_dtype)).validate()
    hf_files.export_hf(Transformer(cfg), cfg, None, tmp_path / "hf")
    notes = [line for line in capsys.readouterr().err.splitlines() if "router_dtype bf16" in line]
    assert len(notes) == (router_dtype == "bf16")


# --------------------------------------------------------------------------- tokenizer

def test_tokenizer_round_trip(tmp_path, monkeypatch):
    tokenizer = _tiny_tokenizer()
    cfg = DenseConfig(**{**TINY, "vocab_size": 320}).validate()
    ours = Transformer(cfg).eval()
    _fake_run(monkeypatch, ours, cfg, tokenizer)
    hf_dir = tmp_path / "hf"
    assert convert_hf.main(["export", "--run-dir", str(tmp_path), "--out", str(hf_dir)]) == 0

    texts = ["hello there, quick fox", "def g(y): return y + 2", "lazy dog jumps<|endoftext|>"]
    loaded = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    for text in texts:
        assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded.eos_token_id == tokenizer.eos_token_id
    assert json.loads((hf_dir / "config.json").read_text())["eos_token_id"] == tokenizer.eos_token_id

    assert convert_hf.main(["import", "--hf", str(hf_dir), "--out", str(tmp_path / "init")]) == 0
    _, _, reloaded = hf_interop.load_init_dir(tmp_path / "init")
    for text in texts:
        assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]


# --------------------------------------------------------------------------- refusals

def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    return err[-1]


def test_switch_export_refused(tmp_path, monkeypatch, capsys):
    cfg = SwitchConfig(**TINY).validate()
    with pytest.raises(ValueError, match="encoder-decoder.*mixtral"):
        hf_interop.to_hf_config(cfg)
    _fake_run(monkeypatch, Transformer(cfg), cfg, None)
    assert convert_hf.main(["export", "--run-dir", str(tmp_path), "--out", str(tmp_path / "hf")]) == 2
    line = _error_line(capsys)
    assert line.startswith("convert_hf.py export: error: model.family 'switch'")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("moe_kwargs,reason", [
    (dict(capacity_factor=1.25), "capacity_factor.*dropless"),
    (dict(normalize_top_k=False), "normalize_top_k.*renormalizes"),
    (dict(moe_layer_freq=2), "moe_layer_freq.*every layer"),
    (dict(router_jitter=0.01), "router_jitter.*experts' inputs"),
    (dict(score_function="sigmoid"), "score_function.*no expert bias"),
    (dict(expert_bias_update_rate=1e-3), "expert_bias_update_rate.*no expert bias"),
    (dict(routed_scaling_factor=2.5), "routed_scaling_factor.*does not scale"),
    (dict(n_group=2, topk_group=1), "n_group.*group-limited"),
    # A shared expert makes the export Qwen2-MoE, whose one shared expert is always gated.
    (dict(num_shared_experts=1), "Qwen2-MoE: model.moe.shared_expert_gate.*always gates"),
])
def test_mixtral_features_hf_cannot_represent_refused(moe_kwargs, reason):
    cfg = OurMixtralConfig(**TINY, moe=MoEConfig(**moe_kwargs)).validate()
    with pytest.raises(ValueError, match=reason):
        hf_interop.to_hf_config(cfg)


@pytest.mark.parametrize("kind,overrides,field", [
    ("llama", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 32}), "rope_parameters"),
    ("llama", dict(attention_bias=True), "attention_bias"),
    ("llama", dict(mlp_bias=True), "mlp_bias"),
    ("llama", dict(hidden_act="gelu"), "hidden_act"),
    ("mixtral", dict(sliding_window=16), "sliding_window"),
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise"),
])
def test_unsupported_hf_features_refused(kind, overrides, field):
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    hf_config = (LlamaConfig if kind == "llama" else MixtralConfig)(**{**base, **overrides})
    with pytest.raises(ValueError, match=f"config.json {field} "):
        hf_interop.from_hf_config(hf_config)


def test_head_dim_apart_from_hidden_over_heads_is_imported():
    """HF's head_dim (Qwen3: 128 at hidden 2048 / 32 heads) is model.attn_head_dim; the default
    width stays null so that an export/import round trip gives the same config."""
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    assert hf_interop.from_hf_config(LlamaConfig(**base, head_dim=32)).attn_head_dim == 32
    assert hf_interop.from_hf_config(LlamaConfig(**base, head_dim=16)).attn_head_dim is None


def test_sliding_window_covering_the_context_is_allowed():
    hf_config = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2,
                              max_position_embeddings=64, sliding_window=64)
    assert hf_interop.from_hf_config(hf_config).max_seq_len == 64


def test_import_refuses_unsupported_arch_and_missing_input(tmp_path, capsys):
    GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4).save_pretrained(tmp_path / "gpt2")
    assert convert_hf.main(["import", "--hf", str(tmp_path / "gpt2"), "--out", str(tmp_path / "o")]) == 2
    line = _error_line(capsys)
    assert "model_type 'gpt2'" in line and "not supported" in line and "llama" in line

    assert convert_hf.main(["import", "--hf", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "--hf" in _error_line(capsys) and not (tmp_path / "o").exists()

    (tmp_path / "noweights").mkdir()
    LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=1,
                num_attention_heads=4).save_pretrained(tmp_path / "noweights")
    assert convert_hf.main(["import", "--hf", str(tmp_path / "noweights"), "--out", str(tmp_path / "o")]) == 2
    assert "model.safetensors" in _error_line(capsys)

    with pytest.raises(FileNotFoundError, match="model_config.json"):
        hf_interop.load_init_dir(tmp_path / "o")


def test_export_refuses_to_overwrite(tmp_path, monkeypatch, capsys):
    cfg = DenseConfig(**TINY).validate()
    _fake_run(monkeypatch, Transformer(cfg), cfg, None)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("user file")
    args = ["export", "--run-dir", str(tmp_path), "--out", str(out)]
    assert convert_hf.main(args) == 2
    assert "--force" in _error_line(capsys)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert convert_hf.main(args + ["--force"]) == 0
    assert (out / "model.safetensors").is_file()


def test_sharded_checkpoint_imports_and_a_missing_shard_is_one_line(tmp_path, capsys):
    hf_model = _hf_tiny("mixtral", tie=False)
    hf_model.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    shards = sorted((tmp_path / "hf").glob("model-*.safetensors"))
    assert len(shards) > 1
    assert convert_hf.main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "init")]) == 0
    cfg, sd, _ = hf_interop.load_init_dir(tmp_path / "init")
    ours = Transformer(cfg)
    ours.load_state_dict(sd, strict=True)
    with torch.no_grad():
        assert (ours.eval()(_ids()).logits - hf_model(_ids()).logits).abs().max().item() <= TOL
    shards[1].unlink()
    assert convert_hf.main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "o")]) == 2
    line = _error_line(capsys)
    assert "--hf" in line and shards[1].name in line and not (tmp_path / "o").exists()
