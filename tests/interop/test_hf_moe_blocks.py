"""Our ``MoELayer`` against transformers' DeepSeek-V3 and Qwen2-MoE MoE blocks with the same weights.

DeepSeek-V3 routing: sigmoid scores, a non-zero ``e_score_correction_bias`` (it chooses the
experts, the combine weights stay unbiased), 8 experts in 4 groups of which 2 are kept, top-2
renormalized, times ``routed_scaling_factor`` 2.5, plus 2 shared experts fused into one FFN.
Qwen2-MoE: softmax, top-2 NOT renormalized (its ``norm_topk_prob`` False), one shared expert
scaled by ``sigmoid(x @ w_gate)``.

Compared in fp32: the output, the input gradient and every weight gradient for a random output
gradient. Tolerance 1e-5 absolute plus 1e-5 relative: both sides compute the same products in
another order (one grouped GEMM against a loop of per-expert linears, gate and up fused or
not), ~1e-7 relative per op; outputs are O(1), weight gradients up to ~25 (measured: at most
1.4e-6 absolute, a tenth of the bound); a wrong layout, a bias that reaches the combine weights,
a wrong group rule or a missing scale moves them by O(0.1-1). The DeepSeek-V3 test also checks
that the bias and the group limit each change some token's experts (not a vacuous comparison).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, Qwen2MoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

from model.config import MoEConfig
from model.moe.layer import MoELayer
from model.moe.router import route

H, I, E, K = 32, 24, 8, 2
TOL = dict(rtol=1e-5, atol=1e-5)


def _randomize(module: torch.nn.Module, seed: int, std: float = 0.15) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)


def _copy_into_hf(ours: MoELayer, hf: torch.nn.Module, shared_name: str) -> None:
    """Our weights into transformers' layout: experts (E, H, I) x @ W -> fused (E, 2I, H) W @ x."""
    with torch.no_grad():
        hf.gate.weight.copy_(ours.gate.weight)
        e = ours.experts
        hf.experts.gate_up_proj.copy_(torch.cat((e.gate_proj.transpose(1, 2), e.up_proj.transpose(1, 2)), 1))
        hf.experts.down_proj.copy_(e.down_proj.transpose(1, 2))
        shared = getattr(hf, shared_name)
        for name in ("gate_proj", "up_proj", "down_proj"):   # nn.Linear layout on both sides
            getattr(shared, name).weight.copy_(getattr(ours.shared_experts, name).weight)


def _our_grads(ours: MoELayer) -> dict[str, torch.Tensor]:
    """Our weight gradients in transformers' names and layout."""
    e, out = ours.experts, {"gate.weight": ours.gate.weight.grad}
    out["experts.gate_up_proj"] = torch.cat((e.gate_proj.grad.transpose(1, 2), e.up_proj.grad.transpose(1, 2)), 1)
    out["experts.down_proj"] = e.down_proj.grad.transpose(1, 2)
    return out


def _compare(ours: MoELayer, hf: torch.nn.Module, shared_name: str, seed: int) -> float:
    """Output, input gradient and weight gradients; returns the largest absolute difference."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 24, H, generator=g)
    dy = torch.randn(2, 24, H, generator=g)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, _ = ours(xa)
    want = hf(xb)
    assert 0.3 < want.abs().max() < 10              # O(1) values, not a vacuous comparison
    (out * dy).sum().backward()
    (want * dy).sum().backward()
    worst = 0.0
    pairs = [("output", out, want), ("input grad", xa.grad, xb.grad)]
    theirs = dict(hf.named_parameters())
    pairs += [(n, t, theirs[n].grad) for n, t in _our_grads(ours).items()]
    for name in ("gate_proj", "up_proj", "down_proj"):
        pairs.append((f"shared {name}", getattr(ours.shared_experts, name).weight.grad,
                      theirs[f"{shared_name}.{name}.weight"].grad))
    if ours.shared_expert_gate is not None:
        pairs.append(("shared gate", ours.shared_expert_gate.weight.grad,
                      hf.shared_expert_gate.weight.grad))
    for what, a, b in pairs:
        torch.testing.assert_close(a, b, **TOL, msg=what)
        worst = max(worst, (a - b).abs().max().item())
    return worst


def test_deepseek_v3_routing_and_shared_experts_match_transformers():
    hf_cfg = DeepseekV3Config(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E,
                              num_experts_per_tok=K, n_group=4, topk_group=2, norm_topk_prob=True,
                              routed_scaling_factor=2.5, n_shared_experts=2, hidden_act="silu")
    moe = MoEConfig(num_experts=E, top_k=K, capacity_factor=None, normalize_top_k=True,
                    score_function="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                    num_shared_experts=2)
    moe.validate()
    ours = MoELayer(moe, H, I)
    assert ours.shared_experts.gate_proj.weight.shape == (2 * I, H)     # 2 shared experts fused
    _randomize(ours, seed=0)
    bias = torch.randn(E, generator=torch.Generator().manual_seed(1)) * 0.2
    ours.gate.e_score_correction_bias.copy_(bias)
    hf = DeepseekV3MoE(hf_cfg).float()
    _copy_into_hf(ours, hf, "shared_experts")
    hf.gate.e_score_correction_bias.copy_(bias)

    # Not vacuous: the bias and the group limit each change some token's experts.
    x = torch.randn(48, H, generator=torch.Generator().manual_seed(2))
    kwargs = dict(score_function="sigmoid", n_group=4, topk_group=2, scaling=2.5)
    chosen = route(x, ours.gate.weight, K, True, bias=bias, **kwargs).expert_idx.sort(-1).values
    unbiased = route(x, ours.gate.weight, K, True, **kwargs).expert_idx.sort(-1).values
    plain = route(x, ours.gate.weight, K, True, bias=bias, score_function="sigmoid").expert_idx.sort(-1).values
    assert (chosen != unbiased).any(dim=-1).sum() >= 5
    assert (chosen != plain).any(dim=-1).sum() >= 5
    _compare(ours, hf, "shared_experts", seed=3)


@pytest.mark.parametrize("normalize", [False, True])
def test_qwen2_moe_shared_expert_gate_matches_transformers(normalize):
    hf_cfg = Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E,
                            num_experts_per_tok=K, norm_topk_prob=normalize,
                            shared_expert_intermediate_size=40, hidden_act="silu")
    moe = MoEConfig(num_experts=E, top_k=K, capacity_factor=None, normalize_top_k=normalize,
                    num_shared_experts=1, shared_expert_ffn_hidden_size=40, shared_expert_gate=True)
    moe.validate()
    ours = MoELayer(moe, H, I)
    assert ours.gate.e_score_correction_bias is None          # softmax, no balancing: no buffer
    _randomize(ours, seed=4)
    hf = Qwen2MoeSparseMoeBlock(hf_cfg).float()
    _copy_into_hf(ours, hf, "shared_expert")
    with torch.no_grad():
        hf.shared_expert_gate.weight.copy_(ours.shared_expert_gate.weight)
    _compare(ours, hf, "shared_expert", seed=5)
