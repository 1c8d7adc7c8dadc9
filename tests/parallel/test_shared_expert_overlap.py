"""Shared experts computed while the dispatch all-to-all is in flight
(``parallel.shared_expert_overlap``, ``model/moe/layer.py``) on 2 gloo ranks at EP2, one spawn:

* ``comm.all_to_all_start`` / ``all_to_all_wait`` equal ``comm.all_to_all`` in value and in
  gradient, for each wire format (as is, bf16, fp8): bitwise, the same bytes travel.
* A Qwen-style model (shared experts with their gate; tp1, ep2) gives the same loss and the
  same gradients with the overlap on and off. Tolerance 1e-6 (fp32): the same operations on the
  same values, only in another order; measured bitwise equal here.
"""

import torch
import torch.distributed as dist

from model import MixtralConfig, Transformer
from model.config import MoEConfig
from model.moe.layer import set_shared_expert_overlap
from model.parallel import comm
from model.parallel.groups import build_groups
from training.run.spawn import run_ranks

SIZES = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
             ffn_hidden_size=48, max_seq_len=16, init_std=0.2, tie_embeddings=False)


def _checks(rank, world):
    groups = build_groups(ep=2)
    gen = torch.Generator().manual_seed(rank)
    in_splits = [3, 5] if rank == 0 else [4, 2]
    out_splits = [3, 4] if rank == 0 else [5, 2]
    for wire in (None, "bf16", "fp8"):
        x = torch.randn(sum(in_splits), 8, generator=gen, requires_grad=True)
        w = torch.randn(sum(out_splits), 8, generator=gen)
        plain = comm.all_to_all(x, out_splits, in_splits, groups.ep_group, wire)
        (plain * w).sum().backward()
        grad, x.grad = x.grad.clone(), None
        token, pending = comm.all_to_all_start(x, out_splits, in_splits, groups.ep_group, wire)
        split = comm.all_to_all_wait(token, pending)
        (split * w).sum().backward()
        assert torch.equal(split, plain) and torch.equal(x.grad, grad), wire

    moe = MoEConfig(num_experts=4, top_k=2, router_jitter=0.0, capacity_factor=None,
                    eval_capacity_factor=None, num_shared_experts=1, shared_expert_gate=True)
    model = Transformer(MixtralConfig(**SIZES, moe=moe).validate(), groups, init_seed=0).train()
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(5 + rank))
    results, started, start = [], [], comm.all_to_all_start

    def counted_start(*args, **kwargs):
        started.append(on)
        return start(*args, **kwargs)
    comm.all_to_all_start = counted_start
    for on in (False, True):
        set_shared_expert_overlap(model, on)
        model.zero_grad(set_to_none=True)
        out = model(ids, ids)
        loss = out.ce_sum / 100 + model.router_loss(out)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    comm.all_to_all_start = start
    assert started == [True, True]              # one overlapped dispatch per MoE layer, when on
    (off_loss, off), (on_loss, on_) = results
    torch.testing.assert_close(on_loss, off_loss, rtol=1e-6, atol=1e-6)
    for n, g in off.items():
        torch.testing.assert_close(on_[n], g, rtol=1e-6, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    assert any("shared_experts" in n and g.abs().sum() > 0 for n, g in on_.items())
    dist.barrier()


def test_overlap_equals_the_sequential_exchange():
    run_ranks(_checks, 2, timeout=120)
