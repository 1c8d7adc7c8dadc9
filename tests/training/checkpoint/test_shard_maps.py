"""``training/checkpoint/shard_maps.py``: the affine maps equal those read off the models the trainer builds.

The reference below reads every parameter's cut off models built and initialised on the CPU,
as the trainer holds them, and splits the indices into runs one index at a time; the module
builds uninitialised models on the meta device and finds whole runs at once. Both must give
the same maps, piece for piece, at every layout.
"""

from __future__ import annotations

import itertools

import pytest

from model import Transformer
from model.parallel.groups import ParallelGroups
from tests.runs import REPO
from training.checkpoint import shard_maps as sm
from training.config.recipe import load_recipe


def _reference_runs(values) -> list[list[int]]:
    """Maximal runs of consecutive values as [first value, first index, length]: within a run
    value - index is constant."""
    runs = (list(g) for _, g in itertools.groupby(enumerate(values), key=lambda jv: jv[1] - jv[0]))
    return [[run[0][1], run[0][0], len(run)] for run in runs]


def _reference_boxes(cfg, tp: int, ep: int, expert_placement: str):
    boxes, full_shapes, shard_shapes = {}, {}, {}
    for ep_rank, tp_rank in itertools.product(range(ep), range(tp)):
        model = Transformer(cfg, ParallelGroups(tp=tp, ep=ep, tp_rank=tp_rank, ep_rank=ep_rank,
                                                expert_placement=expert_placement), init_seed=5)
        for name, p in model.named_parameters():
            index = [list(range(n)) for n in p.full_shape]
            for dim, idx in p.shard_spec:
                index[dim] = [index[dim][i] for i in idx]
            full_shapes[name] = tuple(p.full_shape)
            shard_shapes.setdefault(name, {})[ep_rank * tp + tp_rank] = tuple(p.shape)
            boxes.setdefault(name, {})[ep_rank * tp + tp_rank] = list(
                itertools.product(*map(_reference_runs, index)))
    return boxes, full_shapes, shard_shapes


@pytest.mark.parametrize("recipe, tp, ep, placement", [
    ("tiny_mixtral", 2, 1, "contiguous"),
    ("tiny_mixtral", 1, 2, "contiguous"),
    ("tiny_mixtral", 2, 2, "round_robin"),     # experts not in one run per rank
    ("tiny_mixtral", 4, 1, "contiguous"),      # fewer kv heads than tp ranks: kv replicated
    ("tiny_deepseek_moe", 2, 2, "contiguous"),  # shared experts, a dense first block
    ("tiny_dense", 2, 1, "contiguous"),
])
def test_shard_maps_equal_the_maps_of_the_trainers_models(recipe, tp, ep, placement, monkeypatch):
    cfg = load_recipe(REPO / "recipes" / f"{recipe}.yaml", ["model.num_layers=2"]).model
    got = sm.shard_maps(cfg, tp, ep, placement)
    monkeypatch.setattr(sm, "_boxes", _reference_boxes)
    want = sm.shard_maps(cfg, tp, ep, placement)
    assert list(got) == list(want)
    for name in want:
        assert got[name].to_dict() == want[name].to_dict(), name
