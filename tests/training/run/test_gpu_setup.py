"""What the trainer does on a GPU, checked on CPU with the CUDA calls recorded: the device is set
before any process group, TF32 follows ``train.tf32``, and the logged MFU in both attention
conventions. Plus the threaded weight draw (the GPU machine's many cores), which must give the
one-thread values bit for bit."""

from __future__ import annotations

import types

import pytest
import torch

from model import MixtralConfig
from model.parallel import draw
from model import flops
from training import gpus
from training.run import distributed
from training.config.recipe import load_recipe


class _Stop(Exception):
    pass


@pytest.mark.parametrize("tf32", [False, True])
def test_set_device_and_tf32_come_before_the_process_group(monkeypatch, tf32):
    import deepspeed
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(("set_device", i)))

    def init_distributed(**kwargs):
        calls.append(("init_distributed", torch.backends.cuda.matmul.allow_tf32))
        raise _Stop
    monkeypatch.setattr(deepspeed, "init_distributed", init_distributed)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "3")
    recipe = load_recipe("recipes/tiny_dense.yaml", [f"train.tf32={str(tf32).lower()}", "parallel.backend=gloo"])
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        with pytest.raises(_Stop):
            distributed.init_distributed(recipe)
        assert calls == [("set_device", 3), ("init_distributed", tf32)]
        assert torch.backends.cudnn.allow_tf32 is tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def test_mfu_and_mfu_full_attn(monkeypatch):
    """A known GPU's peak, 8 ranks: mfu counts causal attention at 6 L h s, mfu_full_attn at
    12 L h s; the two differ by exactly 6 L h s over the same peak."""
    cfg = MixtralConfig(vocab_size=512, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                        ffn_hidden_size=512, max_seq_len=128).validate()
    recipe = types.SimpleNamespace(seq_len=128)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3e9)
    ctx = types.SimpleNamespace(device=torch.device("cuda", 0), world_size=8,
                                gpu=gpus.detect_gpu("NVIDIA H200"))
    fpt = distributed.DistContext.flops_per_token(ctx, cfg, recipe)
    row = {"tokens_per_s": 8 * 1000.0}
    distributed.DistContext.add_gpu_metrics(ctx, row, fpt)
    peak = ctx.gpu.bf16_tflops * 1e12
    matmul = 6 * flops.matmul_params_per_token(cfg)
    assert row["mfu"] == pytest.approx(1000 * (matmul + 6 * 2 * 256 * 128) / peak, rel=1e-12)
    assert row["mfu_full_attn"] == pytest.approx(1000 * (matmul + 12 * 2 * 256 * 128) / peak, rel=1e-12)
    assert row["mem_gb"] == 3.0


def test_full_attention_reads_7_percent_higher_at_1p3b():
    """The figure docs/gpu-memory.md gives: dense_1p3b at sequence 2048, 8.508 vs 9.112 GFLOP."""
    cfg = load_recipe("recipes/dense_1p3b.yaml", []).model
    causal, full = (flops.train_flops_per_token(cfg, 2048, causal=c) for c in (True, False))
    assert round(causal / 1e9, 3) == 8.508 and round(full / 1e9, 3) == 9.112
    assert round(100 * (full / causal - 1), 1) == 7.1


def test_threaded_weight_draw_is_the_one_thread_draw(monkeypatch):
    blocks = {0: draw.block_length(384), 1: draw.block_length(320)}
    monkeypatch.setattr(draw, "_DRAW_THREADS", 1)
    one = draw.draw("w", (384, 320), 0.02, 7, blocks, [(0, list(range(64, 256)))])
    monkeypatch.setattr(draw, "_DRAW_THREADS", 4)
    monkeypatch.setattr(draw, "_THREADED_NUMEL", 1)
    many = draw.draw("w", (384, 320), 0.02, 7, blocks, [(0, list(range(64, 256)))])
    assert torch.equal(one, many) and one.shape == (192, 320)
