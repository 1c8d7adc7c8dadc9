"""A non-finite loss never reaches the weights; a loss spike is logged, skipped or stops the run.

Each case runs the real engine and ``Stepper`` in a fresh process (``_stability_run.py``): three
normal steps, then a step whose activations are multiplied by NaN, then one whose logits are
scaled 30x (a finite loss spike against a running mean of 2 steps with factor 1.5), then a
normal step. ``spike_action: stop`` is also run through the trainer (``launch/train.py``), which
saves the pre-spike state and stops.
"""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.runs import SMALL, python, rows, shared_launcher


def _run(config: str, action: str, *scales: str) -> list[dict]:
    out = python("tests/training/step/_stability_run.py", config, action, *scales)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("config", ["ds_configs/zero0_fp32.json", "ds_configs/zero2.json",
                                    "ds_configs/zero3_fp32.json", "ds_configs/zero3.json"])
def test_nan_step_is_skipped_and_spike_is_skipped(config):
    rows = _run(config, "skip")
    # DeepSpeed's linear warmup spends the first updates at lr 0; by step 3 the weights move.
    assert rows[2]["changed"] and rows[2]["skipped"] is None
    nan = rows[3]
    assert nan["skipped"] and not nan["changed"] and nan["finite"]
    spike = rows[4]
    assert spike["loss"] > 1.5 * rows[2]["loss"]
    assert spike["skipped"].startswith("loss spike") and not spike["changed"]
    assert rows[5]["changed"] and rows[5]["finite"] and rows[5]["skipped"] is None


def test_spike_is_only_logged_or_stops_when_asked():
    logged = _run("ds_configs/zero1_fp32.json", "log")
    assert logged[3]["skipped"] and not logged[3]["changed"]      # NaN: always skipped
    assert logged[4]["skipped"] is None and logged[4]["changed"]  # spike: logged only
    assert logged[4]["spike"] and not logged[5]["spike"]
    stopped = _run("ds_configs/zero1_fp32.json", "stop")
    assert stopped[4]["stopped"].startswith("loss spike") and not stopped[4]["changed"]


def _launch(logs: Path, nproc: int, argv: list[str]) -> SimpleNamespace:
    """``argv`` (a script and its arguments) on ``nproc`` ranks as torchrun starts them (forked
    from the warm launcher's server); its exit code and the ranks' stdout and stderr."""
    out, err = logs.with_suffix(".out"), logs.with_suffix(".err")
    rc = shared_launcher().run(argv, out, nproc, 300, stderr=err)
    return SimpleNamespace(returncode=rc, stdout=out.read_text(), stderr=err.read_text())


def _weights(tag_dir: Path) -> dict:
    """Every tensor a checkpoint holds, by file and name: ``mp_rank_*`` files keep the weights
    under ``module``, a pipeline's ``layer_*`` files are the layers' state dicts themselves."""
    out = {}
    for f in sorted(tag_dir.glob("*model_states.pt")):
        state = torch.load(f, map_location="cpu", weights_only=False)
        module = state.get("module") if "module" in state else state
        out.update({(f.name, k): v for k, v in (module or {}).items() if torch.is_tensor(v)})
    return out


@pytest.mark.parametrize("nproc, extra", [(1, []), (2, ["parallel.pipeline_parallel_size=2"])],
                         ids=["one-process", "pp2"])
def test_stop_saves_the_weights_from_before_the_spike_and_resumes(nproc, extra, tmp_path):
    """The trainer with ``spike_action: stop`` and a spike at step 4 (checkpoint every 3 steps):
    step 4 is skipped, ``step00000004`` is written with step 3's weights, the run stops with one
    message, and the same command (here with the spike gone and ``spike_action: log``) resumes
    at step 5. Under a pipeline the spike is seen on the last stage, and the decision must reach
    the first stage's weights too (the skip is decided in DeepSpeed's hook before its step)."""
    run_dir = tmp_path / "run"
    args = ["--config", "ds_configs/zero1_fp32.json", "--run-dir", str(run_dir), "--steps", "6",
            "--set", *SMALL, *extra, "eval.every=0", "train.save_every=3", "train.spike_window=2",
            "train.spike_factor=1.5"]
    out = _launch(tmp_path / "stop", nproc, ["tests/training/step/_stability_run.py", "--trainer", "4", *args,
                                              "train.spike_action=stop"])
    assert out.returncode == 0, out.stderr[-3000:]
    ckpt = run_dir / "checkpoints"
    stops = [line for line in out.stderr.splitlines() if line.startswith("stopping at step")]
    assert len(stops) == 1 and stops[0].startswith("stopping at step 4: loss spike (")
    assert f"{ckpt / 'step00000004'} holds the weights from before it" in stops[0]
    logged = rows(run_dir)
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    assert logged[3]["stopped"].startswith("loss spike") and logged[3]["skipped"] == logged[3]["stopped"]
    assert logged[3]["loss"] > 1.5 * logged[2]["loss"]
    assert (ckpt / "latest").read_text().strip() == "step00000004"
    client = [torch.load(ckpt / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
              for tag in ("step00000003", "step00000004")]
    assert client[1]["step"] == 4 and client[0]["step"] == 3 and client[1]["data"]["step"] == 4
    before, at = _weights(ckpt / "step00000003"), _weights(ckpt / "step00000004")
    assert before.keys() == at.keys() and len(at) > 10
    assert all(torch.equal(before[k], at[k]) for k in at)
    if nproc > 1:       # both stages' layers are in the comparison: embedding and head
        assert {f.split("-")[0] for f, _ in at} >= {"layer_00", "layer_03"}

    resumed = _launch(tmp_path / "resume", nproc, ["launch/train.py", *args, "train.spike_action=log"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {ckpt / 'step00000004'}" in resumed.stdout
    logged = rows(run_dir)
    assert [r["step"] for r in logged] == list(range(1, 7))
    assert not any(r.get("spike") for r in logged[4:])
