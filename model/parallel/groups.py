"""The process groups of one job, built once and passed explicitly (no module globals).

Rank layout, fastest-varying first (tensor-parallel peers are neighbours, so they share a node's
NVLink; pipeline stages are farthest apart). Whatever group spans more ranks than a node holds
crosses the network: with 8 GPUs per node and tp x ep = 8, the data-parallel reduction and the
pipeline's point-to-point traffic both do (docs/communication.md works it out per recipe)::

    rank = (((pp_rank * dp + dp_rank) * cp + cp_rank) * ep + ep_rank) * tp + tp_rank

Groups (each a set of ranks that differ only in the named coordinates):

    tp     tensor-parallel peers: shard attention heads, MLP and expert inner dims
    ep     expert-parallel peers: split each micro-batch between them and shard the experts
    cp     context-parallel peers: hold different tokens of the same sequences; only attention
           exchanges anything between them (``model/parallel/context.py``)
    mp     tp x ep, the "model-parallel" group DeepSpeed sees through ``mpu``
    dp     data-parallel peers: different samples, same shards (which samples a rank loads)
    dp_cp  dp x cp, DeepSpeed's "data-parallel" group: ZeRO shards and reduces over it
    ep_cp  ep x cp: the ranks that split one micro-batch's tokens (the router's statistics)
    batch  ep x cp x dp: every rank that sees different tokens (for loss and statistics sums)
    pp     pipeline stages

Sequence parallelism is not a group: with ``sequence_parallel`` the tp group also splits the
sequence between the tensor-parallel regions (``model/parallel/layers.py``); under context
parallelism it splits the rank's S/cp tokens.

Expert parallelism is folded into DeepSpeed's model-parallel group (docs/zero-and-fsdp.md
says why): experts are sharded across ``ep`` like tensor-parallel shards, every other
parameter is replicated across ``ep`` with its gradient summed there (``grad_sync.py``), and ZeRO
reduces/shards everything over ``dp_cp``. This works at every ZeRO stage with stacked expert
weights.

Context parallelism is folded into DeepSpeed's data-parallel group instead (Megatron's
``dp_cp`` group; docs/context-parallelism.md): every parameter, the experts included, is
replicated over cp, and the cp ranks' gradients are parts of one sum, exactly as the dp ranks'
are. So DeepSpeed averages over dp x cp (the loss is scaled by dp x cp, see
``training/step/stepper.py``) and ZeRO shards over it, while the data loader shards samples
over ``dp`` only: the cp ranks of one dp rank load the same samples and each keeps its slice
of every sequence. The replicated-parameter sums of ``grad_sync.py`` run over tp and ep only,
axes DeepSpeed never reduces over, so no gradient is summed twice. Expert exchanges stay
inside ``ep``: each rank routes its own tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from model.parallel.dims import ParallelDims


@dataclass
class ParallelGroups:
    """Coordinates and groups of this rank. ``None`` groups mean size 1 (no communication).

    It also serves as DeepSpeed's ``mpu`` (the ``get_*`` methods), where "model parallel" means
    tp x ep and "data parallel" means dp x cp.
    """

    tp: int = 1
    ep: int = 1
    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp_rank: int = 0
    ep_rank: int = 0
    dp_rank: int = 0
    pp_rank: int = 0
    cp_rank: int = 0
    tp_group: object = None
    ep_group: object = None
    cp_group: object = None
    mp_group: object = None
    dp_group: object = None
    dp_cp_group: object = None
    ep_cp_group: object = None
    batch_group: object = None
    pp_group: object = None
    expert_placement: str = "contiguous"
    sequence_parallel: bool = False   # Megatron SP: activations outside TP regions split by tp
    cp_comm: str = "a2a"              # context parallelism's attention exchange (parallel.cp_comm)
    # The hierarchical expert exchange (``model/moe/node_exchange.py``): ep ranks per node, the
    # ep ranks of this node, and the ep ranks of the same place on every node (None: flat).
    ep_per_node: int = 0
    ep_node_group: object = None
    ep_cross_group: object = None
    _ranks: dict = field(default_factory=dict, repr=False)
    _handles: dict = field(default_factory=dict, repr=False)   # real groups, size 1 included

    def _group(self, name: str):
        # DeepSpeed wants a real group even of one rank; our own code uses None for those.
        return self._handles.get(name, getattr(self, f"{name}_group"))

    @property
    def mp_rank(self) -> int:
        return self.ep_rank * self.tp + self.tp_rank

    # -- DeepSpeed mpu interface ------------------------------------------------------------
    def get_model_parallel_rank(self) -> int:
        return self.mp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.tp * self.ep

    def get_model_parallel_group(self):
        return self._group("mp")

    # DeepSpeed counts a gradient in the global norm when the parameter is marked
    # ``tensor_model_parallel`` or this "tensor" rank is 0, then sums over the model-parallel
    # group; reporting the mp coordinates here makes that count every shard exactly once.
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    # DeepSpeed's data parallelism is dp x cp: it averages the gradients over both (the cp
    # ranks' gradients are parts of one sum, as the dp ranks' are) and ZeRO shards over both.
    def get_data_parallel_rank(self) -> int:
        return self.dp_rank * self.cp + self.cp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp * self.cp

    def get_data_parallel_group(self):
        return self._group("dp_cp")

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self._ranks.get("dp_cp", [0])

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.pp_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.pp


def build_groups(tp: int = 1, ep: int = 1, pp: int = 1, expert_placement: str = "contiguous",
                 sequence_parallel: bool = False, timeout: timedelta | None = None,
                 node_size: int | None = None, cp: int = 1, cp_comm: str = "a2a") -> ParallelGroups:
    """Create every group on every rank (``new_group`` is collective) and keep this rank's.

    Communicates over the default group. With one process, returns all-``None`` groups. The
    degrees are checked by ``ParallelDims`` (``model/parallel/dims.py``). ``timeout`` is each
    group's collective timeout (torch's default when None).
    ``sequence_parallel`` takes effect only with tp > 1 (see ``model/parallel/layers.py``).
    ``node_size`` (ranks per node, for the hierarchical expert exchange): also split each ep
    group by node (``ep_node_group``) and across nodes (``ep_cross_group``); the ep group must
    span whole nodes (tp x ep a multiple of ``node_size``, more than one node). ``cp``: the
    context-parallel degree, ``cp_comm`` its attention exchange (``parallel.cp_comm``).
    """
    if expert_placement not in ("contiguous", "round_robin"):
        raise ValueError(f"parallel.expert_placement ({expert_placement!r}) must be "
                         f"contiguous or round_robin")
    if not (dist.is_available() and dist.is_initialized()):
        ParallelDims(tp, ep, pp, world_size=1, cp=cp, cp_comm=cp_comm)
        return ParallelGroups(expert_placement=expert_placement, cp_comm=cp_comm)
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = ParallelDims(tp, ep, pp, sequence_parallel, world_size=world, cp=cp, cp_comm=cp_comm).dp
    sizes = {"tp": tp, "ep": ep, "cp": cp, "dp": dp, "pp": pp}       # fastest-varying first

    def coords(r: int) -> dict:
        out = {}
        for axis, n in sizes.items():
            r, out[axis] = divmod(r, n)
        return out

    mine = coords(rank)
    varying = {"tp": ("tp",), "ep": ("ep",), "cp": ("cp",), "mp": ("tp", "ep"), "dp": ("dp",),
               "dp_cp": ("cp", "dp"), "ep_cp": ("ep", "cp"), "batch": ("ep", "cp", "dp"),
               "pp": ("pp",)}
    out = ParallelGroups(tp=tp, ep=ep, dp=dp, pp=pp, cp=cp, tp_rank=mine["tp"], ep_rank=mine["ep"],
                         dp_rank=mine["dp"], pp_rank=mine["pp"], cp_rank=mine["cp"],
                         expert_placement=expert_placement,
                         sequence_parallel=sequence_parallel and tp > 1, cp_comm=cp_comm)
    for name, free in varying.items():
        if cp == 1 and name in ("dp_cp", "ep_cp"):       # the same ranks as dp, ep: no new group
            alias = name[:2]
            out._ranks[name], out._handles[name] = out._ranks[alias], out._handles[alias]
            setattr(out, f"{name}_group", getattr(out, f"{alias}_group"))
            continue
        size = 1
        for axis in free:
            size *= sizes[axis]
        # Partition all ranks by their fixed coordinates; every rank creates every group in the
        # same order, as new_group requires.
        buckets: dict[tuple, list[int]] = {}
        for r in range(world):
            c = coords(r)
            key = tuple(c[a] for a in sizes if a not in free)
            buckets.setdefault(key, []).append(r)
        for ranks in buckets.values():
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                out._ranks[name] = ranks
                out._handles[name] = group
                setattr(out, f"{name}_group", group if size > 1 else None)
            if name == "ep" and node_size:
                _split_by_node(out, ranks, tp, ep, node_size, rank, timeout)
    return out


def check_node_size(tp: int, ep: int, node_size: int) -> None:
    """The hierarchical expert exchange's one condition: the ep group (tp x ep consecutive ranks)
    spans several whole nodes of ``node_size`` ranks, and tp divides a node. ValueError (one line)
    otherwise."""
    if node_size % tp or (tp * ep) % node_size or tp * ep == node_size:
        raise ValueError(f"parallel.expert_exchange hierarchical with node_size {node_size}: the ep "
                         f"group (tp x ep = {tp * ep} consecutive ranks) must span several whole nodes "
                         f"and tp ({tp}) divide a node; use flat (an ep group inside one node never "
                         f"crosses the network)")


def _split_by_node(out: ParallelGroups, ep_ranks: list[int], tp: int, ep: int, node_size: int,
                   rank: int, timeout) -> None:
    """The node and cross-node sub-groups of one ep group (its ranks in ep order), created on
    every rank alike; this rank's kept in ``out``."""
    check_node_size(tp, ep, node_size)
    per_node = node_size // tp
    nodes = ep // per_node
    for n in range(nodes):                          # ep ranks of node n
        ranks = ep_ranks[n * per_node:(n + 1) * per_node]
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            out.ep_node_group = group if per_node > 1 else None
    for place in range(per_node):                   # the same place on every node
        ranks = ep_ranks[place::per_node]
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            out.ep_cross_group = group
    out.ep_per_node = per_node


def local_experts(num_experts: int, groups: ParallelGroups | None) -> list[int]:
    """Global ids of the experts this rank holds, in local order.

    ``contiguous``: rank r holds experts [r*E/ep, (r+1)*E/ep) (neighbouring experts together);
    ``round_robin``: rank r holds r, r+ep, r+2*ep, ... (spreads experts that a router tends to
    pick together, e.g. after upcycling, over ranks).
    """
    if groups is None or groups.ep == 1:
        return list(range(num_experts))
    if num_experts % groups.ep:
        raise ValueError(f"model.moe.num_experts ({num_experts}) is not divisible by "
                         f"parallel.expert_parallel_size ({groups.ep})")
    per = num_experts // groups.ep
    if groups.expert_placement == "round_robin":
        return list(range(groups.ep_rank, num_experts, groups.ep))
    return list(range(groups.ep_rank * per, (groups.ep_rank + 1) * per))
