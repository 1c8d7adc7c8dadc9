"""Modern routing options (docs/routers-and-top-k.md, docs/load-balancing.md): sigmoid scores,
group-limited routing, the expert bias of loss-free balancing and its update, shared experts'
parameter counts, and the config's validation. Single process, fp32.

The reference computations here are Python loops over tokens and groups, independent of the
vectorized ``route``; routing decisions are compared exactly (sets of expert ids), combine
weights bit for bit where the same fp32 ops produce them and to 1e-6 relative where they are
recomputed another way.
"""

from __future__ import annotations

import math

import pytest
import torch

from model import MixtralConfig, SwitchConfig, Transformer
from model.config import MoEConfig
from model.moe.layer import MoELayer
from model.moe.router import route
from training.config.recipe import load_recipe

SIZES = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
             ffn_hidden_size=48, max_seq_len=16)


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def test_group_limited_routing_never_leaves_the_kept_groups_hand_case():
    # 8 experts in 4 groups {0,1} {2,3} {4,5} {6,7}; sigmoid scores (identity router):
    #   expert 0 is the single best (0.95) but its group's second best is 0.01: group 0 = 0.96,
    #   group 1 = 1.6, group 2 = 1.4, group 3 = 0.2 -> keep groups 1 and 2 (topk_group 2).
    # Plain top-2 picks expert 0 and 2 (or 3); group-limited top-2 must pick 2 and 3.
    scores = [0.95, 0.01, 0.8, 0.79, 0.7, 0.7, 0.1, 0.1]
    x = torch.tensor([[_logit(s) for s in scores]])
    gate = torch.eye(8)
    plain = route(x, gate, 2, False, score_function="sigmoid").expert_idx[0].tolist()
    limited = route(x, gate, 2, False, score_function="sigmoid", n_group=4, topk_group=2)
    assert 0 in plain
    assert limited.expert_idx[0].tolist() == [2, 3]
    torch.testing.assert_close(limited.weights[0], torch.tensor([0.8, 0.79]), rtol=1e-6, atol=0)


def test_group_limited_routing_matches_a_per_token_loop_with_bias():
    T, E, G, kept, k = 256, 16, 4, 2, 4
    g = torch.Generator().manual_seed(0)
    x, gate = torch.randn(T, 32, generator=g), torch.randn(E, 32, generator=g) * 0.3
    bias = torch.randn(E, generator=g) * 0.1
    r = route(x, gate, k, True, score_function="sigmoid", bias=bias, n_group=G, topk_group=kept,
              scaling=2.5)
    scores = torch.sigmoid(x @ gate.t())
    outside_plain = 0
    size = E // G
    for t in range(T):
        choice = (scores[t] + bias).tolist()
        group_score = [sum(sorted(choice[j * size:(j + 1) * size])[-2:]) for j in range(G)]
        groups = sorted(range(G), key=lambda j: -group_score[j])[:kept]
        allowed = [e for e in range(E) if e // size in groups]
        want = sorted(sorted(allowed, key=lambda e: -choice[e])[:k])
        got = r.expert_idx[t].tolist()
        assert sorted(got) == want and all(e // size in groups for e in got), t
        plain = sorted(range(E), key=lambda e: -choice[e])[:k]
        outside_plain += any(e // size not in groups for e in plain)
        # Combine weights: the UNBIASED scores of the chosen experts, renormalized, times 2.5.
        w = [scores[t, e].item() for e in got]
        assert r.weights[t].tolist() == pytest.approx([2.5 * v / sum(w) for v in w], rel=1e-6)
    assert outside_plain > 20        # the plain top-k would leave the kept groups: not vacuous


def test_bias_changes_which_experts_are_chosen_not_the_combine_weights():
    g = torch.Generator().manual_seed(1)
    x, gate = torch.randn(64, 32, generator=g), torch.randn(8, 32, generator=g) * 0.3
    bias = torch.zeros(8)
    bias[3] = 1.0                             # more than any gap between two sigmoid scores
    for normalize in (False, True):
        free = route(x, gate, 2, normalize, score_function="sigmoid", bias=torch.zeros(8))
        biased = route(x, gate, 2, normalize, score_function="sigmoid", bias=bias)
        assert (biased.expert_idx[:, 0] == 3).all()            # every token now picks expert 3
        assert (free.expert_idx != biased.expert_idx).any(dim=-1).float().mean() > 0.5
        unbiased = torch.sigmoid(x @ gate.t()).gather(1, biased.expert_idx)
        if normalize:
            unbiased = unbiased / unbiased.sum(-1, keepdim=True)
        torch.testing.assert_close(biased.weights, unbiased, rtol=1e-6, atol=0)
        torch.testing.assert_close(biased.probs, free.probs, rtol=0, atol=0)   # no bias in there
    # The sigmoid's normalized scores feed the balance loss and the entropy: they sum to 1.
    torch.testing.assert_close(biased.probs.sum(-1), torch.ones(64), rtol=1e-6, atol=0)


def test_the_default_router_is_unchanged_and_has_no_bias():
    # Softmax without bias or groups: no buffer (checkpoints of models without the bias load
    # strictly), and the plain top-k of the softmax, renormalized.
    model = Transformer(MixtralConfig(**SIZES, moe=MoEConfig(num_experts=4)).validate())
    assert not [k for k in model.state_dict() if "e_score_correction_bias" in k]
    g = torch.Generator().manual_seed(2)
    x, gate = torch.randn(16, 32, generator=g), torch.randn(4, 32, generator=g)
    r = route(x, gate, 2, True)
    probs = torch.softmax(x @ gate.t(), -1)
    w, idx = probs.topk(2, -1)
    assert torch.equal(r.expert_idx, idx) and torch.equal(r.weights, w / w.sum(-1, keepdim=True))


def _skewed_layer(rate: float) -> tuple[MoELayer, torch.Tensor]:
    """Sigmoid routing where experts 0 and 1 win most tokens (load max/mean about 3.5 of E/k = 4)."""
    torch.manual_seed(0)
    moe = MoEConfig(num_experts=8, top_k=2, score_function="sigmoid", expert_bias_update_rate=rate)
    layer = MoELayer(moe, 32, 16)
    direction = torch.nn.functional.normalize(torch.randn(32), dim=0)
    with torch.no_grad():
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.3)
        layer.gate.weight[:2] += 2.0 * direction
    return layer, direction


def _balance_run(rate: float, steps: int = 100) -> tuple[MoELayer, list[float]]:
    """``steps`` synthetic steps of 128 tokens each, the bias updated after each from the step's
    routed counts; returns the layer and each step's load max/mean."""
    layer, direction = _skewed_layer(rate)
    ratios = []
    for step in range(steps):
        x = torch.randn(4, 32, 32, generator=torch.Generator().manual_seed(step)) + 3 * direction
        with torch.no_grad():
            counts = layer(x)[1].routed_per_expert
        ratios.append(counts.max().item() / counts.double().mean().item())
        before = layer.gate.e_score_correction_bias.clone()
        layer.gate.update_bias(counts)
        step_taken = layer.gate.e_score_correction_bias - before
        sign = torch.sign(counts.double().mean() - counts.double()).float()
        torch.testing.assert_close(step_taken, rate * sign, rtol=0, atol=1e-7)   # the rule
    return layer, ratios


def test_bias_update_moves_the_load_toward_uniform():
    layer, ratios = _balance_run(0.01)
    bias = layer.gate.e_score_correction_bias
    assert bias.dtype == torch.float32
    assert "gate.e_score_correction_bias" in layer.state_dict()
    assert "gate.e_score_correction_bias" not in dict(layer.named_parameters())   # no gradient
    assert ratios[0] > 3.0 and max(ratios[40:]) < 2.0       # measured: 3.56, then at most 1.78
    assert bias[:2].max() < min(0.0, bias[2:].min().item())  # the two hot experts pushed down
    off, ratios_off = _balance_run(0.0)
    assert min(ratios_off) > 3.0                             # without updates: stays skewed
    assert torch.equal(off.gate.e_score_correction_bias, torch.zeros(8))


def test_transformer_update_expert_bias_takes_one_row_per_moe_layer():
    moe = MoEConfig(num_experts=4, top_k=1, normalize_top_k=False, moe_layer_freq=2,
                    expert_bias_update_rate=0.5)
    model = Transformer(SwitchConfig(**{**SIZES, "num_layers": 4}, moe=moe).validate())
    counts = torch.tensor([[5.0, 1.0, 1.0, 1.0], [2.0, 2.0, 0.0, 4.0]], dtype=torch.float64)
    model.update_expert_bias(counts)
    assert model.layers[1].mlp.gate.e_score_correction_bias.tolist() == [-0.5, 0.5, 0.5, 0.5]
    assert model.layers[3].mlp.gate.e_score_correction_bias.tolist() == [0.0, 0.0, 0.5, -0.5]
    with pytest.raises(ValueError):                          # one row per MoE layer, no more
        model.update_expert_bias(counts[:1])


def test_shared_experts_are_counted_in_total_and_active_parameters():
    moe = MoEConfig(num_experts=8, top_k=2, num_shared_experts=2, shared_expert_gate=True)
    cfg = MixtralConfig(**SIZES, moe=moe).validate()
    model = Transformer(cfg)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    shared = 3 * 32 * (2 * 48) + 32                        # fused 2 x 48 inner, plus the gate
    assert cfg.shared_params == shared
    routed = 3 * 32 * 48
    assert cfg.num_params(active=True) == cfg.num_params() - 2 * (8 - 2) * routed
    plain = MixtralConfig(**SIZES, moe=MoEConfig(num_experts=8, top_k=2)).validate()
    assert cfg.num_params() - plain.num_params() == 2 * shared


BAD = [
    (dict(score_function="tanh"), r"model\.moe\.score_function \('tanh'\) must be softmax or sigmoid"),
    (dict(routed_scaling_factor=0.0), r"model\.moe\.routed_scaling_factor \(0\.0\) must be a finite number > 0"),
    (dict(expert_bias_update_rate=-1e-3), r"model\.moe\.expert_bias_update_rate \(-0\.001\) must be a finite number >= 0"),
    (dict(n_group=0), r"model\.moe\.n_group \(0\) must be an integer >= 1"),
    (dict(n_group=3), r"model\.moe\.num_experts \(8\) is not divisible by model\.moe\.n_group \(3\): choose"),
    (dict(n_group=8), r"model\.moe\.n_group \(8\) leaves 1 expert per group.*choose n_group <= num_experts/2"),
    (dict(n_group=4, topk_group=5), r"model\.moe\.topk_group \(5\) exceeds model\.moe\.n_group \(4\): choose"),
    (dict(top_k=6, n_group=4, topk_group=2), r"model\.moe\.top_k \(6\) exceeds the 4 experts.*raise topk_group"),
    (dict(num_shared_experts=-1), r"model\.moe\.num_shared_experts \(-1\) must be an integer >= 0"),
    (dict(num_shared_experts=1, shared_expert_ffn_hidden_size=0),
     r"model\.moe\.shared_expert_ffn_hidden_size \(0\) must be an integer >= 1 or null"),
    (dict(shared_expert_ffn_hidden_size=64), r"shared_expert_ffn_hidden_size \(64\) is set but "
     r"model\.moe\.num_shared_experts is 0: set num_shared_experts >= 1"),
    (dict(shared_expert_gate=True), r"model\.moe\.shared_expert_gate \(True\) is set but"),
]


@pytest.mark.parametrize("kwargs,message", BAD)
def test_validation_errors_name_the_field_and_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        MoEConfig(**{"num_experts": 8, **kwargs}).validate()
    assert "\n" not in str(err.value)


def test_recipe_keys_and_layout_checks():
    sets = ["model.moe.score_function=sigmoid", "model.moe.n_group=4", "model.moe.topk_group=2",
            "model.moe.expert_bias_update_rate=1e-3", "model.moe.num_shared_experts=1",
            "model.moe.shared_expert_gate=true"]
    moe = load_recipe("recipes/tiny_mixtral.yaml", sets).model.moe
    assert (moe.score_function, moe.n_group, moe.expert_bias_update_rate) == ("sigmoid", 4, 1e-3)
    assert moe.shared_ffn_size(128) == 128 and moe.shared_expert_gate
    with pytest.raises(ValueError, match=r"expected one of softmax\|sigmoid"):
        load_recipe("recipes/tiny_mixtral.yaml", ["model.moe.score_function=tanh"])
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\) does not divide the shared "
                       r"experts' inner size \(33\): set model\.moe\.shared_expert_ffn_hidden_size"):
        load_recipe("recipes/tiny_mixtral.yaml", sets + [
            "model.moe.shared_expert_ffn_hidden_size=33", "parallel.tensor_parallel_size=2"])
