"""Gradient norm per layer: the embedding, each transformer block and the head, on the device.

``LayerGradNorms.squares()`` is the sum of squared gradients of each layer's parameters after
the step's last backward and before the optimizer step, summed over the ranks so that every
tensor-, expert-, pipeline- and ZeRO-sharded piece is counted once, as DeepSpeed counts it for
the global ``grad_norm``: the square root of the vector's sum is that norm, and the test checks
it at every ZeRO stage and layout (``tests/training/step/test_layer_grad_norms.py``). The vector stays
on the device; the stepper reads it to the host together with the global norm it already reads
(one ``.tolist()`` of both, no extra host sync; ``training/step/stepper.py``).

Where each rank's piece of a gradient lives depends on the ZeRO stage, and DeepSpeed gives no
per-layer norm, so this walks its documented accessors:

- fp32 ZeRO-0: ``param.grad`` holds the whole data-parallel-averaged gradient on every
  data-parallel rank; summed over tp x ep and the stages only (as ``Stepper._local_grad_norm``).
- ZeRO-3: ``deepspeed.utils.safe_get_local_grad`` (this rank's partition);
- ZeRO-1/2 and DeepSpeed's bf16 optimizer: the parameter's ``_hp_mapping`` fragment (the part of
  the flat gradient partition this rank owns; the accessor behind ``safe_get_full_grad``, whose
  full gradient would cost an all-reduce per parameter). Partitions are summed over every rank.

A parameter counts only where it is canonical: ``tensor_model_parallel`` (false on the replicas
of a tensor- or expert-parallel replicated weight, ``model/parallel/layers.py``) and not
``ds_pipe_replicated`` (a tied embedding's copy on a later pipeline stage).
"""

from __future__ import annotations

import math
import re

import torch

from model.parallel import comm

_BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def slot(name: str, num_layers: int) -> int:
    """The vector position of parameter ``name``: 0 the embedding, 1 + i block i, num_layers + 1
    the rest (the final norm and the output head). Pipeline stages name blocks ``<k>.layers.<i>.``
    (``training/engine/pipeline.py``), the plain model ``layers.<i>.``."""
    m = _BLOCK.search(name)
    if m:
        return 1 + int(m.group(1))
    return 0 if "embed_tokens" in name else num_layers + 1


def names(num_layers: int) -> list[str]:
    """The labels of the vector's positions."""
    return ["embed"] + [f"block{i}" for i in range(num_layers)] + ["head"]


def row_value(values: list[float], num_layers: int) -> dict:
    """The ``metrics.jsonl`` field from the vector's host copy (squared sums): norms as
    ``{"embed": x, "blocks": [one per block], "head": y}``."""
    norms = [max(v, 0.0) ** 0.5 for v in values]
    return {"embed": norms[0], "blocks": norms[1:num_layers + 1], "head": norms[num_layers + 1]}


def add_to_row(row: dict, extra: dict, squares: list[float], num_layers: int) -> None:
    """Put the norms into the metrics row (``grad_norm_layers``, ``row_value``) and into
    ``extra``, what W&B gets beside the row: ``grad_norm/embed``, ``grad_norm/block{i}``,
    ``grad_norm/head``."""
    field = row["grad_norm_layers"] = row_value(squares, num_layers)
    extra.update({"grad_norm/embed": field["embed"], "grad_norm/head": field["head"]})
    extra.update({f"grad_norm/block{i}": v for i, v in enumerate(field["blocks"])})


def read(global_norm, squares) -> tuple[float | None, list[float] | None]:
    """The step's global gradient norm (a float or DeepSpeed's device tensor; None when unknown)
    and the per-layer squares (a device tensor, a host list, or None) on the host: the norm,
    None when not finite, and the squares as a list. DeepSpeed keeps its norm on the device at
    ZeRO 1-3, so both come over in one copy, the read the norm needs anyway."""
    if torch.is_tensor(squares):
        head = torch.as_tensor(global_norm if global_norm is not None else float("nan"), dtype=torch.float64)
        global_norm, *squares = torch.cat((head.reshape(1).to(squares.device), squares)).tolist()
    gn = float(global_norm) if global_norm is not None else None
    return (gn if gn is not None and math.isfinite(gn) else None), squares


class LayerGradNorms:
    """The per-layer squared gradient sums of ``model`` after a backward.

    Args:
        model: the engine's module (``Transformer`` or the pipeline stage's ``PipelineModule``).
        num_layers: the model's transformer blocks (all stages').
        zero_stage: the DeepSpeed ZeRO stage; with ``half`` (bf16/fp16) it decides where a
            rank's gradient pieces live (the module docstring).
        groups: the run's ``ParallelGroups`` (``mp_group``: tp x ep, ``pp_group``).
    """

    def __init__(self, model: torch.nn.Module, num_layers: int, zero_stage: int, half: bool, groups):
        self.num_layers, self.groups = num_layers, groups
        self.whole = zero_stage == 0 and not half       # param.grad: the full averaged gradient
        self.zero3 = zero_stage == 3
        self.params = [(slot(name, num_layers), p) for name, p in model.named_parameters()
                       if p.requires_grad and getattr(p, "tensor_model_parallel", True)
                       and not getattr(p, "ds_pipe_replicated", False)]

    def _piece(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        if self.whole:
            return p.grad
        if self.zero3:
            from deepspeed.utils import safe_get_local_grad
            return safe_get_local_grad(p)
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is None:         # no part of this parameter's partition lives on this rank
            return None
        return mapping.get_lp_grad_fragment(p._index_in_param_group)

    def squares(self, device: torch.device) -> torch.Tensor:
        """The (num_layers + 2,) float64 vector of squared gradient sums, summed over the ranks
        (device collectives only)."""
        sq = torch.zeros(self.num_layers + 2, dtype=torch.float64, device=device)
        for i, p in self.params:
            g = self._piece(p)
            if g is not None and g.numel():
                sq[i] += torch.linalg.vector_norm(g, dtype=torch.float64) ** 2
        if self.whole:      # every data-parallel rank holds the same averaged gradient
            comm.all_reduce_sum(sq, self.groups.mp_group)
            return comm.all_reduce_sum(sq, self.groups.pp_group)
        return comm.job_sum(sq)     # partitions: each piece on one rank of its group
