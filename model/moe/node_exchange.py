"""The expert exchange with each token sent across the network once per destination node
(DeepEP's node-level deduplication; Tutel's 2DH splits the exchange the same way, in two stages,
one across nodes and one inside them).

The flat exchange (``MoELayer._exchange``) sends each kept (token, slot) row to the rank holding
its expert: a token whose k experts sit on two ranks of the same remote node crosses the network
twice. Here, on ep rank (node a, place l) with ``ep_per_node`` L ranks per node:

1. **Deduplicate**: one row per (token, destination node b) that the token uses, with a k-wide
   payload beside it: the combine weights of the slots whose experts are on b (0 elsewhere), and
   where each goes (place and local expert on b, or -1).
2. **Across nodes**: all-to-all over the ranks at place l of every node (``ep_cross_group``), so
   each row crosses the network once, to rank (b, l).
3. **Inside the node**: rank (b, l) expands each row to its (row, slot) pairs and runs the flat
   exchange over its node's ep ranks (``ep_node_group``): the pairs go to the ranks holding their
   experts, the experts run, the outputs come back (NVLink on a GPU node).
4. **Combine on the node**: rank (b, l) sums each row's slot outputs times their weights, so the
   way back also crosses the network once per (token, node), then the source adds its nodes'
   sums per token.

Equal to the flat exchange up to the order of the sums (each token's slot outputs are added per
node first): outputs and gradients agree to fp32 rounding (``tests/parallel/test_node_exchange.py``).
Bytes across nodes, per token, with E experts spread evenly over N nodes and k distinct experts
chosen uniformly: the flat exchange sends k (N - 1) / N rows each way; this one sends
(N - 1) (1 - C(E - E/N, k) / C(E, k)) rows each way (one per remote node that holds at least one
of its experts), each with k numbers more on the way out. ``docs/communication.md`` works it out.

Hand-written because no library here does it: DeepEP's kernels are CUDA with NVSHMEM, Tutel's
2DH is CUDA too, and neither deduplicates through ``torch.distributed`` collectives.
"""

from __future__ import annotations

import torch

from model.moe import dispatcher
from model.parallel import comm


def routed_over_nodes(layer, x: torch.Tensor, weights: torch.Tensor,
                      plan: dispatcher.DispatchPlan) -> torch.Tensor:
    """(T, H) tokens -> (T, H) combined expert outputs of ``layer`` (a ``MoELayer``), partial
    over tp as the flat path's, through the two-stage exchange (see the module docstring)."""
    g, e_local = layer.groups, layer.experts.num_experts
    per_node, top_k = g.ep_per_node, weights.shape[1]
    num_tokens = x.shape[0]
    kept = plan.kept_per_expert.tolist()                                # (E,) host: the one copy here
    n = sum(kept)
    token, slot = plan.token_idx[:n], plan.slot_idx[:n]                 # (N,) kept rows
    position = torch.repeat_interleave(torch.arange(len(kept), device=x.device),
                                       plan.kept_per_expert, output_size=n)   # (N,) expert, rank order
    dest = position // e_local                                          # (N,) destination ep rank
    node, place = dest // per_node, dest % per_node
    code = place * e_local + position % e_local                         # where on the node
    # 1. One row per (token, node): pairs grouped by node (the cross group's rank order).
    pair_key, pair_of_row = torch.unique(node * num_tokens + token, return_inverse=True)   # (P,), (N,)
    pair_node, pair_token = pair_key // num_tokens, pair_key % num_tokens
    nodes = g.ep // per_node
    send = torch.zeros(nodes, dtype=torch.long, device=x.device).scatter_add_(
        0, pair_node, torch.ones_like(pair_node))                       # (nodes,) rows per node
    slot_weight = weights.index_select(0, token).gather(1, slot.unsqueeze(1)).squeeze(1)   # (N,)
    pair_weights = torch.zeros(pair_key.numel(), top_k, dtype=weights.dtype,
                               device=x.device).index_put((pair_of_row, slot), slot_weight)   # (P, k)
    pair_code = torch.full((pair_key.numel(), top_k), -1, dtype=torch.long,
                           device=x.device).index_put((pair_of_row, slot), code)          # (P, k)
    # 2. Across nodes: rows and their weights in one payload, the codes beside them.
    recv = comm.all_to_all_counts(send.view(nodes, 1), g.ep_cross_group).view(nodes)
    in_splits, out_splits = torch.stack((send, recv)).tolist()
    payload = torch.cat((x.index_select(0, pair_token), pair_weights.to(x.dtype)), dim=1)  # (P, H + k)
    got = comm.all_to_all(payload, out_splits, in_splits, g.ep_cross_group)               # (P', H + k)
    got_code = comm.all_to_all(pair_code, out_splits, in_splits, g.ep_cross_group)        # (P', k)
    rows, row_weights = got[:, :-top_k], got[:, -top_k:]
    # 3. Inside the node: each (row, slot) pair to the rank of its expert, by (place, expert).
    pair_row, pair_slot = (got_code >= 0).nonzero(as_tuple=True)        # (Q,), (Q,)
    pair_codes = got_code[pair_row, pair_slot]
    order = torch.argsort(pair_codes, stable=True)
    pair_row, pair_slot, pair_codes = pair_row[order], pair_slot[order], pair_codes[order]
    per_code = torch.zeros(per_node * e_local, dtype=torch.long, device=x.device).scatter_add_(
        0, pair_codes, torch.ones_like(pair_codes))                     # (L x E_local,)
    y = layer.exchange_over(rows.index_select(0, pair_row), per_code, g.ep_node_group, per_node)
    # 4. Combine on the node, back across once per (token, node), add per token.
    scaled = y * row_weights[pair_row, pair_slot].unsqueeze(1).to(y.dtype)
    combined = y.new_zeros(rows.shape[0], y.shape[1]).index_add_(0, pair_row, scaled)     # (P', H)
    back = comm.all_to_all(combined, in_splits, out_splits, g.ep_cross_group)             # (P, H)
    return back.new_zeros(num_tokens, back.shape[1]).index_add_(0, pair_token, back)
