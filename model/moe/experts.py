"""SwiGLU experts stored as one stacked weight per projection, run as grouped GEMMs.

Rows arrive grouped by expert (see ``dispatcher.py``); ``tokens_per_expert`` gives the group
sizes. ``torch.nn.functional.grouped_mm`` multiplies each group by its own expert's matrix in one
call, with no Python loop over experts and no padding of every expert to the busiest one. Where
the kernel does not support the device/dtype (e.g. bf16 matrices whose rows are not 16-byte
aligned on CPU, or an older torch), a per-expert loop computes the same result.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.parallel.groups import ParallelGroups, local_experts
from model.parallel.layers import check_tp_divides, even_slice, shard_param

# (device type, dtype, 16-byte aligned) cases where the grouped kernel has been seen to fail;
# filled lazily so that the fallback costs one failed call per process, not one per step.
_UNSUPPORTED: set[tuple[str, torch.dtype, bool]] = set()
# torch >= 2.10 has F.grouped_mm; torch 2.9 only the private torch._grouped_mm (same signature).
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Grouped matmul: rows of group e are multiplied by ``w[e]``.

    Args:
        x: (N, K) rows grouped by expert.
        w: (E, K, M) one matrix per expert.
        tokens_per_expert: (E,) group sizes, summing to N.

    Returns:
        (N, M).
    """
    # The CPU kernel wants 16-byte aligned rows: a failure on one shape says nothing of the others.
    key = (x.device.type, x.dtype, _aligned(x) and _aligned(w))
    if _GROUPED_MM is not None and key not in _UNSUPPORTED:
        offsets = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)    # (E,) group ends
        try:
            return _GROUPED_MM(x, w, offs=offsets)
        except RuntimeError as err:
            # Out of memory is not a missing kernel: re-raise it (the trainer reports it) rather
            # than switch this process to the loop for good.
            if isinstance(err, torch.OutOfMemoryError) or "DefaultCPUAllocator" in str(err):
                raise
            _UNSUPPORTED.add(key)
    return _looped_mm(x, w, tokens_per_expert)


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])


def _looped_mm(x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Reference/fallback grouped matmul: one matmul per expert."""
    chunks = torch.split(x, tokens_per_expert.tolist(), dim=0)
    # unbind, not w[e]: its backward stacks the E weight gradients once, where every w[e] would
    # make a zero (E, K, M) gradient of its own (E^2*K*M writes; 24 s/step instead of 1.5 at E=64).
    return torch.cat([chunk @ w_e for chunk, w_e in zip(chunks, w.unbind(0))], dim=0)


class GroupedExperts(nn.Module):
    """E SwiGLU experts: ``down(silu(x @ gate) * (x @ up))`` per expert.

    Weights are stored in ``x @ W`` layout: ``gate_proj``/``up_proj`` are (E, H, I) and
    ``down_proj`` is (E, I, H). (transformers' Mixtral stores the transposes, fused gate+up; the
    converter transposes and splits.)

    Under expert parallelism this rank holds only its experts (``local_experts``), under tensor
    parallelism a 1/tp slice of each expert's inner dimension: the input is replicated over tp and
    the outputs are partial sums, as in a column- then row-parallel MLP; ``MoELayer`` sums them over
    tp after the combine, on T tokens instead of k*T rows.

    Args:
        num_experts: E, all experts of the layer.
        hidden_size: H.
        ffn_hidden_size: I, the full inner size of each expert.
        groups: process groups (None: single process).
    """

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, groups=None):
        super().__init__()
        g = self.groups = groups or ParallelGroups()
        self.expert_ids = local_experts(num_experts, g)
        check_tp_divides("model.ffn_hidden_size", ffn_hidden_size, g.tp)
        self.num_experts = len(self.expert_ids)
        inner = even_slice(ffn_hidden_size, g.tp, g.tp_rank)
        sharded = tuple(a for a, n in (("tp", g.tp), ("ep", g.ep)) if n > 1)
        E, H, I = num_experts, hidden_size, ffn_hidden_size
        for name, full, dim in (("gate_proj", (E, H, I), 2), ("up_proj", (E, H, I), 2),
                                ("down_proj", (E, I, H), 1)):
            shape = list(full)
            shape[0], shape[dim] = self.num_experts, len(inner)
            p = nn.Parameter(torch.empty(shape))
            setattr(self, name, shard_param(p, g, full, [(0, self.expert_ids), (dim, inner)], sharded))

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """(N, H) rows grouped by local expert -> (N, H) partial sums over tp: the caller passes
        the input through ``copy_to_region`` and sums the output over tp (``MoELayer`` does both
        on the T tokens rather than on the k*T rows)."""
        gate = grouped_mm(x, self.gate_proj, tokens_per_expert)     # (N, I/tp)
        up = grouped_mm(x, self.up_proj, tokens_per_expert)         # (N, I/tp)
        return grouped_mm(F.silu(gate) * up, self.down_proj, tokens_per_expert)   # (N, H) partial
