"""Gradient sums of parameters that are replicated over ranks that see different tokens.

Every non-expert parameter is replicated over ep while the ep ranks route different tokens, and
some parameters are replicated over tp while the tp ranks see different tokens (norm weights
under sequence parallelism, kv heads when there are fewer of them than tp ranks). DeepSpeed
reduces over dp only (tp x ep is its "model parallel"), so their gradients must first be summed
over those groups. A parameter declares it at construction (``sum_grad_over``); the model uses
the parameter itself (no autograd op on it, so ZeRO-3 can free it after forward), and
``ReplicaGradSync`` sums its gradient from a hook on the parameter (``param.register_hook``: it
runs on this backward's gradient before it is accumulated into ``.grad``, so before any
post-accumulate-grad hook, DeepSpeed's included, whatever the registration order):

* ``"micro_batch"``: one all-reduce per parameter per backward, of this backward's gradient
  only (a post-accumulate-grad hook would see ``.grad`` accumulated over the earlier
  micro-batches, summed again). DeepSpeed's own hooks (ZeRO-2/3, ZeRO-1 with ``overlap_comm`` or
  a separate accumulation dtype, bf16 ZeRO-0) take ``.grad`` right after it is accumulated, and
  the pipeline engine runs backward per micro-batch, so no bucketing is possible there without
  letting DeepSpeed see an unsummed gradient: this is per parameter by necessity.
* ``"step"``: the gradients accumulate locally over the micro-batches; at the accumulation
  boundary's backward the first hook queues one callback at the end of backward, which sums the
  flattened gradients per (group, dtype) in buckets. For ZeRO-0 and ZeRO-1 without hooks, where
  DeepSpeed reduces after backward returns (``engine.allreduce_gradients``). The caller sets
  ``boundary`` before each backward.

A tied parameter (embedding and head) is one tensor: autograd adds the gradients of both uses
before its hook, which runs once per backward.
"""

from __future__ import annotations

from collections import defaultdict
from functools import partial

import torch
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from model.parallel import comm
from model.parallel.groups import ParallelGroups

MODES = ("micro_batch", "step")


def sum_grad_over(param: nn.Parameter, groups: ParallelGroups | None, *axes: str) -> nn.Parameter:
    """Declare that ``param`` is replicated over ``axes`` ("tp", "ep") while their ranks see
    different tokens: ``param.grad_sum_over`` becomes the group its gradient is summed over
    ("tp", "ep", or "mp" for both; None when those axes have one rank)."""
    g = groups or ParallelGroups()
    live = [a for a in ("tp", "ep") if a in axes and getattr(g, a) > 1]
    param.grad_sum_over = "mp" if len(live) == 2 else (live[0] if live else None)
    return param


class ReplicaGradSync:
    """Sums the gradients of ``module``'s parameters marked by ``sum_grad_over`` over their
    group (tp, ep or tp x ep), from gradient hooks installed at construction.

    Args:
        module: the model (or a pipeline stage); hooks go on its current parameters, so build
            this after the parameters are final (under ``zero.Init`` too: it keeps the objects).
        groups: the process groups.
        mode: "micro_batch" or "step" (see the module docstring); settable later.
        bucket_numel: elements per all-reduce bucket in "step" mode.
    """

    def __init__(self, module: nn.Module, groups: ParallelGroups | None, mode: str = "micro_batch",
                 bucket_numel: int = 25_000_000):
        self.groups = groups or ParallelGroups()
        self.mode = mode
        self.bucket_numel = bucket_numel
        self.boundary = True           # "step" mode: whether this backward ends the accumulation
        self._queued = False
        self.params = {p: name for name, p in module.named_parameters()   # deduplicated: tied once
                       if p.requires_grad and getattr(p, "grad_sum_over", None)}
        self._handles = [p.register_hook(partial(self._hook, p)) for p in self.params]

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        if value not in MODES:
            raise ValueError(f"ReplicaGradSync mode ({value!r}) must be one of {MODES}")
        self._mode = value

    def _group(self, param: torch.Tensor):
        return getattr(self.groups, f"{param.grad_sum_over}_group")

    def _hook(self, param: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor | None:
        if grad is None:        # a deferred weight gradient (weight_grad.py): its W sums it
            return None
        if self._mode == "micro_batch":      # a copy: autograd may hand the same tensor elsewhere
            return comm.all_reduce_sum(grad.clone(memory_format=torch.contiguous_format),
                                       self._group(param))
        if self.boundary and not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.sum_accumulated)
        return None

    def summed(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` summed over ``param``'s group now: a gradient added to ``.grad`` by hand
        (a deferred weight gradient, ``weight_grad.py``) fires no hook. "micro_batch" mode,
        whose hooks sum each backward's gradient the same way."""
        if self._mode != "micro_batch":
            raise RuntimeError("ReplicaGradSync.summed needs mode 'micro_batch' (a deferred "
                               "weight gradient lands after the step mode's end-of-backward sum)")
        return comm.all_reduce_sum(grad.contiguous(), self._group(param))

    def sum_accumulated(self) -> None:
        """Sum every marked gradient over its group, one all-reduce per (group, dtype) bucket
        ("step" mode's end-of-backward callback)."""
        self._queued = False
        buckets: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        for p, name in self.params.items():     # the same order on every rank
            if p.grad is None:
                raise RuntimeError(f"ReplicaGradSync: {name} has no gradient at the accumulation "
                                   f"boundary (a DeepSpeed hook took it during backward?): use "
                                   f"mode 'micro_batch' with this ZeRO configuration")
            buckets[(p.grad_sum_over, p.grad.dtype, p.grad.device)].append(p.grad)
        for (over, _, _), grads in buckets.items():
            group = getattr(self.groups, f"{over}_group")
            for chunk in _chunks(grads, self.bucket_numel):
                flat = comm.all_reduce_sum(_flatten_dense_tensors(chunk), group)
                for grad, summed in zip(chunk, _unflatten_dense_tensors(flat, chunk)):
                    grad.copy_(summed)


def _chunks(tensors: list[torch.Tensor], limit: int):
    """Consecutive runs of ``tensors`` of at most ``limit`` elements (a larger tensor alone)."""
    chunk, size = [], 0
    for t in tensors:
        if chunk and size + t.numel() > limit:
            yield chunk
            chunk, size = [], 0
        chunk.append(t)
        size += t.numel()
    if chunk:
        yield chunk
