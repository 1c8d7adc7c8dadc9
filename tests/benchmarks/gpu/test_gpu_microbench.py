"""``benchmarks/gpu/gpu_microbench.py``'s arithmetic: the FLOP and byte counts behind its TFLOP/s, GB/s
and roofline figures (docs/gpu.md), the GEMM shapes it reads from the recipes, and one CPU pass
with no time budget left (bandwidth measured, every matmul skipped, the JSON written)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks.gpu import gpu_microbench as gm
from training.gpus import GPUS


def test_flop_and_byte_counts_of_a_matmul():
    # (2, 3) @ (3, 4): 2*4 outputs, each 3 multiplies and 3 adds.
    assert gm.matmul_flops(2, 3, 4) == 48
    # A 6 and B 12 elements read, C 8 written: bf16 in, fp32 out.
    assert gm.matmul_bytes(2, 3, 4, 2, 4) == 6 * 2 + 12 * 2 + 8 * 4
    # A square n^3 matmul in bf16 moves 3 n^2 x 2 bytes for 2 n^3 FLOPs: n / 3 FLOP per byte.
    for n in (128, 8192):
        assert gm.intensity(n, n, n, 2) == pytest.approx(n / 3, rel=1e-12)
    # fp8 operands with a bf16 output (torch._scaled_mm's out_dtype) move fewer bytes than bf16.
    assert gm.intensity(4096, 4096, 4096, 1, 2) > gm.intensity(4096, 4096, 4096, 2)


def test_bandwidth_bytes_of_copy_and_add():
    assert gm.stream_bytes("copy", 1000) == 2000        # read src, write dst
    assert gm.stream_bytes("add", 1000) == 3000         # read a and b, write c
    with pytest.raises(KeyError):
        gm.stream_bytes("scale", 1000)


def test_ridge_points_come_from_the_shared_gpu_table():
    h200 = GPUS["h200-141gb"]
    assert gm.ridge_point("h200-141gb", "bf16") == pytest.approx(h200.bf16_tflops / h200.hbm_tb_s)
    # fp8 doubles the bf16 ridge, tf32 halves it, fp16 equals it; fp32 runs on CUDA cores.
    for dtype, factor in (("fp8", 2.0), ("tf32", 0.5), ("fp16", 1.0)):
        assert gm.ridge_point("h100-80gb", dtype) == pytest.approx(factor * gm.ridge_point("h100-80gb", "bf16"))
    assert gm.ridge_point("h200-141gb", "fp32") == pytest.approx(gm.FP32_TFLOPS["h200-141gb"] / h200.hbm_tb_s)
    text = gm.roofline_text()
    assert f"{gm.ridge_point('b200-192gb', 'fp8'):.0f} |" in text


def test_attention_traffic_unfused_tiled_and_from_l2():
    b, h, s, d, elem = 2, 3, 512, 64, 2
    unfused = gm.attention_hbm_bytes(b, h, s, d, elem, "unfused")
    l2 = gm.attention_hbm_bytes(b, h, s, d, elem, "tiled_l2")
    tiled = gm.attention_hbm_bytes(b, h, s, d, elem, "tiled")
    # The unfused kernel moves the (S, S) scores and probabilities four times over on top of Q, K, V, O.
    assert unfused - l2 == elem * b * h * 4 * s * s
    # Tiled reads K and V once per query block: S / QUERY_BLOCK times as often as from L2.
    assert tiled - l2 == elem * b * h * 2 * s * d * (math.ceil(s / gm.QUERY_BLOCK) - 1)
    # One block covers the whole sequence: nothing to re-read.
    assert gm.attention_hbm_bytes(b, h, gm.QUERY_BLOCK, d, elem, "tiled") == \
        gm.attention_hbm_bytes(b, h, gm.QUERY_BLOCK, d, elem, "tiled_l2")


@pytest.mark.parametrize("size", ["gpu", "tiny"])
def test_repo_gemms_follow_the_recipes(size):
    gemms = {label.split(" (")[0]: (m, k, n) for label, m, k, n in gm.repo_gemms(size)}
    tokens, h, _ = gemms["q/o proj"]
    assert gemms["down proj"] == (tokens, gemms["gate/up proj"][2], h)
    expert = next(v for k, v in gemms.items() if k.startswith("expert"))
    experts = next(int(label.split("(")[1].split()[0]) for label, *_ in gm.repo_gemms(size) if "expert" in label)
    # The MoE recipe has the dense one's active FLOPs: its experts' gate/up GEMMs together (one expert's
    # rows at balanced routing, times the experts) do what the dense gate/up GEMM does.
    assert experts * gm.matmul_flops(*expert) == gm.matmul_flops(*gemms["gate/up proj"])


def test_a_cpu_pass_without_budget_measures_bandwidth_and_each_dtypes_smallest_matmul(tmp_path, capsys):
    out = tmp_path / "mb.json"
    assert gm.main(["--device", "cpu", "--size", "tiny", "--budget-s", "0", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for row in result["bandwidth"]:
        assert row["bytes"] == {"copy": 2, "add": 3}[row["op"]] * row["buffer_bytes"]
        assert row["gb_s"] == pytest.approx(row["bytes"] / row["seconds"] / 1e9)
    smallest = min(gm.matmul_flops(*g[1:]) for g in gm.repo_gemms("tiny"))
    for dtype in gm.DTYPES:
        rows = [r for r in result["matmul"] if r["dtype"] == dtype]
        first, rest = rows[0], rows[1:]
        assert first["flops"] == smallest
        if dtype == "tf32":                                   # the CPU has none
            assert all(r["status"].startswith("unsupported") for r in rows)
        else:                                                 # measured; the others past the budget
            assert first["status"] == "ok"
            assert first["tflops"] == pytest.approx(first["flops"] / first["seconds"] / 1e12)
            assert rest and all(r["status"].startswith("skipped") for r in rest), dtype
    printed = capsys.readouterr().out
    assert "| memory op |" in printed and "| fp32 | tf32 | bf16 | fp16 | fp8 |" in printed


def test_a_timed_matmul_and_a_refused_dtype():
    cpu = torch.device("cpu")
    assert gm.time_matmul("bf16", 16, 16, 16, cpu, 0.001) > 0
    with pytest.raises(RuntimeError, match="no tf32 on cpu"):
        gm.time_matmul("tf32", 16, 16, 16, cpu, 0.001)


def test_a_device_it_does_not_have_is_one_line(capsys):
    assert gm.main(["--device", "tpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: gpu_microbench.py: --device tpu") and err.count("\n") == 1
