"""The router-logit metrics (``router_logit_max``, ``router_lse``; docs/trainer.md) against the
router logits themselves: a tiny Mixtral's two micro-batches through ``StatsLayout`` on one
process give, per MoE layer, the largest logit of each micro-batch and the mean over tokens of
the logits' log-sum-exp, each averaged over the micro-batches; the row carries the largest
layer's maximum and the mean log-sum-exp over layers. Tolerance 1e-6 relative: fp32 logits
summed in float64."""

import torch

from model import MixtralConfig, Transformer
from model.config import MoEConfig
from training.step.stats import StatsLayout


def test_router_logit_metrics_match_the_logits():
    moe = MoEConfig(num_experts=4, top_k=2, router_jitter=0.0)
    cfg = MixtralConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                        ffn_hidden_size=48, max_seq_len=16, init_std=0.5, moe=moe).validate()
    model = Transformer(cfg, None, init_seed=0).train()
    logits = {i: [] for i in range(cfg.num_moe_layers)}
    gates = [b.mlp.gate for b in model.layers if b.is_moe]
    for j, gate in enumerate(gates):
        gate.register_forward_hook(lambda mod, args, out, j=j: logits[j].append(out[0].detach()))
    layout = StatsLayout(len(gates), moe.num_experts, bias=False)
    stats = layout.new("cpu")
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        ids = torch.randint(0, 64, (4, 16), generator=gen)
        out = model(ids, ids)
        layout.add_micro_batch(stats, out, out.ce_sum.detach(), gas=2)
    row, extra = layout.moe_metrics(stats.tolist(), dp=1, blocks=[0, 1])
    want_max = [sum(x.max().item() for x in logits[j]) / 2 for j in logits]
    want_lse = [sum(torch.logsumexp(x, -1).mean().item() for x in logits[j]) / 2 for j in logits]
    assert max(want_max) > 1.0                       # init_std 0.5: logits well away from 0
    for j, block in enumerate([0, 1]):
        assert abs(extra[f"moe/layer{block}/router_logit_max"] / want_max[j] - 1) < 1e-6
        assert abs(extra[f"moe/layer{block}/router_lse"] / want_lse[j] - 1) < 1e-6
    assert abs(row["router_logit_max"] / max(want_max) - 1) < 1e-6
    assert abs(row["router_lse"] / (sum(want_lse) / 2) - 1) < 1e-6
