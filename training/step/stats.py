"""The statistics vector of one optimizer step: its layout, what each micro-batch adds, and the
metrics read back from it; and each rank's busy time, which names the slowest rank.

One float64 vector on the compute device per step (``training/step/stepper.py``): filled with
device-side adds only, summed once over the ranks that see different tokens (and the pipeline
stages), and copied to the host once. L is the number of MoE layers, E the experts per layer:

    [ce_sum, target_tokens, nonfinite, aux, z, entropy, dropped, small-batch |G|^2]   scalars
    tokens per expert (L x E), router entropy (L), dropped fraction (L),
    largest router logit (L), mean router log-sum-exp (L)                            per layer
    cross-entropy sum and target tokens of each MTP depth (2 D), with model.mtp_depth D
    expert bias (L x E), only when the router has one (loss-free balancing)
    router divergence (the tp x ep replicas of the router weights)                   last

The router values of the scalars are means over MoE layers and micro-batches, summed over ranks
(``moe_metrics`` divides by the data-parallel size). ``StatsLayout.read`` names the values of the
host copy (``StepValues``).

Stragglers. A step's wall time is the same on every rank (the others wait for the slowest in
the collectives), so each rank measures its busy time: from the start of ``Stepper.train_step``
to its arrival at the step's statistics all-reduce, which it reaches after its own forward passes
(``BusyTime``: ``time.perf_counter()`` on CPU; on a GPU two CUDA events recorded on the current
stream and read after the step's ``.tolist()`` has synchronized: no extra sync). Every
``train.log_every`` steps each rank's mean busy seconds since the last such step ride as a one-hot
row of length world size (``busy_row``) in the job-wide sum of ``Stepper._to_host`` (no extra
collective), and the metrics row carries ``step_busy_s_max``, ``step_busy_s_median`` and
``slowest_rank`` (``straggler_metrics``). On CPU the mean includes the log step itself; on a GPU
that step's time is known only after the sum it rides in, so the mean is over the steps from the
previous log step up to this one excluded (a log step with none, e.g. the first of a run at
``log_every`` 1, carries no straggler fields).

What it catches: a rank slow in its own work before that all-reduce (a host stall, a slow or
throttled GPU) arrives there last. Its limit: a fast rank's wait in any collective before that
point counts as busy. Where the layout has collectives inside the forward (tensor/expert-parallel
all-to-alls, ZeRO-3 parameter gathers, global-batch balancing's count all-reduce) or in the
earlier micro-batches' backward (ZeRO-2's gradient reductions at accumulation > 1), the fast ranks
wait in those and the slow rank's lead is only what comes after the last of them; with pipeline
stages the point is after the whole schedule, its sends and its gradient reductions. With data
parallel alone at ZeRO 0-1 (ZeRO-2 without accumulation) a stall before or in the forward shows
in full. The last backward, the optimizer step and the trainer's work between steps (reading the
batches, logging, saving) are not measured.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

# The scalars' indices, in the order above (NOISE: the small-batch |G|^2, training/step/noise_scale.py).
CE_SUM, TOKENS, NONFINITE, AUX, Z, ENTROPY, DROPPED, NOISE = range(8)
SCALARS = NOISE + 1


@dataclass(frozen=True)
class StepValues:
    """The host copy of one step's statistics vector, summed over the ranks that see different
    tokens and the stages, by name (``StatsLayout.read``); ``vector`` is the whole of it
    (``StatsLayout.moe_metrics`` reads it)."""

    ce_sum: float                 # summed next-token cross-entropy of the step's target tokens
    tokens: float                 # the step's target tokens
    nonfinite: float              # micro-batches whose objective was not finite
    small_batch_grad_sq: float    # the summed small-batch |G|^2 (training/step/noise_scale.py)
    router_divergence: float      # put in on log steps under tp x ep > 1, else 0.0
    vector: list[float]

    @property
    def loss(self) -> float:
        """The mean next-token cross-entropy of the step's tokens."""
        return self.ce_sum / max(self.tokens, 1)


class StatsLayout:
    """Where each value of the vector lives, for ``layers`` MoE layers of ``experts`` experts;
    ``bias``: the routers hold an expert bias (``model.moe.expert_bias``); ``mtp``: the MTP
    depths (``model.mtp_depth``)."""

    def __init__(self, layers: int, experts: int, bias: bool, mtp: int = 0):
        self.layers, self.experts = layers, experts
        counts_end = SCALARS + layers * experts
        self.counts = slice(SCALARS, counts_end)                       # (L x E,) layer-major
        self.entropy = slice(counts_end, counts_end + layers)
        self.dropped = slice(counts_end + layers, counts_end + 2 * layers)
        self.logit_max = slice(counts_end + 2 * layers, counts_end + 3 * layers)
        self.logit_lse = slice(counts_end + 3 * layers, counts_end + 4 * layers)
        self.mtp = slice(self.logit_lse.stop, self.logit_lse.stop + 2 * mtp)   # (ce sums, tokens)
        end = self.mtp.stop
        self.bias = slice(end, end + layers * experts) if bias and layers else None
        self.divergence = self.bias.stop if self.bias else end         # router divergence
        self.size = self.divergence + 1

    def new(self, device) -> torch.Tensor:
        return torch.zeros(self.size, dtype=torch.float64, device=device)

    def read(self, values: list[float]) -> StepValues:
        """The host copy ``values`` of a step's (summed) vector, by name."""
        return StepValues(ce_sum=values[CE_SUM], tokens=values[TOKENS], nonfinite=values[NONFINITE],
                          small_batch_grad_sq=values[NOISE],
                          router_divergence=values[self.divergence], vector=values)

    def add_micro_batch(self, stats: torch.Tensor, out, loss: torch.Tensor, gas: int) -> None:
        """One micro-batch's loss sums and router values (``TransformerOutput``), ``loss`` its
        detached objective; no value leaves the device."""
        stats[CE_SUM] += out.ce_sum.detach().double()
        stats[TOKENS] += out.num_target_tokens.double()
        stats[NONFINITE] += (~torch.isfinite(loss)).double()
        if out.mtp_ce_sum:
            stats[self.mtp] += torch.cat([torch.stack(out.mtp_ce_sum).detach().double(),
                                          torch.stack(out.mtp_target_tokens).double()])
        if out.moe_aux:
            # Means over micro-batches here, over data-parallel ranks in moe_metrics.
            entropy = torch.stack([a.entropy for a in out.moe_aux]).double() / gas      # (L,)
            dropped = torch.stack([a.dropped_frac for a in out.moe_aux]).double() / gas  # (L,)
            counts = torch.stack([a.routed_per_expert for a in out.moe_aux]).double()   # (L, E)
            logits = torch.stack([torch.stack([a.logit_max, a.logit_lse]) for a in out.moe_aux]
                                 ).double().t() / gas                                    # (2, L)
            stats[AUX] += out.aux_loss.detach().double() / gas
            stats[Z] += out.z_loss.detach().double() / gas
            stats[ENTROPY] += entropy.mean()
            stats[DROPPED] += dropped.mean()
            # counts, entropy, dropped and the logit sizes lie next to each other: one add
            stats[self.counts.start:self.logit_lse.stop] += torch.cat([counts.flatten(), entropy, dropped,
                                                                       logits.flatten()])

    def mtp_losses(self, values: list[float]) -> list[float]:
        """Each MTP depth's mean cross-entropy over its targets, from the host copy."""
        sums = values[self.mtp]
        depth = len(sums) // 2
        return [ce / max(n, 1) for ce, n in zip(sums[:depth], sums[depth:])]

    def add_layer(self, stats: torch.Tensor, j: int, counts, entropy, dropped, logit_max, logit_lse,
                  gas: int) -> None:
        """One micro-batch's values of MoE layer ``j`` alone (a pipeline stage's blocks)."""
        e = self.experts
        stats[self.counts][j * e:(j + 1) * e] += counts.double()
        for where, value in ((self.entropy, entropy), (self.dropped, dropped),
                             (self.logit_max, logit_max), (self.logit_lse, logit_lse)):
            stats[where.start + j] += value.double() / gas

    def add_expert_biases(self, stats: torch.Tensor, biases, share: int) -> None:
        """The expert bias each of this rank's MoE layers routed the step with, ``biases`` as
        (layer j, (E,) bias) pairs: divided by ``share``, the number of ranks in the batch group
        (every one holds the same bias), so that the step's sum is the bias itself."""
        if self.bias is None:
            return
        e = self.experts
        for j, bias in biases:
            stats[self.bias][j * e:(j + 1) * e] += bias.double() / share

    def moe_metrics(self, values: list[float], dp: int, blocks: list[int]) -> tuple[dict, dict]:
        """The router statistics of a step from the host copy ``values``: means over MoE layers
        for the metrics row (the load of the worst layer; with an expert bias, the widest
        spread of a layer's biases), and each layer's for W&B as ``moe/layer{i}/...``, ``i``
        the transformer block's index (``blocks``)."""
        e = self.experts
        counts, entropy, dropped = values[self.counts], values[self.entropy], values[self.dropped]
        logit_max, logit_lse = values[self.logit_max], values[self.logit_lse]
        row = {"aux_loss": values[AUX] / dp, "z_loss": values[Z] / dp,
               "router_entropy": values[ENTROPY] / dp, "dropped_frac": values[DROPPED] / dp,
               # the layer with the largest logits; the mean log-sum-exp over layers
               "router_logit_max": max(logit_max, default=0.0) / dp,
               "router_lse": sum(logit_lse) / max(len(logit_lse), 1) / dp}
        extra, worst = {}, 0.0
        for j, block in enumerate(blocks):
            tokens = [int(c) for c in counts[j * e:(j + 1) * e]]
            ratio = max(tokens) / max(sum(tokens) / e, 1e-9)
            worst = max(worst, ratio)
            extra[f"moe/layer{block}/load_max_over_mean"] = ratio
            extra[f"moe/layer{block}/tokens_per_expert"] = tokens
            extra[f"moe/layer{block}/router_entropy"] = entropy[j] / dp
            extra[f"moe/layer{block}/dropped_frac"] = dropped[j] / dp
            extra[f"moe/layer{block}/router_logit_max"] = logit_max[j] / dp
            extra[f"moe/layer{block}/router_lse"] = logit_lse[j] / dp
        row["expert_load_max_over_mean"] = worst         # the worst MoE layer
        if self.bias is not None:
            biases = [values[self.bias][j * e:(j + 1) * e] for j in range(len(blocks))]
            row["expert_bias_range"] = max(max(b) - min(b) for b in biases)
            for block, bias in zip(blocks, biases, strict=True):
                extra[f"moe/layer{block}/expert_bias"] = bias
        return row, extra


class BusyTime:
    """This rank's busy seconds per step (the module docstring's "Stragglers"), averaged over the
    steps measured since the last ``take_mean``."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.begin = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
        self.t0, self.pending = 0.0, False
        self.total, self.steps = 0.0, 0

    def start(self) -> None:
        """The step starts."""
        if self.cuda:
            self.begin.record()
        else:
            self.t0 = time.perf_counter()

    def arrive(self) -> None:
        """This rank reaches the step's statistics all-reduce: counted now on CPU; on a GPU the
        stream is marked, and ``synced`` counts it."""
        if self.cuda:
            self.end.record()
            self.pending = True
        else:
            self._add(time.perf_counter() - self.t0)

    def synced(self) -> None:
        """The host has waited for the step's statistics: a GPU's two events have completed."""
        if self.pending:
            self._add(self.begin.elapsed_time(self.end) / 1000)
            self.pending = False

    def take_mean(self) -> float | None:
        """The mean of the steps counted since the last call (None: none); starts a new window."""
        mean = self.total / self.steps if self.steps else None
        self.total, self.steps = 0.0, 0
        return mean

    def _add(self, seconds: float) -> None:
        self.total, self.steps = self.total + seconds, self.steps + 1


def busy_row(seconds: float, rank: int, world_size: int) -> list[float]:
    """This rank's row of the job-wide busy times: ``seconds`` at ``rank``, zeros elsewhere.
    Summed over the job, the rows give every rank's seconds at its index."""
    row = [0.0] * world_size
    row[rank] = seconds
    return row


def straggler_metrics(busy: list[float]) -> dict:
    """The metrics of the ranks' busy seconds ``busy`` (rank r's at index r): the largest, the
    median, and the rank with the largest (the lowest such rank on a tie)."""
    slowest = max(range(len(busy)), key=busy.__getitem__)
    return {"step_busy_s_max": busy[slowest], "step_busy_s_median": statistics.median(busy),
            "slowest_rank": slowest}
