"""The CPU's bf16 support and the one warning line a bf16 run gets on a CPU without it."""

from __future__ import annotations

import pytest

from training.run import host

BF16 = {"bf16": {"enabled": True}}


@pytest.mark.parametrize("native, config, expected", [
    (False, "ds_configs/zero3.json", "use ds_configs/zero3_fp32.json"),
    (False, "ds_configs/zero1.json", "use ds_configs/zero1_fp32.json"),
    # No fp32 twin beside it (the user's own file, or one of ours without one): the key to turn off.
    (False, "ds_configs/zero3_offload.json", '--set ds.bf16.enabled=false'),
    (False, "/nowhere/mine.json", '"bf16": {"enabled": false}'),
])
def test_a_bf16_run_on_a_cpu_without_bf16_names_the_fp32_json(monkeypatch, native, config, expected):
    monkeypatch.setattr(host, "cpu_has_native_bf16", lambda: native)
    line = host.cpu_bf16_warning(BF16, config)
    assert line.startswith("warning: this CPU (") and "\n" not in line
    assert "no native bf16" in line and expected in line and "goes on in bf16" in line


@pytest.mark.parametrize("native, ds", [(True, BF16), (None, BF16), (False, {"bf16": {"enabled": False}}),
                                        (False, {}), (False, {"fp16": {"enabled": True}})])
def test_no_warning_with_native_bf16_unknown_support_or_no_bf16(monkeypatch, native, ds):
    monkeypatch.setattr(host, "cpu_has_native_bf16", lambda: native)
    assert host.cpu_bf16_warning(ds, "ds_configs/zero3.json") is None


def test_native_bf16_is_read_from_the_cpu_flags():
    import platform

    import torch
    native = host.cpu_has_native_bf16()
    if platform.machine().lower() in ("x86_64", "amd64"):
        caps = torch._C._cpu._get_cpu_capability()
        assert native == bool(caps["avx512_bf16"] or caps["amx_bf16"])
        flags = open("/proc/cpuinfo").read().split()           # the kernel's view agrees
        assert native == ("avx512_bf16" in flags or "amx_bf16" in flags)
    else:
        assert native in (True, False, None)
