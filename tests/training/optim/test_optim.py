"""Weight-decay grouping, the CPU LAMB against a hand computation, and LR scaling."""

import math

import pytest
import torch
from torch import nn

from training.optim.optimizers import (Lamb, apply_lr_scaling, maybe_build_client_optimizer, param_groups, scale_lr)


class _Block(nn.Module):
    """HF-named stand-in for one decoder layer with an MoE FFN."""

    def __init__(self):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(4)  # weight and bias
        self.post_attention_layernorm = nn.Module()
        self.post_attention_layernorm.weight = nn.Parameter(torch.ones(4))  # RMSNorm-style gain
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(4, 4, bias=True)
        self.self_attn.o_proj = nn.Linear(4, 4, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate = nn.Linear(4, 3, bias=False)  # MoE router
        self.mlp.experts = nn.Module()
        self.mlp.experts.gate_proj = nn.Parameter(torch.zeros(3, 4, 8))  # stacked experts (E, in, out)
        self.mlp.experts.down_proj = nn.Parameter(torch.zeros(3, 8, 4))


class _Model(nn.Module):
    def __init__(self, tied=False, frozen_norm=False):
        super().__init__()
        self.embed_tokens = nn.Embedding(10, 4)
        self.layers = nn.ModuleList([_Block()])
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(4), requires_grad=not frozen_norm)
        self.lm_head = nn.Linear(4, 10, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight


def _names(model, group):
    ids = {id(p) for p in group["params"]}
    return sorted(n for n, p in model.named_parameters() if id(p) in ids)


def test_param_groups_split_by_role():
    model = _Model()
    groups = param_groups(model, 0.1)
    assert [(g["name"], g["weight_decay"]) for g in groups] == [("decay", 0.1), ("no_decay", 0.0)]
    assert _names(model, groups[0]) == [
        "layers.0.mlp.experts.down_proj", "layers.0.mlp.experts.gate_proj", "layers.0.mlp.gate.weight",
        "layers.0.self_attn.o_proj.weight", "layers.0.self_attn.q_proj.weight", "lm_head.weight"]
    assert _names(model, groups[1]) == [
        "embed_tokens.weight", "layers.0.input_layernorm.bias", "layers.0.input_layernorm.weight",
        "layers.0.post_attention_layernorm.weight", "layers.0.self_attn.q_proj.bias", "norm.weight"]
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


def test_param_groups_tied_frozen_and_empty():
    model = _Model(tied=True, frozen_norm=True)
    groups = param_groups(model, 0.05)
    decayed = _names(model, groups[0])
    assert "lm_head.weight" not in decayed  # tied: reported once, as the embedding
    assert "norm.weight" not in _names(model, groups[1])  # frozen params are left out
    only_vectors = param_groups(nn.LayerNorm(3), 0.1)
    assert [g["name"] for g in only_vectors] == ["no_decay"]  # no empty group for ZeRO


def _one_lamb_step(p0, g, **kw):
    p = nn.Parameter(torch.tensor(p0, dtype=torch.float64))
    opt = Lamb([p], **kw)
    p.grad = torch.tensor(g, dtype=torch.float64)
    opt.step()
    return p.detach().tolist(), opt


def test_lamb_one_step_by_hand():
    # Step 1 with bias correction: m_hat = g, v_hat = g^2, so m_hat / sqrt(v_hat) = sign(g) = [1, -1].
    # u = [1, -1] + 0.1 * [3, 4] = [1.3, -0.6]; ||p|| = 5; ||u|| = sqrt(2.05); r = 5 / sqrt(2.05).
    new, _ = _one_lamb_step([3.0, 4.0], [1.0, -2.0], lr=0.1, betas=(0.9, 0.99), eps=0.0, weight_decay=0.1)
    r = 5 / math.sqrt(2.05)
    assert new == pytest.approx([3 - 0.1 * r * 1.3, 4 + 0.1 * r * 0.6], rel=1e-12)

    # Without bias correction: m = 0.1 g, sqrt(v) = sqrt(0.001) |g|, so m / sqrt(v) = 0.1 / sqrt(0.001) sign(g).
    k = 0.1 / math.sqrt(0.001)
    u = [k + 0.3, -k + 0.4]
    r = 5 / math.hypot(*u)
    new, _ = _one_lamb_step([3.0, 4.0], [1.0, -2.0], lr=0.1, betas=(0.9, 0.999), eps=0.0, weight_decay=0.1,
                            bias_correction=False)
    assert new == pytest.approx([3 - 0.1 * r * u[0], 4 - 0.1 * r * u[1]], rel=1e-12)


def test_lamb_trust_ratio_rules():
    # No weight decay: plain Adam step (ratio 1), as apex FusedLAMB does without use_nvlamb.
    new, _ = _one_lamb_step([3.0, 4.0], [1.0, -2.0], lr=0.1, eps=0.0)
    assert new == pytest.approx([2.9, 4.1])
    # always_adapt: ratio ||p|| / ||u|| = 5 / sqrt(2) even without decay.
    new, _ = _one_lamb_step([3.0, 4.0], [1.0, -2.0], lr=0.1, eps=0.0, always_adapt=True)
    r = 5 / math.sqrt(2)
    assert new == pytest.approx([3 - 0.1 * r, 4 + 0.1 * r])
    # Clamp: ||p|| = 500 would give r = 353, capped at max_coeff = 10.
    new, _ = _one_lamb_step([300.0, 400.0], [1.0, -2.0], lr=0.1, eps=0.0, always_adapt=True)
    assert new == pytest.approx([300 - 1.0, 400 + 1.0])
    # Zero weights (fresh biases): ratio 1.
    new, _ = _one_lamb_step([0.0, 0.0], [1.0, -2.0], lr=0.1, eps=0.0, weight_decay=0.1)
    assert new == pytest.approx([-0.1, 0.1])


def test_lamb_state_and_bf16_params():
    p = nn.Parameter(torch.tensor([1.0, -1.0], dtype=torch.bfloat16))
    opt = Lamb([p], lr=0.01, weight_decay=0.1)
    for _ in range(3):
        p.grad = torch.ones_like(p)
        opt.step()
    state = opt.state[p]
    assert state["step"] == 3 and state["exp_avg"].dtype == torch.float32
    assert p.dtype == torch.bfloat16 and p[0].item() < 1.0
    with pytest.raises(ValueError, match="lr"):
        Lamb([p], lr=0.0)


def test_scale_lr_rules():
    assert scale_lr(1e-3, 256, 1024, "none") == 1e-3
    assert scale_lr(1e-3, 256, 1024, "linear") == pytest.approx(4e-3)
    assert scale_lr(1e-3, 256, 1024, "sqrt") == pytest.approx(2e-3)
    assert scale_lr(1e-3, 256, 64, "sqrt") == pytest.approx(5e-4)
    with pytest.raises(ValueError, match="lr_scaling.rule"):
        scale_lr(1e-3, 256, 1024, "cubic")
    with pytest.raises(ValueError, match="lr_scaling.base_batch_size"):
        scale_lr(1e-3, 0, 1024, "linear")


def test_apply_lr_scaling():
    cfg = {"train_batch_size": 256, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3}},
           "lr_scaling": {"rule": "sqrt", "base_batch_size": 64}}
    out = apply_lr_scaling(cfg)
    assert "lr_scaling" not in out and "lr_scaling" in cfg
    assert out["optimizer"]["params"]["lr"] == pytest.approx(2e-3)
    assert out["scheduler"]["params"] == pytest.approx({"warmup_min_lr": 2e-5, "warmup_max_lr": 2e-3})
    del cfg["lr_scaling"]
    assert apply_lr_scaling(cfg) == cfg  # no rule: unchanged
    linear = apply_lr_scaling({**cfg, "lr_scaling": {"rule": "linear", "base_batch_size": 128}})
    assert linear["optimizer"]["params"]["lr"] == pytest.approx(2e-3)


def test_maybe_build_client_optimizer():
    model = _Model()
    lamb = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0},
            "optimizer": {"type": "Lamb", "params": {"lr": 2e-3, "betas": [0.9, 0.999], "weight_decay": 0.01}}}
    opt, out = maybe_build_client_optimizer(lamb, param_groups(model, 0.01), "cpu")
    assert isinstance(opt, Lamb) and "optimizer" not in out and "optimizer" in lamb
    assert [g["name"] for g in opt.param_groups] == ["decay", "no_decay"]
    assert opt.param_groups[0]["weight_decay"] == 0.01 and opt.param_groups[1]["weight_decay"] == 0.0
    assert opt.param_groups[0]["lr"] == 2e-3

    zero2 = {**lamb, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    _, out = maybe_build_client_optimizer(zero2, param_groups(model, 0.01), "cpu")
    assert out["zero_allow_untested_optimizer"] is True and out["zero_force_ds_cpu_optimizer"] is False

    assert maybe_build_client_optimizer(lamb, param_groups(model, 0.01), "cuda") == (None, lamb)
    adamw = {**lamb, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    assert maybe_build_client_optimizer(adamw, param_groups(model, 0.01), "cpu") == (None, adamw)

    bad = {**lamb, "optimizer": {"type": "Lamb", "params": {"lr": 1e-3, "amsgrad": False}}}
    with pytest.raises(ValueError, match=r"optimizer\.params\.amsgrad"):
        maybe_build_client_optimizer(bad, param_groups(model, 0.01), "cpu")
    lion = {**lamb, "optimizer": {"type": "Lion", "params": {"lr": 1e-4}}}
    with pytest.raises(ValueError, match=r"optimizer\.type.*offload"):
        maybe_build_client_optimizer(lion, param_groups(model, 0.01), "cpu")
