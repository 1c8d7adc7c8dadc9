"""The background save's snapshot (``training/checkpoint/saving.py`` ``_snapshot``), in one process: what
``torch.save`` writes from it is byte for byte what it writes from the live state, and the live
state can change once the snapshot is taken. The saves themselves, with 2 ranks, slow and full
disks, are in ``tests/launch/test_train.py``."""

from __future__ import annotations

import io
from collections import OrderedDict

import torch

from training.checkpoint import saving


class _Scaler:
    """Stands in for DeepSpeed's loss scaler: an object torch.save pickles whole."""

    def __init__(self):
        self.cur_scale = 65536.0


def _state():
    flat = torch.arange(24, dtype=torch.float32)
    return {"module": OrderedDict(w=flat[:12].view(3, 4), b=flat[12:16]),     # views of one storage
            "optimizer": {"state": {0: {"exp_avg": torch.ones(5), "step": torch.tensor(3.0)}},
                          "param_groups": [{"lr": 1e-3, "params": [0]}]},
            "flat": [flat, flat[16:].t()], "bf16": torch.randn(4, 2).to(torch.bfloat16).t(),
            "scaler": _Scaler(), "client": {"step": 7, "tokens": 1024}, "ds_version": "0.19.8"}


def _bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_the_snapshot_saves_the_same_bytes_and_is_independent_of_the_live_state():
    live = _state()
    snap = saving._snapshot(live, {})
    assert _bytes(snap) == _bytes(live)
    assert type(snap["module"]) is OrderedDict and snap["module"]["w"].untyped_storage().data_ptr() \
        == snap["flat"][0].untyped_storage().data_ptr()          # one storage, as in the original
    before = _bytes(snap)
    live["flat"][0].add_(1.0)                                     # the next step changes the state
    live["optimizer"]["state"][0]["exp_avg"].mul_(0.5)
    live["scaler"].cur_scale = 2.0
    live["client"]["step"] = 8
    assert _bytes(snap) == before != _bytes(live)
    loaded = torch.load(io.BytesIO(before), weights_only=False)
    assert torch.equal(loaded["module"]["w"], torch.arange(12, dtype=torch.float32).view(3, 4))
    assert loaded["scaler"].cur_scale == 65536.0 and loaded["client"]["step"] == 7
