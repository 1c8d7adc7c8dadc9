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
the uninterrupted one. Half-precision (bf16) gradients are compressed in fp32: the sum with the
errors, Q, the QR and the result are fp32, written back rounded; what goes on the wire (the
vectors, P and Q; every gradient in the uncompressed steps) is in the gradients' own dtype, as
DeepSpeed's all-reduce sends it, so a rank-r step sends r (n + m) bf16 numbers per matrix. The
error feedback takes the factors' rounding as it takes the projection's: the error is M' minus
the P Q^T that every rank applies.
"""

from __future__ import annotations

import math
from collections.abc import Callable

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


def exchange_elements(shapes, rank: int) -> dict[str, int]:
    """What ``PowerSGD`` sends and keeps for gradients of ``shapes`` (one rank's), in elements:
    ``plain`` (sent as is, in the first all-reduce of a compressed step with the P factors),
    ``p`` and ``q`` (the factors: ``plain + p`` in the first all-reduce, ``q`` in the second),
    ``compressed`` (the gradient elements compressed: the error feedback's size), ``q_state``
    (the Q kept: ``q`` again) and ``total`` (what an uncompressed step sends). For the planner
    (``planning/estimator.py``); the trainer's counted bytes equal 4 x these
    (``tests/training/step/test_grad_compression_run.py``)."""
    out = dict.fromkeys(("plain", "p", "q", "compressed", "total"), 0)
    for shape in shapes:
        numel, view = math.prod(shape), matrix_view(torch.Size(shape), rank)
        out["total"] += numel
        if view is None:
            out["plain"] += numel
        else:
            batch, rows, cols = view
            out["p"] += batch * rows * rank
            out["q"] += batch * cols * rank
            out["compressed"] += numel
    return {**out, "q_state": out["q"]}


class PowerSGD:
    """Averages the gradients of ``params`` over ``group`` (``world`` ranks) in place, compressed
    (see the module docstring). Call ``reduce`` once per optimizer step, after the last backward,
    on every rank alike; a step that is not applied (skipped) must not call it, or, when the skip
    is decided after the exchange, must call ``reduce(tentative=True)`` and then ``rollback``
    (``commit`` when applied), the same on every rank.

    Args:
        params: (name, parameter) pairs, in the same order on every rank.
        group: the data-parallel process group (None: one rank).
        world: its size.
        rank: r, the factors' width.
        start_steps: reductions made uncompressed before the first compressed one.
        error_feedback: keep what compression leaves out and add it to the next step's gradient.
        seed: Q's initial draw (the same on every rank).
        bucket_numel: elements per all-reduce of the uncompressed reductions.
        member: this rank's index in ``group``.
        member_rank: the global rank of the ``group`` member of index i, at any group size (with
            the same model-parallel layout); names the checkpoint files ``load_other_world``
            reads. None: i (one rank per member).
    """

    def __init__(self, params, group, world: int, rank: int = 4, start_steps: int = 10,
                 error_feedback: bool = True, seed: int = 0, bucket_numel: int = 25_000_000,
                 member: int = 0, member_rank: Callable[[int], int] | None = None):
        if rank < 1 or start_steps < 0:
            raise ValueError(f"PowerSGD: rank {rank} must be >= 1 and start_steps {start_steps} >= 0")
        self.params = list(params)
        self.group, self.world, self.rank = group, world, rank
        self.member, self.member_rank = member, member_rank or (lambda i: i)
        self.start_steps, self.error_feedback, self.seed = start_steps, error_feedback, seed
        self.bucket_numel = bucket_numel
        self.views = [matrix_view(p.shape, rank) for _, p in self.params]
        self.reductions = 0             # reduce() calls so far (applied steps)
        self.q: list[torch.Tensor] | None = None       # (batch, m, r) per compressed tensor
        self.errors: list[torch.Tensor] | None = None  # (batch, n, m) per compressed tensor
        self.last_bytes = 0             # bytes this rank put into the all-reduces of the last reduce()
        self._pending = None            # a tentative reduce()'s new (count, Q, errors)
        self._spare: list[torch.Tensor] | None = None   # where a tentative reduce() writes its errors

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

    def _mean(self, tensors: list[torch.Tensor], wire: torch.dtype | None = None) -> int:
        """Average ``tensors`` over the group in place, in buckets, sent as ``wire`` (None: their
        own dtype); returns the bytes sent."""
        sent = 0
        for chunk in _chunks(tensors, self.bucket_numel):
            flat = _flatten_dense_tensors(chunk)
            sending = flat if wire is None else flat.to(wire)
            comm.all_reduce_sum(sending, self.group)
            sent += sending.numel() * sending.element_size()
            flat = sending.to(flat.dtype).div_(self.world)
            for t, mean in zip(chunk, _unflatten_dense_tensors(flat, chunk)):
                t.copy_(mean)
        return sent

    def _start_state(self, grads: list[torch.Tensor]) -> tuple[list, list]:
        """Q's first draw (from ``seed``: the same on every rank) and zero errors, fp32."""
        gen = torch.Generator().manual_seed(self.seed)
        q, errors = [], []
        for g, view in zip(grads, self.views):
            if view is None:
                continue
            batch, rows, cols = view
            q.append(torch.randn(batch, cols, self.rank, generator=gen).to(g.device))
            if self.error_feedback:
                errors.append(torch.zeros(batch, rows, cols, device=g.device))
        return q, errors

    @torch.no_grad()
    def reduce(self, tentative: bool = False) -> None:
        """Replace every ``.grad`` by its mean over the group: exactly for the uncompressed
        tensors and steps, as P Q^T for the compressed ones.

        ``tentative``: the step may still be skipped after the exchange (a gradient-norm spike,
        known only from the exchanged gradients): the new state (the count, Q and the errors)
        is kept aside, and ``commit`` takes it or ``rollback`` drops it, leaving the state as
        it was before this call; one of the two must come before the next ``reduce``. The new
        errors then go into a second buffer (one more fp32 copy of the compressed gradients,
        allocated on the first such step and reused)."""
        if self._pending is not None:
            raise RuntimeError("PowerSGD.reduce: the last tentative reduction was neither "
                               "committed nor rolled back")
        grads = self._grads()
        reductions = self.reductions + 1
        if not self.compressing:
            self.last_bytes = self._mean(grads)
            self._settle(tentative, reductions, self.q, self.errors)
            return
        fresh = self.q is None          # the first compressed step: its start state is nobody's yet
        q_old, e_old = self._start_state(grads) if fresh else (self.q, self.errors)
        given, plain_given = [], []
        for g, view in zip(grads, self.views):
            (plain_given if view is None else given).append(g if view is None else g.view(view))
        # In fp32 (bf16 gradients: fp32 copies, written back at the end; fp32: the gradients).
        mats, plain = [m.float() for m in given], [t.float() for t in plain_given]
        if self.error_feedback:
            for m, e in zip(mats, e_old):
                m.add_(e)
        wire = grads[0].dtype if grads else None     # sent as the gradients are (bf16: bf16)
        ps = [torch.bmm(m, q) for m, q in zip(mats, q_old)]
        sent = self._mean(plain + ps, wire)                     # the vectors and every P at once
        ps = [torch.linalg.qr(p).Q for p in ps]                 # orthonormal columns, batched
        qs = [torch.bmm(m.transpose(1, 2), p) for m, p in zip(mats, ps)]
        sent += self._mean(qs, wire)
        e_new = e_old                   # overwritten in place: committed now, or fresh zeros
        if self.error_feedback and tentative and not fresh:
            if self._spare is None:
                self._spare = [torch.empty_like(e) for e in e_old]
            e_new = self._spare         # aside: e_old stays what rollback() leaves
        for i, (m, p, q) in enumerate(zip(mats, ps, qs)):
            approx = torch.bmm(p, q.transpose(1, 2))
            if self.error_feedback:
                torch.sub(m, approx, out=e_new[i])
            m.copy_(approx)
        for out, work in zip(given + plain_given, mats + plain):
            if out is not work:         # half-precision gradients: the result, rounded
                out.copy_(work)
        self.last_bytes = sent
        self._settle(tentative, reductions, qs, e_new)

    def _settle(self, tentative: bool, reductions: int, q, errors) -> None:
        if tentative:
            self._pending = (reductions, q, errors)
        else:
            self.reductions, self.q, self.errors = reductions, q, errors

    def commit(self) -> None:
        """Keep the state the last ``reduce(tentative=True)`` computed (the step is applied)."""
        if self._pending is None:
            raise RuntimeError("PowerSGD.commit: no tentative reduction to commit")
        reductions, q, errors = self._pending
        if errors is not None and errors is self._spare:
            self._spare = self.errors   # the old errors' buffers take the next step's new ones
        self.reductions, self.q, self.errors = reductions, q, errors
        self._pending = None

    def rollback(self) -> None:
        """Drop the state the last ``reduce(tentative=True)`` computed (the step is skipped): the
        count, Q and the errors are as before that call. The ``.grad`` it wrote stays (the
        skipped step zeroes it)."""
        if self._pending is None:
            raise RuntimeError("PowerSGD.rollback: no tentative reduction to roll back")
        self._pending = None

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
        self.reductions, self._pending, self._spare = int(state["reductions"]), None, None
        self.q = None if q is None else [t.to(device) for t in q]
        self.errors = None if q is None else ([t.to(device) for t in errors] if self.error_feedback else [])

    def load_other_world(self, read: Callable[[int], dict], saved_ranks: int, ranks: int) -> str:
        """Take the state of a checkpoint saved at another data-parallel size, and return the one
        line that says what was done. ``read(r)``: the state global rank ``r`` saved (its
        ``state_dict``); ``saved_ranks`` and ``ranks``: the job's sizes then and now, with as
        many ranks per data-parallel member (``ranks // world``: a model-parallel change is
        refused before this, ``training/checkpoint/resume.py``).

        Exact for the exchange: it sees the errors only through their mean over the group (each
        step averages M + e: P = mean(M + e) Q, Q = mean(M + e)^T P, and the mean of the new
        errors is mean(M + e) - P Q^T), so member j takes the sum of the saved members'
        errors i = j, j + W, j + 2 W, ... (W members now, W' saved) times W / W': the mean over
        the members is the saved mean. A member with none (a larger world) starts from zero
        errors. Q and the count, the same on every rank, carry over."""
        per = ranks // self.world
        if not per or ranks % self.world or saved_ranks % per:
            raise ValueError(f"the checkpoint's PowerSGD state was saved by {saved_ranks} ranks, "
                             f"which do not split into data-parallel members of {per} ranks as "
                             f"this run's {ranks} do: resume with the layout that wrote it")
        saved = saved_ranks // per
        members = list(range(self.member, saved, self.world))
        states = [read(self.member_rank(i)) for i in members] or [read(self.member_rank(self.member % saved))]
        state = dict(states[0])
        if state.get("errors") is not None:
            if members:
                total = [t.clone() for t in states[0]["errors"]]
                for other in states[1:]:
                    for t, e in zip(total, other["errors"], strict=True):
                        t.add_(e)
                state["errors"] = [t.mul_(self.world / saved) for t in total]
            else:
                state["errors"] = [torch.zeros_like(t) for t in state["errors"]]
        self.load_state_dict(state)
        return (f"PowerSGD state saved by {saved} data-parallel ranks resharded onto {self.world}: "
                f"each rank's error feedback is the sum of its share of the saved ranks' x "
                f"{self.world}/{saved} (their mean, all the exchange uses, is kept); Q and the "
                f"step count carried over")
