"""ZeRO-3 checkpoints of tensor/expert-parallel runs consolidate offline into the control's model.

Three runs of the tiny Mixtral on 4 gloo ranks under ZeRO-3 fp32, each partitioned as it is
built (``training/engine/sharded_build.py``): TP2 (dp 2: each model-parallel rank's weights are split
over two optimizer files), EP2 (dp 2) and TP2 x EP2 (dp 1), against a single-process ZeRO-2
control on the same micro-batches. ``launch/evaluate.py`` and ``launch/convert_hf.py
export`` on each run (``interop/consolidate.py``: each model-parallel rank's ZeRO-3 pieces joined, then
the tp x ep merge) must give the single-process control's weights, loss and logits. The runs
are ``launch/train.py``'s command line on ranks forked from one process that has imported the
libraries (``tests.runs.WarmLauncher``; tests/launch/test_train.py covers torchrun).

Tolerance: fp32; the layouts change only the summation order (~1e-7 relative per op). After 4
AdamW steps nearly every weight agrees to ~1e-7, but AdamW's normalized update m / (sqrt(v) + eps)
turns a rounding difference in a near-zero gradient into a visible fraction of one step's lr:
measured at most 2.4e-6 absolute, on one element of 262,144 (an embedding row whose token is
rare). So 1e-4 relative plus ``tests.runs.WEIGHT_ATOL`` absolute, which still fails on any
real error: a missing or misplaced shard is off by O(init_std) = 2e-2, a mis-ordered partition by as much.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.runs import WEIGHT_ATOL, ds_variant, rows

STEPS = 4
NO_JITTER = ["model.moe.router_jitter=0.0"]
# (overrides, gradient accumulation steps): 4 ranks / (tp x ep) data-parallel ranks.
LAYOUTS = {"tp2": (["parallel.tensor_parallel_size=2"], 1),
           "ep2": (["parallel.expert_parallel_size=2"], 1),
           "tp2xep2": (["parallel.tensor_parallel_size=2", "parallel.expert_parallel_size=2"], 2)}


@pytest.fixture(scope="module")
def runs(warm_launcher, tmp_path_factory):
    """The router losses are per micro-batch: every run, the control included, steps on the same
    two micro-batches of 4 sequences (over dp 2, or accumulated twice on dp 1)."""
    tmp = tmp_path_factory.mktemp("zero3")
    out = {"control": tmp / "control"}
    control = ds_variant(tmp, "zero2_fp32", train_micro_batch_size_per_gpu=4,
                         gradient_accumulation_steps=2)
    warm_launcher.launch(out["control"], control, nproc=1, steps=STEPS, extra=NO_JITTER)
    batch = []                   # the 4-rank runs one after another in one process group
    for name, (extra, accumulation) in LAYOUTS.items():
        out[name] = tmp / name
        ds = ds_variant(tmp, "zero3_fp32", train_micro_batch_size_per_gpu=4,
                        gradient_accumulation_steps=accumulation)
        batch.append((out[name], ds, NO_JITTER + extra, STEPS))
    warm_launcher.launch_many(batch, nproc=4)
    return out


def test_zero3_model_parallel_runs_export_the_controls_model(runs, tmp_path, capsys):
    from interop.consolidate import load_run_model
    from launch import convert_hf, evaluate

    text = tmp_path / "eval.txt"
    text.write_text(Path(torch.nn.modules.linear.__file__).read_text(encoding="utf-8"))
    ids = torch.arange(64).remainder(97).view(1, 64) + 5

    def consolidated(run):
        assert evaluate.main(["--run-dir", str(runs[run]), "--text-file", str(text)]) == 0
        loss = json.loads(capsys.readouterr().out.strip().splitlines()[-1])   # its JSON line
        out = tmp_path / f"hf-{run}"
        assert convert_hf.main(["export", "--run-dir", str(runs[run]), "--out", str(out)]) == 0
        from transformers import AutoModelForCausalLM
        with torch.no_grad():
            logits = AutoModelForCausalLM.from_pretrained(str(out)).eval()(ids).logits
        return dict(load_run_model(runs[run])[0].named_parameters()), loss, logits

    ref, ref_loss, ref_logits = consolidated("control")
    assert ref_loss["tokens"] > 1000
    for run in LAYOUTS:
        first, last = rows(runs[run])[0], rows(runs[run])[-1]
        assert first["loss"] == pytest.approx(rows(runs["control"])[0]["loss"], rel=1e-5), run
        assert last["step"] == STEPS
        params, loss, logits = consolidated(run)
        assert params.keys() == ref.keys()
        for name, p in params.items():
            torch.testing.assert_close(p, ref[name], rtol=1e-4, atol=WEIGHT_ATOL, msg=f"{run} {name}")
        assert loss["tokens"] == ref_loss["tokens"]
        assert loss["loss"] == pytest.approx(ref_loss["loss"], rel=1e-5), run
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-5, msg=run)
