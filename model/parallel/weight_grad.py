"""Weight gradients that can wait: the B / W split of zero-bubble pipelining (Qi et al., 2023).

A linear layer's backward is two matmuls: the input gradient ``dx = dy W`` (B), which the
previous pipeline stage is waiting for, and the weight gradient ``dW = dy^T x`` (W), which
nobody needs before the optimizer step. The ZB-H1 schedule (``training/engine/pipe_schedules.py``)
runs B at once and W later, in the time a stage would otherwise wait.

``STORE.enabled`` routes the model's linear sites through functions whose backward asks
``STORE.defer`` first: inside ``STORE.deferring()`` (a B) the weight gradient is queued as a
closure over its inputs (``x``, ``dy``) and autograd gets no gradient for the weight; outside
it (a plain backward, the first stage's) it is computed at once, so an enabled model trains the
same everywhere. Deferred sites: the column- and row-parallel linears (attention, dense MLP,
shared experts, an untied output head; ``model/parallel/layers.py``, ``model/moe/shared.py``), the sequence-parallel
gather into column-parallel layers (whose W all-gathers the input shard again,
``model/parallel/comm.py``) and the grouped-GEMM experts (``model/moe/experts.py``). The
embedding (and a head tied to it), the norms and the router keep their weight gradients in B.

``run_oldest`` (a W) computes the oldest B's queued gradients and adds them to ``.grad``. Two
things autograd would have done are done here by hand: a weight replicated over tp or ep whose
ranks saw different tokens has its gradient summed over them (``reduce``, which the pipeline
stage points at ``ReplicaGradSync.summed``: a gradient added by hand fires no ``register_hook``),
and gradients only ever accumulate into ``.grad``, or into where the optimizer accumulates them
when that is not ``.grad`` (``sink``: the pipeline stage points it at the fp32 accumulators of
an optimizer that moves ``.grad`` away after every backward).

Hand-written because neither torch's autograd nor DeepSpeed splits a backward this way
(``torch.distributed.pipelining``'s ``stage_backward_weight`` works on torch's own pipeline
stages, not on DeepSpeed's engine).
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from typing import Callable

import torch
import torch.nn.functional as F


class WeightGradStore:
    """The queue of deferred weight gradients, one entry per B (micro-batch), oldest first."""

    def __init__(self) -> None:
        self.enabled = False            # the model's linear sites go through ``linear`` & co.
        self.reduce: Callable | None = None      # (param, grad) -> grad summed over its replicas
        self.sink: Callable | None = None        # (param, grad) -> True if it took the gradient
        self._deferring = False
        self._current: list = []
        self._queue: deque[list] = deque()

    def configure(self, enabled: bool, reduce: Callable | None = None, sink: Callable | None = None) -> None:
        """Set for one engine (a process may build several, one after the other)."""
        self.enabled, self.reduce, self.sink = enabled, reduce, sink
        self._deferring, self._current = False, []
        self._queue.clear()

    @property
    def pending(self) -> int:
        """Micro-batches whose weight gradients are still queued."""
        return len(self._queue)

    def defer(self, params: tuple, compute: Callable[[], tuple]) -> bool:
        """Queue ``compute`` (returning one gradient per parameter of ``params``) if inside a B;
        False if the caller must compute the gradients now."""
        if not self._deferring:
            return False
        self._current.append((params, compute))
        return True

    @contextmanager
    def deferring(self):
        """One B: the weight gradients met in this block form one queue entry."""
        self._deferring, self._current = True, []
        try:
            yield
        finally:
            self._deferring = False
            self._queue.append(self._current)
            self._current = []

    def run_oldest(self) -> None:
        """One W: the oldest queued B's weight gradients, added to ``.grad``."""
        with torch.no_grad():           # as inside autograd's backward: no graph recorded
            for params, compute in self._queue.popleft():
                self._add(params, compute())

    def _add(self, params: tuple, grads: tuple) -> None:
        for param, grad in zip(params, grads):
            if grad is None:
                continue
            if self.reduce is not None and getattr(param, "grad_sum_over", None):
                grad = self.reduce(param, grad)
            if self.sink is not None and self.sink(param, grad):
                continue
            if param.grad is None:
                param.grad = grad.to(param.dtype)
            else:
                param.grad.add_(grad)


STORE = WeightGradStore()


class _Linear(torch.autograd.Function):
    """``F.linear(x, w)`` whose weight gradient may be deferred (``STORE.defer``)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x)
        ctx.weight = w          # the parameter itself: W adds to its ``.grad``
        return F.linear(x, w)

    @staticmethod
    def backward(ctx, dy):
        (x,), w = ctx.saved_tensors, ctx.weight
        dx = dy @ w if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            def compute():
                return (dy.flatten(0, -2).t() @ x.flatten(0, -2),)
            if not STORE.defer((w,), compute):
                dw = compute()[0]
        return dx, dw


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)``; with ``STORE.enabled`` its weight gradient can be deferred."""
    return _Linear.apply(x, w) if STORE.enabled else F.linear(x, w)
