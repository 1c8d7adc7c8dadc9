"""Global-batch load balancing (``model.moe.balance_over: global_batch``): on 2 data-parallel
gloo ranks whose micro-batches route differently, each rank's loss uses the routed counts of
both ranks' micro-batches (their mean), with this rank's mean probabilities; the default uses
its own counts only. Checked against the counts gathered by hand, at the float32 rounding of
the same few sums (1e-6 relative)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from model.config import MoEConfig
from model.moe.layer import MoELayer, load_balancing_losses, start_balance_step
from model.parallel.groups import ParallelGroups
from training.run.spawn import run_ranks

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
    counts = [torch.zeros_like(aux.routed_per_expert) for _ in range(world)]
    dist.all_gather(counts, aux.routed_per_expert)
    assert not torch.equal(counts[0], counts[1]), counts             # the test means something
    mean = torch.stack(counts).float().mean(0)
    torch.testing.assert_close(global_, aux.balance_scale * (mean * aux.mean_prob).sum(),
                               rtol=1e-6, atol=0)
    torch.testing.assert_close(local, aux.balance_scale * (aux.routed_per_expert.float()
                                                           * aux.mean_prob).sum(), rtol=1e-6, atol=0)
    assert not torch.allclose(local, global_)
    global_.backward()                                     # the gradient flows through the probs
    assert layer.gate.weight.grad is not None and layer.gate.weight.grad.abs().sum() > 0


def test_global_batch_balance_uses_every_data_parallel_ranks_counts():
    run_ranks(_check, 2)


def _check_accumulation(rank: int, world: int) -> None:
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(num_experts=4, top_k=2, balance_over="global_batch"), H, I)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.5)
    groups = ParallelGroups(dp=world, dp_rank=rank, batch_group=dist.group.WORLD)
    torch.manual_seed(200 + rank)
    xs = [torch.randn(2, 6, H) * (1 + 2 * m + 3 * rank) for m in range(2)]

    def step() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        start_balance_step(layer)
        losses, counts = [], []
        for x in xs:                                        # two accumulation micro-batches
            _, aux = layer(x)
            losses.append(load_balancing_losses([aux], groups, global_batch=True)[0])
            gathered = [torch.zeros_like(aux.routed_per_expert) for _ in range(world)]
            dist.all_gather(gathered, aux.routed_per_expert)
            counts.append((torch.stack(gathered).float().mean(0), aux))
        return losses, counts

    losses, counts = step()
    assert not torch.equal(counts[0][0], counts[1][0]), counts       # the micro-batches differ
    running = (counts[0][0] + counts[1][0]) / 2             # every rank's, both micro-batches
    for loss, mean, (_, aux) in zip(losses, [counts[0][0], running], counts):
        torch.testing.assert_close(loss, aux.balance_scale * (mean * aux.mean_prob).sum(),
                                   rtol=1e-6, atol=0)
    assert not torch.allclose(losses[1], counts[1][1].balance_scale
                              * (counts[1][0] * counts[1][1].mean_prob).sum())
    again, _ = step()                                       # a new step starts from zero counts
    torch.testing.assert_close(torch.stack(again), torch.stack(losses), rtol=0, atol=0)
    layer.eval()                                            # evaluation adds nothing to the step
    start_balance_step(layer)
    with torch.no_grad():
        _, aux = layer(xs[0])
    assert aux.step_counts is None and layer.step_counts.micro_batches == 0


def test_global_batch_balance_averages_the_steps_micro_batches_so_far():
    """Across accumulation: micro-batch m's loss uses the mean of both ranks' counts over
    micro-batches 1..m (Megatron's running global aux loss); ``start_balance_step`` resets it
    (so a repeated step gives bitwise the same losses) and evaluation does not count."""
    run_ranks(_check_accumulation, 2)


def test_the_trainer_resets_the_running_counts_every_optimizer_step():
    """Through the real engine and ``Stepper`` (2 accumulation steps, 3 optimizer steps): every
    MoE layer's window holds exactly the step's 2 micro-batches after each step, never more."""
    out = subprocess.run([sys.executable, str(Path(__file__).parent / "_balance_step_run.py")],
                         cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stdout[-2000:] + out.stderr[-3000:]
    windows = json.loads(lines[-1].removeprefix("RESULT "))
    assert len(windows) == 3 and all(w == [2, 2] for w in windows), windows
