"""Communication of one micro-batch or step: the elements each parallel dimension moves (as
``benchmarks/systems/comm_volume.py`` counts them) and the seconds a ring collective or an all-to-all
takes on a cluster (``planning/hardware.py``); ``planning/cost_model.py`` decides what is hidden.
"""

from __future__ import annotations

import math

from planning.cost_compute import routed_rows
from planning.cost_layout import ACT_BYTES, Layout, Recompute, Shape
from planning.hardware import Cluster

# ---------------------------------------------------------------------------------------------
# Communication volumes (elements, as benchmarks/systems/comm_volume.py counts them: an all-reduce or
# reduce-scatter its full tensor per rank, an all-gather this rank's shard, an all-to-all what
# a rank sends, off-rank rows included).

def _mla_attention(put, t: float, h: int, tp: int, shape: Shape, sp: bool) -> None:
    """MLA's attention (``model/mla.py``): the w-wide latents enter the tp region in one
    collective, the hidden state only through q_proj (no query latent); o_proj leaves as GQA's."""
    w = shape.latent
    if sp:
        put("all_gather", "forward", t * w / tp)
        put("reduce_scatter", "forward", t * h)
        put("reduce_scatter", "backward", t * w)
        put("all_gather", "backward", t * h / tp)
    else:
        put("all_reduce", "forward", t * h)
        put("all_reduce", "backward", t * w)
    if not shape.latent_q:               # q_proj reads the hidden state, as GQA's q/k/v
        if sp:
            put("all_gather", "forward", t * h / tp)
            put("reduce_scatter", "backward", t * h)
            put("all_gather", "backward", t * h / tp)
        else:
            put("all_reduce", "backward", t * h)


def tp_volumes(shape: Shape, layout: Layout, layers: range, head: bool = False,
               embedding: bool | None = None) -> dict[tuple, float]:
    """TP/SP collectives of one micro-batch on one rank over ``layers``: {(op, phase): elements}.

    Per layer, without SP: one all-reduce of T h forward after the attention and after the FFN,
    (MLA: ``_mla_attention``)
    and one backward each for the gradients entering q/k/v and the FFN. With SP each becomes a
    reduce-scatter of T h plus an all-gather of the T h / tp shard, and backward gathers the
    shard once more where a column-parallel layer stored only its input's shard (q/k/v and
    gate/up; not an MoE layer, which stores no gathered input). An MoE layer whose experts are
    split by tp also sums the gradient of its (T, k) combine weights, which multiply the experts'
    tp-partial outputs (``model/moe/layer.py``): an all-reduce of T k backward. Megatron's MoE
    with experts not split by tp (etp 1) has no TP collective in its MoE layers.

    ``head`` (the last stage): the vocab-parallel output head's input grad, an all-reduce of T h
    backward (SP: its input gathered forward and again backward, T h / tp each, and the grad
    reduce-scattered, T h), and the vocab-parallel cross-entropy's statistics over all T
    tokens, all-reduces of 3 T forward (the max, then the target logit and the sum of
    exponentials). ``embedding`` (None: when ``layers`` holds layer 0, as the first stage
    does): the vocab-parallel embedding's partial lookups summed forward, an all-reduce of T h
    (SP: a reduce-scatter of T h, and backward the all-gather of its grad's T h / tp shard).
    These are the collectives ``benchmarks/systems/comm_volume.py`` counts, element for element
    (``tests/benchmarks/systems/test_comm_volume.py``).
    """
    out: dict[tuple, float] = {}
    if layout.tp == 1:
        return out
    t, h, tp = layout.tokens, shape.hidden, layout.tp

    def put(op, phase, n):
        out[(op, phase)] = out.get((op, phase), 0.0) + n

    for i in layers:
        moe = shape.is_moe(i)
        subs = [False] + ([] if moe and layout.expert_tp == 1 else [moe])   # attention, FFN
        for is_moe in subs:
            if shape.latent and not is_moe:
                _mla_attention(put, t, h, tp, shape, layout.sp)
            elif layout.sp:
                put("reduce_scatter", "forward", t * h)
                put("all_gather", "forward", t * h / tp)
                put("reduce_scatter", "backward", t * h)
                put("all_gather", "backward", t * h / tp * (1 if is_moe else 2))
            else:
                put("all_reduce", "forward", t * h)
                put("all_reduce", "backward", t * h)
            if is_moe:
                put("all_reduce", "backward", t * shape.top_k)      # combine weights' grad
    if embedding is None:
        embedding = 0 in layers
    if embedding:
        if layout.sp:
            put("reduce_scatter", "forward", t * h)
            put("all_gather", "backward", t * h / tp)
        else:
            put("all_reduce", "forward", t * h)
    if head:
        if layout.sp:
            put("all_gather", "forward", t * h / tp)
            put("all_gather", "backward", t * h / tp)
            put("reduce_scatter", "backward", t * h)
        else:
            put("all_reduce", "backward", t * h)
        put("all_reduce", "forward", 3 * t)                         # cross-entropy statistics
    return out


def ep_volumes(shape: Shape, layout: Layout, layers: range) -> dict[tuple, float]:
    """All-to-all elements one rank sends per micro-batch over ``layers``: dispatch and combine
    each move the routed rows (k rows of h per token, dropless: no padding), forward and again
    reversed in backward, and once more forward (phase ``recompute``) where recompute repeats
    the MoE layer (``full``, ``every_k``, ``moe``; not ``experts``, which recomputes only the
    expert FFNs between the exchanges). Balanced routing (times ``moe_imbalance``): what one
    rank's combine sends back depends on how many rows its experts received, but summed over
    the ep ranks each exchange moves exactly ep k T h elements when dropless (k rows for every
    token), as ``benchmarks/systems/comm_volume.py`` counts it."""
    out: dict[tuple, float] = {}
    if layout.ep == 1 or not shape.experts:
        return out
    rc = Recompute.parse(layout.recompute, shape.layers)
    rows = routed_rows(shape, layout) * shape.hidden
    for i in layers:
        if not shape.is_moe(i):
            continue
        for label in ("dispatch", "combine"):
            for phase in ("forward", "backward"):
                out[(label, phase)] = out.get((label, phase), 0.0) + rows
            if i in rc.whole or rc.moe:
                out[(label, "recompute")] = out.get((label, "recompute"), 0.0) + rows
    return out


def dp_volume(psi: float, dp: int, accumulation: int, zero_stage: int, grad_bytes: int,
              param_bytes: int = ACT_BYTES, exchange_scale: float = 1.0) -> dict[str, float]:
    """Bytes each rank sends for data parallelism in one optimizer step, for ``psi`` parameters
    replicated over ``dp`` ranks: the ZeRO paper's counts (arXiv:1910.02054, sec. 7) as
    DeepSpeed schedules them, each times (dp-1)/dp for a ring:

    - ZeRO-0: all-reduce of the gradients at the accumulation boundary, 2 psi (compressed:
      ``exchange_scale`` elements per gradient element, PowerSGD's P, Q and vectors);
    - ZeRO-1 (and Megatron's distributed optimizer): reduce-scatter of the gradients once, psi,
      then all-gather of the updated parameters, psi (compressed: PowerSGD's all-reduces in
      place of the reduce-scatter);
    - ZeRO-2: DeepSpeed reduce-scatters on every micro-batch (m psi), then all-gathers (psi);
    - ZeRO-3 / FSDP: per micro-batch all-gather in forward and again in backward (2 psi) and
      a reduce-scatter of the gradients (psi).
    """
    if dp <= 1 or psi <= 0:
        return {}
    m, ring = accumulation, (dp - 1) / dp
    if zero_stage == 0:
        parts = {"grad_all_reduce": 2 * psi * grad_bytes * exchange_scale}
    elif zero_stage == 1 and exchange_scale != 1.0:     # PowerSGD's all-reduces, then the gather
        parts = {"grad_all_reduce": 2 * psi * grad_bytes * exchange_scale, "param_all_gather": psi * param_bytes}
    elif zero_stage == 1:
        parts = {"grad_reduce_scatter": psi * grad_bytes, "param_all_gather": psi * param_bytes}
    elif zero_stage == 2:
        parts = {"grad_reduce_scatter": m * psi * grad_bytes, "param_all_gather": psi * param_bytes}
    else:
        parts = {"param_all_gather": 2 * m * psi * param_bytes,
                 "grad_reduce_scatter": m * psi * grad_bytes}
    return {k: v * ring for k, v in parts.items()}


def cp_volumes(shape: Shape, layout: Layout, layers: range) -> dict[tuple, float]:
    """Context parallelism's attention exchange (``model/parallel/context.py``, ``ring.py``) of
    one micro-batch on one rank over ``layers``: {(op, phase): elements}, T the rank's S/cp
    tokens, per tp rank nh query heads of width d (MLA: the query-key width; its values are
    zero-padded to it) and nkv key/value heads of width dv.

    - ``a2a`` (Ulysses): q, k, v into head shards (one all-to-all) and the output back (another),
      of which a rank sends (cp-1)/cp; kv heads are repeated to lcm(nkv, cp) first. Backward the
      same for their gradients.
    - ``allgather``: K and V all-gathered (this rank's T nkv (d + dv) shard), their gradients
      reduce-scattered in backward (the full cp T nkv (d + dv)).
    - ``p2p`` (ring): cp - 1 sends of the K/V block (T nkv (d + dv)) forward; backward cp - 1
      sends of the block and cp of its gradient (the last hop brings a rank its own, complete).
    A recomputed layer (full, every_k, attention) repeats its forward exchange (``recompute``)."""
    out: dict[tuple, float] = {}
    cp = layout.cp
    if cp == 1:
        return out
    rc = Recompute.parse(layout.recompute, shape.layers)
    t, tp, d = layout.tokens, layout.tp, shape.head_dim
    nh = shape.heads / tp
    nkv = shape.heads / tp if shape.latent else max(shape.kv_heads / tp, 1.0)
    dv = d if shape.latent else (shape.v_head_dim or d)
    if layout.cp_comm == "a2a":
        kv_a2a = math.lcm(int(nkv), cp)             # kv heads repeated until cp divides them
        per = {("all_to_all", "forward"): (cp - 1) / cp * t * (nh * d + kv_a2a * (d + dv) + nh * dv)}
        per[("all_to_all", "backward")] = per[("all_to_all", "forward")]
    elif layout.cp_comm == "allgather":
        per = {("all_gather", "forward"): t * nkv * (d + dv),
               ("reduce_scatter", "backward"): cp * t * nkv * (d + dv)}
    else:
        block = t * nkv * (d + dv)
        per = {("send", "forward"): (cp - 1) * block, ("send", "backward"): (2 * cp - 1) * block}
    for i in layers:
        for key, n in per.items():
            out[key] = out.get(key, 0.0) + n
        if i in rc.whole or rc.attention:
            fwd = [(k, n) for k, n in per.items() if k[1] == "forward"]
            for (op, _), n in fwd:
                out[(op, "recompute")] = out.get((op, "recompute"), 0.0) + n
    return out


def cp_seconds(shape: Shape, layout: Layout, cluster: Cluster, layers: range,
               attention_s: float) -> float:
    """Seconds the cp exchange of ``layers`` adds to one micro-batch: the all-to-alls and the
    all-gather / reduce-scatter wait for their results; the ring's sends travel while the
    previous block is computed (``model/parallel/ring.py``), so only what exceeds the attention
    core's ``attention_s`` (forward and backward of those layers) shows, plus a latency per hop.
    In Megatron's order cp comes right after tp, so cp ranks are tp apart; this trainer's is the
    order tp, ep, cp, dp, pp (``model/parallel/groups.py``), so the stride also counts ep when
    the layout splits batches over ep."""
    cp = layout.cp
    if cp == 1:
        return 0.0
    a = ACT_BYTES
    stride = layout.tp * (layout.ep if layout.ep_splits_batch else 1)
    vol = cp_volumes(shape, layout, layers)
    if layout.cp_comm == "a2a":
        calls = 4 * len(layers)           # q, k, v in and the output out, each way
        return sum(all_to_all_seconds(cluster, n * a, cp, stride, calls=0) for n in vol.values()) \
            + calls * cluster.latency(cp, stride)
    if layout.cp_comm == "allgather":
        return sum(_collective(cluster, op, n * a, cp, stride, calls=0) for (op, _), n in vol.items()) \
            + 2 * len(layers) * cluster.latency(cp, stride)
    hops = sum(vol.values()) * a / cluster.busbw(cp, stride)      # the ring's slowest hop
    return max(0.0, hops - attention_s) + (3 * cp - 2) * len(layers) * cluster.latency(cp, stride)


def dp_groups(shape: Shape, layout: Layout) -> dict[str, tuple[int, int]]:
    """{"dense"|"expert": (ranks a parameter is replicated over, their stride)}.

    The cp ranks hold different tokens of the same sequences, so gradients are reduced over dp
    x cp everywhere (Megatron's data-parallel-with-context-parallel group). Megatron and
    torchtitan: dense parameters over dp cp = world / (tp pp), stride tp; experts over world /
    (etp ep pp) (expert data parallelism), stride etp ep. This trainer (``ep_splits_batch``,
    order tp, ep, cp, dp, pp): both over dp cp = world / (tp ep pp), stride tp ep; the dense
    parameters' sum over ep is a separate all-reduce (``step_cost``).
    """
    if layout.ep_splits_batch or not shape.experts:
        stride = layout.tp * (layout.ep if layout.ep_splits_batch else 1)
        return {"dense": (layout.dp * layout.cp, stride), "expert": (layout.dp * layout.cp, stride)}
    etp = layout.expert_tp
    return {"dense": (layout.dp * layout.cp, layout.tp),
            "expert": (layout.world // (etp * layout.ep * layout.pp), etp * layout.ep)}


def _collective(cluster: Cluster, op: str, nbytes: float, size: int, stride: int,
                calls: int = 1) -> float:
    """Seconds of ``calls`` ring collectives moving ``nbytes`` in all (all-reduce /
    reduce-scatter: the full tensors; all-gather: this rank's shards) over ``size`` ranks
    ``stride`` apart: the bus-bandwidth term, and one latency per call."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    bw = cluster.busbw(size, stride)
    factor = {"all_reduce": 2 * (size - 1) / size, "reduce_scatter": (size - 1) / size,
              "all_gather": float(size - 1)}[op]
    return factor * nbytes / bw + calls * cluster.latency(size, stride)


def tp_calls(shape: Shape, layout: Layout, layer: int, phases=("forward", "backward")) -> int:
    """TP collectives one layer issues per micro-batch in ``phases`` (the calls of
    ``tp_volumes``): per sub-layer with a TP collective, one forward and one backward
    all-reduce, or under SP a reduce-scatter and an all-gather each way and the backward gather
    again where the input was stored as a shard; the combine weights' backward all-reduce of an
    MoE layer with tp-split experts."""
    if layout.tp == 1:
        return 0
    moe = shape.is_moe(layer)
    subs = [False] + ([] if moe and layout.expert_tp == 1 else [moe])
    fwd = len(subs) * (2 if layout.sp else 1)
    bwd = sum((3 if not is_moe else 2) if layout.sp else 1 for is_moe in subs) + (moe and subs[-1])
    return ("forward" in phases) * fwd + ("backward" in phases) * bwd


def all_to_all_seconds(cluster: Cluster, nbytes: float, size: int, stride: int,
                       remote: float | None = None, calls: int = 1) -> float:
    """One all-to-all in which a rank sends ``nbytes`` spread evenly over ``size`` ranks: the
    share for ranks of its own node over NVLink, the rest (``remote``, default the ranks on
    other nodes' share) over its network share, at once."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    local, nodes = cluster.placement(size, stride)
    remote = (size - local) / size if remote is None else remote
    inside = nbytes * (local - 1) / size / (cluster.device.nvlink_a2a_gb_s * 1e9)
    outside = nbytes * remote / cluster.nic_bytes_s_per_gpu if nodes > 1 else 0.0
    return max(inside, outside) + calls * cluster.latency(size, stride)


def remote_share(shape: Shape, layout: Layout, cluster: Cluster) -> float | None:
    """Share of a rank's routed rows that cross the network when a token is sent once per remote
    node (``a2a_node_dedup``, DeepEP's dispatch): the expected number of other nodes among its k
    experts, over k; experts spread evenly over the ep group's nodes, routing uniform. None
    without deduplication (every row to another node crosses)."""
    if not layout.a2a_node_dedup or not shape.experts:
        return None
    nodes = cluster.placement(layout.ep, layout.tp * (1 if layout.ep_splits_batch else layout.cp))[1]
    if nodes <= 1:
        return 0.0
    per_node, e, k = shape.experts / nodes, shape.experts, shape.top_k
    missed = math.comb(int(e - per_node), k) / math.comb(e, k)    # a given node gets none of k
    return (nodes - 1) * (1 - missed) / k
