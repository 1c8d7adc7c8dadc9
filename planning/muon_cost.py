"""What Muon (``training/optim/muon.py``) changes in a rank's memory and step, for the estimator.

Per pipeline stage, from the model built at the rank's tp x ep shard on the meta device (shapes
only): the elements on Muon (``muon.is_muon``), the largest matrix Newton-Schulz sees whole, its
FLOPs per step and the elements tensor parallelism gathers for it.

- Memory: a Muon parameter keeps one fp32 momentum (Adam keeps two moments), on the matrix's
  owner in its data-parallel group under ZeRO 1-3 (``MuonUpdate``: 1/dp of them per rank, as
  ZeRO divides Adam's) and on every rank at ZeRO-0, beside ZeRO's fp32 master partition where
  it has one. While the update runs, an owner's whole fp32 gradient, its update and
  Newton-Schulz's temporaries (X, X X^T and its square) of its largest matrix are live, with
  one broadcast buffer: ``transient``.
- Newton-Schulz FLOPs per matrix of m x n (m <= n) and ``ns_steps`` iterations:
  ``ns_steps * (4 m^2 n + 2 m^3)`` (X X^T, A^2 and (bA + cA^2) X), on every data-parallel rank.
- Communication: each tensor-parallel matrix is all-gathered over tp (``tp_gathered``
  elements, fp32) and, at ZeRO 1-3, each Muon matrix's gradient is reduced to its owner and
  the update broadcast back (one all-reduce's worth over the data-parallel group, after backward).
"""

from __future__ import annotations

import re

_CACHE: dict[tuple, list[dict]] = {}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def muon_elements(recipe, layout, ns_steps: int = 5) -> list[dict]:
    """Per pipeline stage (index = stage): ``{"params", "largest", "ns_flops", "tp_gathered"}``:
    elements on Muon, the largest tensor Newton-Schulz sees whole (an expert stack of this rank's
    experts, a tp-split matrix gathered), FLOPs per step and the elements gathered over tp."""
    key = (repr(recipe.model), layout.tp, layout.ep, layout.sp, layout.pp, ns_steps)
    if key not in _CACHE:
        _CACHE[key] = _elements(recipe, layout, ns_steps)
    return _CACHE[key]


def _elements(recipe, layout, ns_steps: int) -> list[dict]:
    import math

    import torch

    from model.parallel.groups import ParallelGroups
    from model.transformer import Transformer
    from planning.memory_model import stage_layers
    from training.optim.muon import is_muon

    cfg = recipe.model
    with torch.device("meta"):
        model = Transformer(cfg, ParallelGroups(tp=layout.tp, ep=layout.ep, sequence_parallel=layout.sp),
                            init_seed=None)
    out = []
    for stage in range(layout.pp):
        layers, last = set(stage_layers(cfg, layout.pp, stage)), stage == layout.pp - 1
        row = {"params": 0, "largest": 0, "ns_flops": 0.0, "tp_gathered": 0}
        for name, p in model.named_parameters():
            m = _LAYER.search(name)
            held = (int(m.group(1)) in layers) if m else (last if name.startswith("mtp.") else False)
            if not held or not is_muon(name, p):
                continue
            full = tuple(p.full_shape)
            per, count = (full[1:], full[0] // layout.ep) if len(full) == 3 else (full, 1)
            a, b = sorted(per)
            row["params"] += p.numel()
            row["largest"] = max(row["largest"], count * math.prod(per))      # this rank's experts, tp gathered
            row["ns_flops"] += count * ns_steps * (4 * a * a * b + 2 * a ** 3)
            split = any(len(i) < full[d] and not (len(full) == 3 and d == 0) for d, i in p.shard_spec)
            row["tp_gathered"] += count * math.prod(per) if split else 0
        out.append(row)
    return out


def apply_to_states(states: dict, muon: dict, psi: float, dp: int, stage: int, master: bool) -> dict:
    """Model-state bytes of a Muon run from AdamW's (``memory_model.model_state_bytes``): the
    Muon elements' two Adam moments replaced by one fp32 momentum, partitioned alike (by whole
    matrices at ZeRO >= 1), their master partition kept."""
    div = dp if stage >= 1 else 1
    adam_k = 8 + (4 if master else 0)
    out = dict(states)
    out["optimizer"] = adam_k * (psi - muon["params"]) / div + (4 + (4 if master else 0)) * muon["params"] / div
    return out


def transient_bytes(muon: dict) -> float:
    """The update's live fp32 buffers for its largest matrix (the module docstring)."""
    return 5 * 4 * muon["largest"]


def muon_step_terms(est: dict) -> dict:
    """The cost model's Muon terms (``planning/cost_layout.py``) for an estimate ``est`` of a Muon
    JSON (none otherwise), from its heaviest stage: at ZeRO 1-3 the owners share the
    Newton-Schulz work (1/dp each) and each rank reduces and receives each Muon matrix once in
    fp32 (2 x 4 bytes x (dp - 1) / dp per element, an all-reduce's worth), its owned share of the
    tp gathers besides; at ZeRO-0 every rank runs every Newton-Schulz and gathers every tp-split
    matrix."""
    muon = est.get("muon")
    if not muon:
        return {}
    dp, tp = est["zero_dp"], est["tp"]
    share = 1 / dp if est["zero_stage"] >= 1 else 1.0
    comm = 2 * 4 * muon["params"] * (dp - 1) / dp if est["zero_stage"] >= 1 else 0.0
    comm += share * 4 * muon["tp_gathered"] * (tp - 1) / tp
    return {"muon_ns_flops": share * muon["ns_flops"], "muon_comm_bytes": comm}
