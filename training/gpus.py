"""The GPU table: one row per GPU model from NVIDIA's datasheets, read by the trainer's MFU and
memory figures and by the planner (``planning/hardware.py`` adds what the cost model needs beyond
the datasheet: SMs, the fractions of each peak that kernels reach, NCCL bandwidths).

Peaks are dense (no 2:4 sparsity) bf16 tensor-core figures; H200 has H100's compute with more and
faster memory.
"""

from __future__ import annotations

from dataclasses import dataclass


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
