"""``parallel.grad_compression`` in the trainer, 2 ranks at dp2, fp32 ZeRO-0 (what PowerSGD was
made for), tiny Mixtral and tiny dense; the bytes of every all-reduce of a step counted by
``_grad_exchange_run.py`` around ``launch/train.py`` (it changes no value).

* PowerSGD at rank 4 hands the all-reduces at most 1/8 of the bytes of its uncompressed start
  (which equals DeepSpeed's own exchange without compression, within its few scalars), and
  DeepSpeed exchanges no gradient; the metrics' ``grad_exchange_bytes`` is the counted figure.
* ``bf16`` halves DeepSpeed's bytes, and its losses stay within 1e-3 of fp32's over 4 steps
  (bf16 keeps 8 bits of mantissa: a relative error of 2^-9 per gradient element).
* A step made non-finite (NaN) is skipped and leaves PowerSGD's state (Q, errors, count) as it
  was; the next step trains on.
* Resuming from a checkpoint (copy of the run, the later checkpoint removed, as after a crash)
  continues bitwise: the same losses, norms, bytes and PowerSGD state as the uninterrupted run.
* Under EP2 x DP2 (4 ranks) PowerSGD's own reduction equals DeepSpeed's step for step in its
  uncompressed start (each expert averaged over its own replicas), and compresses after it.
* Each setting that cannot apply is refused before the start in one line naming the key (the
  communication keys of ``parallel``: compression, shared-expert overlap, hierarchical exchange).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.runs import SMALL, ds_variant, rows
from training.run.preflight import plan_for

SCRIPT = "tests/training/step/_grad_exchange_run.py"
POWERSGD = ["parallel.grad_compression=powersgd", "parallel.powersgd_rank=4",
            "parallel.powersgd_start_steps=2"]
SCALARS = 64          # bytes of DeepSpeed's scalar all-reduces in a step (norms, flags), at most


@pytest.fixture(scope="module")
def runs(warm_launcher, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("exchange")
    warm = warm_launcher
    config = ds_variant(tmp, "zero0_fp32", train_micro_batch_size_per_gpu=4)
    common = ["eval.every=0"]
    for name, extra, steps, env in (("none", [], 4, {}),
                                    ("bf16", ["parallel.grad_compression=bf16"], 4, {}),
                                    ("powersgd", POWERSGD + ["train.save_every=3"], 6, {"NAN_STEP": "5"})):
        warm.launch(tmp / name, config, steps=steps, script=SCRIPT, extra=common + extra,
                    extra_env={"EXCHANGE_OUT": str(tmp / f"{name}-bytes"), **env})
    dense = [s for s in SMALL if not s.startswith("model.moe.")]
    warm.script(SCRIPT, ["--config", config, "--recipe", "recipes/tiny_dense.yaml", "--run-dir",
                         str(tmp / "dense"), "--steps", "4", "--set", *dense, *common, *POWERSGD],
                tmp / "dense.log", extra_env={"EXCHANGE_OUT": str(tmp / "dense-bytes")})
    # As after a crash at step 5: the checkpoint of step 3 is the latest; the same command resumes.
    shutil.copytree(tmp / "powersgd", tmp / "resumed")
    shutil.rmtree(tmp / "resumed" / "checkpoints" / "step00000006")
    (tmp / "resumed" / "checkpoints" / "latest").write_text("step00000003")
    (tmp / "resumed" / "metrics.jsonl").write_text("")
    warm.launch(tmp / "resumed", config, steps=6, script=SCRIPT, extra=common + POWERSGD + ["train.save_every=3"],
                extra_env={"EXCHANGE_OUT": str(tmp / "resumed-bytes"), "NAN_STEP": "5"})
    return tmp


def _bytes(runs: Path, name: str, rank: int = 0) -> dict[int, dict]:
    return {int(k): v for k, v in json.loads((runs / f"{name}-bytes.{rank}.json").read_text()).items()}


@pytest.mark.parametrize("name", ["powersgd", "dense"])
def test_powersgd_sends_at_most_an_eighth(runs, name):
    counted, logged = _bytes(runs, name), {r["step"]: r for r in rows(runs / name)}
    start = [counted[s]["bytes"]["powersgd"] for s in (1, 2)]
    compressed = [counted[s]["bytes"]["powersgd"] for s in (3, 4)]
    print(name, "uncompressed", start, "compressed", compressed)
    assert start[0] == start[1] and compressed[0] == compressed[1]
    assert compressed[0] * 8 <= start[0], (compressed, start)
    for step in (1, 2, 3, 4):
        assert logged[step]["grad_exchange_bytes"] == counted[step]["bytes"]["powersgd"]
        assert counted[step]["bytes"].get("deepspeed", 0) <= SCALARS    # no gradient from DeepSpeed
    if name == "powersgd":
        deepspeed = _bytes(runs, "none")[2]["bytes"]["deepspeed"]
        assert start[0] <= deepspeed <= start[0] + SCALARS, (start, deepspeed)


@pytest.mark.parametrize("name", ["powersgd", "dense"])
def test_the_estimator_counts_powersgds_bytes_and_state(runs, name, monkeypatch):
    """``planning/estimator.py`` at the run's recipe and layout (the model's shapes on the meta
    device): 4 bytes x its ``total`` elements are the counted bytes of an uncompressed step,
    4 x (``plain`` + ``p`` + ``q``) those of a compressed one, and the PowerSGD state it adds to
    the model states (Q and the errors, fp32) is the bytes of the state the run saved; the cost
    model's data-parallel bytes shrink by the same ratio."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    from planning.estimator import estimate, step_time
    from planning.hardware import cluster
    sets = SMALL if name == "powersgd" else [s for s in SMALL if not s.startswith("model.moe.")]
    recipe = None if name == "powersgd" else "recipes/tiny_dense.yaml"
    plan = plan_for("ds_configs/zero0_fp32.json", recipe, sets=[*sets, *POWERSGD])
    est = estimate(plan.recipe, plan.ds, 2, on_gpu=False)
    elements, counted = est["powersgd"], _bytes(runs, name)
    assert 4 * elements["total"] == counted[1]["bytes"]["powersgd"]
    assert 4 * (elements["plain"] + elements["p"] + elements["q"]) == counted[3]["bytes"]["powersgd"]
    saved = sorted((runs / name / "checkpoints").glob("step*/trainer_state_rank00000.pt"))[-1]
    state = torch.load(saved, weights_only=True)["grad_compression"]
    state_bytes = sum(t.numel() * t.element_size() for t in state["q"] + state["errors"])
    assert est["worst"]["states"]["compression"] == state_bytes > 0
    plain_plan = plan_for("ds_configs/zero0_fp32.json", recipe, sets=sets)
    plain = estimate(plain_plan.recipe, plain_plan.ds, 2, on_gpu=False)
    assert est["worst"]["model_states"] == plain["worst"]["model_states"] + state_bytes
    where = cluster(name="dgx-h100")
    dp = [step_time(p.recipe, e, p.ds, where)["volumes"]["dp_bytes"] for p, e in ((plan, est), (plain_plan, plain))]
    ratio = (elements["plain"] + elements["p"] + elements["q"]) / elements["total"]
    assert dp[0] == pytest.approx(dp[1] * ratio, rel=1e-9), (dp, ratio)


def test_bf16_halves_the_exchange_and_tracks_fp32(runs):
    fp32, bf16 = _bytes(runs, "none")[2]["bytes"]["deepspeed"], _bytes(runs, "bf16")[2]["bytes"]["deepspeed"]
    assert abs(bf16 - fp32 / 2) <= SCALARS, (fp32, bf16)
    config = json.loads((runs / "bf16" / "config.json").read_text())
    assert config["ds_config"]["communication_data_type"] == "bf16"
    for a, b in zip(rows(runs / "none"), rows(runs / "bf16")):
        assert abs(a["loss"] - b["loss"]) <= 1e-3, (a, b)


def test_a_skipped_step_leaves_powersgd_alone(runs):
    logged = {r["step"]: r for r in rows(runs / "powersgd")}
    assert logged[5]["skipped"] == "non-finite loss" and logged[5]["grad_exchange_bytes"] == 0
    for rank in range(2):
        counted = _bytes(runs, "powersgd", rank)
        assert counted[5]["state"] == counted[4]["state"] != counted[3]["state"]
        assert counted[5]["bytes"].get("powersgd", 0) == 0
        assert counted[6]["state"] != counted[5]["state"]
    assert "skipped" not in logged[6] and logged[6]["loss"] < 20


def fingerprint(state: dict) -> str:
    """``_grad_exchange_run.state_fingerprint`` of a PowerSGD state (a saved one here)."""
    digest = hashlib.sha256(str(state["reductions"]).encode())
    for t in (state["q"] or []) + (state["errors"] or []):
        digest.update(t.numpy().tobytes())
    return digest.hexdigest()


SPIKE = POWERSGD + ["eval.every=0", "train.grad_spike_factor=3", "train.spike_window=4",
                    "train.spike_action=skip"]


def test_a_gradient_spike_is_skipped_and_leaves_powersgd_alone(warm_launcher, tmp_path):
    """Step 10's gradient (not its loss) multiplied by 100 under PowerSGD with
    ``train.grad_spike_factor``: exactly step 10 is flagged and skipped, none of the next 20, and
    PowerSGD's state (count, Q, errors) after step 10 is the state after step 9 on every rank:
    the compressor reduces before the norm is known and keeps the new state aside until the
    step's skip decision (``PowerSGD.commit`` / ``rollback``). Kept, the spike would sit in the
    error feedback and come back: every later step flagged. With ``spike_action: stop`` the run
    stops at step 10 and its checkpoint holds the state of step 9."""
    config = ds_variant(tmp_path, "zero0_fp32", train_micro_batch_size_per_gpu=4)
    env = {"SPIKE_STEP": "10", "SPIKE_FACTOR": "100"}
    warm_launcher.launch(tmp_path / "skip", config, steps=30, script=SCRIPT, extra=SPIKE,
                         extra_env={"EXCHANGE_OUT": str(tmp_path / "skip-bytes"), **env})
    logged = {r["step"]: r for r in rows(tmp_path / "skip")}
    flagged = {s: r.get("skipped") for s, r in logged.items() if r.get("grad_spike") or "skipped" in r}
    assert list(flagged) == [10] and flagged[10].startswith("grad-norm spike"), flagged
    assert logged[10]["grad_exchange_bytes"] == logged[9]["grad_exchange_bytes"] > 0    # it did exchange
    for rank in range(2):
        counted = _bytes(tmp_path, "skip", rank)
        assert counted[10]["state"] == counted[9]["state"] != counted[8]["state"]
        assert counted[11]["state"] != counted[10]["state"]

    warm_launcher.launch(tmp_path / "stop", config, steps=12, script=SCRIPT,
                         extra=SPIKE + ["train.spike_action=stop", "train.save_every=100"],
                         extra_env={"EXCHANGE_OUT": str(tmp_path / "stop-bytes"), **env})
    assert [r["step"] for r in rows(tmp_path / "stop")][-1] == 10
    assert rows(tmp_path / "stop")[-1]["stopped"].startswith("grad-norm spike")
    for rank in range(2):
        saved = torch.load(tmp_path / "stop" / "checkpoints" / "step00000010" / f"trainer_state_rank{rank:05d}.pt",
                           weights_only=True)["grad_compression"]
        assert fingerprint(saved) == _bytes(tmp_path, "stop", rank)[9]["state"]


def _saved_powersgd(run: Path, step: int) -> list[dict]:
    folder = run / "checkpoints" / f"step{step:08d}"
    files = sorted(folder.glob("trainer_state_rank*.pt"))
    return [torch.load(f, weights_only=True)["grad_compression"] for f in files]


def _check_resharded(saved: list[dict], loaded: list[dict]) -> None:
    """Every rank's loaded Q and count are the saved ones; the errors' mean over the ranks (all
    the exchange uses of them) is the saved mean."""
    for state in loaded:
        assert state["reductions"] == saved[0]["reductions"] and state["rank"] == saved[0]["rank"]
        assert all(torch.equal(a, b) for a, b in zip(state["q"], saved[0]["q"], strict=True))
    for i, before in enumerate(saved[0]["errors"]):
        mean_saved = sum(s["errors"][i] for s in saved) / len(saved)
        mean_loaded = sum(s["errors"][i] for s in loaded) / len(loaded)
        assert mean_saved.abs().max() > 0 and before.shape == mean_loaded.shape
        torch.testing.assert_close(mean_loaded, mean_saved, rtol=1e-5, atol=1e-7)
    assert not torch.equal(loaded[0]["errors"][0], loaded[1]["errors"][0])   # not one copy for all


def test_a_resume_at_another_data_parallel_size_reshards_powersgd(warm_launcher, tmp_path):
    """fp32 ZeRO-0 resumes at another data-parallel size (DeepSpeed keeps the optimizer whole
    there); PowerSGD's per-rank state is resharded, with one warning line: 2 ranks, checkpoint
    at step 3 (compressed since step 3), resumed at 4 ranks to step 5, then that checkpoint at 2
    ranks to step 7. Each time every rank starts with the saved Q and count and the saved mean
    of the errors over the ranks, and trains on compressed without a skip. Before: at 4 ranks
    ranks 2-3 found no ``trainer_state_rank`` file and the run was refused as written "by a
    trainer without it"; at 2 ranks the error feedback of 2 of the 4 ranks was silently lost."""
    # The same global batch (8 sequences) at both sizes: the data order resumes.
    config = {n: ds_variant(tmp_path, "zero0_fp32", train_micro_batch_size_per_gpu=8 // n) for n in (2, 4)}
    common = POWERSGD + ["eval.every=0", "train.save_every=100"]
    warm_launcher.launch(tmp_path / "dp2", config[2], steps=3, script=SCRIPT, extra=common,
                         extra_env={"EXCHANGE_OUT": str(tmp_path / "dp2-bytes")})
    previous, step = "dp2", 3
    for name, nproc, steps in (("dp4", 4, 5), ("dp4-dp2", 2, 7)):
        shutil.copytree(tmp_path / previous, tmp_path / name)
        (tmp_path / name / "metrics.jsonl").write_text("")
        warm_launcher.launch(tmp_path / name, config[nproc], nproc=nproc, steps=steps, script=SCRIPT, extra=common,
                             extra_env={"EXCHANGE_OUT": str(tmp_path / f"{name}-bytes"),
                                        "LOADED_OUT": str(tmp_path / f"{name}-loaded")})
        log = (tmp_path / f"{name}.log").read_text()
        warnings = [line for line in log.splitlines() if "was saved by" in line]
        assert len(warnings) == 1, log[-3000:]
        saved_ranks = 2 if previous == "dp2" else 4
        assert (f"was saved by {saved_ranks} ranks, this run has {nproc}: PowerSGD state saved by "
                f"{saved_ranks} data-parallel ranks resharded onto {nproc}") in warnings[0], warnings
        loaded = [torch.load(tmp_path / f"{name}-loaded.{r}.pt", weights_only=True) for r in range(nproc)]
        _check_resharded(_saved_powersgd(tmp_path / previous, step), loaded)
        resumed = rows(tmp_path / name)
        assert [r["step"] for r in resumed] == list(range(step + 1, steps + 1))
        assert all("skipped" not in r and r["loss"] < 20 for r in resumed), resumed
        assert len({r["grad_exchange_bytes"] for r in resumed}) == 1       # compressed, as before
        previous, step = name, steps


def test_resume_continues_bitwise(runs):
    full, resumed = rows(runs / "powersgd"), rows(runs / "resumed")
    assert [r["step"] for r in resumed] == [4, 5, 6]
    keys = ("loss", "grad_norm", "grad_exchange_bytes", "skipped")
    assert [{k: r.get(k) for k in keys} for r in resumed] == [{k: r.get(k) for k in keys} for r in full[3:]]
    for rank in range(2):
        a, b = _bytes(runs, "powersgd", rank), _bytes(runs, "resumed", rank)
        assert [a[s]["state"] for s in (4, 5, 6)] == [b[s]["state"] for s in (4, 5, 6)]


def test_bf16_compression_at_zero3_casts_the_reduce_scatter(warm_launcher, tmp_path):
    """``grad_compression: bf16`` at fp32 ZeRO-3 (dp2, 4 steps): DeepSpeed's ZeRO-3
    reduce-scatter takes ``communication_data_type`` (its ``__avg_scatter_grads`` casts each
    bucket), so the key applies there too. The losses equal the uncompressed run's within 1e-5
    (the first step's exactly), and the grad norms differ by bf16's rounding, neither 0 (the
    cast happened) nor more than 1e-3 relative (8 bits of mantissa, two ranks)."""
    config = ds_variant(tmp_path, "zero3_fp32", train_micro_batch_size_per_gpu=4)
    warm_launcher.launch_many([(tmp_path / name, config, ["eval.every=0", *extra]) for name, extra in
                               (("none", []), ("bf16", ["parallel.grad_compression=bf16"]))], steps=4)
    resolved = json.loads((tmp_path / "bf16" / "config.json").read_text())["ds_config"]
    assert resolved["communication_data_type"] == "bf16"
    fp32, bf16 = rows(tmp_path / "none"), rows(tmp_path / "bf16")
    assert len(fp32) == len(bf16) == 4 and fp32[0]["loss"] == bf16[0]["loss"]
    norms = [abs(b["grad_norm"] - a["grad_norm"]) / a["grad_norm"] for a, b in zip(fp32, bf16)]
    assert 0 < max(norms) <= 1e-3, norms
    assert all(abs(b["loss"] - a["loss"]) <= 1e-5 * a["loss"] for a, b in zip(fp32, bf16)), (fp32, bf16)


@pytest.fixture(scope="module")
def bf16_runs(warm_launcher, tmp_path_factory) -> Path:
    """bf16, dp2, tiny Mixtral, at ZeRO-0 (``zero0.json``: DeepSpeed's bf16 optimizer reads
    ``.grad``) and ZeRO-1 (``zero1.json``: ``DeepSpeedZeroOptimizer`` takes its partition after
    the exchange): uncompressed, PowerSGD rank 4 from step 3 (6 steps, a checkpoint at step 3),
    and the PowerSGD run resumed from step 3 as after a crash."""
    tmp = tmp_path_factory.mktemp("exchange-bf16")
    for base in ("zero0", "zero1"):
        config = ds_variant(tmp, base, train_micro_batch_size_per_gpu=4)
        for name, extra in (("none", []), ("powersgd", POWERSGD + ["train.save_every=3"])):
            warm_launcher.launch(tmp / f"{base}-{name}", config, steps=6, script=SCRIPT,
                                 extra=["eval.every=0", *extra],
                                 extra_env={"EXCHANGE_OUT": str(tmp / f"{base}-{name}-bytes")})
        resumed = tmp / f"{base}-resumed"
        shutil.copytree(tmp / f"{base}-powersgd", resumed)
        shutil.rmtree(resumed / "checkpoints" / "step00000006")
        (resumed / "checkpoints" / "latest").write_text("step00000003")
        (resumed / "metrics.jsonl").write_text("")
        warm_launcher.launch(resumed, config, steps=6, script=SCRIPT,
                             extra=["eval.every=0", *POWERSGD, "train.save_every=3"],
                             extra_env={"EXCHANGE_OUT": str(tmp / f"{base}-resumed-bytes")})
    return tmp


@pytest.mark.parametrize("base", ["zero0", "zero1"])
def test_powersgd_in_bf16_sends_an_eighth_tracks_the_loss_and_resumes_exactly(bf16_runs, base):
    """PowerSGD rank 4 in bf16 (what goes on the wire is bf16, the compression fp32): a
    compressed step hands the all-reduces at most 1/8 of the bytes of the uncompressed run's
    gradient exchange, which PowerSGD's uncompressed start equals; DeepSpeed exchanges no gradient;
    ZeRO-1's all-gather of the updated parameters, which compression cannot shrink, is counted
    apart and is the same in both runs. The losses stay within 1% of the uncompressed run's over
    the 6 steps (the 200-step figures: docs/communication.md); the resume from step 3 logs the
    same losses, grad norms and bytes and holds the same PowerSGD state, bitwise."""
    none, psgd = _bytes(bf16_runs, f"{base}-none"), _bytes(bf16_runs, f"{base}-powersgd")
    exchange = none[2]["bytes"]["deepspeed"]
    assert psgd[1]["bytes"]["powersgd"] == psgd[2]["bytes"]["powersgd"] <= exchange <= psgd[1]["bytes"]["powersgd"] + SCALARS
    for step in (3, 4, 5, 6):
        assert psgd[step]["bytes"]["powersgd"] * 8 <= exchange, (psgd[step], exchange)
        assert psgd[step]["bytes"].get("deepspeed", 0) <= SCALARS
        gather = "deepspeed:all_gather_into_tensor"
        assert psgd[step]["bytes"].get(gather) == none[step]["bytes"].get(gather), (psgd[step], none[step])
        assert (psgd[step]["bytes"].get(gather, 0) > 0) == (base == "zero1")
    logged, plain = rows(bf16_runs / f"{base}-powersgd"), rows(bf16_runs / f"{base}-none")
    assert len(logged) == len(plain) == 6 and all("skipped" not in r for r in logged)
    for a, b in zip(plain, logged):
        assert abs(b["loss"] - a["loss"]) <= 0.01 * a["loss"], (a, b)
    resumed = rows(bf16_runs / f"{base}-resumed")
    keys = ("loss", "grad_norm", "grad_exchange_bytes")
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [{k: r[k] for k in keys} for r in resumed] == [{k: r[k] for k in keys} for r in logged[3:]]
    for rank in range(2):
        a, b = _bytes(bf16_runs, f"{base}-powersgd", rank), _bytes(bf16_runs, f"{base}-resumed", rank)
        assert [a[s]["state"] for s in (4, 5, 6)] == [b[s]["state"] for s in (4, 5, 6)]


@pytest.mark.parametrize("world, config, sets, message", [
    (2, "zero2_fp32", ["parallel.grad_compression=powersgd"], "runs at ZeRO-0 or ZeRO-1 in fp32 or bf16"),
    (2, "zero3", ["parallel.grad_compression=powersgd"], "not at ZeRO-3 (it reduce-scatters"),
    (2, "zero1", ["parallel.grad_compression=powersgd", "ds.zero_optimization.overlap_comm=true"],
     "ZeRO-1 with overlap_comm"),
    (2, "zero1", ["parallel.grad_compression=powersgd", "ds.data_types.grad_accum_dtype=fp32"],
     "BF16_Optimizer then reduces its own fp32 accumulators"),
    (4, "zero0_fp32", ["parallel.grad_compression=powersgd", "parallel.pipeline_parallel_size=2"],
     "not at pipeline_parallel_size 2"),
    (1, "zero0_fp32", ["parallel.grad_compression=powersgd"], "one data-parallel rank"),
    (2, "zero2", ["parallel.grad_compression=bf16", "ds.communication_data_type=fp32"],
     "ds_config.communication_data_type ('fp32') both set the exchange"),
    (2, "zero0_fp32", ["parallel.powersgd_rank=8"], "parallel.powersgd_rank (8) is set but parallel.grad_compression is none"),
    (2, "zero0_fp32", ["parallel.grad_compression=powersgd", "parallel.powersgd_rank=0"],
     "parallel.powersgd_rank (0) must be an integer >= 1"),
    (2, "zero0_fp32", ["parallel.grad_compression=fp8"], "parallel.grad_compression"),
    (2, "zero1_fp32", ["parallel.shared_expert_overlap=true", "parallel.expert_parallel_size=2"],
     "shared_expert_overlap is true but the model has no shared experts"),
    (2, "zero1_fp32", ["parallel.expert_exchange=hierarchical"], "expert_parallel_size is 1; use flat"),
    (4, "zero1_fp32", ["parallel.expert_exchange=hierarchical", "parallel.expert_parallel_size=4",
                       "parallel.node_size=4"], "must span several whole nodes"),
    (4, "zero1_fp32", ["parallel.expert_exchange=hierarchical", "parallel.expert_parallel_size=4",
                       "model.moe.dispatch_dtype=bf16"], "dispatch_dtype is bf16"),
    (4, "zero1_fp32", ["parallel.node_size=2"], "parallel.node_size (2) is set but parallel.expert_exchange is flat"),
])
def test_settings_that_cannot_apply_are_refused(monkeypatch, world, config, sets, message):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(ValueError) as err:
        plan_for(f"ds_configs/{config}.json", sets=sets)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_bf16_sets_deepspeeds_communication_type(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    plan = plan_for("ds_configs/zero2_fp32.json", sets=["parallel.grad_compression=bf16"])
    assert plan.ds["communication_data_type"] == "bf16"
    assert "communication_data_type" not in plan_for("ds_configs/zero2_fp32.json").ds


def test_powersgd_under_expert_parallelism_reduces_over_each_experts_replicas(warm_launcher, tmp_path):
    """4 ranks, EP2 x DP2, fp32 ZeRO-0: PowerSGD's own reduction in its uncompressed start (all 3
    steps) equals DeepSpeed's all-reduce step for step (relative 1e-6: the same two-rank sums,
    divided in another place): each expert's gradient is averaged over its own data-parallel
    replicas, after the non-expert gradients were summed over ep. Reduced over a wrong group
    (e.g. the whole job) the expert gradients would mix different experts. A compressed run
    (start 1) trains on at this layout."""
    config = ds_variant(tmp_path, "zero0_fp32", train_micro_batch_size_per_gpu=4)
    ep = ["parallel.expert_parallel_size=2", "eval.every=0"]
    psgd = ["parallel.grad_compression=powersgd", "parallel.powersgd_rank=4"]
    warm_launcher.launch_many([(tmp_path / "none", config, ep),
                               (tmp_path / "start", config, ep + psgd + ["parallel.powersgd_start_steps=10"]),
                               (tmp_path / "compressed", config, ep + psgd + ["parallel.powersgd_start_steps=1"])],
                              nproc=4, steps=3)
    none, start, compressed = (rows(tmp_path / n) for n in ("none", "start", "compressed"))
    for a, b in zip(none, start):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * a["loss"], (a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6 * a["grad_norm"], (a["grad_norm"], b["grad_norm"])
    assert compressed[2]["grad_exchange_bytes"] * 8 <= start[2]["grad_exchange_bytes"]
    assert all(r["loss"] < 20 and "skipped" not in r for r in compressed)
