"""Shared experts: an always-on SwiGLU FFN beside the routed experts (DeepSeek-MoE/V3, Qwen2-MoE).

Every token goes through it; its output is added to the routed experts' combined output,
optionally scaled per token by ``sigmoid(x @ w_gate)`` (Qwen2-MoE's ``shared_expert_gate``).
``num_shared_experts`` experts of inner size I are one FFN of inner size ``num_shared_experts *
I`` (the sum of SwiGLU FFNs on the same input is one SwiGLU FFN with their inner dims stacked),
or ``shared_expert_ffn_hidden_size`` when set.

Tensor parallelism as the dense MLP: gate and up column parallel, down row parallel (the
layers of ``model/parallel/layers.py``, so the same shard bookkeeping and init from the full
weights). ``MoELayer`` hands it the tokens already inside its tensor-parallel region and sums
its partial output over tp together with the routed experts' (one all-reduce or reduce-scatter
for both). Its weights are replicated over ep, whose ranks see different tokens: their gradients
are summed over ep (``sum_grad_over``, declared by the layers). The gate's (1, H) weight is
replicated over tp too; the gate value is computed from the router's input, outside the region,
and enters the region as the combine weights do, so its gradient is summed over tp before it
reaches the weight, which then only needs the sum over ep.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.parallel import comm, weight_grad
from model.parallel.grad_sync import sum_grad_over
from model.parallel.groups import ParallelGroups
from model.parallel.layers import (ColumnParallelLinear, RowParallelLinear, check_tp_divides,
                                   replicated)


class SharedExperts(nn.Module):
    """``down(silu(x @ gate) * (x @ up))`` on every token, inner size split over tp.

    Args:
        hidden_size: H.
        ffn_hidden_size: the full inner size (all shared experts together).
        groups: process groups (None: single process).
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, groups=None):
        super().__init__()
        self.groups = groups or ParallelGroups()
        check_tp_divides("model.moe.shared_expert_ffn_hidden_size", ffn_hidden_size, self.groups.tp)
        self.gate_proj = ColumnParallelLinear(hidden_size, ffn_hidden_size, groups)
        self.up_proj = ColumnParallelLinear(hidden_size, ffn_hidden_size, groups)
        self.down_proj = RowParallelLinear(ffn_hidden_size, hidden_size, groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(T, H) tokens inside the tp region (replicated or gathered, gradient summed over tp
        by the caller's region entry) -> (T, H) partial sums over tp."""
        gate = weight_grad.linear(x, self.gate_proj.weight)                     # (T, I/tp)
        up = weight_grad.linear(x, self.up_proj.weight)                         # (T, I/tp)
        return weight_grad.linear(F.silu(gate) * up, self.down_proj.weight)     # (T, H) partial


class SharedExpertGate(nn.Module):
    """``sigmoid(x @ w_gate^T)`` per token, a (1, H) weight replicated over tp and ep."""

    def __init__(self, hidden_size: int, groups=None):
        super().__init__()
        self.groups = groups or ParallelGroups()
        self.weight = sum_grad_over(replicated(nn.Parameter(torch.empty(1, hidden_size)), groups),
                                    groups, "ep")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(T, H) router input (outside the tp region) -> (T, 1) gate inside it: its gradient is
        summed over tp, as the shared output it scales is a partial sum there."""
        return comm.copy_to_region(torch.sigmoid(F.linear(x, self.weight)), self.groups.tp_group)
