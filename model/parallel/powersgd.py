"""The data-parallel gradient exchange compressed with PowerSGD (Vogels, Karimireddy and Jaggi,
"PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization", 2019), with
error feedback and a warm-started Q.

Why hand-written: torch ships PowerSGD only as a DDP communication hook (the trainer runs under
DeepSpeed's engine, not DDP), and that hook flattens a gradient of more than two dimensions into
one matrix: the stacked experts, (E, H, I), would become one (E*H, I) matrix whose rank can be E
times one expert's, which a rank-r factorisation cannot follow. Here each expert is its own
matrix, and a tensor's experts are compressed together in batched matmuls.

For a gradient matrix M (n x m) on each of W ranks, with this rank's error e (n x m) and the
kept Q (m x r):

    M' = M + e                  error feedback: what earlier compressions left out
    P  = M' Q                   all-reduced (mean) and orthonormalized (QR)     n r numbers
    Q  = M'^T P                 all-reduced (mean), kept for the next step      m r numbers
    M^ = P Q^T                  the same on every rank: mean(M') projected on span(P)
    e  = M' - M^                kept on this rank for the next step

One power iteration per step, started from last step's Q, tracks the top-r subspace of a
gradient that moves slowly. Without error feedback what the projection drops is lost every step,
and training converges worse (the paper's Table 3; docs/communication.md measures it here). Per
matrix the exchange is r (n + m) numbers instead of n m; a tensor whose factors would not save
at least half (vectors: norms and biases; small matrices) goes uncompressed, in the same
all-reduce as the P factors, so that a step makes two bucketed all-reduces in all. The first
``start_steps`` reductions are uncompressed (the gradient changes fastest at the start, and the
error-feedback state starts from there).

State per rank: the errors (one fp32 copy of the compressed gradients: this rank's own) and Q
(the same on every rank); ``state_dict`` carries both, so that a resumed run reduces exactly as
the uninterrupted one.
"""

from __future__ import annotations

import math

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from model.parallel import comm
from model.parallel.grad_sync import _chunks

MIN_SAVING = 2.0        # compress a matrix only when its factors are at most half its size


def matrix_view(shape: torch.Size, rank: int) -> tuple[int, int, int] | None:
    """(batch, n, m) that a gradient of ``shape`` is compressed as, or None (sent as is): a
    matrix is one (n, m); a stacked tensor (E, n, m, ...) is E matrices (one per expert), each
    (n, m x ...). None for vectors and where rank-``rank`` factors would not save half."""
    if len(shape) < 2:
        return None
    batch, rows, cols = (1, shape[0], math.prod(shape[1:])) if len(shape) == 2 else \
        (shape[0], shape[1], math.prod(shape[2:]))
    if rank * (rows + cols) * MIN_SAVING > rows * cols:
        return None
    return batch, rows, cols


class PowerSGD:
    """Averages the gradients of ``params`` over ``group`` (``world`` ranks) in place, compressed
    (see the module docstring). Call ``reduce`` once per optimizer step, after the last backward,
    on every rank alike; a step that is not applied (skipped) must not call it.

    Args:
        params: (name, parameter) pairs, in the same order on every rank.
        group: the data-parallel process group (None: one rank).
        world: its size.
        rank: r, the factors' width.
        start_steps: reductions made uncompressed before the first compressed one.
        error_feedback: keep what compression leaves out and add it to the next step's gradient.
        seed: Q's initial draw (the same on every rank).
        bucket_numel: elements per all-reduce of the uncompressed reductions.
    """

    def __init__(self, params, group, world: int, rank: int = 4, start_steps: int = 10,
                 error_feedback: bool = True, seed: int = 0, bucket_numel: int = 25_000_000):
        if rank < 1 or start_steps < 0:
            raise ValueError(f"PowerSGD: rank {rank} must be >= 1 and start_steps {start_steps} >= 0")
        self.params = list(params)
        self.group, self.world, self.rank = group, world, rank
        self.start_steps, self.error_feedback, self.seed = start_steps, error_feedback, seed
        self.bucket_numel = bucket_numel
        self.views = [matrix_view(p.shape, rank) for _, p in self.params]
        self.reductions = 0             # reduce() calls so far (applied steps)
        self.q: list[torch.Tensor] | None = None       # (batch, m, r) per compressed tensor
        self.errors: list[torch.Tensor] | None = None  # (batch, n, m) per compressed tensor
        self.last_bytes = 0             # bytes this rank put into the all-reduces of the last reduce()

    @property
    def compressing(self) -> bool:
        """Whether the next ``reduce`` compresses."""
        return self.reductions >= self.start_steps and any(v is not None for v in self.views)

    def bytes_per_step(self, compressed: bool = True) -> int:
        """The bytes this rank hands to the all-reduces of one step, compressed or not (fp32)."""
        total = 0
        for (_, p), view in zip(self.params, self.views):
            if compressed and view is not None:
                batch, rows, cols = view
                total += batch * self.rank * (rows + cols)
            else:
                total += p.numel()
        return total * 4

    def _grads(self) -> list[torch.Tensor]:
        grads = []
        for _, p in self.params:
            if p.grad is None:          # unused this step on this rank: zeros, for equal buffers
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        return grads

    def _mean(self, tensors: list[torch.Tensor]) -> int:
        """Average ``tensors`` over the group in place, in buckets; returns the bytes sent."""
        sent = 0
        for chunk in _chunks(tensors, self.bucket_numel):
            flat = _flatten_dense_tensors(chunk)
            comm.all_reduce_sum(flat, self.group).div_(self.world)
            sent += flat.numel() * flat.element_size()
            for t, mean in zip(chunk, _unflatten_dense_tensors(flat, chunk)):
                t.copy_(mean)
        return sent

    def _start_state(self, grads: list[torch.Tensor]) -> None:
        gen = torch.Generator().manual_seed(self.seed)
        self.q, self.errors = [], []
        for g, view in zip(grads, self.views):
            if view is None:
                continue
            batch, rows, cols = view
            self.q.append(torch.randn(batch, cols, self.rank, generator=gen).to(g.device, g.dtype))
            if self.error_feedback:
                self.errors.append(torch.zeros(batch, rows, cols, device=g.device, dtype=g.dtype))

    @torch.no_grad()
    def reduce(self) -> None:
        """Replace every ``.grad`` by its mean over the group: exactly for the uncompressed
        tensors and steps, as P Q^T for the compressed ones."""
        grads = self._grads()
        compress = self.compressing
        self.reductions += 1
        if not compress:
            self.last_bytes = self._mean(grads)
            return
        if self.q is None:
            self._start_state(grads)
        mats, plain = [], []
        for g, view in zip(grads, self.views):
            (plain if view is None else mats).append(g if view is None else g.view(view))
        if self.error_feedback:
            for m, e in zip(mats, self.errors):
                m.add_(e)
        ps = [torch.bmm(m, q) for m, q in zip(mats, self.q)]
        sent = self._mean(plain + ps)                           # the vectors and every P at once
        ps = [torch.linalg.qr(p).Q for p in ps]                 # orthonormal columns, batched
        qs = [torch.bmm(m.transpose(1, 2), p) for m, p in zip(mats, ps)]
        sent += self._mean(qs)
        for i, (m, p, q) in enumerate(zip(mats, ps, qs)):
            self.q[i].copy_(q)
            approx = torch.bmm(p, q.transpose(1, 2))
            if self.error_feedback:
                torch.sub(m, approx, out=self.errors[i])
            m.copy_(approx)
        self.last_bytes = sent

    def state_dict(self) -> dict:
        """This rank's state: plain data and CPU tensors (the checkpoint is read weights-only)."""
        cpu = (lambda ts: None if ts is None else [t.detach().cpu().clone() for t in ts])
        return {"reductions": self.reductions, "rank": self.rank, "q": cpu(self.q),
                "errors": cpu(self.errors) if self.error_feedback else None}

    def load_state_dict(self, state: dict) -> None:
        """Take ``state_dict``'s state back; ValueError (one line) when it does not fit."""
        if state.get("rank") != self.rank:
            raise ValueError(f"the checkpoint's PowerSGD state has rank {state.get('rank')}, the "
                             f"run asks for {self.rank}: resume with parallel.powersgd_rank="
                             f"{state.get('rank')}")
        shapes = [(v[0], v[2], self.rank) for v in self.views if v is not None]
        q = state.get("q")
        if q is not None and [tuple(t.shape) for t in q] != shapes:
            raise ValueError("the checkpoint's PowerSGD state does not fit this model's gradients: "
                             "resume with the model and layout that wrote it")
        errors = state.get("errors") if self.error_feedback else None
        if q is not None and self.error_feedback and errors is None:
            raise ValueError("the checkpoint's PowerSGD state has no error feedback and the run "
                             "asks for it: resume with parallel.powersgd_error_feedback=false")
        device = self.params[0][1].device if self.params else torch.device("cpu")
        self.reductions = int(state["reductions"])
        self.q = None if q is None else [t.to(device) for t in q]
        self.errors = None if q is None else ([t.to(device) for t in errors] if self.error_feedback else [])
