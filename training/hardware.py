"""GPU table and FLOP accounting, shared by the trainer's MFU and the memory estimator, the
CPU's bf16 support, and the CUDA allocator's history for the out-of-memory report.

Peaks are dense (no 2:4 sparsity) bf16 tensor-core figures from NVIDIA's datasheets; H200 has
H100's compute with more and faster memory.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

from model.config import TransformerConfig


@dataclass(frozen=True)
class GPUSpec:
    """One GPU model."""

    name: str
    memory_gb: float          # usable HBM, GB (1e9 bytes)
    bf16_tflops: float        # dense bf16 peak, TFLOP/s
    hbm_tb_s: float           # HBM bandwidth, TB/s
    nvlink_gb_s: float        # NVLink bandwidth per GPU, GB/s (bidirectional)
    network_gb_s: float       # typical inter-node bandwidth per GPU, GB/s (400 Gb/s NIC = 50)


GPUS: dict[str, GPUSpec] = {g.name: g for g in [
    GPUSpec("a100-40gb", 40, 312, 1.555, 600, 25),
    GPUSpec("a100-80gb", 80, 312, 2.039, 600, 25),
    GPUSpec("h100-80gb", 80, 989, 3.35, 900, 50),
    GPUSpec("h100-96gb-500w", 96, 989, 2.4, 900, 50),   # Meta's Grand Teton H100: HBM2e, 500 W cap
    GPUSpec("h200-141gb", 141, 989, 4.8, 900, 50),
    GPUSpec("b200-192gb", 180, 2250, 8.0, 1800, 50),
]}


def detect_gpu(device_name: str) -> GPUSpec | None:
    """Match ``torch.cuda.get_device_name()`` to the table (None when unknown)."""
    name = device_name.lower()
    for key, prefix in (("h200-141gb", "h200"), ("h100-80gb", "h100"), ("b200-192gb", "b200")):
        if prefix in name:
            return GPUS[key]
    if "a100" in name:
        return GPUS["a100-80gb" if "80" in name else "a100-40gb"]
    return None


def matmul_params_per_token(cfg: TransformerConfig) -> int:
    """Matmul parameters a token passes through: attention, the MLP or the k routed experts plus
    the router and any shared experts, and the output head (not the input embedding, a lookup);
    each MTP depth's block, projection and head too."""
    h, f, fe = cfg.hidden_size, cfg.ffn_hidden_size, cfg.expert_ffn_size
    attn = cfg.attention_matmul_params
    total = cfg.vocab_size * h            # output head
    total += cfg.mtp_depth * (2 * h * h + cfg.vocab_size * h)    # each MTP depth's projection and head
    for i in range(cfg.num_layers + cfg.mtp_depth):
        total += attn
        if cfg.is_moe_layer(i):
            total += cfg.moe.top_k * 3 * h * fe + h * cfg.moe.num_experts + cfg.shared_params
        else:
            total += 3 * h * f
    return total


def attention_widths(cfg: TransformerConfig) -> tuple[int, int]:
    """(heads x query-key width, heads x value width): the widths of the attention scores'
    product (Q K^T) and of the weighted sum of the values (P V), per token. Both are
    ``num_heads x head_dim`` here, which is ``hidden_size`` only when ``attn_head_dim`` is unset
    (Qwen3-30B-A3B: 32 x 128 = 4096 against hidden 2048); with MLA the query-key width is
    qk_nope_head_dim + qk_rope_head_dim and the value width v_head_dim (DeepSeek-V3: 192, 128)."""
    if cfg.mla:
        return cfg.num_heads * cfg.qk_head_dim, cfg.num_heads * cfg.v_head_dim
    return cfg.num_heads * cfg.head_dim, cfg.num_heads * cfg.head_dim


def train_flops_per_token(cfg: TransformerConfig, seq_len: int, causal: bool = True) -> float:
    """6 x active matmul params + attention scores and values, 6 x layers x seq x (heads x
    query-key width + heads x value width) (``attention_widths``; 12 x layers x hidden x seq when
    both are the hidden size), halved by the causal mask (``causal``, our ``mfu``) or whole
    (``mfu_full_attn``, torchtitan's and most published figures' count)."""
    qk, v = attention_widths(cfg)
    attention = (3.0 if causal else 6.0) * (cfg.num_layers + cfg.mtp_depth) * seq_len * (qk + v)
    return 6.0 * matmul_params_per_token(cfg) + attention


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
    return (f"warning: this CPU ({_cpu_name()}) has no native bf16 "
            f"instructions (AVX512-BF16, AMX-BF16 or Arm BF16), so bf16 runs through fallback "
            f"kernels far slower than fp32; for a CPU run {instead} (this run goes on in bf16 as asked)")


def _cpu_name() -> str:
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
