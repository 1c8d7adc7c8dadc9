"""The CPU's bf16 support and the one warning line a bf16 run gets on a CPU without it."""

from __future__ import annotations

import pytest

from training import hardware

BF16 = {"bf16": {"enabled": True}}


@pytest.mark.parametrize("native, config, expected", [
    (False, "ds_configs/zero3.json", "use ds_configs/zero3_fp32.json"),
    (False, "ds_configs/zero1.json", "use ds_configs/zero1_fp32.json"),
    # No fp32 twin beside it (the user's own file, or one of ours without one): the key to turn off.
    (False, "ds_configs/zero3_offload.json", '--set ds.bf16.enabled=false'),
    (False, "/nowhere/mine.json", '"bf16": {"enabled": false}'),
])
def test_a_bf16_run_on_a_cpu_without_bf16_names_the_fp32_json(monkeypatch, native, config, expected):
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: native)
    line = hardware.cpu_bf16_warning(BF16, config)
    assert line.startswith("warning: this CPU (") and "\n" not in line
    assert "no native bf16" in line and expected in line and "goes on in bf16" in line


@pytest.mark.parametrize("native, ds", [(True, BF16), (None, BF16), (False, {"bf16": {"enabled": False}}),
                                        (False, {}), (False, {"fp16": {"enabled": True}})])
def test_no_warning_with_native_bf16_unknown_support_or_no_bf16(monkeypatch, native, ds):
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: native)
    assert hardware.cpu_bf16_warning(ds, "ds_configs/zero3.json") is None


def test_native_bf16_is_read_from_the_cpu_flags():
    import platform

    import torch
    native = hardware.cpu_has_native_bf16()
    if platform.machine().lower() in ("x86_64", "amd64"):
        caps = torch._C._cpu._get_cpu_capability()
        assert native == bool(caps["avx512_bf16"] or caps["amx_bf16"])
        flags = open("/proc/cpuinfo").read().split()           # the kernel's view agrees
        assert native == ("avx512_bf16" in flags or "amx_bf16" in flags)
    else:
        assert native in (True, False, None)


def test_attention_flops_count_the_heads_widths_not_the_hidden_size():
    """Qwen3-30B-A3B: 32 heads x 128 = 4096 query-key and value width against hidden 2048. The
    attention term is 3 L s (w_qk + w_v) causal and twice that whole; counting it with the hidden
    size undercounts it by half (10.5% of the model's FLOPs per token at s = 4096)."""
    from planning.cost_layout import Shape
    from training.config.recipe import load_recipe
    cfg = load_recipe("recipes/qwen3_30b_a3b.yaml").model
    assert (cfg.num_heads * cfg.head_dim, cfg.hidden_size) == (4096, 2048)
    assert hardware.attention_widths(cfg) == (4096, 4096)
    s, L = 4096, cfg.num_layers
    matmul = 6 * hardware.matmul_params_per_token(cfg)
    causal, whole = (hardware.train_flops_per_token(cfg, s, causal=c) for c in (True, False))
    assert causal - matmul == 3 * L * s * (4096 + 4096) and whole - matmul == 2 * (causal - matmul)
    assert (causal - matmul - 6 * L * 2048 * s) / causal == pytest.approx(0.1047, abs=1e-4)   # missed
    shape = Shape.from_config(cfg)                                  # the planner counts the same
    assert shape.flops_per_token(s) == causal and shape.flops_per_token(s, causal=False) == whole
    # A model whose heads span the hidden size: the familiar 6 L h s and 12 L h s.
    tiny = load_recipe(None).model
    assert hardware.train_flops_per_token(tiny, 128) - 6 * hardware.matmul_params_per_token(tiny) == \
        6 * tiny.num_layers * tiny.hidden_size * 128
