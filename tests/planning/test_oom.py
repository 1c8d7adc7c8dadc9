"""Out of memory in the real trainer: exit code 3, one line, a full report, an intact run directory.

``_oom_run.py`` runs ``launch.train.main`` in a fresh process with ``Transformer.forward`` raising a
CUDA-style ``torch.OutOfMemoryError`` at its 6th call: with accumulation 2 that is micro-batch 2 of
step 3, after the checkpoint of step 2 (``train.save_every=2``). The product code has no test
branch: the error travels the same path a real one would. The ladder of next layouts is also
checked in-process on a GPU-sized case (no GPU needed: the estimator is arithmetic).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from training.config import ds_config
from training.run import preflight
from planning import next_layout, oom
from launch import train
from training.config.recipe import load_recipe
from tests.runs import REPO, SMALL, ds_variant, env
from training.step.stepper import StepContext

OOM_AT_CALL = 6
SECTIONS = ("## Where", "## Layout", "## Memory: estimate vs allocator", "## Largest live tensors",
            "## Memory snapshot", "## Next layout to try", "## Traceback")


@pytest.fixture(scope="module")
def oom_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("oom")
    run_dir = tmp / "run"
    config = ds_variant(tmp, "zero2_fp32", train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2)
    cmd = [sys.executable, str(Path(__file__).parent / "_oom_run.py"), "--config", config,
           "--run-dir", str(run_dir), "--steps", "10", "--set", *SMALL, "train.save_every=2"]
    out = subprocess.run(cmd, cwd=REPO, env=dict(env(), OOM_AT_CALL=str(OOM_AT_CALL)),
                         capture_output=True, text=True, timeout=300)
    return out, run_dir


def test_one_error_line_and_exit_code_3(oom_run):
    out, run_dir = oom_run
    assert out.returncode == oom.EXIT_CODE, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    report = run_dir / "oom_report.md"
    assert errors[0].startswith(f"error: out of memory at step 3 (rank 0); report: {report}; next try: ")


def test_run_directory_is_intact(oom_run):
    _, run_dir = oom_run
    ckpt = run_dir / "checkpoints"
    before = json.loads(Path(f"{run_dir}.before_oom.json").read_text())
    assert before["latest"][2] == "step00000002"
    after = {p.relative_to(ckpt).as_posix(): [p.stat().st_size, p.stat().st_mtime_ns,
                                              p.read_text() if p.name == "latest" else None]
             for p in sorted(ckpt.rglob("*")) if p.is_file()}
    assert after == before
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert max(r["step"] for r in rows) == 2            # and step 2's save_stall_s row
    assert not [p.name for p in run_dir.iterdir() if ".tmp" in p.name]


def test_report_has_every_section(oom_run):
    _, run_dir = oom_run
    md = (run_dir / "oom_report.md").read_text()
    assert all(s in md for s in SECTIONS), md[:2000]
    rep = json.loads((run_dir / "oom_report.json").read_text())
    assert {k: rep["where"][k] for k in ("step", "micro_batch", "micro_batches", "phase")} == {
        "step": 3, "micro_batch": 2, "micro_batches": 2, "phase": "forward"}
    lay = rep["layout"]
    assert [lay[k] for k in ("world_size", "tp", "ep", "pp", "dp", "zero_stage")] == [1, 1, 1, 1, 1, 2]
    assert (lay["precision"], lay["micro_batch"], lay["accumulation"], lay["seq_len"],
            lay["activation_checkpointing"]) == ("fp32", 4, 2, 64, "none")
    est = rep["estimate"]
    assert est["breakdown"]["total per GPU"] > est["breakdown"]["parameters"] > 0
    assert est["requested"] == 20 * 2 ** 30
    cpu = rep["allocator"]["cpu"]
    assert cpu["peak_rss"] >= cpu["rss"] > 50e6
    assert rep["snapshot"]["path"] is None                         # no GPU here

    tensors = rep["largest_tensors"]
    assert len(tensors) == oom.TOP_TENSORS
    assert [t["mb"] for t in tensors] == sorted((t["mb"] for t in tensors), reverse=True)
    params = re.compile(r"^(embed_tokens|lm_head|norm|layers\.\d+\.[\w.]+)\.weight\b")
    assert any(t["name"] and params.match(t["name"]) for t in tensors), tensors
    # Named from the engine the trainer handed over: Adam's states of ZeRO's fp32 partitions and
    # the ZeRO optimizer's gradient buffer.
    names = [t["name"] or "" for t in tensors]
    assert {"optimizer exp_avg of fp32 flat partition of param group 0",
            "optimizer exp_avg_sq of fp32 flat partition of param group 0"} <= set(names), names
    assert any(n.startswith("DeepSpeedZeroOptimizer.") for n in names), names
    # Micro-batch 1's output was released after its backward: its logits (4.2 MB, the largest
    # tensor of this run) are not alive during micro-batch 2's forward.
    assert not any(t["shape"] == [4, 64, 4096] for t in tensors), tensors


def test_report_says_where_the_trainer_last_recorded(tmp_path):
    """Outside a micro-batch the report names the phase the trainer recorded; before the trainer
    recorded anything (an error in start-up) it says start-up."""
    args = train.parse_args(["--config", "ds_configs/zero1_fp32.json", "--run-dir", str(tmp_path / "run"),
                             "--set", *SMALL])
    plan = preflight.prepare(args)
    err = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
    assert oom.report(err, plan, args).startswith("error: out of memory at start-up (rank 0); report: ")
    line = oom.report(err, plan, args, StepContext(phase="checkpoint save", step=7))
    assert line.startswith(f"error: out of memory at step 7 (rank 0); report: {tmp_path / 'run' / 'oom_report.md'};")
    where = json.loads((tmp_path / "run" / "oom_report.json").read_text())["where"]
    assert where == {"step": 7, "micro_batch": None, "micro_batches": None, "phase": "checkpoint save",
                     "at": "step 7"}
    md = (tmp_path / "run" / "oom_report.md").read_text()
    assert "- step: 7\n- micro-batch: -\n- phase: checkpoint save\n" in md


def test_suggested_command_is_runnable(oom_run):
    _, run_dir = oom_run
    sug = json.loads((run_dir / "oom_report.json").read_text())["suggestion"]
    assert sug["rungs"][0]["rung"] == next_layout.LADDER[0] and sug["changes"]
    argv = shlex.split(sug["command"])
    assert argv[:2] == ["python", "launch/train.py"]
    args = train.parse_args(argv[2:])
    recipe = load_recipe(args.recipe, args.set)
    assert recipe.train.activation_checkpointing == ("full" if "activation checkpointing full"
                                                     in sug["changes"] else "none")
    assert Path(args.run_dir) == run_dir and args.steps == 10


def test_suggested_command_resumes_the_run(oom_run):
    """The next try, run as printed (for one more step), resumes from the step-2 checkpoint. Runs last:
    it changes the run directory the tests above read."""
    _, run_dir = oom_run
    argv = shlex.split(json.loads((run_dir / "oom_report.json").read_text())["suggestion"]["command"])
    argv[argv.index("--steps") + 1] = "3"
    out = subprocess.run([sys.executable, *argv[1:]], cwd=REPO, env=env(), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / 'step00000002'}" in out.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]


def test_ladder_on_eight_gpus(tmp_path, monkeypatch):
    """Mixtral 8x7B at EP 8 on one node of 8 H100s with ZeRO-1 and a 20 GiB request that failed:
    the estimate (above what the allocator needed) is taken as is; checkpointing is already full,
    ZeRO-2 saves nothing without accumulation (DeepSpeed's ZeRO-1 already reduces into
    partitions), so ZeRO-3 is taken; micro-batch 4 cannot be split over 8 expert ranks; TP cannot
    grow at dp 1; offloading fits."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    recipe = load_recipe("recipes/mixtral_8x7b.yaml", ["parallel.pipeline_parallel_size=1"])
    args = train.parse_args(["--config", "ds_configs/zero1.json", "--recipe", "recipes/mixtral_8x7b.yaml",
                             "--run-dir", str(tmp_path), "--set", "parallel.pipeline_parallel_size=1"])
    ds = ds_config_for(args.config, recipe, dp=1)
    plan = preflight.Plan(recipe, ds, tmp_path, 8, 1, None)
    ctx = type("Ctx", (), {"rank": 0, "device": torch.device("cuda", 0), "gpu": oom.GPUS["h100-80gb"]})()
    alloc = {"gpu": {"device_total": 80e9, "allocated": 70e9}, "cpu": {}}
    est = oom._estimate(plan, ctx, ctx.device, alloc, 20 * 2 ** 30)
    assert est["need"] == 70e9 + 20 * 2 ** 30 and est["total"] > est["need"] and est["scale"] == 1
    sug = next_layout.suggest(plan, args, ctx.device, est)
    status = [(r["status"], r["change"]) for r in sug["rungs"]]
    assert status == [("skipped", None), ("applied", "ZeRO-1 -> ZeRO-3"),
                      ("skipped", "micro-batch 8 -> 4, accumulation 1 -> 2"), ("skipped", None),
                      ("skipped", None),
                      ("applied", "offload the optimizer and parameters to CPU")], sug["rungs"]
    assert sug["fits"] and sug["estimate_gb"] * 1e9 <= est["budget"]
    written = json.loads(Path(sug["config"]).read_text())
    assert written["zero_optimization"]["stage"] == 3
    assert written["zero_optimization"]["offload_param"]["device"] == "cpu"
    argv = shlex.split(sug["command"].replace("[your launcher args] ", ""))
    assert argv[0] == "deepspeed" and train.parse_args(argv[2:]).config == sug["config"]


def ds_config_for(path: str, recipe, dp: int) -> dict:
    par = recipe.parallel
    world = dp * par.tensor_parallel_size * par.expert_parallel_size * par.pipeline_parallel_size \
        * par.context_parallel_size
    return ds_config.resolve_ds_config(ds_config.load_ds_config(path), recipe, recipe.dims(world))


def test_out_of_memory_is_recognized_and_other_errors_are_not(monkeypatch, tmp_path):
    try:
        torch.empty(2 ** 50, dtype=torch.uint8)            # the CPU allocator's real failure
    except RuntimeError as err:
        assert oom.is_out_of_memory(err) and oom._requested_bytes(str(err)) == 2 ** 50
    assert oom.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB"))
    assert oom._requested_bytes("CUDA out of memory. Tried to allocate 2.00 MiB") == 2 * 2 ** 20
    assert not oom.is_out_of_memory(RuntimeError("shape mismatch"))
    # Any other RuntimeError keeps its traceback (not swallowed into exit code 3).
    from types import SimpleNamespace
    plan = SimpleNamespace(run_dir=tmp_path / "run", world_size=1,
                           recipe=SimpleNamespace(train=SimpleNamespace(hang_timeout_s=0.0)))
    monkeypatch.setattr(train.Run, "prepare", classmethod(lambda cls, args: cls(plan)))
    monkeypatch.setattr(train.Run, "train", lambda run: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        train.main(["--config", "ds_configs/zero1.json"])


def test_tensor_parallel_rung_turns_on_sequence_parallelism():
    """Raising tp also splits the sequence when it can (same traffic, less activation memory);
    a sequence the new tp cannot split keeps sequence parallelism off."""
    import dataclasses
    recipe = load_recipe(REPO / "recipes" / "dense_7b.yaml")
    ds = {"gradient_accumulation_steps": 4}
    [(what, sets, ds_keys)] = next_layout._rung_tp(recipe, ds, 8, 8)
    assert sets == {"parallel.tensor_parallel_size": 2, "parallel.sequence_parallel": "true"}, what
    assert ds_keys == {"gradient_accumulation_steps": 8} and "sequence parallelism" in what
    odd = dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, seq_len=recipe.seq_len - 1))
    [(_, sets, _)] = next_layout._rung_tp(odd, ds, 8, 8)
    assert sets == {"parallel.tensor_parallel_size": 2}


def test_context_parallel_rung_for_long_sequences():
    """A long sequence is split over twice the cp ranks (same global batch: accumulation doubled)
    before the matmuls are split; the estimator then puts half the activations on each rank. A
    short one skips the rung."""
    from planning import estimator
    recipe = load_recipe(REPO / "recipes" / "long_context_7b.yaml")
    ds = {"gradient_accumulation_steps": 4}
    [(what, sets, ds_keys)] = next_layout._rung_cp(recipe, ds, 16, 8)
    assert sets == {"parallel.context_parallel_size": 8} and ds_keys == {"gradient_accumulation_steps": 8}
    assert "context parallelism 4 -> 8 (a2a" in what
    wider = load_recipe(REPO / "recipes" / "long_context_7b.yaml", [f"{k}={v}" for k, v in sets.items()])
    zero3 = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 8,
             "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    acts = [estimator.estimate(r, dict(zero3, gradient_accumulation_steps=acc), 16)["worst"]["activations"]["saved"]
            for r, acc in ((recipe, 4), (wider, 8))]
    assert acts[1] / acts[0] == pytest.approx(0.5, rel=0.02)
    assert "below 8192" in next_layout._rung_cp(load_recipe(REPO / "recipes" / "dense_7b.yaml"), ds, 8, 8)
