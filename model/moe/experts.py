"""SwiGLU experts stored as one stacked weight per projection, run as grouped GEMMs.

Rows arrive grouped by expert (see ``dispatcher.py``); ``rows_per_expert`` gives the group
sizes. ``torch.nn.functional.grouped_mm`` multiplies each group by its own expert's matrix in one
call, with no Python loop over experts and no padding of every expert to the busiest one, reading
the group offsets on the device. Elsewhere a per-expert loop computes the same result from host
sizes:

* CUDA: torch's grouped kernel runs bf16 on compute capability 9.x/10.x (H100/H200, B200) only.
  Any other dtype or GPU takes ATen's own fallback, which copies the offsets to the host in each
  of a layer's nine grouped GEMMs (three forward, six backward); the loop copies the sizes once
  per layer call, and not at all under expert parallelism, whose exchange already brought them.
* CPU: torch's kernel (a loop of its own on the host), unless it refuses the operands (e.g. rows
  that are not 16-byte aligned) or this torch has none (2.9).

Under ``torch.compile`` (``train.compile``) that choice cannot be traced: it reads ``data_ptr()``
and catches the kernel's refusal, and the loop needs host sizes. So the compiled block calls two
custom ops instead, ``moe::grouped_mm`` and its weight gradient ``moe::grouped_mm_wgrad``, opaque
to the compiler (no graph break) and making the same choice when they run. Their backward is
ATen's own for the kernel (checked bitwise in tests/model/test_compile.py), so compiled and eager
agree; outside a compiled region nothing changes. The loop under compile reads the sizes in each
of its nine GEMMs (three forward, six backward), not once per layer call: on a GPU without the
kernel (fp32, or not sm 9.x/10.x) that is nine device syncs per MoE layer instead of one.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.parallel import weight_grad
from model.parallel.groups import ParallelGroups, local_experts
from model.parallel.layers import check_tp_divides, even_slice, shard_param

# (device type, dtype, 16-byte aligned) cases the grouped kernel refused; filled lazily so that
# the fallback costs one failed call per process, not one per step.
_UNSUPPORTED: set[tuple[str, torch.dtype, bool]] = set()
# torch >= 2.10 has F.grouped_mm; torch 2.9 only the private torch._grouped_mm (same signature).
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
# How torch's kernel refuses operands it cannot take: ATen's GroupedMMUtils.h (strides, alignment,
# dtype), torch 2.9's bf16-only check, and the dispatcher's message for a backend without the
# kernel. Anything else -- out of memory, a CUDA error (sticky: the context is lost), a shape bug
# of ours -- propagates instead of switching this process to the loop.
_REFUSALS = ("strides should be multiple of 16 bytes", "expected data_ptr to be aligned to 16 bytes",
             "Invalid strides/sizes", "to be Float32, BFloat16 or Float16 matrix",
             "to be BFloat16 matrix", "Could not run 'aten::_grouped_mm'")


class ExpertGroups:
    """The group sizes of one layer call, shared by its grouped GEMMs: the (E,) device counts,
    their int32 offsets for the kernel (one cumsum per call), and host sizes for the loop, copied
    at most once per call (never on the kernel path), or handed in by a caller that has them."""

    def __init__(self, rows_per_expert: torch.Tensor, sizes: list[int] | None = None):
        self.counts, self._sizes = rows_per_expert, sizes

    @functools.cached_property
    def offsets(self) -> torch.Tensor:
        return torch.cumsum(self.counts, 0, dtype=torch.int32)             # (E,) group ends

    def sizes(self) -> list[int]:
        if self._sizes is None:
            self._sizes = self.counts.tolist()      # the loop's one device-to-host copy
        return self._sizes


def grouped_mm(x: torch.Tensor, w: torch.Tensor,
               rows_per_expert: torch.Tensor | ExpertGroups) -> torch.Tensor:
    """Grouped matmul: rows of group e are multiplied by ``w[e]``.

    Args:
        x: (N, K) rows grouped by expert; rows past the last group (dropped by a capacity) are
            not read, and their output rows are unspecified.
        w: (E, K, M) one matrix per expert.
        rows_per_expert: (E,) group sizes, summing to at most N (or their ``ExpertGroups``).

    Returns:
        (N, M).
    """
    groups = (rows_per_expert if isinstance(rows_per_expert, ExpertGroups)
              else ExpertGroups(rows_per_expert))
    if torch.compiler.is_compiling():       # the choice below runs inside the op, not traced
        return torch.ops.moe.grouped_mm(x, w, groups.counts)
    # The CPU kernel wants 16-byte aligned rows: a refusal of one shape says nothing of the others.
    key = (x.device.type, x.dtype, _aligned(x) and _aligned(w))
    if _kernel_reads_offsets_on_device(x, w) and key not in _UNSUPPORTED:
        try:
            return _GROUPED_MM(x, w, offs=groups.offsets)
        except RuntimeError as err:
            if not any(m in str(err) for m in _REFUSALS):
                raise
            _UNSUPPORTED.add(key)
    return _looped_mm(x, w, groups)


def _kernel_reads_offsets_on_device(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch's grouped kernel runs here without a host copy of the offsets."""
    if _GROUPED_MM is None:
        return False
    if x.device.type != "cuda":
        return True        # the CPU kernel loops on the host: there is no device to wait for
    # ATen's fast path (_grouped_mm_cuda): bf16 on sm 9.x/10.x; ROCm only with CK builds.
    return (torch.version.hip is None and x.dtype == w.dtype == torch.bfloat16
            and _capability(x.device)[0] in (9, 10))


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])


def _looped_mm(x: torch.Tensor, w: torch.Tensor,
               rows_per_expert: torch.Tensor | ExpertGroups) -> torch.Tensor:
    """Reference/fallback grouped matmul: one matmul per expert, from host group sizes (one
    device-to-host copy per layer call unless the caller handed them in)."""
    groups = (rows_per_expert if isinstance(rows_per_expert, ExpertGroups)
              else ExpertGroups(rows_per_expert))
    sizes = groups.sizes()
    rest = x.shape[0] - sum(sizes)                  # rows dropped by a capacity, after the groups
    chunks = torch.split(x, sizes + [rest], dim=0)
    # unbind, not w[e]: its backward stacks the E weight gradients once, where every w[e] would
    # make a zero (E, K, M) gradient of its own (E^2*K*M writes; 24 s/step instead of 1.5 at E=64).
    out = [chunk @ w_e for chunk, w_e in zip(chunks, w.unbind(0))]
    if rest:
        out.append(x.new_zeros(rest, w.shape[-1]))
    return torch.cat(out, dim=0)


# ----------------------------------------------------------------------------------------------
# The same products as custom ops, for compiled blocks (see the module docstring).

@torch.library.custom_op("moe::grouped_mm", mutates_args=())
def _grouped_mm_op(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``grouped_mm`` as one op: (N, K) x (E, K, M) -> (N, M), kernel or loop chosen at run time."""
    return grouped_mm(x, w, counts).contiguous()        # the layout the fake promises


@_grouped_mm_op.register_fake
def _(x, w, counts):
    return x.new_empty((x.shape[0], w.shape[-1]), dtype=torch.promote_types(x.dtype, w.dtype))


@torch.library.custom_op("moe::grouped_mm_wgrad", mutates_args=())
def _grouped_mm_wgrad_op(x: torch.Tensor, dy: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The weight gradient of ``grouped_mm``: (N, K), (N, M) -> (E, K, M), ``x_e^T @ dy_e`` per
    group (zeros for an empty one); ATen's grouped kernel on (K, N) x (N, M), else a loop."""
    key = (x.device.type, x.dtype, _aligned(x) and _aligned(dy), "wgrad")
    if _kernel_reads_offsets_on_device(x, dy) and key not in _UNSUPPORTED:
        try:
            return _GROUPED_MM(x.t(), dy, offs=torch.cumsum(counts, 0, dtype=torch.int32)).contiguous()
        except RuntimeError as err:
            if not any(m in str(err) for m in _REFUSALS):
                raise
            _UNSUPPORTED.add(key)
    sizes = counts.tolist()                          # host sizes, as the loop of ``grouped_mm``
    chunks_x = torch.split(x[:sum(sizes)], sizes)
    chunks_dy = torch.split(dy[:sum(sizes)], sizes)
    return torch.stack([cx.t() @ cd for cx, cd in zip(chunks_x, chunks_dy)])   # (E, K, M)


@_grouped_mm_wgrad_op.register_fake
def _(x, dy, counts):
    return x.new_empty((counts.shape[0], x.shape[1], dy.shape[1]))


def _grouped_mm_setup(ctx, inputs, output):
    x, w, counts = inputs
    ctx.save_for_backward(x, w, counts)


def _grouped_mm_backward(ctx, dy):
    """ATen's ``_grouped_mm`` backward: dx = dy @ w_e^T per group, dw = x_e^T @ dy_e."""
    x, w, counts = ctx.saved_tensors
    dx = torch.ops.moe.grouped_mm(dy, w.transpose(-2, -1), counts) if ctx.needs_input_grad[0] else None
    dw = torch.ops.moe.grouped_mm_wgrad(x, dy, counts) if ctx.needs_input_grad[1] else None
    return dx, dw, None


_grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


class _DeferrableGroupedMM(torch.autograd.Function):
    """``grouped_mm`` whose weight gradient may wait for a W (``model/parallel/weight_grad.py``):
    the same products as its own backward, ``dx = dy @ w_e^T`` now, ``dw = x_e^T @ dy_e`` now
    or queued."""

    @staticmethod
    def forward(ctx, x, w, groups):
        ctx.save_for_backward(x)
        ctx.weight, ctx.groups = w, groups      # the parameter itself: W adds to its ``.grad``
        return grouped_mm(x, w, groups)

    @staticmethod
    def backward(ctx, dy):
        (x,), w, groups = ctx.saved_tensors, ctx.weight, ctx.groups
        dx = grouped_mm(dy, w.transpose(-2, -1), groups) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            def compute():
                return (torch.ops.moe.grouped_mm_wgrad(x, dy, groups.counts),)
            if not weight_grad.STORE.defer((w,), compute):
                dw = compute()[0]
        return dx, dw, None


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
        check_tp_divides("expert inner size (model.moe.expert_ffn_hidden_size, else "
                         "model.ffn_hidden_size)", ffn_hidden_size, g.tp)
        self.num_experts = len(self.expert_ids)
        inner = even_slice(ffn_hidden_size, g.tp, g.tp_rank)
        sharded = tuple(a for a, n in (("tp", g.tp), ("ep", g.ep)) if n > 1)
        E, H, I = num_experts, hidden_size, ffn_hidden_size
        for name, full, dim in (("gate_proj", (E, H, I), 2), ("up_proj", (E, H, I), 2),
                                ("down_proj", (E, I, H), 1)):
            shape = list(full)
            shape[0], shape[dim] = self.num_experts, len(inner)
            p = nn.Parameter(torch.empty(shape))
            # Init blocks of one expert: an ep rank draws only its experts, whichever placement.
            setattr(self, name, shard_param(p, g, full, [(0, self.expert_ids), (dim, inner)],
                                            sharded, blocks={0: 1}))

    def forward(self, x: torch.Tensor, rows_per_expert: torch.Tensor,
                sizes: list[int] | None = None) -> torch.Tensor:
        """(N, H) rows grouped by local expert -> (N, H) partial sums over tp: the caller passes
        the input through ``copy_to_region`` and sums the output over tp (``MoELayer`` does both
        on the T tokens rather than on the k*T rows). ``sizes``: ``rows_per_expert`` on the
        host, when the caller already has it (the per-expert loop then copies nothing)."""
        groups = ExpertGroups(rows_per_expert, sizes)
        mm = _DeferrableGroupedMM.apply if weight_grad.STORE.enabled else grouped_mm
        gate = mm(x, self.gate_proj, groups)                # (N, I/tp)
        up = mm(x, self.up_proj, groups)                    # (N, I/tp)
        return mm(F.silu(gate) * up, self.down_proj, groups)   # (N, H) partial
