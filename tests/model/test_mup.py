"""muP (``model/mup.py``): init std, attention scale, output multiplier, per-group lrs as the
trainer builds them (and kept by every scheduler), muP off = the standard model, and the
coordinate check's trend (``benchmarks/studies/mup_coord_check.py``)."""

from pathlib import Path

import pytest
import torch

from model import DenseConfig, MixtralConfig, Transformer
from model import mup
from model.config import MoEConfig
from model.rope import RotaryEmbedding
from model.transformer import Attention
from training.optim import optimizers
from training.optim import schedules

REPO = Path(__file__).resolve().parents[2]
SIZES = dict(vocab_size=96, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
             ffn_hidden_size=96, max_seq_len=16)
MOE = MoEConfig(num_experts=4, top_k=2, num_shared_experts=1, shared_expert_gate=True)


def _pair(cls=MixtralConfig, base=32, **kw):
    """The same architecture in SP and in muP with m = 128 / base."""
    kw = {**SIZES, **({"moe": MOE} if cls is MixtralConfig else {}), **kw}
    return cls(**kw).validate(), cls(**kw, mup_base_hidden_size=base).validate()


def test_hidden_weights_init_std_scaled_by_inverse_sqrt_width_mult_and_the_rest_unchanged():
    sp_cfg, mup_cfg = _pair(base=32)                                  # m = 4
    sp, mu = dict(Transformer(sp_cfg).named_parameters()), dict(Transformer(mup_cfg).named_parameters())
    hidden = {n for n in sp if mup.is_hidden(n)}
    # Every matrix of a block, experts, router and shared-expert gate included; nothing else.
    assert {n.split(".", 2)[2] for n in hidden if n.startswith("layers.0.")} == {
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "mlp.gate.weight", "mlp.experts.gate_proj", "mlp.experts.up_proj",
        "mlp.experts.down_proj", "mlp.shared_experts.gate_proj.weight",
        "mlp.shared_experts.up_proj.weight", "mlp.shared_experts.down_proj.weight",
        "mlp.shared_expert_gate.weight"}
    for name in sp:
        factor = 0.5 if name in hidden else 1.0                       # 1/sqrt(4)
        torch.testing.assert_close(mu[name], sp[name] * factor, rtol=1e-6, atol=0, msg=name)
    # The std itself: 0.02 / 2 for q_proj, 0.02 / sqrt(2L) / 2 for o_proj.
    assert mu["layers.0.self_attn.q_proj.weight"].std().item() == pytest.approx(0.01, rel=0.1)
    assert mu["layers.0.self_attn.o_proj.weight"].std().item() == pytest.approx(0.005, rel=0.1)
    assert mu["embed_tokens.weight"].std().item() == pytest.approx(0.02, rel=0.1)


def test_attention_scores_are_divided_by_head_dim():
    sp_cfg, mup_cfg = _pair(DenseConfig)
    torch.manual_seed(0)
    sp, mu = Attention(sp_cfg), Attention(mup_cfg)
    assert sp.scale is None and mu.scale == 1 / sp_cfg.head_dim == 1 / 32
    for p in sp.parameters():                                 # built uninitialized
        torch.nn.init.normal_(p, std=0.1)
    mu.load_state_dict(sp.state_dict())
    x = torch.randn(2, 8, 128)
    rope = RotaryEmbedding(sp_cfg.head_dim, sp_cfg.rope_theta)(8, x.device, x.dtype)
    out_mu = mu(x, rope)
    assert not torch.allclose(out_mu, sp(x, rope))
    # q.k / d == (q / sqrt(d)).k / sqrt(d): SP with q_proj scaled by 1/sqrt(d) gives the same.
    with torch.no_grad():
        sp.q_proj.weight.mul_(sp_cfg.head_dim ** -0.5)
    torch.testing.assert_close(out_mu, sp(x, rope), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", [DenseConfig, MixtralConfig])
def test_logits_are_multiplied_by_inverse_width_mult(cls):
    sp_cfg, mup_cfg = _pair(cls, base=32)                                   # m = 4
    sp, mu = Transformer(sp_cfg), Transformer(mup_cfg)
    mu.load_state_dict(sp.state_dict())
    with torch.no_grad():            # fold muP's attention scale and output multiplier into SP
        for layer in sp.layers:
            layer.self_attn.q_proj.weight.mul_(sp_cfg.head_dim ** -0.5)
        sp.lm_head.weight.mul_(0.25)
    ids = torch.randint(0, 96, (2, 16))
    out_mu, out_sp = mu(ids, ids), sp(ids, ids)
    torch.testing.assert_close(out_mu.logits, out_sp.logits, rtol=1e-5, atol=1e-6)
    assert out_mu.logits.abs().mean() > 0


def _lrs_over_steps(opt, sched, steps=12):
    seen = []
    for _ in range(steps):
        seen.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    return seen


def test_per_group_lrs_as_the_trainer_builds_them_keep_their_ratio_under_every_scheduler():
    from deepspeed.runtime import lr_schedules as ds_sched
    _, cfg = _pair(base=32)                                                   # m = 4
    model = Transformer(cfg)
    groups = optimizers.param_groups(model, 0.1, cfg)
    assert [g["name"] for g in groups] == ["decay", "no_decay", "decay_mup_hidden"]
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in groups[2]["params"]} == {n for n in names.values() if mup.is_hidden(n)}
    assert [names[id(p)] for p in groups[0]["params"]] == ["lm_head.weight"]
    assert groups[2]["lr_scale"] == 0.25 and groups[2]["weight_decay"] == 0.1
    base_lr = 3e-3
    sections = {
        "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": base_lr, "warmup_num_steps": 5},
        "WarmupDecayLR": {"warmup_min_lr": 1e-5, "warmup_max_lr": base_lr, "warmup_num_steps": 4,
                          "total_num_steps": 12},
        "WarmupCosineLR": {"total_num_steps": 12, "warmup_num_steps": 4},
        "OneCycle": {"cycle_min_lr": 1e-4, "cycle_max_lr": base_lr, "cycle_first_step_size": 4},
        "WarmupStableDecayLR": {"total_num_steps": 12, "warmup_num_steps": 3},
    }
    for kind, params in sections.items():
        ds = {"optimizer": {"type": "AdamW", "params": {"lr": base_lr}},
              "scheduler": {"type": kind, "params": dict(params)}}
        groups = optimizers.param_groups(model, 0.1, cfg)
        ds = optimizers.apply_group_lr_scales(ds, groups)
        assert [g["lr"] for g in groups] == [base_lr, base_lr, base_lr * 0.25]
        opt = torch.optim.AdamW(groups, lr=base_lr)        # as DeepSpeed builds it from the JSON
        if kind in schedules.OUR_SCHEDULERS:
            sched = schedules.build_scheduler(ds["scheduler"], opt, total_steps=12)
        else:
            sched = getattr(ds_sched, kind)(opt, **ds["scheduler"]["params"])
        seen = _lrs_over_steps(opt, sched)
        assert len({lr[0] for lr in seen}) > 2, kind                           # it does schedule
        for lr in seen:
            assert lr[1] == lr[0] and lr[2] == pytest.approx(0.25 * lr[0], rel=1e-12, abs=1e-15), kind


def test_mup_off_is_the_standard_model():
    cfg, _ = _pair()
    model = Transformer(cfg)
    t = torch.randn(3)
    assert mup.scale_logits(cfg, t) is t and mup.attention_scale(cfg) is None
    assert all(mup.init_scale(cfg, n) == 1.0 == mup.lr_scale(cfg, n) for n, _ in model.named_parameters())
    with_cfg, without = optimizers.param_groups(model, 0.1, cfg), optimizers.param_groups(model, 0.1)
    assert [(g.keys(), g["params"]) for g in with_cfg] == [(g.keys(), g["params"]) for g in without]
    assert [g["name"] for g in with_cfg] == ["decay", "no_decay"]
    ds = {"optimizer": {"params": {"lr": 1e-3}}, "scheduler": {"params": {"warmup_max_lr": 1e-3}}}
    assert optimizers.apply_group_lr_scales(ds, with_cfg) is ds and "lr" not in with_cfg[0]
    # At m = 1 muP keeps every weight bitwise; only the attention scale differs.
    base = DenseConfig(**SIZES, mup_base_hidden_size=SIZES["hidden_size"]).validate()
    sp_state, mu_state = Transformer(DenseConfig(**SIZES)).state_dict(), Transformer(base).state_dict()
    assert all(torch.equal(sp_state[k], mu_state[k]) for k in sp_state)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"model.mup_base_hidden_size \(0\) must be an integer >= 1 or null"):
        DenseConfig(**SIZES, mup_base_hidden_size=0).validate()
    from interop.hf import to_hf_config
    with pytest.raises(ValueError, match="mup_base_hidden_size"):
        to_hf_config(DenseConfig(**SIZES, mup_base_hidden_size=32).validate())
    ds = {"optimizer": {"type": "AdamW", "params": {}}}
    _, cfg = _pair(DenseConfig)
    with pytest.raises(ValueError, match="optimizer.params.lr"):
        optimizers.apply_group_lr_scales(ds, optimizers.param_groups(Transformer(cfg), 0.0, cfg))


def _coord_check_module():
    from benchmarks.studies import mup_coord_check
    return mup_coord_check


def test_coordinate_check_logits_grow_with_width_under_sp_and_stay_flat_under_mup():
    """Widths 32 and 256, 4 AdamW steps at lr 1e-2 on corpus bytes: measured, the 4th pass's
    mean |logits| grows 4.03x from width 32 to 256 under SP (the middle MLP's output 384x) and
    1.05x under muP (MLP 1.23x). Asserted: SP > 2.5x (MLP > 20x), muP within 0.8x..1.25x."""
    cc = _coord_check_module()
    torch.manual_seed(0)
    tokens = cc.corpus_bytes(200_000)
    last = {}
    for name, use_mup in (("sp", False), ("mup", True)):
        for width in (32, 256):
            stats = cc.coord_check(width, use_mup, 32, steps=4, lr=1e-2, seed=0, tokens=tokens,
                                   batch=4, seq=32)
            last[name, width] = {q: v[-1] for q, v in stats.items()}
    sp_growth = last["sp", 256]["logits"] / last["sp", 32]["logits"]
    mup_growth = last["mup", 256]["logits"] / last["mup", 32]["logits"]
    assert sp_growth > 2.5, sp_growth
    assert 0.8 < mup_growth < 1.25, mup_growth
    assert last["sp", 256]["mlp"] / last["sp", 32]["mlp"] > 20
