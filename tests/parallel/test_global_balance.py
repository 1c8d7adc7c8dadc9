"""Global-batch load balancing (``model.moe.balance_over: global_batch``): on 2 data-parallel
gloo ranks whose micro-batches route differently, each rank's loss uses the routed counts of
both ranks' micro-batches (their mean), with this rank's mean probabilities; the default uses
its own counts only. Checked against the counts gathered by hand, at the float32 rounding of
the same few sums (1e-6 relative)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from model.config import MoEConfig
from model.moe.layer import MoELayer, load_balancing_losses
from model.parallel.groups import ParallelGroups
from tests.distributed import run_ranks

H, I = 16, 32


def _check(rank: int, world: int) -> None:
    torch.manual_seed(0)                                   # the same layer on both ranks
    layer = MoELayer(MoEConfig(num_experts=4, top_k=2, balance_over="global_batch"), H, I)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.5)
    torch.manual_seed(100 + rank)                          # different tokens per rank
    x = torch.randn(2, 6, H) * (1 + 3 * rank)
    _, aux = layer(x)
    groups = ParallelGroups(dp=world, dp_rank=rank, batch_group=dist.group.WORLD)
    local = load_balancing_losses([aux], groups)[0]
    global_ = load_balancing_losses([aux], groups, global_batch=layer.moe.global_balance)[0]
    counts = [torch.zeros_like(aux.tokens_per_expert) for _ in range(world)]
    dist.all_gather(counts, aux.tokens_per_expert)
    assert not torch.equal(counts[0], counts[1]), counts             # the test means something
    mean = torch.stack(counts).float().mean(0)
    torch.testing.assert_close(global_, aux.balance_scale * (mean * aux.mean_prob).sum(),
                               rtol=1e-6, atol=0)
    torch.testing.assert_close(local, aux.balance_scale * (aux.tokens_per_expert.float()
                                                           * aux.mean_prob).sum(), rtol=1e-6, atol=0)
    assert not torch.allclose(local, global_)
    global_.backward()                                     # the gradient flows through the probs
    assert layer.gate.weight.grad is not None and layer.gate.weight.grad.abs().sum() > 0


def test_global_batch_balance_uses_every_data_parallel_ranks_counts():
    run_ranks(_check, 2)
