"""What the cost model knows about a GPU and a cluster: peaks from datasheets, and the fraction of
each peak that kernels and NCCL reach, from public microbenchmarks.

Peaks (dense bf16 TFLOP/s, HBM TB/s, memory) are ``training.gpus.GPUS`` (NVIDIA datasheets).
This module adds what a step-time model needs beyond them; every figure below names its source in
the comment beside it, and ``docs/planning.md`` lists them with links. Nothing here is fitted to a
published training run: ``benchmarks/planner_vs_published.py`` checks the model against those.

A cluster is nodes of ``gpus_per_node`` GPUs joined by NVLink/NVSwitch inside a node and by a
network of ``network_gbit_s`` per node across nodes (NVIDIA's reference nodes: one 400 Gb/s NIC
per GPU, 3.2 Tb/s per node; many clouds: 400 Gb/s per node).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from training.gpus import GPUS, GPUSpec


@dataclass(frozen=True)
class Device:
    """One GPU model as the cost model sees it."""

    spec: GPUSpec
    sms: int                      # streaming multiprocessors: one GEMM tile per SM per wave
    gemm_fraction: float          # of the bf16 peak a large GEMM sustains (maximum achievable matmul)
    attention: dict               # kernel -> (forward, backward) fraction of the peak, causal, d=128
    hbm_fraction: float           # of the HBM bandwidth a memory-bound kernel streams at
    nvlink_busbw_gb_s: float      # NCCL ring all-reduce bus bandwidth inside an NVSwitch node, GB/s
    nvlink_a2a_gb_s: float        # NCCL all-to-all bus bandwidth inside the node, GB/s

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def peak_flops(self) -> float:
        return self.spec.bf16_tflops * 1e12

    @property
    def hbm_bytes_s(self) -> float:
        return self.spec.hbm_tb_s * 1e12 * self.hbm_fraction


# Tile of one CTA in cuBLAS/CUTLASS bf16 GEMMs on Ampere and Hopper (128 x 256 output elements per
# SM per wave for large problems: CUTLASS's default Hopper warp-specialized tile, cuBLAS's largest
# Ampere tile). The wave and tile quantization of a GEMM follow from it.
TILE_M, TILE_N = 128, 256

# Attention fractions, in the FlashAttention benchmarks' count (forward 4 b s^2 h d, halved when
# causal; backward 2.5x the forward), read off the FlashAttention-2 paper's A100 and H100 figures
# (arXiv 2307.08691; Dao-AILab/flash-attention assets/flash2_*_fwd_bwd_benchmark.png) and the
# FlashAttention-3 paper's H100 figures (arXiv 2407.08608), causal, head dim 128, 4k-8k tokens:
# A100 FA2 forward up to 0.73, forward+backward 0.58 (182 TFLOP/s) -> backward 0.54; H100 FA2
# forward 0.32 (319 TFLOP/s), forward+backward 0.30 -> backward 0.30; H100 FA3 forward 0.57
# (521-616 TFLOP/s over 2k-16k), backward 0.51-0.57 without the mask, taken 0.45 with it; cuDNN's
# fused attention (Transformer Engine) is FA3's class in the same figures (backward 499 TFLOP/s at
# 4k). B200: FA4's forward reaches 0.71 (arXiv 2603.05451); Hopper's fractions are used.
_A100_ATTENTION = {"fa2": (0.70, 0.54)}
POWER_CAP_500W = (500 / 700) ** (1 / 3)       # an H100's clock at 500 W over its clock at 700 W
_HOPPER_ATTENTION = {"fa2": (0.32, 0.30), "fa3": (0.57, 0.45), "cudnn": (0.57, 0.45)}

DEVICES: dict[str, Device] = {d.name: d for d in [
    # A100 SXM: 108 SMs (whitepaper). Large GEMM 0.87: maximum achievable matmul FLOPS 271.2 of
    # 312 TFLOP/s (stas00/ml-engineering, compute/accelerator/README.md). NCCL on DGX A100
    # (NVLink 3): all-reduce busbw 232 GB/s, all-to-all 210 (NVIDIA GTC25 NCCL talk, as tabled in
    # ml-engineering's network/README.md).
    Device(GPUS["a100-40gb"], 108, 0.87, _A100_ATTENTION, 0.80, 232, 210),
    Device(GPUS["a100-80gb"], 108, 0.87, _A100_ATTENTION, 0.80, 232, 210),
    # H100 SXM: 132 SMs. Large GEMM 0.80: 794.5 of 989 TFLOP/s (ml-engineering, MAMF). NCCL on
    # DGX H100 (NVLink 4): ring all-reduce 370 GB/s, all-to-all 320 (GTC25). H200: the same
    # compute and NVLink (ml-engineering: "H200 is the same"; its all-reduce sweep 367 GB/s).
    Device(GPUS["h100-80gb"], 132, 0.80, _HOPPER_ATTENTION, 0.80, 370, 320),
    Device(GPUS["h200-141gb"], 132, 0.80, _HOPPER_ATTENTION, 0.80, 367, 320),
    # H100 SXM with 96 GB of HBM2e (2.4 TB/s) run at a 500 W power limit (Meta's Grand Teton
    # nodes, torchtitan's benchmarks): a sustained GEMM on the 700 W part draws its limit, and
    # dynamic power goes as f V^2 with the voltage following the clock, so the clock a 500 W cap
    # sustains is (500/700)^(1/3) of the 700 W one (this model's assumption; static power, left
    # out, would lower it further). Memory and NVLink unchanged.
    Device(GPUS["h100-96gb-500w"], 132, 0.80 * POWER_CAP_500W,
           {k: (f * POWER_CAP_500W, b * POWER_CAP_500W) for k, (f, b) in _HOPPER_ATTENTION.items()},
           0.80, 370, 320),
    # B200: 148 SMs. Large GEMM 0.776: 1745 of 2250 TFLOP/s (ml-engineering, MAMF). NVLink 5:
    # ring all-reduce 682 GB/s, all-to-all 640 (GTC25).
    Device(GPUS["b200-192gb"], 148, 0.776, _HOPPER_ATTENTION, 0.80, 682, 640),
]}
# Memory-bound kernels stream at 0.80 of the HBM figure: DeepGEMM's small-M FP8 GEMMs on H800 run
# memory-bound at 2.67 of 3.35 TB/s (deepseek-ai/DeepGEMM README), and A100 copy kernels measure
# 0.75-0.87 in PyTorch and CUDA issue threads.
ATTENTION_KERNELS = ("fa2", "fa3", "cudnn")   # fa2: what PyTorch's SDPA flash backend runs

# Of the NIC line rate NCCL reaches across nodes: all-reduce busbw 370 GB/s and all-to-all 48 GB/s
# per GPU over 8 x 400 Gb/s (50 GB/s per GPU) on 4 DGX H100 nodes (GTC25, via ml-engineering).
NETWORK_EFFICIENCY = 0.925
# One small collective: 44 us for a 32 KiB all-reduce on 8 A100 (nccl-tests PERFORMANCE.md's
# example), about 40 us on 8 H200 (ml-engineering's sweep); across nodes no first-hand figure
# was found: twice the NVLink figure is this model's assumption.
LATENCY_NVLINK_S = 40e-6
LATENCY_NETWORK_S = 80e-6


@dataclass(frozen=True)
class Cluster:
    """Nodes of identical GPUs: NVLink inside a node, ``network_gbit_s`` per node across them."""

    device: Device
    gpus_per_node: int = 8
    network_gbit_s: float = 3200.0      # per node, line rate

    @property
    def nic_bytes_s_per_gpu(self) -> float:
        """What one GPU's share of the node's network carries, bytes/s."""
        return self.network_gbit_s / 8 * 1e9 * NETWORK_EFFICIENCY / self.gpus_per_node

    def placement(self, size: int, stride: int) -> tuple[int, int]:
        """(members per node, nodes) of a group of ``size`` ranks ``stride`` apart (the product of
        the faster-varying parallel degrees)."""
        local = max(1, min(size, self.gpus_per_node // max(1, stride)))
        return local, max(1, math.ceil(size / local))

    def busbw(self, size: int, stride: int) -> float:
        """Bus bandwidth (bytes/s per rank) of a ring collective over the group: NVLink inside a
        node; across nodes, NCCL runs one ring per NIC, so the ``local`` members of the group in
        a node drive ``local`` NICs: min(NVLink, local x one GPU's network share)."""
        local, nodes = self.placement(size, stride)
        nvlink = self.device.nvlink_busbw_gb_s * 1e9
        return nvlink if nodes == 1 else min(nvlink, local * self.nic_bytes_s_per_gpu)

    def latency(self, size: int, stride: int) -> float:
        return LATENCY_NVLINK_S if self.placement(size, stride)[1] == 1 else LATENCY_NETWORK_S


# Cluster shapes: NVIDIA's reference nodes (DGX/HGX: 8 GPUs on NVSwitch, one NIC per GPU) and the
# common cloud node with one 400 Gb/s NIC for all eight.
CLUSTERS: dict[str, tuple[str, int, float]] = {
    "dgx-a100": ("a100-80gb", 8, 1600.0),        # 8 x 200 Gb/s HDR InfiniBand
    "dgx-h100": ("h100-80gb", 8, 3200.0),        # 8 x 400 Gb/s NDR InfiniBand
    "hgx-h200": ("h200-141gb", 8, 3200.0),
    "dgx-b200": ("b200-192gb", 8, 3200.0),
    "h100-400g": ("h100-80gb", 8, 400.0),        # one 400 Gb/s NIC per node
    "a100-400g": ("a100-80gb", 8, 400.0),
}


def cluster(gpu: str = "h100-80gb", gpus_per_node: int = 8, network_gbit_s: float | None = None,
            name: str | None = None, gemm_fraction: float | None = None) -> Cluster:
    """A ``Cluster`` by shape name, or by GPU type, node size and network (default: one 400 Gb/s
    NIC per GPU); ``gemm_fraction`` replaces the device's large-GEMM fraction (a calibration
    from a measured run, docs/planning.md). Raises ValueError for an unknown name or GPU."""
    if name is not None:
        if name not in CLUSTERS:
            raise ValueError(f"--cluster {name!r} is unknown: choose one of {', '.join(CLUSTERS)}")
        gpu, gpus_per_node, default = CLUSTERS[name]
        network_gbit_s = network_gbit_s or default
    if gpu not in DEVICES:
        raise ValueError(f"--gpu {gpu!r} is unknown: choose one of {', '.join(DEVICES)}")
    if gpus_per_node < 1:
        raise ValueError(f"--gpus-per-node {gpus_per_node} must be at least 1")
    if network_gbit_s is not None and network_gbit_s <= 0:
        raise ValueError(f"--network-gbit-s {network_gbit_s:g} must be positive")
    device = DEVICES[gpu]
    if gemm_fraction is not None:
        if not 0 < gemm_fraction <= 1:
            raise ValueError(f"--gemm-fraction {gemm_fraction:g}: a share of the peak, in (0, 1]")
        device = replace(device, gemm_fraction=gemm_fraction)
    return Cluster(device, gpus_per_node, network_gbit_s if network_gbit_s else 400.0 * gpus_per_node)
