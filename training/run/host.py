"""The machine a rank runs on, as the trainer checks it: whether its CPU has native bf16 (a bf16
run on a CPU without it gets one warning line naming the fp32 JSON), the CPU's name for messages
and figures, and the CUDA allocator's history for the out-of-memory report.
"""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_has_native_bf16() -> bool | None:
    """Whether this CPU has the bf16 instructions torch's CPU kernels use for bf16 matrix products
    (x86: AVX512-BF16 or AMX-BF16; Arm: the BF16 extension); None when it cannot tell. Without
    them torch computes bf16 through generic fallback kernels, far slower than its fp32 ones."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        import torch
        try:
            caps = torch._C._cpu._get_cpu_capability()     # cpuinfo's flags, as torch sees them
        except (AttributeError, RuntimeError):
            return None
        return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))
    if machine in ("aarch64", "arm64"):
        try:
            features = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
        return any("bf16" in line.split() for line in features.splitlines() if line.startswith("Features"))
    return None


def cpu_bf16_warning(ds: dict, config_path: str | None, device=None) -> str | None:
    """One warning line for a bf16 run on a CPU (``device``, when given, is the CPU) without
    native bf16, naming the fp32 JSON to use instead (``zero3.json`` -> ``zero3_fp32.json`` when
    it exists beside it); None otherwise."""
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        return None
    if not (ds.get("bf16") or ds.get("bfloat16") or {}).get("enabled") or cpu_has_native_bf16() is not False:
        return None
    fp32 = Path(config_path).with_name(Path(config_path).stem + "_fp32.json") if config_path else None
    instead = (f"use {fp32.as_posix()}" if fp32 is not None and fp32.is_file()
               else 'turn bf16 off ("bf16": {"enabled": false}, or --set ds.bf16.enabled=false)')
    return (f"warning: this CPU ({cpu_name()}) has no native bf16 "
            f"instructions (AVX512-BF16, AMX-BF16 or Arm BF16), so bf16 runs through fallback "
            f"kernels far slower than fp32; for a CPU run {instead} (this run goes on in bf16 as asked)")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


HISTORY_ENTRIES = 100_000        # allocator events kept by the memory history


def record_memory_history(enabled: bool, device) -> bool:
    """Switch on the CUDA allocator's history (the stack trace of each of the last
    ``HISTORY_ENTRIES`` allocation events) so that an OOM snapshot (``planning/oom.py``) shows who
    allocated what. Only on a GPU and when asked (``train.memory_snapshot``): it slows every
    allocation a little."""
    if not enabled or device.type != "cuda":
        return False
    import torch
    torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES)
    return True
