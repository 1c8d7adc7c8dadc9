"""fp16 dynamic loss scaling as ds_configs/fp16.json configures it, on CPU.

DeepSpeed refuses fp16 training on these CPUs, so the real run is in benchmarks/gpu_suite.sh;
here DeepSpeed's own DynamicLossScaler runs the JSON's settings through a scripted sequence of
overflowing and clean steps (the window shortened from 1000 to 4 to keep the sequence short).
"""

import json
import os
import socket

import pytest
import torch.distributed as dist

from tests.runs import REPO


@pytest.fixture
def one_rank():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")      # DeepSpeed's comm backend, as in training
    yield
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(key, None)
    dist.destroy_process_group()


def test_dynamic_loss_scale_follows_the_json(one_rank):
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    fp16 = json.loads((REPO / "ds_configs" / "fp16.json").read_text())["fp16"]
    assert fp16["loss_scale"] == 0                       # 0 = dynamic
    scaler = DynamicLossScaler(init_scale=2 ** fp16["initial_scale_power"], scale_window=4,
                               min_scale=fp16["min_loss_scale"], delayed_shift=fp16["hysteresis"],
                               consecutive_hysteresis=fp16["consecutive_hysteresis"])
    start = 2.0 ** 16
    assert scaler.cur_scale == start
    scaler.update_scale(True)            # hysteresis 2: the first overflow only spends it
    assert scaler.cur_scale == start
    scaler.update_scale(True)            # the second halves the scale
    assert scaler.cur_scale == start / 2
    # DeepSpeed doubles once (clean steps since the overflow - 1) is a multiple of the window:
    # on the 5th clean step for a window of 4.
    for _ in range(4):
        scaler.update_scale(False)
    assert scaler.cur_scale == start / 2
    scaler.update_scale(False)
    assert scaler.cur_scale == start
    for _ in range(40):                  # never below min_loss_scale
        scaler.raise_error_at_min_scale = False
        scaler.update_scale(True)
    assert scaler.cur_scale == fp16["min_loss_scale"]
