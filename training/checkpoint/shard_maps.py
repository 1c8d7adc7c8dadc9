"""How each parameter is cut over the tp x ep ranks, described to DeepSpeed's own converter.

The trainer's conversion (``interop/universal.py``) and its load (``universal_load.py``) read the
cuts from each parameter's ``shard_spec`` directly. This module also describes them in the form
DeepSpeed's ``ds_to_universal`` and universal loaders read, so that DeepSpeed's own tools stay
usable on this trainer's dp, tp and ep checkpoints: DeepSpeed's rule (chunk along one dimension)
cannot describe experts or row-parallel weights, so every parameter's cut is given as a
``deepspeed.checkpoint.affine.ParamAffineMap``, derived from its ``shard_spec``
(``model/parallel/layers.py``). ``runs_of`` is shared with the trainer's reader.
"""

from __future__ import annotations

import itertools
import re

import torch


def _strides(shape) -> tuple[int, ...]:
    """Row-major strides of a tensor of ``shape``."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def runs_of(values) -> list[list[int]]:
    """``[source start, shard start, length]`` of each run of consecutive indices in ``values``."""
    if values and values == list(range(values[0], values[0] + len(values))):
        return [[values[0], 0, len(values)]]                   # one run: compared at C speed
    out = []
    for j, v in enumerate(values):
        if out and v == out[-1][0] + out[-1][2]:
            out[-1][2] += 1
        else:
            out.append([v, j, 1])
    return out


def _boxes(cfg, tp: int, ep: int, expert_placement: str):
    """Per parameter and mp rank, the boxes (one run per dimension) of the full tensor that
    rank holds, plus the full and shard shapes; from models built on the meta device without
    their weight init (drawing meta tensors tile by tile costs seconds and sets nothing read
    here)."""
    from model import Transformer
    from model.parallel.groups import ParallelGroups

    boxes: dict[str, dict[int, list]] = {}
    full_shapes, shard_shapes = {}, {}
    for ep_rank in range(ep):
        for tp_rank in range(tp):
            mp_rank = ep_rank * tp + tp_rank
            layout = ParallelGroups(tp=tp, ep=ep, tp_rank=tp_rank, ep_rank=ep_rank,
                                    expert_placement=expert_placement)
            with torch.device("meta"):
                model = Transformer(cfg, layout, init_seed=None)    # the cuts, no weights
            for name, p in model.named_parameters():
                index = [list(range(n)) for n in p.full_shape]
                for dim, idx in p.shard_spec:
                    index[dim] = [index[dim][i] for i in idx]
                full_shapes[name] = tuple(p.full_shape)
                shard_shapes.setdefault(name, {})[mp_rank] = tuple(p.shape)
                boxes.setdefault(name, {})[mp_rank] = list(itertools.product(*map(runs_of, index)))
    return boxes, full_shapes, shard_shapes


def shard_maps(cfg, tp: int, ep: int, expert_placement: str = "contiguous") -> dict:
    """``name -> deepspeed.checkpoint.affine.ParamAffineMap`` over the tp x ep model-parallel
    ranks (mp rank = ep_rank * tp + tp_rank, DeepSpeed's ``mp_rank_XX``).

    Built from every parameter's ``shard_spec`` at each (tp_rank, ep_rank) on the meta device.
    A piece is a box of the full tensor: one run of consecutive indices per dimension; the
    pieces of a replicated parameter name every rank that holds them.
    """
    from deepspeed.checkpoint.affine import AffinePiece, ParamAffineMap

    boxes, full_shapes, shard_shapes = _boxes(cfg, tp, ep, expert_placement)
    maps = {}
    for name, per_rank in boxes.items():
        holders = {}
        for rank, pieces in per_rank.items():
            for box in pieces:
                holders.setdefault(tuple((src, n) for src, _, n in box), set()).add(rank)
        fs = _strides(full_shapes[name])
        pieces_by_rank = {}
        for rank, pieces in per_rank.items():
            ss = _strides(shard_shapes[name][rank])
            pieces_by_rank[rank] = [AffinePiece(
                shape=[n for _, _, n in box],
                source_offset=sum(src * s for (src, _, _), s in zip(box, fs)), source_strides=fs,
                dest_offset=sum(dst * s for (_, dst, _), s in zip(box, ss)), dest_strides=ss,
                locations=holders[tuple((src, n) for src, _, n in box)]) for box in pieces]
        maps[name] = ParamAffineMap(full_shapes[name], shard_shapes[name], pieces_by_rank)
    return maps


def enable_universal_checkpoint(model, groups) -> None:
    """Describe ``model``'s sharding to DeepSpeed's own universal-checkpoint tools.

    Sets ``model.universal_checkpoint_info`` (saved into every checkpoint; DeepSpeed's
    ``ds_to_universal`` merges the tp x ep shards with its affine maps) and, under
    tensor/expert parallelism, each parameter's restore map
    (``ds_autotp_universal_checkpoint_meta``), with which DeepSpeed's loader would cut a
    universal checkpoint for this layout. The trainer's own conversion does not need them.
    """
    from deepspeed.checkpoint.affine import AFFINE_MAP_FORMAT_VERSION
    from deepspeed.checkpoint.constants import (AFFINE_MAP, AFFINE_MAP_PARAMS, AFFINE_MAP_VERSION,
                                                DS_AUTOTP_UC_META, UNIVERSAL_CHECKPOINT_INFO,
                                                UNIVERSAL_CHECKPOINT_VERSION_KEY,
                                                UNIVERSAL_CHECKPOINT_VERSION_VALUE)
    info = {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}
    if groups.tp * groups.ep > 1:
        maps = {n: m.to_dict() for n, m in
                shard_maps(model.cfg, groups.tp, groups.ep, groups.expert_placement).items()}
        info[AFFINE_MAP] = {AFFINE_MAP_VERSION: AFFINE_MAP_FORMAT_VERSION,
                            AFFINE_MAP_PARAMS: {f"^{re.escape(n)}$": m for n, m in maps.items()}}
        for name, p in model.named_parameters():
            setattr(p, DS_AUTOTP_UC_META, {"conversion": {"affine_map": maps[name]}})
    setattr(model, UNIVERSAL_CHECKPOINT_INFO, info)
