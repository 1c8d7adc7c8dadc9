"""Checkpoint files are read weights-only (``training/checkpoint/safe_load.py``): a pickled object that
would run code is refused in one line and never runs; the classes DeepSpeed really pickles load.
The trainer's resume tests (``tests/launch/test_train.py``, ``tests/parallel/``) and the export
tests (``tests/interop/``) load every kind of checkpoint file this way."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from training.checkpoint import safe_load


class _Payload:
    """Unpickling this calls ``open(marker, "w")``: a stand-in for code a file could run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_code_in_a_checkpoint_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.ones(2)}, "extra": _Payload(marker)}, path)
    with pytest.raises(ValueError) as info:
        safe_load.load(path)
    assert str(info.value).startswith(f"{path}: refusing to load it: it holds a pickled object")
    assert "(io.open)" in str(info.value) and "\n" not in str(info.value)
    assert not marker.exists()
    torch.load(path, weights_only=False)         # the control: the full unpickler runs it
    assert marker.exists()


def test_deepspeed_plain_data_classes_load(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    path = tmp_path / "optim_states.pt"
    torch.save({"zero_stage": ZeroStageEnum.optimizer_states, "loss_scaler": DynamicLossScaler(2.0 ** 16, 1000, 1.0, 2, False),
                "state": {"exp_avg": torch.zeros(3)}}, path)
    got = safe_load.load(path)
    assert got["zero_stage"] == ZeroStageEnum.optimizer_states
    assert isinstance(got["loss_scaler"], DynamicLossScaler) and got["state"]["exp_avg"].shape == (3,)


def test_install_routes_deepspeeds_reads_through_the_weights_only_loader(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "states.pt"
    torch.save({"x": _Payload(marker)}, path)
    engine = SimpleNamespace(checkpoint_engine=SimpleNamespace(load=None))
    safe_load.install(engine)
    with pytest.raises(ValueError, match="refusing to load it"):
        engine.checkpoint_engine.load(str(path), map_location=torch.device("cpu"))
    assert not marker.exists()
