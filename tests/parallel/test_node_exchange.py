"""The hierarchical expert exchange (``model/moe/node_exchange.py``) on 4 gloo ranks as 2 "nodes"
of 2 (``build_groups(ep=4, node_size=2)``), against the flat all-to-all at EP4, one spawn:

* the same model from the same init: loss and every gradient equal to the flat exchange's,
  relative 1e-6 (the per-token sums are taken per node first, another order of fp32 additions);
  with a capacity factor (dropped rows) too;
* the bytes sent to the other node, counted around ``all_to_all_single`` on every rank, forward
  and backward, summed over the ranks: the flat exchange's are 4 x (kept rows whose expert is on
  the other node) x H fp32 (dispatch and combine, each way); the hierarchical one's are, per
  (token, other node) pair used, H + k fp32 out and H fp32 back, the same in backward, and k
  int64 codes, as the module docstring says; both within 64 bytes per layer and rank of count
  tables. And fewer in total.
"""

import torch
import torch.distributed as dist

from model import MixtralConfig, Transformer
from model.config import MoEConfig
from model.moe import dispatcher
from model.parallel.groups import build_groups
from training.run.spawn import run_ranks

H, K, E, LAYERS = 32, 2, 8, 2
SIZES = dict(vocab_size=64, hidden_size=H, num_layers=LAYERS, num_heads=4, num_kv_heads=2,
             ffn_hidden_size=48, max_seq_len=16, init_std=0.2, tie_embeddings=False)


def _counting(me: int):
    """Wrap all_to_all_single: bytes this rank sends to ranks of the other node (2 per node)."""
    sent, real = [0], dist.all_to_all_single

    def counted(out, inp, out_splits=None, in_splits=None, group=None, **kw):
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(4))
        rows = in_splits if in_splits is not None else [inp.shape[0] // len(ranks)] * len(ranks)
        row_bytes = inp[0].numel() * inp.element_size() if inp.shape[0] else 0
        sent[0] += sum(n * row_bytes for n, r in zip(rows, ranks) if r // 2 != me // 2)
        return real(out, inp, out_splits, in_splits, group=group, **kw)
    dist.all_to_all_single = counted
    return sent, real


def _run(cfg, groups, ids, me):
    plans, plan_dispatch = [], dispatcher.plan_dispatch
    dispatcher.plan_dispatch = lambda *a, **k: plans.append(plan_dispatch(*a, **k)) or plans[-1]
    sent, real = _counting(me)
    try:
        model = Transformer(cfg, groups, init_seed=0).train()
        out = model(ids, ids)
        loss = out.ce_sum / 100 + model.router_loss(out)
        loss.backward()
    finally:
        dispatcher.plan_dispatch, dist.all_to_all_single = plan_dispatch, real
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, sent[0], plans


def _remote(plans, me):
    """(kept rows to the other node, (token, other node) pairs) of this rank, over the layers."""
    rows = pairs = 0
    e_local = E // 4
    for plan in plans:
        n = int(plan.kept_per_expert.sum())
        position = torch.repeat_interleave(torch.arange(E), plan.kept_per_expert)
        node = position // e_local // 2
        remote = node != me // 2
        rows += int(remote.sum())
        pairs += len({(int(t), int(b)) for t, b in zip(plan.token_idx[:n][remote], node[remote])})
    return rows, pairs


def _checks(rank, world):
    flat, nodes = build_groups(ep=4), build_groups(ep=4, node_size=2)
    assert nodes.ep_per_node == 2 and dist.get_process_group_ranks(nodes.ep_cross_group) == [rank % 2, rank % 2 + 2]
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(11))  # ep splits it
    for capacity in (None, 1.0):
        moe = MoEConfig(num_experts=E, top_k=K, router_jitter=0.0, capacity_factor=capacity,
                        eval_capacity_factor=capacity)
        cfg = MixtralConfig(**SIZES, moe=moe).validate()
        loss_f, grads_f, bytes_f, plans = _run(cfg, flat, ids, rank)
        loss_h, grads_h, bytes_h, _ = _run(cfg, nodes, ids, rank)
        torch.testing.assert_close(loss_h, loss_f, rtol=1e-6, atol=0)
        for n, g in grads_f.items():
            torch.testing.assert_close(grads_h[n], g, rtol=1e-6, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")
        # Over the job: a rank's way back carries what the others sent it.
        total = torch.tensor([*_remote(plans, rank), bytes_f, bytes_h], dtype=torch.float64)
        dist.all_reduce(total)
        rows, pairs, bytes_f, bytes_h = (int(v) for v in total.tolist())
        assert 0 < pairs < rows, (rows, pairs)
        assert 0 <= bytes_f - 4 * rows * H * 4 <= 64 * LAYERS * world, (bytes_f, rows)
        expected = pairs * (2 * (H + K) * 4 + 2 * H * 4 + K * 8)
        assert 0 <= bytes_h - expected <= 64 * LAYERS * world, (bytes_h, expected, pairs)
        assert bytes_h < bytes_f
        if capacity is None and rank == 0:
            tokens = ids.numel() * LAYERS                   # each ep rank routes a quarter
            print(f"{rows} rows and {pairs} (token, node) pairs cross nodes over {tokens} token-layers "
                  f"({rows / tokens:.3f} and {pairs / tokens:.3f} per token); bytes across, forward "
                  f"and backward: flat {bytes_f}, hierarchical {bytes_h} ({bytes_h / bytes_f:.3f})")


def test_hierarchical_exchange_equals_the_flat_one_and_sends_less():
    run_ranks(_checks, 4, timeout=180)
