"""Step time of one optimizer step, from the model's GEMM shapes, the layout and the cluster.

``step_cost(shape, layout, cluster)`` returns the predicted seconds of one optimizer step and its
breakdown: compute (GEMMs, attention, memory-bound elementwise work, the forward that
recomputation repeats, the optimizer update), exposed communication per kind (TP/SP, DP/ZeRO, the
EP all-to-all, pipeline sends) and the pipeline bubble. It describes hardware and layout, not one
code base: the layout says which kernels run (``attention``, ``fused_elementwise``) and what a
system overlaps (``overlap_*``), so the same model predicts a Megatron-Core run and this repo's
trainer. ``benchmarks/planner_vs_published.py`` checks it against published runs;
``docs/planning.md`` has the derivation and every constant's source.

Hand-written: the open performance models we know of (Calculon; the closed forms of the
Megatron papers) describe dense Megatron layouts, not DeepSpeed's ZeRO schedules, expert
parallelism or this trainer's layouts.

The pieces: ``planning/cost_layout.py`` (``Shape``, ``Layout``, ``Recompute``, the
conventions), ``planning/cost_compute.py`` (one layer's compute) and ``planning/cost_comm.py``
(volumes and collectives); their names are importable from here, the model's one entry point.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planning.cost_comm import (_collective, all_to_all_seconds, cp_seconds, cp_volumes,  # noqa: F401
                                dp_groups, dp_volume, ep_volumes, remote_share, tp_calls, tp_volumes)
from planning.cost_compute import (ATTENTION_BWD_FLOPS, BACKWARD_ELEMENTWISE,  # noqa: F401
                                   BACKWARD_GEMMS, CE_BYTES_EAGER, CE_BYTES_FUSED, EAGER_FACTOR,
                                   K_OVERHEAD, MAMF_K, SUSTAINED_CLOCK, Phases, attention_flops,
                                   attention_gemms, attention_seconds, elementwise_bytes,
                                   gemm_fwd_bwd, gemm_seconds, head_compute, k_efficiency,
                                   layer_compute, routed_rows)
from planning.cost_layout import ACT_BYTES, Layout, Recompute, Shape  # noqa: F401
from planning.hardware import Cluster

__all__ = ["ACT_BYTES", "ADAM_BYTES", "ATTENTION_BWD_FLOPS", "BACKWARD_ELEMENTWISE", "BACKWARD_GEMMS",
           "CE_BYTES_EAGER", "CE_BYTES_FUSED", "COMM_SM_SHARE", "EAGER_FACTOR", "K_OVERHEAD",
           "MAMF_K", "SUSTAINED_CLOCK", "ZERO3_PREFETCH_EXPOSED", "Layout", "Phases", "Recompute",
           "Shape", "StepCost", "_collective", "all_to_all_seconds", "attention_flops",
           "attention_gemms", "attention_seconds", "dp_groups", "dp_volume", "elementwise_bytes",
           "ep_volumes", "gemm_fwd_bwd", "gemm_seconds", "head_compute", "k_efficiency",
           "layer_compute", "local_params", "pipeline_seconds", "remote_share", "routed_rows",
           "stage_layer_ranges", "step_cost", "tp_calls", "tp_volumes"]

# Adam on one parameter, bytes moved: read fp32 master, grad, m, v (16), write master, m, v (12),
# write the bf16 copy (2); the grad-norm pass reads the grad once more (4).
ADAM_BYTES = 34
ZERO3_PREFETCH_EXPOSED = 1   # ZeRO-3/FSDP: the first layer's gather of each pass is not hidden
# While communication is hidden under compute its kernels hold SMs: DeepEP's normal kernels use
# 20-24 of H100's 132 (deepseek-ai/DeepEP README), NCCL one per channel, so the compute under it
# runs slower; a hidden second of communication costs COMM_SM_SHARE of a second.
COMM_SM_SHARE = 24 / 132


# ---------------------------------------------------------------------------------------------
# Parameters per rank.

def local_params(shape: Shape, layout: Layout, layers: range, first: bool, last: bool) -> dict:
    """Parameters one rank holds for its ``layers``: {"dense", "expert"} (before ZeRO)."""
    h, tp = shape.hidden, layout.tp
    attn = h * shape.head_dim * (2 * shape.heads + 2 * shape.kv_heads) / tp + 2 * h
    dense = expert = 0.0
    up = 3 if shape.gated else 2
    for i in layers:
        dense += attn
        if shape.is_moe(i):
            dense += h * shape.experts + up * h * shape.shared_ffn / tp
            expert += shape.experts / layout.ep * up * h * shape.expert_ffn / layout.expert_tp
        else:
            dense += up * h * shape.ffn / tp
    dense += (first + last) * shape.vocab * h / tp
    return {"dense": dense, "expert": expert}


def stage_layer_ranges(shape: Shape, layout: Layout) -> list[range]:
    """Layers of each pipeline rank (all its virtual stages together): even, earlier ranks one
    more when pp does not divide, or ``layout.stage_layers``."""
    counts = list(layout.stage_layers) if layout.stage_layers else \
        [shape.layers // layout.pp + (r < shape.layers % layout.pp) for r in range(layout.pp)]
    if sum(counts) != shape.layers or len(counts) != layout.pp:
        raise ValueError(f"stage_layers {counts} must be pp = {layout.pp} counts summing to "
                         f"{shape.layers} layers")
    starts = [sum(counts[:r]) for r in range(layout.pp)]
    return [range(s, s + c) for s, c in zip(starts, counts)]


# ---------------------------------------------------------------------------------------------
# The step.

@dataclass
class StepCost:
    """The prediction for one optimizer step, seconds unless named otherwise."""

    step_s: float
    tokens_per_s_per_gpu: float
    compute_s: float                 # per micro-batch work x micro-batches on the slowest stage
    bubble_s: float
    optimizer_s: float
    exposed: dict[str, float]        # exposed communication per kind: tp, dp, ep, pp
    breakdown: dict[str, float] = field(default_factory=dict)   # compute by kind, one step
    volumes: dict[str, float] = field(default_factory=dict)     # bytes per rank per step

    def as_dict(self) -> dict:
        return {"step_s": self.step_s, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
                "compute_s": self.compute_s, "bubble_s": self.bubble_s,
                "optimizer_s": self.optimizer_s, **{f"{k}_comm_s": v for k, v in self.exposed.items()},
                "breakdown": self.breakdown, "volumes": self.volumes}


# ZB-H1's ramp over 1F1B's: (F + B - W) / (F + B + W) with a linear layer's three equal matmuls
# (forward, input gradient, weight gradient), Qi et al. 2023 (training/engine/pipe_schedules.py).
ZB_H1_RAMP = 1 / 3


def pipeline_seconds(stage_work: list[float], micro_batches: int, vpp: int = 1,
                     schedule: str = "1f1b") -> float:
    """Makespan of a synchronous 1F1B step with free communication: the slowest stage paces the
    m - 1 steady micro-batches, and every stage's work fills the ramp up and down (the model of
    ``benchmarks/pipeline_schedules.py``); interleaving v virtual stages per rank divides the
    ramp by v (Megatron, arXiv:2104.04473 sec. 2.2.2: bubble (p-1)/(v m)). Exact for equal
    stages; with a slower stage before a faster one it is an upper bound (DeepSpeed's schedule
    then overlaps part of the ramp: ``tests/planning/test_cost_model.py`` pins a case). GPipe
    has 1F1B's makespan; ZB-H1 fills the ramp with deferred weight gradients, leaving
    ``ZB_H1_RAMP`` of it idle."""
    if len(stage_work) == 1:
        return micro_batches * stage_work[0]
    slowest = max(stage_work)
    ramp = (sum(stage_work) - slowest) / vpp * (ZB_H1_RAMP if schedule == "zb-h1" else 1.0)
    return (micro_batches - 1) * slowest + slowest + ramp


def step_cost(shape: Shape, layout: Layout, cluster: Cluster) -> StepCost:
    """Predicted seconds of one optimizer step of ``shape`` at ``layout`` on ``cluster``."""
    layout.check(shape)
    dev, m = cluster.device, layout.accumulation
    tp, cp, ep, dp, pp = layout.tp, layout.cp, layout.ep, layout.dp, layout.pp
    a = ACT_BYTES
    stride_ep = tp if layout.ep_splits_batch else tp * cp      # ep after tp (Megatron: and cp)
    stride_dp = tp * cp * (ep if layout.ep_splits_batch else 1)
    stride_pp = stride_dp * dp
    ranges = stage_layer_ranges(shape, layout)
    rc, memo = Recompute.parse(layout.recompute, shape.layers), {}
    per_stage, kinds, tp_exposed, ep_exposed = [], [], [], []
    for r, layers in enumerate(ranges):
        work = {"gemm": 0.0, "attention": 0.0, "elementwise": 0.0, "recompute": 0.0, "head": 0.0}
        gemm_fwd = attention_side = attention_core = 0.0
        for i in layers:
            key = (shape.is_moe(i), i in rc.whole)
            if key not in memo:         # layers differ only by these
                memo[key] = (layer_compute(shape, layout, dev, i), attention_gemms(shape, layout, dev))
            c, attn_gemms = memo[key]
            for k, ph in c.items():
                work[k] += ph.fwd + ph.bwd
                work["recompute"] += ph.recompute
            gemm_fwd += c["gemm"].fwd
            attention_side += c["attention"].total + attn_gemms
            attention_core += c["attention"].fwd + c["attention"].bwd
        if r == pp - 1:
            work["head"] = head_compute(shape, layout, dev).total
        compute = sum(work.values())
        head = r == pp - 1
        tp_s = sum(_collective(cluster, op, n * a, tp, 1, calls=0) for (op, _), n in
                   tp_volumes(shape, layout, layers, head=head, embedding=r == 0).items())
        calls = sum(tp_calls(shape, layout, i) for i in layers) + \
            (5 if layout.sp else 3) * head + (2 if layout.sp else 1) * (r == 0)
        redone = range(0)
        if rc.whole:                # a recomputed layer repeats its forward collectives
            redone = [i for i in layers if i in rc.whole]
            tp_s += sum(_collective(cluster, op, n * a, tp, 1, calls=0) for (op, phase), n in
                        tp_volumes(shape, layout, redone, embedding=False).items()
                        if phase == "forward")
            calls += sum(tp_calls(shape, layout, i, ("forward",)) for i in redone)
        tp_s += calls * cluster.latency(tp, 1) if tp > 1 else 0.0
        if layout.overlap_tp:       # under the GEMMs they feed (forward and backward)
            hidden = min(tp_s, gemm_fwd * (1 + BACKWARD_GEMMS))
            tp_s = tp_s - hidden + COMM_SM_SHARE * hidden
        remote = remote_share(shape, layout, cluster)
        ep_s = sum(all_to_all_seconds(cluster, n * layout.dispatch_bytes, ep, stride_ep, remote,
                                      calls=0)
                   for n in ep_volumes(shape, layout, layers).values())
        if ep > 1 and shape.experts:    # dispatch and combine each way, and the recomputed ones
            moe_layers = [i for i in layers if shape.is_moe(i)]
            ep_calls = 4 * len(moe_layers) + 2 * sum(i in rc.whole or rc.moe for i in moe_layers)
            ep_s += ep_calls * cluster.latency(ep, stride_ep)
        if layout.overlap_a2a:
            # Megatron's EP overlap runs one micro-batch's dispatch and combine under another's
            # attention: what that hides, at the cost of the SMs the exchange holds meanwhile
            hidden = min(ep_s, attention_side)
            ep_s = ep_s - hidden + COMM_SM_SHARE * hidden
        pp_s = 0.0
        if pp > 1:   # activation forward and its grad backward, per boundary this rank crosses
            msg = layout.tokens * shape.hidden * a / (tp if layout.sp else 1)
            crossings = 2 * layout.vpp if 0 < r < pp - 1 else layout.vpp
            pp_s = crossings * (msg / cluster.busbw(2, stride_pp) + cluster.latency(2, stride_pp))
            if layout.overlap_p2p:
                pp_s = crossings * cluster.latency(2, stride_pp)
        cp_s = cp_seconds(shape, layout, cluster, layers, attention_core)
        per_stage.append(compute + tp_s + ep_s + pp_s + cp_s)
        kinds.append((work, tp_s, ep_s, pp_s, cp_s))
        tp_exposed.append(tp_s)
        ep_exposed.append(ep_s)
    slowest = max(range(pp), key=lambda r: per_stage[r])
    pipeline = pipeline_seconds(per_stage, m, layout.vpp, layout.schedule)
    bubble = pipeline - m * per_stage[slowest]
    work, tp_s, ep_s, pp_s, cp_s = kinds[slowest]
    # Each stage reduces its own gradients and steps its own optimizer after its last backward:
    # the step ends with the stage that finishes last.
    tails = [_dp_and_optimizer(shape, layout, cluster, ranges[r], r, per_stage[r],
                               sum(kinds[r][0].values())) for r in range(pp)]
    dp_exposed, optimizer, volumes = max(tails, key=lambda t: t[0] + t[1])
    step = pipeline + dp_exposed + optimizer
    tokens = layout.global_batch * layout.seq_len
    breakdown = {k: m * v for k, v in work.items()}
    exposed = {"tp": m * tp_s, "dp": dp_exposed, "ep": m * ep_s, "pp": m * pp_s, "cp": m * cp_s}
    volumes = {"dp_bytes": sum(volumes.values()),
               "tp_bytes": m * sum(tp_volumes(shape, layout, ranges[slowest], slowest == pp - 1,
                                              slowest == 0).values()) * a,
               "ep_bytes": m * sum(ep_volumes(shape, layout, ranges[slowest]).values())
               * layout.dispatch_bytes,
               "cp_bytes": m * sum(cp_volumes(shape, layout, ranges[slowest]).values()) * a}
    return StepCost(step, tokens / step / layout.world, m * sum(work.values()), bubble,
                    optimizer, exposed, breakdown, volumes)


def _dp_and_optimizer(shape: Shape, layout: Layout, cluster: Cluster, layers: range, stage: int,
                      micro: float, fwd_bwd: float) -> tuple[float, float, dict]:
    """(exposed data-parallel seconds, optimizer seconds, bytes per part) of one pipeline
    stage, whose micro-batch takes ``micro`` seconds (``fwd_bwd`` of it compute)."""
    m, ep, tp = layout.accumulation, layout.ep, layout.tp
    params = local_params(shape, layout, layers, stage == 0, stage == layout.pp - 1)
    groups = dp_groups(shape, layout)
    volumes, reduce_s, gather_s = {}, 0.0, 0.0
    for kind, (size, stride) in groups.items():
        vol = dp_volume(params[kind], size, m, layout.zero_stage, layout.grad_reduce_bytes,
                        exchange_scale=layout.grad_exchange_scale)
        for part, nbytes in vol.items():
            volumes[f"{kind}_{part}"] = nbytes
            seconds = nbytes / cluster.busbw(size, stride)
            if part == "param_all_gather":
                gather_s += seconds
            else:
                reduce_s += seconds
    if layout.ep_splits_batch and ep > 1 and shape.experts:
        # this trainer: the parameters outside the experts are replicated over the ep ranks of
        # a replica, their grads summed over ep (model/parallel/grad_sync.py): once per
        # micro-batch, or once per step in its "step" mode (training.config.ds_config.replica_sync_mode)
        times = 1 if layout.replica_sync == "step" else m
        nbytes = times * 2 * params["dense"] * layout.grad_reduce_bytes * (ep - 1) / ep
        volumes["dense_ep_all_reduce"] = nbytes
        reduce_s += nbytes / cluster.busbw(ep, tp)
    if layout.zero_stage == 3:
        # gathers prefetched under every layer's compute: what does not fit under it shows,
        # and the first layer's gather of each pass at least
        total = reduce_s + gather_s
        first = total / max(1, 2 * m * len(layers)) * ZERO3_PREFETCH_EXPOSED
        hidden = min(total - first, m * fwd_bwd)
    else:
        window = 0.0
        if layout.overlap_dp:       # under the last micro-batch's backward; ZeRO-2: every one
            window = (m if layout.zero_stage == 2 else 1) * micro * (2 / 3)
        total = reduce_s + gather_s
        hidden = min(reduce_s, window) + (gather_s if layout.overlap_param_gather else 0.0)
    exposed = total - hidden + COMM_SM_SHARE * hidden
    optimizer = sum(params[k] / (groups[k][0] if layout.zero_stage >= 1 else 1)
                    for k in groups) * ADAM_BYTES / cluster.device.hbm_bytes_s
    if layout.muon_ns_flops or layout.muon_comm_bytes:   # after backward, not overlapped
        device = cluster.device
        optimizer += layout.muon_ns_flops / (device.peak_flops * device.gemm_fraction * SUSTAINED_CLOCK)
        volumes["muon"] = layout.muon_comm_bytes
        exposed += layout.muon_comm_bytes / cluster.busbw(*groups["dense"])
    return exposed, optimizer, volumes
