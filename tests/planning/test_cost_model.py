"""planning/cost_model.py against numbers worked out by hand from its documented formulas.

Every expected value below is written from the datasheet and microbenchmark figures that
``planning/hardware.py`` cites (H100: 989 TFLOP/s bf16, 0.80 of it for a large GEMM, 132 SMs,
3.35 TB/s HBM streamed at 0.80, NCCL 370 GB/s ring all-reduce and 320 GB/s all-to-all inside a
node; A100: 312 TFLOP/s) and the cost model's constants (a sustained clock of 1305/1410 of boost,
128 x 256 GEMM tiles, a tile's fixed cost worth 400 of reduction length normalized at
k = 13312), not from the functions' own output; the assembled step is checked against its parts.
Cross-checks: the pipeline model against ``benchmarks/pipeline_schedules.py``'s and against a
discrete-event run of DeepSpeed's own 1F1B instruction streams; ``Shape.flops_per_token``
against ``model.flops.train_flops_per_token``. The exact TP/EP volumes against the
counted collectives are in ``tests/benchmarks/systems/test_comm_volume.py``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import pytest

from planning import cost_model as cm
from planning.hardware import DEVICES, cluster
from model.flops import train_flops_per_token
from training.config.recipe import load_recipe

REPO = Path(__file__).resolve().parents[2]
H100, A100 = DEVICES["h100-80gb"], DEVICES["a100-80gb"]
SUSTAINED = 1305 / 1410
RATE = 989e12 * 0.80 * SUSTAINED      # H100 large-GEMM FLOP/s at k = 13312: 732.3 TFLOP/s
HBM = 3.35e12 * 0.80                  # H100 memory-bound streaming, bytes/s
NVLINK, NVLINK_A2A = 370e9, 320e9     # H100 NCCL bus bandwidths inside a node, bytes/s
NIC_3200 = 3200 / 8 * 1e9 * 0.925 / 8   # a GPU's share of a 3.2 Tb/s node: 46.25 GB/s
NIC_400 = 400 / 8 * 1e9 * 0.925 / 8     # of a 400 Gb/s node: 5.78 GB/s


def keff(k):
    """A tile's useful share at reduction length k: k / (k + 400), normalized at k = 13312."""
    return (k / (k + 400)) / (13312 / 13712)


# ---------------------------------------------------------------------------------------------
# 1. GEMMs.

def test_k_efficiency_is_one_at_the_maximum_achievable_matmul_shape():
    assert cm.k_efficiency(cm.MAMF_K) == 1.0
    # k = 400: half of a tile's time is its fixed cost, 0.5 / (13312 / 13712) = 0.515
    assert cm.k_efficiency(400) == pytest.approx(0.5 * 13712 / 13312, rel=1e-12)


def test_large_square_gemm_is_compute_bound():
    # 16896 = 132 x 128 = 66 x 256: 132 x 66 tiles, exactly 66 waves over 132 SMs (no wave
    # quantization). 2 m n k = 9.65e12 FLOP at 732.3 TFLOP/s x keff(16896) = 1.0062: 13.09 ms;
    # its operands, 2 bytes x 3 x 16896^2 at 2.68 TB/s, would take 0.64 ms.
    m = n = k = 16896
    want = 2 * m * n * k / (RATE * keff(k))
    assert cm.gemm_seconds(m, n, k, H100) == pytest.approx(want, rel=1e-12)
    assert want == pytest.approx(13.09e-3, rel=1e-3)


def test_skinny_gemm_is_memory_bound():
    # m = 16 rows against a 13312 x 33792 weight (132 tiles, one wave): the compute, 2 m n k /
    # (RATE x 16/128 of each tile used) = 157 us, is below the 2 (mk + kn + mn) bytes at HBM
    # speed: 2 x 450.6e6 / 2.68e12 = 336 us.
    m, n, k = 16, 33792, 13312
    want = 2 * (m * k + k * n + m * n) / HBM
    assert cm.gemm_seconds(m, n, k, H100) == pytest.approx(want, rel=1e-12)
    assert want == pytest.approx(336.3e-6, rel=1e-3)


def test_one_tile_more_than_the_sms_takes_a_second_wave():
    # One wave: every SM computes one 128 x 256 tile over k = 13312, 2 x 128 x 256 x 13312 FLOP
    # at RATE / 132 per SM: 157.3 us, whatever the tile grid. 132 tiles (12 x 11) take one wave;
    # 133 tiles (19 x 7) two.
    k = 13312
    wave = 2 * 128 * 256 * k / (RATE / 132)
    assert cm.gemm_seconds(12 * 128, 11 * 256, k, H100) == pytest.approx(wave, rel=1e-12)
    assert cm.gemm_seconds(19 * 128, 7 * 256, k, H100) == pytest.approx(2 * wave, rel=1e-12)
    assert wave == pytest.approx(157.25e-6, rel=1e-3)


def test_few_tiles_split_the_reduction_over_idle_sms():
    # One 128 x 256 tile with k = 8192 would leave 131 SMs idle: split-K in 8 splits of 1024
    # (8192 // 1024; at most the 132 SMs), each on its own SM at RATE / 132 x keff(1024).
    want = 2 * 128 * 256 * 1024 / (RATE / 132 * keff(1024))
    assert cm.gemm_seconds(128, 256, 8192, H100) == pytest.approx(want, rel=1e-12)
    assert want == pytest.approx(16.33e-6, rel=1e-3)


def test_grouped_gemm_counts_the_tiles_of_all_groups():
    # 4 groups of 1408 x 768 (11 x 3 tiles each): 132 tiles, one wave; a 5th group: 165 tiles,
    # two waves (the second 33/132 full).
    k = 13312
    wave = 2 * 128 * 256 * k / (RATE / 132)
    assert cm.gemm_seconds(1408, 768, k, H100, groups=4) == pytest.approx(wave, rel=1e-12)
    assert cm.gemm_seconds(1408, 768, k, H100, groups=5) == pytest.approx(2 * wave, rel=1e-12)
    # the same FLOPs, 4 x 2 x 1408 x 768 x 13312, as one wave at the large-GEMM rate
    assert wave == pytest.approx(4 * 2 * 1408 * 768 * k / RATE, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# 2. Attention.

LLAMA = cm.Shape(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=32000)


def test_attention_flops_causal_split_by_tp_cp_and_the_ep_ranks_of_a_micro_batch():
    # Causal forward: QK^T and PV, 4 s^2 d per head, halved by the mask: 2 s^2 d per head and
    # sequence. 2 sequences of 4096, 32 heads of 128: 2 x 2 x 4096^2 x 128 x 32 = 2.749e14.
    whole = 2 * 2 * 4096 ** 2 * 128 * 32
    assert whole == 274_877_906_944
    lay = cm.Layout(world=1, global_batch=2, seq_len=4096, micro_batch=2)
    assert cm.attention_flops(LLAMA, lay) == whole
    # tp 2 (16 heads per rank) and cp 2 (a rank's 2048 queries against all keys): a quarter
    assert cm.attention_flops(LLAMA, replace(lay, world=4, tp=2, cp=2)) == whole / 4
    # this trainer's ep ranks split a micro-batch: one sequence each at ep 2
    assert cm.attention_flops(LLAMA, replace(lay, world=2, ep=2, ep_splits_batch=True)) == whole / 2


def test_attention_seconds_at_the_kernel_fractions_fa2_where_no_fa3():
    f = 2 * 2 * 4096 ** 2 * 128 * 32
    lay = cm.Layout(world=1, global_batch=2, seq_len=4096, micro_batch=2, attention="fa3")
    # H100 FA3: forward 0.57 of the peak, backward 2.5x the FLOPs at 0.45
    fwd, bwd = cm.attention_seconds(LLAMA, lay, H100)
    assert fwd == pytest.approx(f / (989e12 * SUSTAINED * 0.57), rel=1e-12)
    assert bwd == pytest.approx(2.5 * f / (989e12 * SUSTAINED * 0.45), rel=1e-12)
    # A100 has no FA3: FA2's 0.70 forward, 0.54 backward of 312 TFLOP/s
    fwd, bwd = cm.attention_seconds(LLAMA, lay, A100)
    assert fwd == pytest.approx(f / (312e12 * SUSTAINED * 0.70), rel=1e-12)
    assert bwd == pytest.approx(2.5 * f / (312e12 * SUSTAINED * 0.54), rel=1e-12)
    # H100 FA2 (PyTorch SDPA's flash backend): 0.32, 0.30
    fwd, _ = cm.attention_seconds(LLAMA, replace(lay, attention="fa2"), H100)
    assert fwd == pytest.approx(f / (989e12 * SUSTAINED * 0.32), rel=1e-12)


# ---------------------------------------------------------------------------------------------
# 3. Memory-bound elementwise work.

SMALL = cm.Shape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=256)
SMALL_MOE = replace(SMALL, experts=4, top_k=2, expert_ffn=32, shared_ffn=64)


def test_elementwise_bytes_dense_fused_eager_and_sequence_parallel():
    # T = 32 tokens, h = 64, bf16 (2 bytes). Norms r+w twice and residuals 2r+w twice: 10 T h a
    # = 40960; rotary r+w on q and k, (4 + 2) x 16 = 96 wide: 2 x 32 x 96 x 2 = 12288; SwiGLU
    # r 2f w f: 3 x 32 x 128 x 2 = 24576. Fused: 77824; eager: 3x.
    lay = cm.Layout(world=1, global_batch=1, seq_len=32, fused_elementwise=True)
    assert cm.elementwise_bytes(SMALL, lay, moe=False) == 40960 + 12288 + 24576
    assert cm.elementwise_bytes(SMALL, replace(lay, fused_elementwise=False), moe=False) == 3 * 77824
    # tp 2: rotary 6144 and SwiGLU 12288 on half the heads and width; SP also halves the norms'
    # and residuals' tokens: 20480 (without SP they stay 40960)
    tp2 = replace(lay, world=2, tp=2)
    assert cm.elementwise_bytes(SMALL, tp2, moe=False) == 40960 + 6144 + 12288
    assert cm.elementwise_bytes(SMALL, replace(tp2, sp=True), moe=False) == 20480 + 6144 + 12288


def test_elementwise_bytes_moe_permutation_fused_or_eager():
    # Attention side as the dense layer: 40960 + 12288. k T = 64 routed rows: expert SwiGLU
    # 64 x 3 x 32 x 2 = 12288; shared FFN (64 wide) 32 x 3 x 64 x 2 = 12288; sum 77824.
    # Permutation: rows r+w 64 x 64 x 2 x 2 = 16384, combine reads them 8192 and writes T h
    # 4096: 28672.
    lay = cm.Layout(world=1, global_batch=1, seq_len=32)
    assert cm.elementwise_bytes(SMALL_MOE, lay, moe=True) == 3 * 77824 + 3 * 28672
    assert cm.elementwise_bytes(SMALL_MOE, replace(lay, fused_elementwise=True, fused_permute=False),
                                moe=True) == 77824 + 3 * 28672
    assert cm.elementwise_bytes(SMALL_MOE, replace(lay, fused_elementwise=True), moe=True) == 77824 + 28672


# ---------------------------------------------------------------------------------------------
# 4. Collectives and the cluster.

DGX = cluster("h100-80gb")             # 8 GPUs per node, 8 x 400 Gb/s
CLOUD = cluster(name="h100-400g")      # 8 GPUs per node, one 400 Gb/s NIC


@pytest.mark.parametrize("size,stride,placement,busbw", [
    (8, 1, (8, 1), NVLINK),            # a node
    (4, 2, (4, 1), NVLINK),            # every other GPU of a node
    (8, 2, (4, 2), 4 * NIC_3200),      # 4 per node drive 4 NICs: 185 GB/s < NVLink
    (4, 8, (1, 4), NIC_3200),          # one per node
    (4, 16, (1, 4), NIC_3200),         # one every other node
])
def test_placement_and_bus_bandwidth_on_8_gpu_nodes(size, stride, placement, busbw):
    assert DGX.placement(size, stride) == placement
    assert DGX.busbw(size, stride) == pytest.approx(busbw, rel=1e-12)


def test_bus_bandwidth_across_nodes_is_the_smaller_of_nvlink_and_the_local_nics():
    assert NIC_3200 == 46.25e9 and NIC_400 == 5.78125e9
    # 16 ranks over 2 nodes: 8 x 46.25 GB/s = 370 GB/s (NVLink's), or 8 x 5.78 GB/s on a cloud node
    assert DGX.busbw(16, 1) == pytest.approx(min(NVLINK, 8 * NIC_3200), rel=1e-12)
    assert CLOUD.busbw(16, 1) == pytest.approx(8 * NIC_400, rel=1e-12)


def test_ring_collectives_inside_a_node_and_across_nodes():
    gb = 1e9
    # inside a node: all-reduce 2 (n-1)/n, reduce-scatter (n-1)/n of the tensor, all-gather
    # (n-1) shards; plus one small collective's 40 us
    assert cm._collective(DGX, "all_reduce", gb, 8, 1) == pytest.approx(2 * 7 / 8 * gb / NVLINK + 40e-6)
    assert cm._collective(DGX, "reduce_scatter", gb, 8, 1) == pytest.approx(7 / 8 * gb / NVLINK + 40e-6)
    assert cm._collective(DGX, "all_gather", gb / 8, 8, 1) == pytest.approx(7 * gb / 8 / NVLINK + 40e-6)
    # 16 ranks on 2 cloud nodes: the 8 local NICs' 46.25 GB/s, 80 us
    assert cm._collective(CLOUD, "all_reduce", gb, 16, 1) == pytest.approx(
        2 * 15 / 16 * gb / (8 * NIC_400) + 80e-6)
    assert cm._collective(DGX, "all_reduce", gb, 1, 1) == 0.0


def test_a_group_that_does_not_fill_its_nodes_spans_as_many_as_it_touches():
    # 3 ranks 4 apart on 8-GPU nodes: ranks 0 and 4 share node 0, rank 8 is on node 1
    assert DGX.placement(3, 4) == (2, 2)
    assert DGX.busbw(3, 4) == pytest.approx(min(370e9, 2 * NIC_3200))


def test_tp_calls_count_each_collective_once():
    dense, moe = DENSE, replace(DENSE, experts=8, top_k=2, expert_ffn=512)
    lay = replace(STEP, pp=1, world=4, global_batch=4)
    # without SP: forward one all-reduce per sub-layer (2), backward one each (2)
    assert cm.tp_calls(dense, lay, 0) == 4 and cm.tp_calls(dense, lay, 0, ("forward",)) == 2
    # SP: per sub-layer forward a reduce-scatter and a gather (4); backward a reduce-scatter and
    # two gathers (6); an MoE FFN with tp-split experts gathers once backward and adds the
    # combine weights' all-reduce: 4 + (3 + 2 + 1)
    sp = replace(lay, sp=True)
    assert cm.tp_calls(dense, sp, 0) == 4 + 6
    assert cm.tp_calls(moe, sp, 0) == 4 + 6
    # Megatron's MoE with experts not split by tp: only the attention's (2 forward, 3 backward)
    assert cm.tp_calls(moe, replace(sp, etp=1), 0) == 5
    assert cm.tp_calls(dense, replace(lay, tp=1, world=2), 0) == 0


def test_all_to_all_nvlink_inside_and_the_nic_share_across():
    gb = 1e9
    # a node: the 7 of 8 shares for the other GPUs at NVLink's all-to-all 320 GB/s
    assert cm.all_to_all_seconds(DGX, gb, 8, 1) == pytest.approx(gb * 7 / 8 / NVLINK_A2A + 40e-6)
    # 2 cloud nodes: 7/16 over NVLink (1.4 ms) at the same time as 8/16 over the GPU's 5.78 GB/s
    # NIC share (86 ms): the network's
    assert cm.all_to_all_seconds(CLOUD, gb, 16, 1) == pytest.approx(gb * 8 / 16 / NIC_400 + 80e-6)
    # a deduplicated remote share in its place
    assert cm.all_to_all_seconds(CLOUD, gb, 16, 1, remote=0.25) == pytest.approx(gb * 0.25 / NIC_400 + 80e-6)


def test_remote_share_of_deepep_dispatch():
    # 8 experts, top-2, over nodes of 4 experts (ep ranks 8 GPUs apart: one per node). A token
    # crosses once to each other node holding one of its experts. Expected other nodes among its
    # 2 experts, over k = 2: (nodes - 1)(1 - C(E - E/N, k) / C(E, k)) / k.
    shape = cm.Shape(layers=1, hidden=64, heads=4, kv_heads=4, head_dim=16, ffn=128, vocab=256,
                     experts=8, top_k=2, expert_ffn=128)
    lay = cm.Layout(world=16, global_batch=2, seq_len=32, tp=8, ep=2, a2a_node_dedup=True)
    # 2 nodes: 1 x (1 - C(4, 2) / C(8, 2)) / 2 = (1 - 6/28) / 2 = 11/28
    assert cm.remote_share(shape, lay, DGX) == pytest.approx(11 / 28, rel=1e-12)
    # 4 nodes of 2 experts: 3 x (1 - C(6, 2) / C(8, 2)) / 2 = 3 x 13/28 / 2 = 39/56, below the
    # 3/4 of rows that go to other nodes without deduplication
    assert cm.remote_share(shape, replace(lay, world=32, ep=4), DGX) == pytest.approx(39 / 56, rel=1e-12)
    assert cm.remote_share(shape, replace(lay, tp=1, world=2), DGX) == 0.0    # one node
    assert cm.remote_share(shape, replace(lay, a2a_node_dedup=False), DGX) is None


@pytest.mark.parametrize("recompute,again", [("none", 0), ("experts", 0), ("attention", 0),
                                             ("moe", 2), ("full", 2), ("every_k:2", 1)])
def test_ep_volumes_repeat_the_exchange_where_recompute_repeats_the_moe_layer(recompute, again):
    # This trainer's 2 ep ranks split a micro-batch of 2 x 8 tokens: T = 8 per rank, k T h =
    # 2 x 8 x 64 = 1024 elements sent per exchange and MoE layer, 2 MoE layers. ep_volumes'
    # docstring: once more (phase recompute) for the layers recomputed whole (full: both;
    # every_k:2: layer 0) or as an MoE layer (moe); not for experts or attention.
    lay = cm.Layout(world=2, global_batch=2, seq_len=8, micro_batch=2, ep=2, ep_splits_batch=True,
                    recompute=recompute)
    want = {(label, phase): 2 * 1024 for label in ("dispatch", "combine") for phase in ("forward", "backward")}
    want.update({(label, "recompute"): again * 1024 for label in ("dispatch", "combine") if again})
    assert cm.ep_volumes(SMALL_MOE, lay, range(2)) == want
    # Megatron's convention (ep carved out of dp: each rank all 16 tokens), and the busiest
    # rank's imbalance
    lay = replace(lay, ep_splits_batch=False, moe_imbalance=1.5)
    assert cm.ep_volumes(SMALL_MOE, lay, range(2)) == {k: 2 * 1.5 * v for k, v in want.items()}


# ---------------------------------------------------------------------------------------------
# 5. Data-parallel volumes: the ZeRO paper (arXiv:1910.02054 sec. 7) and DeepSpeed's docs.

PSI, DP = 1000, 4
RING = (DP - 1) / DP


@pytest.mark.parametrize("stage,psi_per_step", [(0, 2), (1, 2), (2, 2), (3, 3)])
def test_dp_volume_at_accumulation_one_is_the_zero_papers(stage, psi_per_step):
    # Data parallelism and ZeRO-1/2: a reduce-scatter plus an all-gather (an all-reduce), 2 psi;
    # ZeRO-3: the parameters gathered in forward and again in backward, and the gradients
    # reduce-scattered: 3 psi, 1.5x. Bytes with bf16 gradients and parameters, times (dp-1)/dp.
    got = cm.dp_volume(PSI, DP, 1, stage, grad_bytes=2, param_bytes=2)
    assert sum(got.values()) == pytest.approx(psi_per_step * PSI * 2 * RING, rel=1e-12)


@pytest.mark.parametrize("stage,psi_per_step", [(0, 2), (1, 2), (2, 4 + 1), (3, 3 * 4)])
def test_dp_volume_with_accumulation_as_deepspeed_0_19_8_schedules_it(stage, psi_per_step):
    # docs/memory-estimation.md "The planner": at m = 4 micro-batches ZeRO-0/1 reduce once at the
    # boundary (2 psi), ZeRO-2 reduce-scatters every micro-batch and gathers once ((m + 1) psi),
    # ZeRO-3 moves 3 psi per micro-batch (3 m psi)
    got = cm.dp_volume(PSI, DP, 4, stage, grad_bytes=2, param_bytes=2)
    assert sum(got.values()) == pytest.approx(psi_per_step * PSI * 2 * RING, rel=1e-12)


def test_dp_volume_parts_and_dtypes():
    # ZeRO-1 with fp32 gradient reduction: psi x 4 bytes reduce-scattered, psi x 2 gathered
    assert cm.dp_volume(PSI, DP, 4, 1, grad_bytes=4) == pytest.approx(
        {"grad_reduce_scatter": PSI * 4 * RING, "param_all_gather": PSI * 2 * RING})
    assert cm.dp_volume(PSI, DP, 1, 0, grad_bytes=4) == pytest.approx({"grad_all_reduce": 2 * PSI * 4 * RING})
    assert cm.dp_volume(PSI, 1, 1, 0, grad_bytes=4) == {}


# ---------------------------------------------------------------------------------------------
# 6. The pipeline.

def test_pipeline_equal_stages_and_interleaving():
    t = 3.0
    # p = 4 equal stages, m = 8: (m + p - 1) t = 11 x 3
    assert cm.pipeline_seconds([t] * 4, 8) == 33.0
    # v = 2 virtual stages per rank: (m + (p - 1)/v) t = 9.5 x 3, a bubble of (p-1)/(v m) = 3/16
    got = cm.pipeline_seconds([t] * 4, 8, vpp=2)
    assert got == 28.5 and (got - 8 * t) / (8 * t) == 3 / 16
    assert cm.pipeline_seconds([t], 8) == 24.0        # no pipeline: m t


def test_pipeline_prices_the_schedule():
    """p 4, m 8, equal stages of t = F + B + W: 1F1B and GPipe (m + p - 1) t = 11 t; ZB-H1
    fills the ramp with weight gradients, (m + (p - 1)/3) t = 9 t; refusals for an unknown
    schedule and for interleaving another one."""
    t = 3.0
    assert cm.pipeline_seconds([t] * 4, 8) == cm.pipeline_seconds([t] * 4, 8, schedule="gpipe") == 33.0
    assert cm.pipeline_seconds([t] * 4, 8, schedule="zb-h1") == pytest.approx(27.0)
    for bad in (dict(schedule="interleaved"), dict(schedule="zb-h1", vpp=2)):
        with pytest.raises(ValueError, match="only 1f1b interleaves"):
            cm.Layout(world=8, global_batch=32, seq_len=2048, pp=4, **bad).check(LLAMA)


@pytest.mark.parametrize("work", [[1.0, 2.0], [2.0, 1.0], [3.0, 5.0, 2.0, 4.5], [0.25, 0.5, 0.75]])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_pipeline_equals_the_schedule_benchmarks_model(work, m):
    # imported here: benchmarks/pipeline_schedules.py imports deepspeed (seconds), which only this
    # file's worker then pays for
    from benchmarks.systems.pipeline_schedules import schedule_model_step
    # stage times exact in binary, so the two orders of summation agree to the bit
    assert cm.pipeline_seconds(work, m) == schedule_model_step(work, m)
    if work == [3.0, 5.0, 2.0, 4.5] and m == 3:
        assert schedule_model_step(work, m) == 2 * 5.0 + 14.5     # (m - 1) max + sum


def _deepspeed_1f1b_makespan(stages: int, micro_batches: int, fwd: list[float], bwd: list[float]) -> float:
    """Discrete-event run of DeepSpeed's ``TrainSchedule`` instruction streams, one per stage:
    each stage executes its instructions in order; ForwardPass takes ``fwd[s]``, BackwardPass
    ``bwd[s]``; sends are free and never wait; the n-th RecvActivation on stage s waits for the
    n-th SendActivation of stage s-1, the n-th RecvGrad for the n-th SendGrad of stage s+1."""
    from deepspeed.runtime.pipe.schedule import TrainSchedule
    streams = [[type(cmd).__name__ for step in TrainSchedule(micro_batches=micro_batches, stages=stages,
                                                             stage_id=s).steps() for cmd in step]
               for s in range(stages)]
    clock, pos = [0.0] * stages, [0] * stages
    sent, received = defaultdict(list), defaultdict(int)     # (send, stage) -> times; recvs done
    moved = True
    while moved:
        moved = False
        for s in range(stages):
            while pos[s] < len(streams[s]):
                kind = streams[s][pos[s]]
                if kind in ("RecvActivation", "RecvGrad"):
                    source = s - 1 if kind == "RecvActivation" else s + 1
                    times = sent[(kind.replace("Recv", "Send"), source)]
                    if received[(kind, s)] >= len(times):
                        break                                # its send is not issued yet
                    clock[s] = max(clock[s], times[received[(kind, s)]])
                    received[(kind, s)] += 1
                elif kind in ("SendActivation", "SendGrad"):
                    sent[(kind, s)].append(clock[s])
                elif kind == "ForwardPass":
                    clock[s] += fwd[s]
                elif kind == "BackwardPass":
                    clock[s] += bwd[s]
                pos[s] += 1
                moved = True
    assert pos == [len(x) for x in streams], "the streams deadlocked"
    for x in streams:
        assert x.count("ForwardPass") == x.count("BackwardPass") == micro_batches
    return max(clock)


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("m", [1, 4, 8])
def test_pipeline_equals_deepspeeds_1f1b_for_equal_stages(stages, m):
    f, b = 1.0, 2.5                       # F != B
    got = _deepspeed_1f1b_makespan(stages, m, [f] * stages, [b] * stages)
    assert got == (m + stages - 1) * (f + b)
    assert cm.pipeline_seconds([f + b] * stages, m) == got


def test_pipeline_bounds_deepspeeds_1f1b_for_unequal_stages():
    # Unequal stages, (F, B) = (1, 2) and (2, 4), m = 4: with the slower stage last the model's
    # (m - 1) max + sum, 3 x 6 + 9 = 27, is DeepSpeed's makespan. With the slower stage first,
    # it works 4 x 6 = 24 and idles once, from its second forward's end (4) to the first
    # gradient's arrival (2 + 1 + 2 = 5): 25, where the model adds the fast stage's whole 3
    # again (27): an upper bound there.
    assert _deepspeed_1f1b_makespan(2, 4, [1.0, 2.0], [2.0, 4.0]) == cm.pipeline_seconds([3.0, 6.0], 4) == 27.0
    assert _deepspeed_1f1b_makespan(2, 4, [2.0, 1.0], [4.0, 2.0]) == 25.0
    assert cm.pipeline_seconds([6.0, 3.0], 4) == 27.0


# ---------------------------------------------------------------------------------------------
# 7. The assembled step and the layout's checks.

DENSE = cm.Shape(layers=4, hidden=1024, heads=8, kv_heads=8, head_dim=128, ffn=4096, vocab=32000)
# 8 GPUs: tp 2 x pp 2 x dp 2; 8 sequences of 1024 per step, micro-batch 1: 4 micro-batches
STEP = cm.Layout(world=8, global_batch=8, seq_len=1024, tp=2, pp=2, zero_stage=1, overlap_dp=False)


def test_step_cost_is_the_pipeline_plus_exposed_dp_plus_the_optimizer():
    got = cm.step_cost(DENSE, STEP, DGX)
    m, t, h = 4, 1024, 1024
    # The last stage (layers 2-3 and the head) is the slowest. Its parameters per rank: per
    # layer q/k/v/o 1024 x 128 x 32 / tp + 2 norms + SwiGLU 3 x 1024 x 4096 / tp, and the head
    # 32000 x 1024 / tp.
    psi = 2 * (1024 * 128 * 32 // 2 + 2 * 1024 + 3 * 1024 * 4096 // 2) + 32000 * 1024 // 2
    assert psi == 33_165_312
    # ZeRO-1 over dp 2 (ranks 2 apart: NVLink), not overlapped: fp32 gradients reduce-scattered,
    # bf16 parameters gathered, each x (dp-1)/dp
    assert got.exposed["dp"] == pytest.approx((psi * 4 / 2 + psi * 2 / 2) / NVLINK, rel=1e-12)
    # Adam on this rank's half of them, 34 bytes a parameter at HBM speed
    assert got.optimizer_s == pytest.approx(psi / 2 * 34 / HBM, rel=1e-12)
    # TP per micro-batch: forward all-reduces of 2 x 2 T h and the cross-entropy's 3 T, backward
    # 2 x 2 T h and the head's T h; bf16 over 2 ranks (2 (n-1)/n = 1); one 40 us latency per
    # call: 6 forward (4 in the layers, the cross-entropy's max and sums), 5 backward
    fwd, bwd = 4 * t * h + 3 * t, 4 * t * h + t * h
    tp_s = (fwd + bwd) * 2 / NVLINK + 11 * 40e-6
    assert got.exposed["tp"] == pytest.approx(m * tp_s, rel=1e-12)
    # pipeline send of T h bf16 to the stage 4 ranks away (same node), once per micro-batch
    assert got.exposed["pp"] == pytest.approx(m * (t * h * 2 / NVLINK + 40e-6), rel=1e-12)
    assert got.exposed["ep"] == 0.0
    assert got.compute_s == pytest.approx(sum(got.breakdown.values()), rel=1e-12)
    # 1F1B over 2 stages: m times the slowest stage plus one micro-batch of the first, which has
    # the same layers and the embedding's forward all-reduce of T h (1 call) where the last has
    # the head, its backward all-reduce of T h and the cross-entropy's 3 T (3 calls)
    slowest = (got.compute_s + got.exposed["tp"] + got.exposed["pp"]) / m
    first = slowest - cm.head_compute(DENSE, STEP, H100).total - 3 * t * 2 / NVLINK - 2 * 40e-6
    assert got.bubble_s == pytest.approx(first, rel=1e-9)
    pipeline = m * slowest + first
    assert got.step_s == pytest.approx(pipeline + got.exposed["dp"] + got.optimizer_s, rel=1e-12)
    assert got.tokens_per_s_per_gpu == pytest.approx(8 * 1024 / got.step_s / 8, rel=1e-12)


@pytest.mark.parametrize("shape,layout,flags", [
    (DENSE, STEP, ("overlap_dp", "overlap_param_gather", "overlap_tp", "overlap_p2p")),
    (DENSE, replace(STEP, zero_stage=2, pp=1, world=4, global_batch=8), ("overlap_dp", "overlap_tp")),
    (replace(DENSE, experts=8, top_k=2, expert_ffn=1024),
     replace(STEP, world=16, ep=4, global_batch=16, sp=True), ("overlap_a2a", "overlap_tp", "overlap_dp")),
])
def test_overlap_shortens_the_step(shape, layout, flags):
    # each flag hides something on these layouts (TP, pipeline sends, the gradient reduction,
    # the parameter gather, the expert exchange), and never lengthens the step
    off = replace(layout, **{f: False for f in flags})
    base = cm.step_cost(shape, off, DGX).step_s
    for flag in flags:
        assert cm.step_cost(shape, replace(off, **{flag: True}), DGX).step_s < base, flag
    on = cm.step_cost(shape, replace(off, **{f: True for f in flags}), DGX).step_s
    assert on < min(cm.step_cost(shape, replace(off, **{f: True}), DGX).step_s for f in flags)


@pytest.mark.parametrize("shape,changes,message", [
    (DENSE, dict(world=6, tp=4, pp=1), r"world 6 is not a multiple of tp x cp x pp = 4"),
    (DENSE, dict(global_batch=3), r"global batch 3 is not a multiple of micro 1 x dp 2"),
    (replace(DENSE, experts=6, top_k=2, expert_ffn=512), dict(ep=4), r"ep 4 does not divide 6 experts"),
    (DENSE, dict(attention="fa9"), r"attention 'fa9': one of fa2, fa3, cudnn, unfused"),
    (DENSE, dict(recompute="sometimes"), r"recompute 'sometimes': one of none, full, every_k:N, "
                                         r"attention, moe, experts, selective, elementwise, op"),
    (replace(DENSE, experts=8, top_k=2, expert_ffn=512),
     dict(ep=2, world=16, global_batch=8, ep_splits_batch=True), r"ep 2 does not divide the micro-batch 1"),
    (replace(DENSE, experts=8, top_k=2, expert_ffn=512), dict(ep=8, etp=2, pp=1),
     r"ep 8 x etp 2 does not divide the 8 ranks of a pipeline stage"),
    (DENSE, dict(cp=3, world=12, tp=2, pp=2, global_batch=1), r"cp 3 does not divide the sequence length 1024"),
    (DENSE, dict(tp=16, world=32, pp=1, global_batch=2), r"tp 16 does not divide the 8 attention heads"),
])
def test_layout_check_raises_one_line_naming_the_value(shape, changes, message):
    with pytest.raises(ValueError, match=message) as err:
        replace(STEP, **changes).check(shape)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------
# 8. Shapes of the recipes, and FLOPs per token.

RECIPES = {
    # layers, hidden, heads, kv heads, head dim, FFN, vocab; experts, top-k, expert FFN, shared
    "mixtral_8x7b": cm.Shape(32, 4096, 32, 8, 128, 14336, 32000, experts=8, top_k=2, expert_ffn=14336),
    "qwen3_30b_a3b": cm.Shape(48, 2048, 32, 4, 128, 6144, 151936, experts=128, top_k=8, expert_ffn=768),
    "deepseek_v3_style": cm.Shape(28, 2048, 16, 4, 128, 10944, 129280, experts=64, top_k=8,
                                  expert_ffn=1408, shared_ffn=1408, first_dense=3),
}


def _config(name: str, overrides=()):
    return load_recipe(REPO / "recipes" / f"{name}.yaml", list(overrides)).model


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_shape_from_the_recipes_and_flops_per_token(name):
    cfg = _config(name)
    shape = cm.Shape.from_config(cfg)
    assert shape == RECIPES[name]
    assert [i for i in range(shape.layers) if shape.is_moe(i)] == \
        [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    for causal in (True, False):
        assert shape.flops_per_token(4096, causal) == train_flops_per_token(cfg, 4096, causal)


def test_mixtral_flops_per_token_by_hand():
    # Matmul weights a token passes: per layer attention 4096 x 128 x (2 x 32 + 2 x 8) and two
    # of eight SwiGLU experts 2 x 3 x 4096 x 14336 plus the router 4096 x 8; 32 layers and the
    # head 32000 x 4096: 12.75e9. Causal attention 6 x 32 x 4096 x s; whole 12 x.
    per_layer = 4096 * 128 * 80 + 2 * 3 * 4096 * 14336 + 4096 * 8
    params = 32 * per_layer + 32000 * 4096
    assert params == 12_748_587_008
    shape = RECIPES["mixtral_8x7b"]
    assert shape.flops_per_token(4096) == 6 * params + 6 * 32 * 4096 * 4096 == 79_712_747_520
    assert shape.flops_per_token(4096, causal=False) == 6 * params + 12 * 32 * 4096 * 4096


def test_shape_has_moe_in_the_layers_the_model_does_for_every_other_layer():
    cfg = _config("tiny_switch")                            # blocks 1 and 3 are MoE, 0 and 2 dense
    shape = cm.Shape.from_config(cfg)
    assert [i for i in range(4) if shape.is_moe(i)] == [1, 3]


def test_shape_shared_ffn_with_two_shared_experts():
    cfg = _config("tiny_mixtral", ["model.moe.num_shared_experts=2"])   # 2 x 128 wide
    shape = cm.Shape.from_config(cfg)
    assert shape.shared_ffn == 256
    assert shape.flops_per_token(128) == train_flops_per_token(cfg, 128)
