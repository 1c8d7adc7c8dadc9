"""Deferred weight gradients (``model/parallel/weight_grad.py``, the B / W split of ZB-H1)
against plain autograd, on 2 gloo ranks in one spawn, two micro-batches each:

* Qwen-style MoE (grouped-GEMM experts, shared experts with their gate) at tp2 with sequence
  parallelism: the column-parallel layers' W gathers the input shard again, and the norms'
  gradients (summed over tp by their hooks) stay in B;
* the same model at ep2: every non-expert weight is replicated over ep, so a deferred W must
  sum its gradient over ep by hand (``ReplicaGradSync.summed``), as the hook would have.

B runs each micro-batch's backward inside ``STORE.deferring()``: the loss, the input gradient
and every gradient outside the deferred sites are those of autograd, and the deferred sites
have no gradient until W (``run_oldest``, oldest first) adds them. After both W's every
gradient equals two plain backwards'. Tolerance 1e-6 (fp32): the same products, added to
``.grad`` in the same micro-batch order; measured bitwise equal here (torch 2.13 CPU).
"""

import torch
import torch.distributed as dist

from model import MixtralConfig, Transformer
from model.config import MoEConfig
from model.parallel.groups import build_groups
from model.parallel.weight_grad import STORE
from training.run.spawn import run_ranks

SIZES = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
             ffn_hidden_size=48, max_seq_len=16, init_std=0.2, tie_embeddings=False)
DEFERRED = ("q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_proj", "experts.up_proj",
            "experts.down_proj", "shared_experts.gate_proj", "shared_experts.up_proj",
            "shared_experts.down_proj", "lm_head")


def _grads(model, sync, batches, deferred: bool):
    model.zero_grad(set_to_none=True)
    STORE.configure(enabled=deferred, reduce=sync.summed)
    losses = []
    for ids in batches:
        with STORE.deferring() if deferred else torch.enable_grad():
            out = model(ids, ids)
            loss = out.ce_sum / 100 + model.router_loss(out)
            loss.backward()
        losses.append(loss.detach())
    if deferred:
        assert STORE.pending == 2
        held = [n for n, p in model.named_parameters() if p.grad is None]
        assert held and all(any(d in n for d in DEFERRED) for n in held), held
        assert not any("norm" in n or "embed" in n or "router" in n for n in held), held
        STORE.run_oldest()
        STORE.run_oldest()
        assert STORE.pending == 0
    STORE.configure(enabled=False)
    return losses, {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _checks(rank, world):
    moe = MoEConfig(num_experts=4, top_k=2, router_jitter=0.0, capacity_factor=None,
                    eval_capacity_factor=None, num_shared_experts=1, shared_expert_gate=True)
    for layout in (dict(tp=2, sequence_parallel=True), dict(ep=2)):
        groups = build_groups(**layout)
        model = Transformer(MixtralConfig(**SIZES, moe=moe).validate(), groups, init_seed=0).train()
        sync = model.grad_sync          # the model's own hooks (ReplicaGradSync)
        gen = torch.Generator().manual_seed(5 + (rank if "ep" in layout else 0))
        batches = [torch.randint(0, 64, (4, 16), generator=gen) for _ in range(2)]
        plain_losses, plain = _grads(model, sync, batches, deferred=False)
        losses, grads = _grads(model, sync, batches, deferred=True)
        assert losses == plain_losses, layout
        for n, g in plain.items():
            assert (g is None) == (grads[n] is None), (layout, n)
            if g is not None:
                torch.testing.assert_close(grads[n], g, rtol=1e-6, atol=1e-6,
                                           msg=lambda m, n=n: f"{layout} {n}: {m}")
        dist.barrier()


def test_deferred_weight_gradients_equal_autograd():
    run_ranks(_checks, 2, timeout=180)
