"""Whole-model checks: shapes per family, loss definition, activation checkpointing, config errors."""

import pytest
import torch
import torch.nn.functional as F

from model import DenseConfig, MixtralConfig, SwitchConfig, Transformer
from model.checkpointing import CheckpointPolicy
from model.config import MoEConfig, config_from_dict

SIZES = dict(vocab_size=96, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
             ffn_hidden_size=48, max_seq_len=16)


@pytest.mark.parametrize("cls", [DenseConfig, SwitchConfig, MixtralConfig])
def test_forward_shapes_and_loss_definition(cls):
    torch.manual_seed(0)
    cfg = cls(**SIZES).validate()
    model = Transformer(cfg)
    ids = torch.randint(0, 96, (2, 16))
    labels = torch.randint(0, 96, (2, 16))
    labels[0, :3] = -100
    out = model(ids, labels)
    assert out.logits.shape == (2, 16, 96)
    # loss = mean next-token CE over target tokens only, without auxiliary losses.
    ref = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    torch.testing.assert_close(out.loss, ref)
    assert out.num_target_tokens.item() == 29
    assert len(out.moe_aux) == cfg.num_moe_layers == {"dense": 0, "switch": 2, "mixtral": 4}[cfg.family]
    if cfg.moe is not None:
        expected = cfg.moe.aux_loss_coef * out.aux_loss + cfg.moe.z_loss_coef * out.z_loss
        torch.testing.assert_close(model.router_loss(out), expected)
    else:
        assert model.router_loss(out).item() == 0.0


@pytest.mark.parametrize("policy", ["full", "attention", "moe", "experts", "every_k:2"])
def test_activation_checkpointing_gives_identical_gradients(policy):
    from planning.measured import saved_activation_bytes
    torch.manual_seed(0)
    cfg = MixtralConfig(**SIZES).validate()
    ref, ck = Transformer(cfg), Transformer(cfg)
    ck.load_state_dict(ref.state_dict())
    ck.set_activation_checkpointing(policy)
    ids = torch.randint(0, 96, (2, 16))
    # It does keep less for backward.
    assert saved_activation_bytes(ck, ids, ids) < saved_activation_bytes(ref, ids, ids)
    grads = []
    for m in (ref, ck):
        out = m(ids, ids)
        (out.ce_sum + m.router_loss(out)).backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-6, atol=1e-7, msg=name)
    with pytest.raises(ValueError, match="activation_checkpointing"):
        ck.set_activation_checkpointing("sometimes")


def test_checkpoint_policy_is_parsed_in_one_place():
    parse = CheckpointPolicy.parse
    assert parse("every_k:3").whole_blocks(7) == {0, 3, 6} and str(parse("every_k:3")) == "every_k:3"
    assert parse("full").whole_blocks(2) == {0, 1} and parse("moe").whole_blocks(2) == set()
    with pytest.raises(ValueError, match=r"\('every_k:0'\) is not one of .* with k >= 1"):
        parse("every_k:0")
    assert parse("every_k:5").problems(4, has_moe=True) == [
        "train.activation_checkpointing (every_k:5) exceeds model.num_layers (4): choose k <= 4"]
    assert "needs MoE layers" in parse("experts").problems(4, has_moe=False)[0]


def test_tied_embeddings_share_one_matrix():
    cfg = DenseConfig(**{**SIZES, "tie_embeddings": True}).validate()
    model = Transformer(cfg)
    assert model.lm_head is None and "lm_head.weight" not in model.state_dict()
    captured = []
    model.norm.register_forward_hook(lambda mod, inp, out: captured.append(out))
    logits = model(torch.randint(0, 96, (1, 8))).logits
    torch.testing.assert_close(logits, captured[0] @ model.embed_tokens.weight.t())


@pytest.mark.parametrize("change, message", [
    (dict(num_heads=5), r"model\.hidden_size \(32\) is not divisible by model\.num_heads \(5\)"),
    (dict(num_kv_heads=3), r"model\.num_heads \(4\) is not divisible by model\.num_kv_heads \(3\)"),
    (dict(vocab_size=0), r"model\.vocab_size \(0\) must be an integer >= 1"),
    (dict(moe=MoEConfig(num_experts=2, top_k=3)), r"model\.moe\.top_k \(3\) exceeds model\.moe\.num_experts \(2\)"),
    (dict(moe=MoEConfig(capacity_factor=-1.0)), r"model\.moe\.capacity_factor \(-1\.0\) must be > 0"),
    (dict(moe=MoEConfig(first_k_dense=-1)), r"model\.moe\.first_k_dense \(-1\) must be an integer >= 0"),
    (dict(moe=MoEConfig(first_k_dense=4)), r"model\.moe\.first_k_dense \(4\) leaves no MoE block .*"
                                           r"lower first_k_dense"),
    (dict(moe=MoEConfig(expert_ffn_hidden_size=0)), r"model\.moe\.expert_ffn_hidden_size \(0\) must be an "
                                                    r"integer >= 1 or null"),
    (dict(attn_head_dim=0), r"model\.attn_head_dim \(0\) must be an integer >= 1 or null"),
    (dict(attn_head_dim=7), r"head width \(7: model\.attn_head_dim.*must be even for RoPE"),
])
def test_config_errors_name_field_value_and_fix(change, message):
    with pytest.raises(ValueError, match=message):
        MixtralConfig(**{**SIZES, **change}).validate()


def test_config_round_trip_and_param_counts():
    cfg = MixtralConfig(**SIZES).validate()
    assert config_from_dict(cfg.to_dict()) == cfg
    assert cfg.num_params() == sum(p.numel() for p in Transformer(cfg).parameters())
    # Mixtral 8x7B: 46.7B total, 12.9B active (Mistral's published figures).
    big = MixtralConfig(vocab_size=32000).validate()
    assert abs(big.num_params() / 46.7e9 - 1) < 0.01
    assert abs(big.num_params(active=True) / 12.9e9 - 1) < 0.01
    with pytest.raises(ValueError, match="unknown key model.hiden_size"):
        config_from_dict({**cfg.to_dict(), "hiden_size": 3})


def test_qwen_and_deepseek_options_build_count_and_init():
    """qk_norm, qkv_bias, a head width apart from hidden/heads, narrower experts and dense first
    blocks: the one is_moe_layer rule, the parameter count, and the init (norms 1, biases 0)."""
    moe = MoEConfig(num_experts=4, top_k=2, expert_ffn_hidden_size=16, first_k_dense=1,
                    moe_layer_freq=2, num_shared_experts=1)
    cfg = MixtralConfig(**{**SIZES, "num_layers": 4}, attn_head_dim=16, qk_norm=True, qkv_bias=True,
                        moe=moe).validate()
    assert config_from_dict(cfg.to_dict()) == cfg
    # Block i is MoE when i >= first_k_dense and (i + 1) % moe_layer_freq == 0: blocks 1 and 3.
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    model = Transformer(cfg)
    assert [layer.is_moe for layer in model.layers] == [False, True, False, True]
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    attn = model.layers[1].self_attn
    assert attn.q_proj.weight.shape == (cfg.num_heads * 16, cfg.hidden_size)
    assert attn.q_norm.weight.shape == (16,) and attn.k_proj.bias.shape == (cfg.num_kv_heads * 16,)
    assert model.layers[1].mlp.experts.gate_proj.shape == (4, cfg.hidden_size, 16)
    assert model.layers[1].mlp.shared_experts.gate_proj.weight.shape == (16, cfg.hidden_size)
    assert model.layers[0].mlp.gate_proj.weight.shape == (cfg.ffn_hidden_size, cfg.hidden_size)
    for name, p in model.named_parameters():
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            assert torch.equal(p, torch.ones_like(p)), name
        if name.endswith(".bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    out = model(ids, labels=ids)
    out.loss.backward()
    assert attn.q_norm.weight.grad.abs().sum() > 0 and attn.v_proj.bias.grad.abs().sum() > 0
