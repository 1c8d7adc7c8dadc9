"""Per-layer gradient norms and the gradient-norm spike test (``training/step/layer_grads.py``,
``train.grad_spike_factor``).

A spike is induced on purpose: in step 5 one block's gradients are multiplied by 100 (the loss is
unchanged, so only the gradient-norm test can see it), through the real engine and ``Stepper``
(``_stability_run.py --grad``) and through the trainer (``--trainer-grad``). The per-layer
norms in the rows must name that block, and add up to the row's ``grad_norm``. That they equal
the single-process control's at every layout is checked with the layouts
(``tests/parallel/test_train_layouts.py``, ``_assert_layer_norms``).
"""

import json

import pytest

from tests.runs import SMALL, python, rows
from training.config.schema import TrainConfig
from training.step import history, layer_grads


def _grad_run(config: str, action: str, block: int) -> list[dict]:
    out = python("tests/training/step/_stability_run.py", "--grad", config, action, str(block))
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def _vector(row: dict) -> list[float]:
    f = row["grad_norm_layers"]
    return [f["embed"], *f["blocks"], f["head"]]


def _traced_layer(rows_: list[dict], step: int) -> int:
    """The position whose norm grew most from the step before: how docs/stability.md's playbook
    finds the layer of a gradient spike."""
    now, before = _vector(rows_[step - 1]), _vector(rows_[step - 2])
    return max(range(len(now)), key=lambda i: now[i] / before[i])


@pytest.mark.parametrize("config, action, block", [("ds_configs/zero0_fp32.json", "skip", 0),
                                                   ("ds_configs/zero1_fp32.json", "log", 1)])
def test_an_injected_gradient_spike_is_found_and_traced_to_its_block(config, action, block):
    got = _grad_run(config, action, block)
    for row in got:     # train.log_every 1: every row; the squares add up to the global norm
        assert sum(v * v for v in _vector(row)) ** 0.5 == pytest.approx(row["grad_norm"], rel=1e-6)
        assert len(row["wandb_blocks"]) == 4        # grad_norm/embed, block0, block1, head
    spike = got[4]
    assert spike["grad_spike"] and not spike["spike"] and spike["grad_norm"] > 3 * got[3]["grad_norm"]
    assert _traced_layer(got, 5) == 1 + block
    assert not any(r["grad_spike"] for r in got[:4] + got[5:])
    if action == "skip":        # fp32 ZeRO-0: the norm is known before the update, which is skipped
        assert spike["skipped"].startswith("grad-norm spike (") and not spike["changed"]
    else:                       # ZeRO-1: found inside DeepSpeed's step, logged, applied
        assert spike["skipped"] is None and spike["changed"]
    assert got[5]["changed"] and got[5]["skipped"] is None


def test_stop_on_a_gradient_spike_after_the_update_saves_nothing(tmp_path):
    """ZeRO-1, spike_action stop: the update of step 4 was applied inside DeepSpeed's step, so
    the run stops without saving; the latest checkpoint (step 3) is from before the spike."""
    run_dir = tmp_path / "run"
    out = python("tests/training/step/_stability_run.py", "--trainer-grad", "4", "--config",
                 "ds_configs/zero1_fp32.json", "--run-dir", str(run_dir), "--steps", "6", "--set",
                 *SMALL, "eval.every=0", "train.save_every=3", "train.spike_window=2",
                 "train.grad_spike_factor=3", "train.spike_action=stop")
    assert out.returncode == 0, out.stderr[-3000:]
    stops = [line for line in out.stderr.splitlines() if line.startswith("stopping at step")]
    assert len(stops) == 1 and "so the update was applied and not saved" in stops[0], out.stderr[-2000:]
    assert stops[0].endswith("run the same command to resume from step00000003")
    logged = rows(run_dir)
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    assert logged[3]["grad_spike"] and "skipped" not in logged[3]
    # Off a log step (train.log_every 5) ZeRO 1-3 compute no per-layer norms: the spike is found
    # only after they could have been (docs/stability.md: replay with train.log_every=1).
    assert "grad_norm_layers" not in logged[3]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step00000003"
    assert not (run_dir / "checkpoints" / "step00000004").exists()


def test_slots_window_and_settings():
    assert [layer_grads.slot(n, 2) for n in ("embed_tokens.weight", "layers.0.mlp.gate.weight",
                                              "3.layers.1.self_attn.q_proj.weight", "norm.weight",
                                              "lm_head.weight", "tied_modules.embed.embed_tokens.weight")] == [0, 1, 2, 3, 3, 0]
    h = history.StepHistory(history.SpikeMonitor(4.0, 2), None, history.SpikeMonitor(3.0, 2))
    for loss, gn in ((5.0, 1.0), (4.0, 2.0)):
        h.record(loss, gn)
    assert h.grad_spike(4.6) and not h.grad_spike(4.4) and not h.grad_spike(float("nan"))
    fresh = history.StepHistory(history.SpikeMonitor(4.0, 2), None, history.SpikeMonitor(3.0, 2))
    fresh.load_state_dict(h.state_dict())
    assert fresh.grad_spikes.history == [1.0, 2.0] and fresh.spikes.history == [5.0, 4.0]
    fresh.load_state_dict({"history": [1.0]})    # a checkpoint from before the gradient test
    assert fresh.grad_spikes.history == []
    with pytest.raises(ValueError, match=r"train.grad_spike_factor \(1.0\) must be > 1"):
        TrainConfig(grad_spike_factor=1.0)
