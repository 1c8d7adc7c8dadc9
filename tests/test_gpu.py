"""GPU-only checks (``pytest -m gpu``; skipped without CUDA): bf16 grouped GEMM on the device,
the model in bf16 against fp32, fp16 dynamic loss scaling in a real engine."""

import pytest
import torch

from model import MixtralConfig, Transformer
from model.moe.experts import _looped_mm, grouped_mm

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_grouped_mm_bf16_on_gpu_matches_the_loop():
    counts = torch.tensor([0, 64, 8, 0, 120], device="cuda")
    x = torch.randn(int(counts.sum()), 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(5, 256, 512, device="cuda", dtype=torch.bfloat16)
    # bf16 inputs, fp32 accumulation in both: differences are output roundings (2^-8 relative).
    torch.testing.assert_close(grouped_mm(x, w, counts), _looped_mm(x, w, counts), rtol=2e-2, atol=2e-1)


def test_mixtral_bf16_on_gpu_tracks_fp32():
    cfg = MixtralConfig(vocab_size=512, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                        ffn_hidden_size=512, max_seq_len=128).validate()
    model = Transformer(cfg).cuda()
    ids = torch.randint(0, 512, (2, 128), device="cuda")
    ref = model(ids, ids).loss
    with torch.autocast("cuda", dtype=torch.bfloat16):
        low = model(ids, ids).loss
    assert abs(low.item() - ref.item()) < 0.02 * ref.item()
