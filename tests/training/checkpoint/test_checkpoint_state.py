"""What a checkpoint carries besides the engine's files, declared once (``training/checkpoint/state.py``):
shared parts in DeepSpeed's ``client_state``, per-rank parts in one file per rank, written by the
background writer and covered by the manifest, and each handed back on resume."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.runs import rows
from training.checkpoint.state import TrainState, rank_file

SCRIPT = "tests/training/checkpoint/_rank_state_run.py"


class Part:
    def __init__(self, value):
        self.value, self.loaded = value, None

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.loaded = state


def test_each_rank_gets_its_own_state_back_and_the_run_continues_exactly(warm_launcher, tmp_path):
    full, run_dir = tmp_path / "full", tmp_path / "run"
    args = ["train.save_every=2", "eval.every=0"]
    warm = warm_launcher
    warm.launch(full, "ds_configs/zero1_fp32.json", steps=4, extra=args, script=SCRIPT,
                extra_env={"RANK_STATE_OUT": str(tmp_path / "full-state")})
    ckpt = full / "checkpoints" / "step00000004"
    manifest = json.loads((ckpt / "manifest.json").read_text())["files"]
    assert {rank_file(ckpt, r).name for r in range(2)} <= manifest.keys()
    shutil.copytree(full, run_dir)                 # resume from step 2, as after a crash
    shutil.rmtree(run_dir / "checkpoints" / "step00000004")
    (run_dir / "checkpoints" / "latest").write_text("step00000002")
    (run_dir / "metrics.jsonl").write_text("")
    warm.launch(run_dir, "ds_configs/zero1_fp32.json", steps=4, extra=args, script=SCRIPT,
                extra_env={"RANK_STATE_OUT": str(tmp_path / "resumed-state")})
    for rank in range(2):
        done = json.loads((tmp_path / f"full-state.{rank}.json").read_text())
        resumed = json.loads((tmp_path / f"resumed-state.{rank}.json").read_text())
        assert done == {"loaded": None, "final": {"rank": rank, "steps": [rank * 1000 + s for s in (1, 2, 3, 4)]}}
        assert resumed["loaded"] == {"rank": rank, "steps": [rank * 1000 + 1, rank * 1000 + 2]}
        assert resumed["final"] == done["final"]
    assert [r["loss"] for r in rows(run_dir)] == [r["loss"] for r in rows(full)][2:]


def test_shared_parts_go_into_client_state_and_a_missing_part_is_one_line(tmp_path):
    state = TrainState(rank=1)
    data, mine = Part(3), Part(7)
    state.register("data", data)
    state.register("mine", mine, per_rank=True)
    with pytest.raises(ValueError, match="registered twice"):
        state.register("data", Part(0))
    assert state.client_state(12) == {"step": 12, "data": {"value": 3}}
    assert state.rank_state() == {"mine": {"value": 7}}
    import torch
    torch.save({"mine": {"value": 8}}, rank_file(tmp_path, 1))
    assert state.load({"step": 12, "data": {"value": 4}}, tmp_path) == 12
    assert (data.loaded, mine.loaded) == ({"value": 4}, {"value": 8})
    with pytest.raises(ValueError, match=r"holds no data state .*: resume with the code that wrote it"):
        state.load({"step": 12}, tmp_path)
    rank_file(tmp_path, 1).unlink()
    with pytest.raises(ValueError, match=r"has no trainer_state_rank00001\.pt"):
        state.load({"step": 12, "data": {}}, tmp_path)
    mine.loaded = None                        # another layout (a universal checkpoint): kept fresh
    assert state.load({"step": 12, "data": {}}, tmp_path, same_world=False) == 12 and mine.loaded is None
    assert TrainState().rank_state() is None  # no per-rank part: no file is written
