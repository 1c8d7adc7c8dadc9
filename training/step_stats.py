"""The statistics vector of one optimizer step: its layout, what each micro-batch adds, and the
metrics read back from it.

One float64 vector on the compute device per step (``training/stepping.py``): filled with
device-side adds only, summed once over the ranks that see different tokens (and the pipeline
stages), and copied to the host once. L is the number of MoE layers, E the experts per layer:

    [ce_sum, target_tokens, nonfinite, aux, z, entropy, dropped, small-batch |G|^2]   scalars
    tokens per expert (L x E), router entropy (L), dropped fraction (L)               per layer
    expert bias (L x E), only when the router has one (loss-free balancing)
    router divergence (the tp x ep replicas of the router weights)                   last

The router values of the scalars are means over MoE layers and micro-batches, summed over ranks
(``moe_metrics`` divides by the data-parallel size).
"""

from __future__ import annotations

import torch

SCALARS = 8
NOISE = SCALARS - 1          # the small-batch |G|^2 (training/noise_scale.py)


class StatsLayout:
    """Where each value of the vector lives, for ``layers`` MoE layers of ``experts`` experts;
    ``bias``: the routers hold an expert bias (``model.moe.expert_bias``)."""

    def __init__(self, layers: int, experts: int, bias: bool):
        self.layers, self.experts = layers, experts
        counts_end = SCALARS + layers * experts
        self.counts = slice(SCALARS, counts_end)                       # (L x E,) layer-major
        self.entropy = slice(counts_end, counts_end + layers)
        self.dropped = slice(counts_end + layers, counts_end + 2 * layers)
        end = self.dropped.stop
        self.bias = slice(end, end + layers * experts) if bias and layers else None
        self.size = (self.bias.stop if self.bias else end) + 1        # + router divergence

    def new(self, device) -> torch.Tensor:
        return torch.zeros(self.size, dtype=torch.float64, device=device)

    def add_micro_batch(self, stats: torch.Tensor, out, loss: torch.Tensor, gas: int) -> None:
        """One micro-batch's loss sums and router values (``TransformerOutput``), ``loss`` its
        detached objective; no value leaves the device."""
        stats[0] += out.ce_sum.detach().double()
        stats[1] += out.num_target_tokens.double()
        stats[2] += (~torch.isfinite(loss)).double()
        if out.moe_aux:
            # Means over micro-batches here, over data-parallel ranks in moe_metrics.
            entropy = torch.stack([a.entropy for a in out.moe_aux]).double() / gas      # (L,)
            dropped = torch.stack([a.dropped_frac for a in out.moe_aux]).double() / gas  # (L,)
            counts = torch.stack([a.tokens_per_expert for a in out.moe_aux]).double()   # (L, E)
            stats[3] += out.aux_loss.detach().double() / gas
            stats[4] += out.z_loss.detach().double() / gas
            stats[5] += entropy.mean()
            stats[6] += dropped.mean()
            # counts, entropy and dropped lie next to each other: one add
            stats[self.counts.start:self.dropped.stop] += torch.cat([counts.flatten(), entropy, dropped])

    def add_layer(self, stats: torch.Tensor, j: int, counts, entropy, dropped, gas: int) -> None:
        """One micro-batch's values of MoE layer ``j`` alone (a pipeline stage's blocks)."""
        e = self.experts
        stats[self.counts][j * e:(j + 1) * e] += counts.double()
        stats[self.entropy.start + j] += entropy.double() / gas
        stats[self.dropped.start + j] += dropped.double() / gas

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
        row = {"aux_loss": values[3] / dp, "z_loss": values[4] / dp,
               "router_entropy": values[5] / dp, "dropped_frac": values[6] / dp}
        extra, worst = {}, 0.0
        for j, block in enumerate(blocks):
            tokens = [int(c) for c in counts[j * e:(j + 1) * e]]
            ratio = max(tokens) / max(sum(tokens) / e, 1e-9)
            worst = max(worst, ratio)
            extra[f"moe/layer{block}/load_max_over_mean"] = ratio
            extra[f"moe/layer{block}/tokens_per_expert"] = tokens
            extra[f"moe/layer{block}/router_entropy"] = entropy[j] / dp
            extra[f"moe/layer{block}/dropped_frac"] = dropped[j] / dp
        row["expert_load_max_over_mean"] = worst         # the worst MoE layer
        if self.bias is not None:
            biases = [values[self.bias][j * e:(j + 1) * e] for j in range(len(blocks))]
            row["expert_bias_range"] = max(max(b) - min(b) for b in biases)
            for block, bias in zip(blocks, biases, strict=True):
                extra[f"moe/layer{block}/expert_bias"] = bias
        return row, extra
