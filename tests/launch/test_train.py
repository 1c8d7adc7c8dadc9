"""The real training entry on 1-2 gloo ranks: ZeRO parity, exact accumulation, kill-and-resume,
damaged or unverified checkpoints, W&B offline, evaluate.py on the result.

A launch costs 10-30 s on 2 cores, mostly importing torch, DeepSpeed and transformers, so each
run is made once per module and several tests read it. The runs that are killed or signalled
(SIGKILL, SIGTERM, SIGUSR1) are real ``torchrun`` (or plain ``python``) process trees, as a user
starts them. Every other run, the resumes after a kill included, is the same command line on
ranks forked from one process that has imported those libraries (``tests.runs.WarmLauncher``):
its subject is what the trainer computes, writes and prints.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import signal
import sys
from pathlib import Path

import pytest

from tests.runs import REPO, SMALL, STEPS, kill_after_step, launch, rows
from tests.runs import env as _env
from tests.runs import ds_variant as _fp32_config


def wandb_history(path: Path) -> list[dict]:
    """History rows of an offline W&B run file.

    The file is a LevelDB-style log (wandb-core's format; the Python SDK ships no reader for
    it): a 7-byte file header, then records of (crc32 u32, length u16, type u8, payload) in
    32 KiB blocks, a payload split FIRST/MIDDLE/LAST across blocks; each payload is a
    ``wandb_internal_pb2.Record``.
    """
    import struct

    from wandb.proto import wandb_internal_pb2
    data, block = path.read_bytes(), 32 * 1024
    assert data[:4] == b":W&B"
    pos, buf, history = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:            # block trailer: too small for a header
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind not in (1, 4):                 # FULL or LAST ends a record
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(buf)
        buf = b""
        if record.WhichOneof("record_type") == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
    return history


def eval_losses(run_dir: Path) -> dict[int, float]:
    """Step -> eval loss of a run's metrics.jsonl."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["eval_loss"] for r in lines if "eval_loss" in r}


@pytest.fixture(scope="module")
def warm(warm_launcher):
    return warm_launcher


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory, warm):
    """The module's uninterrupted 2-rank runs, made once, one after another in one launched
    process group (``WarmLauncher.launch_many``): the same recipe under ZeRO 0-3 (fp32), and the
    accumulation pair (micro 1 x accumulation 4, micro 4 x 1). Name -> run directory."""
    tmp = tmp_path_factory.mktemp("two-rank")
    batch = [(tmp / f"zero{stage}", f"ds_configs/zero{stage}_fp32.json", []) for stage in range(4)]
    for micro, acc in ((1, 4), (4, 1)):
        cfg = _fp32_config(tmp, "zero2_fp32", train_micro_batch_size_per_gpu=micro,
                           gradient_accumulation_steps=acc)
        # Jitter off: its noise is drawn per sample index within a micro-batch, so it differs
        # between micro 1 and micro 4 by design.
        batch.append((tmp / f"m{micro}a{acc}", cfg, ["model.moe.aux_loss_coef=0.0", "model.moe.router_jitter=0.0"]))
    warm.launch_many(batch)
    return {run_dir.name: run_dir for run_dir, _, _ in batch}


@pytest.fixture(scope="module")
def zero_runs(two_rank_runs):
    """The same recipe under ZeRO 0-3 (fp32), 2 ranks, 10 steps. ``zero_runs[3]`` is the
    uninterrupted run that the killed, signalled and faulted runs below must reproduce."""
    return {stage: two_rank_runs[f"zero{stage}"] for stage in range(4)}


def test_a_run_in_a_batch_logs_what_it_logs_launched_alone(zero_runs, warm, tmp_path):
    """``launch_many`` runs several trainings in one process group: each logs, bit for bit, what
    the same command launched alone logs (every metric but the timings), eval rows included."""
    alone = tmp_path / "zero1-alone"
    warm.launch(alone, "ds_configs/zero1_fp32.json")
    timing = {"tokens_per_s", "step_time_s", "step_busy_s_max", "step_busy_s_median", "slowest_rank",
              "save_stall_s"}
    lines = [[{k: v for k, v in json.loads(x).items() if k not in timing}
              for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (zero_runs[1], alone)]
    assert lines[0] == lines[1] and len(lines[0]) > STEPS


def test_zero_stages_give_the_same_loss_every_step(zero_runs):
    # fp32 on one machine: the stages differ only in where gradients are summed (all-reduce vs
    # reduce-scatter, different bucket orders), a ~1e-7 relative change per step that training
    # amplifies slowly; 1e-4 over 10 steps leaves a wide margin while catching any real
    # difference (a wrong average or a missed shard changes the loss at step 2 by >1e-3).
    ref = rows(zero_runs[0])
    assert [r["step"] for r in ref] == list(range(1, STEPS + 1))
    # It learns, slowly at this lr (6e-4, lr 0 for 2 warm-up steps). Measured: the loss from
    # 8.333 to 8.254, the eval loss on the same validation batches from 8.324 (step 5) to 8.312
    # (step 10); without learning that eval difference is exactly 0.
    assert ref[-1]["loss"] < ref[0]["loss"] - 0.04
    evals = eval_losses(zero_runs[0])
    assert evals[10] < evals[5] - 0.005, evals
    for stage in (1, 2, 3):
        other = rows(zero_runs[stage])
        for a, b in zip(ref, other, strict=True):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (stage, a["step"])
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3), (stage, a["step"])
            assert b["lr"] == pytest.approx(a["lr"], rel=1e-9)


def test_metrics_rows_have_the_contract_fields(zero_runs):
    all_rows = [json.loads(x) for x in (zero_runs[2] / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in all_rows if "loss" in r]
    for key in ("step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time_s",
                "aux_loss", "z_loss", "expert_load_max_over_mean", "dropped_frac"):
        assert all(key in r for r in train), key
    # 2 ranks x micro 8 x 64 tokens per step, cumulative.
    assert [r["tokens"] for r in train] == [2 * 8 * 64 * s for s in range(1, STEPS + 1)]
    assert [r["step"] for r in all_rows if "eval_loss" in r] == [5, 10]
    config = json.loads((zero_runs[2] / "config.json").read_text())
    assert config["world"]["world_size"] == 2 and config["ds_config"]["train_batch_size"] == 16
    assert config["ds_config"]["scheduler"]["params"]["total_num_steps"] == STEPS
    assert {"torch", "deepspeed", "transformers"} <= set(config["versions"])
    ckpts = sorted(p.name for p in (zero_runs[2] / "checkpoints").iterdir() if p.is_dir())
    assert ckpts == ["step00000010"]


def test_a_bf16_run_on_a_cpu_without_native_bf16_warns_once_and_trains_in_bf16(zero_runs, warm, tmp_path):
    """The quick start's bf16 JSON: on a CPU without native bf16 one warning line naming
    ``ds_configs/zero3_fp32.json``, none on a CPU with it; the run trains in bf16 as asked. The
    fp32 runs print no such line."""
    from training.run import host
    run_dir = tmp_path / "bf16"
    warm.launch(run_dir, "ds_configs/zero3.json", nproc=1, steps=1)
    log = (tmp_path / "bf16.log").read_text()
    warnings = [line for line in log.splitlines() if "no native bf16" in line]
    assert len(warnings) == (1 if host.cpu_has_native_bf16() is False else 0), log[-3000:]
    assert all(w.startswith("warning: this CPU (") and "use ds_configs/zero3_fp32.json" in w for w in warnings)
    assert json.loads((run_dir / "config.json").read_text())["ds_config"]["bf16"]["enabled"] is True
    assert [r["step"] for r in rows(run_dir)] == [1]
    for stage, fp32_run in zero_runs.items():
        assert "no native bf16" not in (fp32_run.parent / f"{fp32_run.name}.log").read_text(), stage


def test_accumulation_is_exact(two_rank_runs):
    # Mixtral routing is per token and dropless, the z-loss a per-token mean: with the
    # load-balancing loss off, micro 1 x accumulation 4 must equal micro 4 x accumulation 1 up to
    # summation order (fp32, ~1e-7; tolerance 1e-5 relative plus 1e-6 absolute per step). The
    # load-balancing loss is a per-micro-batch statistic (as in Switch/Megatron) and is
    # deliberately not accumulation-invariant.
    runs = [rows(two_rank_runs[name]) for name in ("m1a4", "m4a1")]
    for a, b in zip(*runs, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6), a["step"]
        assert b["tokens"] == a["tokens"]


@pytest.mark.parametrize("kill_at", [4, 8])
def test_sigkill_and_restart_reproduces_the_uninterrupted_run(zero_runs, warm, tmp_path, kill_at):
    """SIGKILL once step ``kill_at`` is logged; checkpoints every 3 steps, written in the
    background, so the newest save may still be in flight (unpublished) when the kill comes.
    The same command resumes from ``latest`` (or, killed before any save was published, starts
    over with one warning about the unfinished folder) and reproduces the uninterrupted run."""
    run_dir = tmp_path / f"killed-{kill_at}"
    ckpt, args = run_dir / "checkpoints", ["train.save_every=3"]
    kill_after_step(launch(run_dir, "ds_configs/zero3_fp32.json", extra=args, wait=False), run_dir,
                    kill_at)
    tag = (ckpt / "latest").read_text().strip() if (ckpt / "latest").is_file() else None
    unfinished = tag is None and (ckpt / "step00000003").exists()
    newest = kill_at // 3 * 3                        # the newest save started before the kill
    assert tag in {f"step{newest:08d}", f"step{newest - 3:08d}" if newest > 3 else None}, tag
    warm.launch(run_dir, "ds_configs/zero3_fp32.json", extra=args)     # the same command again
    log = (tmp_path / f"killed-{kill_at}.log").read_text()
    assert (f"resumed from {ckpt / tag}" in log if tag else "resumed from" not in log and
            ("holds only unfinished saves" in log) == unfinished), log[-3000:]
    resumed, ref = rows(run_dir), rows(zero_runs[3])
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))   # no duplicate rows
    for a, b in zip(ref, resumed, strict=True):
        # Same process count, same reduction order: a resumed fp32 run is bit-for-bit the same
        # computation; 1e-6 allows only checkpoint-format rounding, of which there is none.
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6), a["step"]
    kept = sorted(p.name for p in ckpt.iterdir() if p.is_dir())
    assert kept == ["step00000006", "step00000009", "step00000010"]      # keep_last 3


@pytest.fixture(scope="module")
def killed_after_7(tmp_path_factory):
    """A run (checkpoints every 3 steps) SIGKILLed once step 7 is logged: two steps before the next
    save, so no half-written step 9 can join in. Each damage test damages a copy of it."""
    import time
    run_dir = tmp_path_factory.mktemp("killed7") / "run"
    proc = launch(run_dir, "ds_configs/zero3_fp32.json", extra=["train.save_every=3"], wait=False)
    # The step-6 save is written in the background: wait until it is published (on a loaded
    # machine the writer can finish after step 7 is logged), then kill.
    latest, deadline = run_dir / "checkpoints" / "latest", time.time() + 300
    while proc.poll() is None and time.time() < deadline:
        if latest.is_file() and latest.read_text().strip() == "step00000006":
            break
        time.sleep(0.05)
    kill_after_step(proc, run_dir, 7)
    return run_dir


@pytest.mark.parametrize("damage", ["truncated_file", "manifest_deleted"])
def test_a_damaged_newest_checkpoint_is_skipped_with_one_warning(zero_runs, killed_after_7, warm,
                                                                 tmp_path, damage):
    """Checkpoints 3 and 6 (``latest``) of a run killed after step 7 (a copy of
    ``killed_after_7``: the damage comes after the kill, so both cases start from the same
    files); step 6 damaged; the same command warns once, resumes from step 3 and reproduces the
    uninterrupted run."""
    import torch

    from training.checkpoint import manifest
    run_dir, args = tmp_path / damage, ["train.save_every=3"]
    shutil.copytree(killed_after_7, run_dir)
    ckpt = run_dir / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step00000006"
    assert sorted(p.name for p in ckpt.glob("step*")) == ["step00000003", "step00000006"]
    newest = ckpt / "step00000006"
    if damage == "truncated_file":
        largest = max((p for p in newest.iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
        os.truncate(largest, largest.stat().st_size // 2)
        reason = f"has {largest.name} of the wrong size"
    else:
        (newest / "manifest.json").unlink()
        reason = "has no manifest.json"
    warm.launch(run_dir, "ds_configs/zero3_fp32.json", extra=args)     # the same command again
    log = (tmp_path / f"{damage}.log").read_text()
    warnings = [line for line in log.splitlines() if line.startswith("warning: skipping")]
    assert warnings == [f"warning: skipping checkpoints in {ckpt} that do not verify "
                        f"(step00000006 {reason}); resuming from {ckpt / 'step00000003'}"], log[-3000:]
    assert f"resumed from {ckpt / 'step00000003'}" in log
    resumed, ref = rows(run_dir), rows(zero_runs[3])
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))   # rows 4-7 replaced once
    for a, b in zip(ref, resumed, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6), a["step"]
    kept = sorted(p.name for p in ckpt.iterdir() if p.is_dir())
    assert kept == ["step00000006", "step00000009", "step00000010"]    # keep_last 3; 6 saved again
    for tag in kept:
        assert manifest.verify(ckpt / tag, 0, 1, torch.device("cpu")) is None, tag
        assert not list((ckpt / tag).glob("manifest.rank*")), tag


def _without_defaults(section: dict, cls) -> dict:
    """``section`` without every field that holds ``cls``'s default: what a writer that did not
    know those fields yet would have written."""
    import dataclasses
    fields = {f.name: f for f in dataclasses.fields(cls)}

    def default(f):
        value = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else object())
        return json.loads(json.dumps(value, default=str))
    return {k: v for k, v in section.items() if k not in fields or v != default(fields[k])}


def test_a_run_directory_of_older_code_resumes_and_a_changed_model_is_refused(zero_runs, killed_after_7,
                                                                               warm, tmp_path):
    """``config.json`` as code of an earlier week wrote it: its model section without every field
    at its default (the fields added since, ``attention``, ``mtp_depth``, ``moe.router_dtype``, the
    MLA and YaRN keys among them, take defaults that leave the older model unchanged). The same
    command resumes from step 6 and reproduces the uninterrupted run; the next field added cannot
    strand a run either, since any field at its default is left out here."""
    from model.config import CONFIG_CLASSES, MoEConfig
    from training.config.recipe import load_recipe
    run_dir, args = tmp_path / "older", ["train.save_every=3"]
    shutil.copytree(killed_after_7, run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    model = config["recipe"]["model"]
    older = _without_defaults(model, CONFIG_CLASSES[model["family"]])
    older["moe"] = _without_defaults(model["moe"], MoEConfig)
    assert {"attention", "mtp_depth"} <= set(model) - set(older) and "router_dtype" not in older["moe"]
    config["recipe"]["model"] = older
    (run_dir / "config.json").write_text(json.dumps(config, indent=1))
    warm.launch(run_dir, "ds_configs/zero3_fp32.json", extra=args)     # the same command again
    log = (tmp_path / "older.log").read_text()
    assert f"resumed from {run_dir / 'checkpoints' / 'step00000006'}" in log, log[-3000:]
    resumed, ref = rows(run_dir), rows(zero_runs[3])
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    for a, b in zip(ref, resumed, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6), a["step"]
    # A model that really differs is still another model, written in full or in the older form.
    from training.run.preflight import same_model
    recipe = load_recipe(None, SMALL)
    assert same_model(older, recipe) and same_model(model, recipe)
    for changed in ({**older, "num_layers": older["num_layers"] + 1}, {**older, "attention": "mla"},
                    {**older, "moe": {**older["moe"], "router_dtype": "bf16"}}, {**older, "no_such_key": 1}):
        assert not same_model(changed, recipe), changed


FAULT_RUN = "tests/training/checkpoint/_save_fault_run.py"


def test_sigkill_while_a_checkpoint_is_written_resumes_exactly(zero_runs, warm, tmp_path):
    """Both ranks cut their files of checkpoint 6 to half and stop there; SIGKILL. The same
    command skips the half-written checkpoint (no manifest) and resumes from step 3."""
    import time
    run_dir, args = tmp_path / "mid-save", ["train.save_every=3"]
    mark = tmp_path / "holding"
    proc = launch(run_dir, "ds_configs/zero3_fp32.json", extra=args, wait=False, script=FAULT_RUN,
                  extra_env={"FAULT": "hold", "FAULT_TAG": "step00000006", "FAULT_MARK": str(mark)})
    deadline = time.time() + 300
    while not list(tmp_path.glob("holding.*")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None and list(tmp_path.glob("holding.*")), "the save was not reached"
    os.killpg(proc.pid, signal.SIGKILL)
    subprocess.run(["pkill", "-KILL", "-f", str(run_dir)], check=False)
    proc.wait()
    ckpt = run_dir / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step00000003"
    assert not (ckpt / "step00000006" / "manifest.json").exists()
    warm.launch(run_dir, "ds_configs/zero3_fp32.json", extra=args)      # the same command, no fault
    log = (tmp_path / "mid-save.log").read_text()
    assert f"resumed from {ckpt / 'step00000003'}" in log
    resumed, ref = rows(run_dir), rows(zero_runs[3])
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    for a, b in zip(ref, resumed, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6), a["step"]


@pytest.mark.parametrize("policy,background", [("continue", True), ("stop", True), ("stop", False)])
def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(zero_runs, warm, tmp_path, policy,
                                                                 background):
    """Rank 1's files of checkpoint 6 fail with ENOSPC, written by DeepSpeed in the loop or by
    the background writer (``train.async_save``). One warning line from that rank; the partial
    folder is removed and ``latest`` keeps step 3. ``continue``: training goes on (the same
    losses, later checkpoints saved); ``stop``: exit code 74 at step 6 (in the loop) or at the
    step by which the ranks learned of it (background: 6 to 8), and the same command without
    the fault resumes from step 3 and matches the uninterrupted run."""
    import re

    import torch

    from training.checkpoint import manifest
    run_dir = tmp_path / policy
    args = ["train.save_every=3", f"train.on_save_error={policy}",
            f"train.async_save={str(background).lower()}"]
    rc = warm.launch(run_dir, "ds_configs/zero3_fp32.json", extra=args, script=FAULT_RUN, check=False,
                     extra_env={"FAULT": "enospc", "FAULT_TAG": "step00000006", "FAULT_RANK": "1"})
    log = (tmp_path / f"{policy}.log").read_text()
    ckpt = run_dir / "checkpoints"
    warnings = [line for line in log.splitlines() if "could not write checkpoint" in line]
    assert len(warnings) == 1 and warnings[0].startswith(
        f"warning: rank 1 could not write checkpoint {ckpt / 'step00000006'} (No space left on "
        f"device: "), log[-3000:]
    assert warnings[0].endswith("latest still names the previous checkpoint")
    assert not (ckpt / "step00000006").exists()
    if policy == "continue":
        assert rc == 0, log[-3000:]
        assert sorted(p.name for p in ckpt.glob("step*")) == ["step00000003", "step00000009",
                                                              "step00000010"]
    else:
        assert rc == 74 and "(exit code 74)" in log, log[-3000:]
        stopped = re.search(r"stopping at step (\d+): its checkpoint for step 6 could not be written "
                            r"\(exit code 74\); free space and run the same command to resume "
                            r"from step00000003", log)
        # Background: the ranks learn of the failure from the step after the writer failed (6 or
        # 7; on a loaded machine the writer thread can take one step more).
        assert stopped and int(stopped.group(1)) in ((6, 7, 8) if background else (6,)), log[-3000:]
        assert (ckpt / "latest").read_text().strip() == "step00000003"
        warm.launch(run_dir, "ds_configs/zero3_fp32.json", extra=args)  # the disk has room again
    for tag in (p.name for p in ckpt.glob("step*")):
        assert manifest.verify(ckpt / tag, 0, 1, torch.device("cpu")) is None, tag
    resumed, ref = rows(run_dir), rows(zero_runs[3])
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    for a, b in zip(ref, resumed, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6), a["step"]


@pytest.mark.parametrize("background", [True, False])
def test_a_slow_filesystem_stalls_only_a_synchronous_save(zero_runs, warm, tmp_path, background):
    """Every file write of checkpoint 3 takes 3 s longer (``FAULT=slow``). In the background
    (``train.async_save``, the default) the loop waits only for the snapshot: under 1.5 s, and
    the steps after 3 are trained while the files are written. Written in the loop, the save
    stalls it for at least the 3 s. Either way every checkpoint verifies and the losses are the
    uninterrupted run's."""
    import torch

    from training.checkpoint import manifest
    run_dir = tmp_path / f"slow-{background}"
    warm.launch(run_dir, "ds_configs/zero3_fp32.json", script=FAULT_RUN,
                extra=["train.save_every=3", f"train.async_save={str(background).lower()}"],
                extra_env={"FAULT": "slow", "FAULT_TAG": "step00000003"})
    logged = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    stall = {r["step"]: r["save_stall_s"] for r in logged if "save_stall_s" in r}
    assert sorted(stall) == [3, 6, 9, 10]
    assert stall[3] < 1.5 if background else stall[3] >= 3.0, stall
    ckpt = run_dir / "checkpoints"
    for tag in (p.name for p in ckpt.glob("step*")):
        assert manifest.verify(ckpt / tag, 0, 1, torch.device("cpu")) is None, tag
    for a, b in zip(rows(zero_runs[3]), rows(run_dir), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6), a["step"]


def _listing(root: Path) -> dict:
    """Every path under ``root`` (and root): kind, size, content, mtime."""
    return {p.relative_to(root).as_posix(): (p.is_dir(), p.stat().st_size, p.stat().st_mtime_ns,
                                             p.read_bytes() if p.is_file() else None)
            for p in [root, *sorted(root.rglob("*"))]}


def test_no_verified_checkpoint_stops_with_one_line_and_writes_nothing(warm, tmp_path):
    """One process: a checkpoint without a manifest (a failed save, or one written without this
    trainer's manifest) and ``latest`` naming a folder that is gone. The trainer must not start
    over."""
    from training.config.recipe import load_recipe
    run_dir = tmp_path / "unverified"
    ckpt = run_dir / "checkpoints"
    (ckpt / "step00000010").mkdir(parents=True)
    (ckpt / "step00000010" / "mp_rank_00_model_states.pt").write_bytes(b"no manifest")
    (ckpt / "latest").write_text("step00000099")
    recipe = load_recipe(None, [*SMALL, f"train.steps={STEPS}"])
    (run_dir / "config.json").write_text(json.dumps({"recipe": recipe.to_dict(), "ds_config": {}}))
    (run_dir / "metrics.jsonl").write_text('{"step": 10, "loss": 8.2}\n')
    before = _listing(run_dir)
    rc = warm.run(["launch/train.py", "--config", "ds_configs/zero1_fp32.json", "--run-dir",
                   str(run_dir), "--steps", str(STEPS), "--set", *SMALL],
                  tmp_path / "unverified.out", stderr=tmp_path / "unverified.err")
    stderr = (tmp_path / "unverified.err").read_text()
    assert rc == 2, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert [line for line in stderr.splitlines() if line.startswith("error:")] == [
        f"error: no checkpoint in {ckpt} verifies (step00000099 is missing, step00000010 has no "
        f"manifest.json): restore step00000099 from a copy, or move {ckpt} aside to start from "
        f"step 0 (a checkpoint without a manifest counts as unverified)"], stderr
    assert _listing(run_dir) == before


def _signal_after_step(proc, run_dir: Path, step: int) -> float:
    """SIGTERM to every process of the run (the torchrun agent, which forwards it, and the ranks:
    each rank gets it twice, as under SLURM) once metrics.jsonl shows ``step``, and a second
    SIGTERM half a second later; returns the time of the first."""
    import signal
    import time
    metrics = run_dir / "metrics.jsonl"
    while proc.poll() is None and not (metrics.is_file() and f'"step": {step},' in metrics.read_text()):
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be signalled"
    sent = time.time()
    os.killpg(proc.pid, signal.SIGTERM)
    time.sleep(0.5)
    subprocess.run(["pkill", "-TERM", "-f", f"launch/train.py.*{run_dir}"], check=False)
    return sent


def test_sigterm_saves_the_step_reached_and_the_same_command_resumes_exactly(zero_runs, warm, tmp_path):
    """Preemption (``training/resilience/preemption.py``): the ranks finish the step they are in, save it
    (not a save step: save_every is 100) and exit 75 within 60 s; the same command resumes and
    the losses match the uninterrupted run's."""
    import re
    import time
    run_dir = tmp_path / "preempted"
    sent = _signal_after_step(launch(run_dir, "ds_configs/zero3_fp32.json", wait=False), run_dir, 2)
    proc_log = tmp_path / "preempted.log"
    deadline = sent + 60
    while time.time() < deadline and "exit code 75" not in proc_log.read_text():
        time.sleep(0.1)
    log = proc_log.read_text()
    found = re.search(r"preempted at step (\d+): .*(step\d{8}) saved.*\(exit code 75\)", log)
    assert found, log[-3000:]
    step = int(found.group(1))
    assert 2 <= step < STEPS, log[-3000:]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == found.group(2)
    assert found.group(2) == f"step{step:08d}"
    assert "received SIGTERM: finishing this optimizer step" in log
    time.sleep(2)                                 # the launcher's own exit after its workers'
    warm.launch(run_dir, "ds_configs/zero3_fp32.json")     # the same command again
    assert f"resumed from {run_dir / 'checkpoints' / found.group(2)}" in proc_log.read_text()
    resumed, ref = rows(run_dir), rows(zero_runs[3])
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))   # no step lost or repeated
    for a, b in zip(ref, resumed, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6), a["step"]   # as the SIGKILL test


def test_preemption_exit_code_and_signal_names(warm, tmp_path):
    """One process (``python launch/train.py``): SIGUSR1 is a preemption signal too, and the
    process itself exits 75; a signal name that cannot be caught is refused before the start."""
    import signal
    import time
    run_dir = tmp_path / "usr1"
    proc = launch(run_dir, "ds_configs/zero1_fp32.json", nproc=1, wait=False)
    metrics = run_dir / "metrics.jsonl"
    while proc.poll() is None and not (metrics.is_file() and '"step": 1,' in metrics.read_text()):
        time.sleep(0.02)
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=60) == 75, (tmp_path / "usr1.log").read_text()[-3000:]
    step = int((run_dir / "checkpoints" / "latest").read_text().strip()[len("step"):])
    assert 1 <= step < STEPS
    rc = warm.run(["launch/train.py", "--config", "ds_configs/zero1_fp32.json", "--run-dir",
                   str(tmp_path / "bad"), "--set", "train.preemption_signals=[SIGKILL]"],
                  tmp_path / "bad.out", timeout=120, stderr=tmp_path / "bad.err")
    stderr = (tmp_path / "bad.err").read_text()
    assert rc == 2 and "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines() == [
        "error: train.preemption_signals: 'SIGKILL' is not a signal a process can catch; use names "
        "such as SIGTERM, SIGUSR1, SIGUSR2"], stderr
    assert not (tmp_path / "bad").exists()


def test_wandb_offline_run_holds_the_metrics_and_evaluate_reads_the_run(warm, tmp_path, capsys):
    run_dir = tmp_path / "wb"
    # lr 1e-2 so that 10 steps learn enough for evaluate.py to tell a trained model from a random
    # one (ln 4096 = 8.318). Measured: the training loss 8.327 -> 7.011, the eval loss 7.908 at
    # step 5 and 7.601 at step 10, evaluate.py on the text below 7.516.
    config = json.loads((REPO / "ds_configs" / "zero2_fp32.json").read_text())
    config["optimizer"]["params"]["lr"] = 1e-2
    (tmp_path / "zero2_lr1e-2.json").write_text(json.dumps(config))
    warm.launch(run_dir, str(tmp_path / "zero2_lr1e-2.json"), nproc=1,
                extra=["tracking.wandb=true", "tracking.tags=[test]"])
    log = (tmp_path / "wb.log").read_text()
    assert "wandb sync" in log
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1
    logged = wandb_history(next(offline[0].glob("*.wandb")))
    ours = rows(run_dir)
    train_hist = [h for h in logged if "loss" in h]
    assert len(train_hist) == STEPS
    assert [h["loss"] for h in train_hist] == pytest.approx([r["loss"] for r in ours])
    # Each MoE layer's router statistics (SMALL: 2 Mixtral blocks, 8 experts, top-2; one rank of
    # 8 sequences x 64 tokens per step), and the row's load figure is the worst layer's.
    for h, r in zip(train_hist, ours, strict=True):
        for i in (0, 1):
            tokens = h[f"moe/layer{i}/tokens_per_expert"]
            assert len(tokens) == 8 and sum(tokens) == 2 * 8 * 64, (i, tokens)
            assert h[f"moe/layer{i}/load_max_over_mean"] == pytest.approx(max(tokens) / (sum(tokens) / 8))
            assert 0 < h[f"moe/layer{i}/router_entropy"] <= math.log(8) and h[f"moe/layer{i}/dropped_frac"] == 0
        assert r["expert_load_max_over_mean"] == pytest.approx(
            max(h["moe/layer0/load_max_over_mean"], h["moe/layer1/load_max_over_mean"]))
        assert r["router_entropy"] == pytest.approx(
            (h["moe/layer0/router_entropy"] + h["moe/layer1/router_entropy"]) / 2)
        # the router logits' size: the largest layer's maximum, the mean log-sum-exp over layers
        assert r["router_logit_max"] > 0 and r["router_logit_max"] == pytest.approx(
            max(h["moe/layer0/router_logit_max"], h["moe/layer1/router_logit_max"]))
        assert r["router_lse"] == pytest.approx((h["moe/layer0/router_lse"] + h["moe/layer1/router_lse"]) / 2)
        # each layer's gradient norm, flat, on the rows that carry grad_norm_layers (log steps)
        assert ("grad_norm/block1" in h) == ("grad_norm_layers" in r) == (r["step"] % 5 == 0)
        if "grad_norm_layers" in r:
            f = r["grad_norm_layers"]
            assert [h["grad_norm/embed"], h["grad_norm/block0"], h["grad_norm/block1"], h["grad_norm/head"]] == \
                pytest.approx([f["embed"], *f["blocks"], f["head"]]) and "grad_norm_layers" not in h

    # evaluate.py's main in this process (its command line is run as a script by
    # tests/interop/test_hf_moe_training_round_trip.py and tests/launch/test_cli_errors.py).
    from launch import evaluate
    text = tmp_path / "eval.txt"
    text.write_text((Path(os.__file__).parent / "this.py").read_text() * 3)
    capsys.readouterr()
    assert evaluate.main(["--run-dir", str(run_dir), "--text-file", str(text)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ln_vocab = math.log(4096)
    assert ours[-1]["loss"] < ours[0]["loss"] - 0.6, [r["loss"] for r in ours]
    evals = eval_losses(run_dir)
    assert evals[10] < evals[5] < ln_vocab and evals[10] < ln_vocab - 0.35, evals
    assert result["tokens"] > 100 and result["loss"] < ln_vocab - 0.4, result


def test_the_trainer_exits_with_its_code_and_flushed_output_but_no_finalization():
    """``training.run.distributed.exit_now`` (the end of ``launch/train.py``): the run's code, its buffered
    stdout, stderr and logging flushed, and no interpreter finalization, where gloo's threads
    can abort a finished run. An atexit handler stands in for finalization."""
    script = ("import atexit, logging, sys\n"
              "atexit.register(lambda: print('FINALIZED', flush=True))\n"
              "from training.run.distributed import exit_now\n"
              "logging.basicConfig(stream=sys.stderr)\n"
              "print('stdout line'); sys.stderr.write('stderr line\\n')\n"
              "logging.getLogger('x').warning('log line')\n"
              "exit_now(75)\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=_env(), capture_output=True,
                         text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 75, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["stdout line"], out.stdout
    assert "stderr line" in out.stderr and "log line" in out.stderr, out.stderr
