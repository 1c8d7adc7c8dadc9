"""The MoE feed-forward layer: route -> permute -> (exchange) -> grouped experts -> (exchange back)
-> unpermute.

Every step of the routing decision is visible in ``forward``; the pieces live in ``router.py``,
``dispatcher.py``, ``experts.py`` and ``losses.py``. Under expert parallelism the exchange is the
MegaBlocks/Megatron one, narrated in ``_exchange``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.utils.checkpoint

from model.moe.config import MoEConfig
from model.moe import dispatcher, losses, node_exchange
from model.moe.experts import GroupedExperts
from model.moe.router import Routing, TopKRouter
from model.moe.shared import SharedExpertGate, SharedExperts
from model.parallel import comm
from model.parallel.cp_layout import from_cp_order, positions_for_cp
from model.parallel.groups import ParallelGroups, local_experts
from model.parallel.layers import enter_tp_region, leave_tp_region


@dataclass
class MoEAux:
    """Auxiliary outputs of one MoE layer (losses unweighted; the model applies coefficients).

    Every field is this rank's contribution: under expert and context parallelism, where each
    rank routes its own slice of the micro-batch (rows over ep, sequence chunks over cp), summing
    a field over the ep x cp group gives the value over the whole micro-batch (with one rank it
    is that value). The load-balancing loss needs the routed
    counts of the whole micro-batch, so it is not a field: ``load_balancing_losses`` computes it
    for all MoE layers at once, after the forward, with one all-reduce of their counts.
    """

    mean_prob: torch.Tensor           # (E,) this rank's share of the mean router probability
    balance_scale: float              # E / (k*T), T the micro-batch's tokens
    z_loss: torch.Tensor              # scalar
    routed_per_expert: torch.Tensor   # (E,) routed assignments before capacity, this rank's tokens
    dropped_frac: torch.Tensor        # scalar, dropped assignments / (k*T)
    entropy: torch.Tensor             # scalar, mean router entropy in nats
    # Router logit size (the growth the z-loss checks, ST-MoE): this rank's largest logit and
    # its share of the mean log-sum-exp over tokens, both weighted by its share of tokens
    logit_max: torch.Tensor | None = None
    logit_lse: torch.Tensor | None = None
    step_counts: "StepCounts | None" = None   # the layer's running counts (global-batch, training)

    @property
    def load_max_over_mean(self) -> torch.Tensor:
        counts = self.routed_per_expert.float()
        return counts.max() / counts.mean().clamp_min(1e-9)


class StepCounts:
    """One MoE layer's routed counts over the optimizer step so far, for global-batch balancing
    (``MoEConfig.balance_over``): each micro-batch adds its counts (already summed over the batch
    group), and its loss uses the mean over the step's micro-batches up to and including itself
    (Megatron's global aux loss). Device tensors only; ``start_balance_step`` resets it."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None
        self.micro_batches = 0

    def add(self, counts: torch.Tensor) -> torch.Tensor:
        """(E,) this micro-batch's counts -> (E,) the mean over the step's micro-batches so far."""
        self.total = counts if self.total is None else self.total + counts
        self.micro_batches += 1
        return self.total / self.micro_batches


def set_shared_expert_overlap(model: nn.Module, on: bool) -> None:
    """Compute every MoE layer's shared experts while its dispatch all-to-all is in flight (under
    expert parallelism; ``MoELayer.overlap_shared_experts``)."""
    for module in model.modules():
        if isinstance(module, MoELayer):
            module.overlap_shared_experts = on


def start_balance_step(model: nn.Module) -> None:
    """Forget the previous optimizer step's routed counts (call before a step's first forward)."""
    for module in model.modules():
        if isinstance(module, MoELayer):
            module.step_counts = StepCounts()


@dataclass
class _Splits:
    """The expert-parallel exchange's sizes: host lists, and the (ep, E_local) received counts."""

    in_splits: list[int]       # rows sent to each rank
    out_splits: list[int]      # rows received from each rank
    recv: torch.Tensor         # (ep, E_local) rows received per (source, local expert)
    expert_sizes: list[int]    # rows received per local expert

    @property
    def num_send(self) -> int:
        return sum(self.in_splits)


class MoELayer(nn.Module):
    """Mixture-of-experts SwiGLU FFN (Switch, Mixtral or DeepSeek-V3 routing, chosen by ``moe``),
    with optional shared experts added to the routed output.

    Args:
        moe: routing settings (experts, top-k, scores, groups, bias, capacity, jitter,
            renormalization, scaling, shared experts).
        hidden_size: H.
        ffn_hidden_size: I, inner size of each expert.
        groups: process groups; experts are split over ep and their inner size over tp.
    """

    def __init__(self, moe: MoEConfig, hidden_size: int, ffn_hidden_size: int, groups=None):
        super().__init__()
        self.moe = moe
        self.groups = groups or ParallelGroups()
        self.gate = TopKRouter(hidden_size, moe, groups)
        self.experts = GroupedExperts(moe.num_experts, hidden_size, ffn_hidden_size, groups)
        shared = moe.shared_ffn_size(ffn_hidden_size)
        # Shared experts (always on) and their optional per-token gate: see ``shared.py``.
        self.shared_experts = SharedExperts(hidden_size, shared, groups) if shared else None
        self.shared_expert_gate = (SharedExpertGate(hidden_size, groups)
                                   if shared and moe.shared_expert_gate else None)
        # Experts in rank order: rank 0's local experts, then rank 1's, ... Sorting the rows by
        # this order makes each destination rank's rows one contiguous block.
        ep = self.groups.ep
        order = [e for r in range(ep) for e in local_experts(moe.num_experts, _at_rank(self.groups, r))]
        position = torch.empty(moe.num_experts, dtype=torch.long)
        position[torch.tensor(order)] = torch.arange(moe.num_experts)
        self.register_buffer("expert_position", position, persistent=False)
        self.register_buffer("expert_order", torch.tensor(order), persistent=False)
        # Activation checkpointing of the expert FFNs only (``experts`` policy): backward
        # recomputes the grouped GEMMs between the exchanges, not the routing or the exchanges.
        self.checkpoint_experts = False
        # Shared experts computed while the dispatch all-to-all is in flight (Megatron's
        # ``moe_shared_expert_overlap``; recipe key ``parallel.shared_expert_overlap``): the same
        # operations on the same values as the sequential path, in another order.
        self.overlap_shared_experts = False
        self.step_counts = StepCounts()     # global-batch balancing's running counts (not state)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, MoEAux]:
        """(B, S, H) -> (B, S, H) and the layer's auxiliary outputs (S/tp under sequence
        parallelism)."""
        g, moe, ep = self.groups, self.moe, self.groups.ep
        tp_group = g.tp_group
        # Under tp the experts see this rank's slice of their inner dim: bring the T tokens in
        # (replicated, or gathered from sequence shards) and sum the T combined tokens out (not
        # the k*T rows). The combine weights then multiply partial outputs, so their (T, k)
        # gradient is summed over tp too. Routing is replicated over tp: every tp rank routes
        # the same T tokens the same way (with the same jitter noise: see ``TopKRouter``).
        if g.sequence_parallel:
            x = enter_tp_region(x, g)                                       # (B, S, H) gathered
            # The gathered x's gradient is summed over tp by the reduce-scatter; the router's
            # share is the same on every tp rank, so count it once.
            router_in = comm.grad_counted_once(x, tp_group)
        else:
            router_in, x = x, comm.copy_to_region(x, tp_group)
        shape = x.shape
        x, router_in = x.reshape(-1, shape[-1]), router_in.reshape(-1, shape[-1])   # (T, H)
        num_tokens = x.shape[0]
        total_tokens = num_tokens * ep * g.cp        # the micro-batch's T (split over ep x cp)
        # Jitter noise per micro-batch sample (this ep rank's come after the lower ranks'; a cp
        # rank's are its chunks of them), so that every tp/ep/sp/cp layout draws the unsharded
        # model's noise (see ``jitter_noise``).
        routing = Routing(*self.gate(router_in, first_sample=g.ep_rank * shape[0],
                                     num_samples=shape[0]))
        # Per ep rank, pre-exchange, over its samples' whole sequences (cp ranks: see _cp_capacity).
        capacity = moe.capacity(num_tokens * g.cp, self.training)
        # Plan in rank order of experts (the identity without expert parallelism).
        ranked = self.expert_position[routing.expert_idx]                   # (T, k)
        if capacity is not None and g.cp > 1:
            capacity = self._cp_capacity(ranked, shape[0], capacity)       # (E,) this rank's slots
        plan = dispatcher.plan_dispatch(ranked, moe.num_experts, capacity)
        weights = comm.copy_to_region(routing.weights, tp_group)            # (T, k)
        shared = None
        if ep > 1 and g.ep_cross_group is not None:                         # across nodes, deduplicated
            out = self._routed_over_nodes(x, weights, plan)                 # (T, H) partial over tp
        elif ep > 1:
            overlapped = self._shared if self.overlap_shared_experts else None
            out, shared = self._routed_over_ep(x, weights, plan, overlapped, router_in)
        else:
            rows = dispatcher.permute(x, plan)                              # (k*T, H) dropped last
            y = self._experts(rows, plan.kept_per_expert)                 # (k*T, H) partial
            out = dispatcher.unpermute(y, weights, plan, num_tokens)        # (T, H) partial over tp
        if self.shared_experts is not None:                                 # summed over tp with out
            out = out + (shared if shared is not None else self._shared(x, router_in))
        out = leave_tp_region(out.reshape(shape), g)                        # summed over tp

        routed = plan.routed_per_expert[self.expert_position]               # (E,) by expert id
        aux = MoEAux(
            mean_prob=routing.probs.sum(dim=0) / total_tokens,
            balance_scale=moe.num_experts / (moe.top_k * total_tokens),
            z_loss=losses.router_z_loss(routing.logits, total_tokens),
            routed_per_expert=routed.detach(),
            dropped_frac=(plan.num_dropped.float() / (moe.top_k * total_tokens)).detach(),
            entropy=(losses.router_entropy(routing.probs) * num_tokens / total_tokens).detach(),
            logit_max=(routing.logits.detach().max().float() * num_tokens / total_tokens),
            logit_lse=(torch.logsumexp(routing.logits.detach().float(), dim=-1).sum() / total_tokens),
            step_counts=self.step_counts if moe.global_balance and self.training else None)
        return out, aux

    # Eager also inside a compiled block: a collective of the cp group (cp with a capacity only).
    @torch.compiler.disable
    def _cp_capacity(self, ranked: torch.Tensor, num_samples: int, capacity: int) -> torch.Tensor:
        """Under context parallelism with a capacity factor: (E,) how many of this rank's
        assignments to each expert (rank order) the single process keeps, so that a token is
        dropped exactly when it is dropped with the whole sequences on one rank.

        The single process keeps, per expert, the first ``capacity`` assignments in priority
        order (slot, then sample, then position: ``dispatcher.plan_dispatch``), ``capacity``
        counted on the ep rank's whole sequences. The cp ranks' choices, (B, S/cp, k) each, are
        all-gathered over the cp group (k x B x S/cp int64 from each rank, no gradient) and put back in
        window order (``from_cp_order``); the whole plan's kept assignments that are this rank's
        are counted per expert. A rank's tokens keep their window order, so the kept ones of an
        expert are the first of this rank's own in its plan: ``plan_dispatch`` with these
        per-expert slots drops exactly the tokens the single process drops. Cost per MoE layer
        call: one all-gather of the choices and a k x B x S sort (the single process's plan).
        """
        g, E = self.groups, self.moe.num_experts
        T, k = ranked.shape
        local = T // num_samples                                            # S/cp
        window = from_cp_order(comm.gather_dim(ranked.view(num_samples, local, k), 1, g.cp_group),
                               g.cp, 1)                                     # (B, S, k)
        S = window.shape[1]
        mine = torch.zeros(S, dtype=torch.bool, device=ranked.device)
        mine[positions_for_cp(S, g.cp, g.cp_rank, ranked.device)] = True
        mine = mine.expand(num_samples, S).reshape(-1)                      # (B*S,) by token
        whole = dispatcher.plan_dispatch(window.reshape(-1, k), E, capacity)
        # The whole plan's kept rows (its first ones) that are this rank's, counted per expert.
        kept = whole.row_kept & mine[whole.token_idx]                       # (k*B*S,)
        expert = window.reshape(-1, k)[whole.token_idx, whole.slot_idx]    # (k*B*S,) rank order
        return torch.zeros(E, dtype=torch.long, device=ranked.device).scatter_add_(0, expert, kept.long())

    def _shared(self, x: torch.Tensor, router_in: torch.Tensor) -> torch.Tensor:
        """(T, H) -> (T, H) the shared experts' output, partial over tp, times their gate."""
        shared = self.shared_experts(x)
        if self.shared_expert_gate is not None:
            shared = shared * self.shared_expert_gate(router_in)           # (T, 1) gate
        return shared

    def _experts(self, rows: torch.Tensor, per_expert: torch.Tensor,
                 sizes: list[int] | None = None) -> torch.Tensor:
        if self.checkpoint_experts and self.training:
            return torch.utils.checkpoint.checkpoint(self.experts, rows, per_expert, sizes,
                                                     use_reentrant=False)
        return self.experts(rows, per_expert, sizes)

    # Eager also inside a compiled block (``train.compile``), a graph break at ep > 1 only: the
    # uneven all-to-all needs its split sizes on the host, and the N kept rows it moves are a
    # data-dependent size, which would recompile the graph for every new N. Its result, (T, H),
    # has the static shape the compiled rest of the block continues from.
    @torch.compiler.disable
    def _routed_over_ep(self, x: torch.Tensor, weights: torch.Tensor, plan: dispatcher.DispatchPlan,
                        overlapped=None, router_in: torch.Tensor | None = None):
        """(T, H) tokens -> (T, H) combined expert outputs, through the exchange (``_exchange``),
        and ``overlapped(x, router_in)`` computed while the dispatch is in flight (None without)."""
        splits = self._exchange_counts(plan.kept_per_expert)              # the one host copy
        rows = dispatcher.permute(x, plan, splits.num_send)                 # (N, H) kept rows
        y, during = self._exchange(rows, splits, overlapped and (lambda: overlapped(x, router_in)))
        return dispatcher.unpermute(y, weights, plan, x.shape[0]), during   # (T, H)

    @torch.compiler.disable
    def _routed_over_nodes(self, x: torch.Tensor, weights: torch.Tensor,
                           plan: dispatcher.DispatchPlan) -> torch.Tensor:
        """(T, H) tokens -> (T, H) combined expert outputs, each token crossing the network once
        per destination node (``model/moe/node_exchange.py``)."""
        return node_exchange.routed_over_nodes(self, x, weights, plan)

    def exchange_over(self, rows: torch.Tensor, per_expert: torch.Tensor, group, size: int) -> torch.Tensor:
        """The flat exchange of ``rows`` (grouped by destination rank and local expert,
        ``per_expert`` (size x E_local,) of them each) over ``group`` of ``size`` ranks holding
        this layer's experts in order: the local experts' outputs, back in ``rows``' order."""
        y, _ = self._exchange(rows, self._exchange_counts(per_expert, group, size), None, group, size)
        return y

    def _exchange_counts(self, per_expert: torch.Tensor, group=None, size: int | None = None) -> _Splits:
        """Steps 1-2 of the exchange (see ``_exchange``): the counts, and the split sizes on the
        host, which the uneven all-to-all needs there: send and receive tables come over in one
        device-to-host copy, the layer's only one. Over the ep group unless ``group`` (of
        ``size`` ranks) is given."""
        g, e_local = self.groups, self.experts.num_experts
        group, size = (g.ep_group, g.ep) if size is None else (group, size)
        send = per_expert.view(size, e_local)                               # (ep, E_local)
        recv = comm.all_to_all_counts(send, group)                          # (ep, E_local)
        send_host, recv_host = torch.stack((send, recv)).tolist()           # (2, ep, E_local)
        return _Splits(in_splits=[sum(row) for row in send_host],
                       out_splits=[sum(row) for row in recv_host], recv=recv,
                       expert_sizes=[sum(col) for col in zip(*recv_host)])

    def _exchange(self, rows: torch.Tensor, s: _Splits, during=None, group=None,
                  size: int | None = None) -> tuple[torch.Tensor, object]:
        """Send each row to the rank holding its expert, run the local experts, send back; and
        ``during()``, when given, run while the rows travel (its result is returned beside the
        outputs; backward overlaps its gradient with the reversed exchange the same way).

        1. (``_exchange_counts``, before the rows are permuted) ``per_expert`` (E,) counts this
           rank's kept rows per expert, in rank order; viewed as (ep, E_local), row j is what
           goes to rank j. Exchange the counts (all-to-all), so each rank knows how many rows it
           receives from each source for each of its experts; copy both tables to the host.
        2. Exchange the rows (uneven splits).
        3. Received rows are grouped by (source, local expert); a stable sort by local expert
           makes each expert's rows contiguous for the grouped GEMM (local, no communication).
        4. Undo the sort and the exchange for the outputs.
        """
        g, e_local = self.groups, self.experts.num_experts
        group, size = (g.ep_group, g.ep) if size is None else (group, size)
        wire = self.moe.dispatch_dtype
        if during is None:
            received, done = comm.all_to_all(rows, s.out_splits, s.in_splits, group, wire), None
        else:
            token, pending = comm.all_to_all_start(rows, s.out_splits, s.in_splits, group, wire)
            done = during()                                                 # while rows travel
            received = comm.all_to_all_wait(token, pending)                 # (N_recv, H)
        local_id = torch.arange(e_local, device=rows.device).repeat(size)   # (ep*E_local,)
        row_expert = torch.repeat_interleave(local_id, s.recv.flatten(),
                                             output_size=received.shape[0])  # (N_recv,)
        order = torch.argsort(row_expert, stable=True)
        y = self._experts(received.index_select(0, order), s.recv.sum(0), s.expert_sizes)
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(),
                                                                          device=order.device))
        y = y.index_select(0, inverse)                                      # back to source order
        combine = "bf16" if wire else None                                  # fp8 dispatches only
        return comm.all_to_all(y, s.in_splits, s.out_splits, group, combine), done   # (N, H)


def load_balancing_losses(auxes: list[MoEAux], groups: ParallelGroups | None = None,
                          global_batch: bool = False) -> torch.Tensor:
    """(L,) this rank's share of each MoE layer's load-balancing loss (``losses.
    load_balancing_loss``), summing over the ep x cp group to the micro-batch's loss.

    The loss weighs each expert's mean probability by its routed count over the whole
    micro-batch. The counts carry no gradient, so the layers' counts are summed over the ep x cp group
    here, after the forward, in one all-reduce per micro-batch rather than one per layer (and
    none is repeated when backward recomputes a checkpointed layer). With ``global_batch``
    (``MoEConfig.balance_over``) the same one all-reduce runs over the batch group (dp x ep) and
    the sum is divided by dp; in training each layer's ``StepCounts`` then averages that over
    the step's micro-batches so far. Each expert's share is then the one of every data-parallel
    rank's micro-batches of the optimizer step up to this one (Qwen's global-batch balancing,
    Megatron's running form across accumulation), which lets a micro-batch be unbalanced where
    the step is not.
    """
    groups = groups or ParallelGroups()
    group, replicas = (groups.batch_group, groups.dp) if global_batch else (groups.ep_cp_group, 1)
    counts = torch.stack([a.routed_per_expert for a in auxes])              # (L, E) this rank's
    counts = comm.all_reduce_sum(counts, group).to(auxes[0].mean_prob.dtype) / replicas
    if global_batch:
        counts = torch.stack([c if a.step_counts is None else a.step_counts.add(c)
                              for a, c in zip(auxes, counts)])
    return torch.stack([a.balance_scale * (c * a.mean_prob).sum() for a, c in zip(auxes, counts)])


def _at_rank(groups: ParallelGroups, ep_rank: int) -> ParallelGroups:
    """The same layout seen from another ep rank (for the expert placement table)."""
    return ParallelGroups(ep=groups.ep, ep_rank=ep_rank, expert_placement=groups.expert_placement)
