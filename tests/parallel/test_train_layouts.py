"""Every parallel layout through the real training entry against the single-process control.

The control is ``python launch/train.py`` on one process with the same DeepSpeed JSON (micro 8,
accumulation 1), so every optimizer step sees the same 8 sequences. Each layout runs 10 steps
(fp32; TP2, EP2, TP2 x EP2 and TP2 with sequence parallelism under each ZeRO stage) and must log
the same loss and grad norm at every step.

The runs are made once per module (``runs``), those of one world size one after another in one
launched process group: each is ``launch.train.main`` with the command line a user types, and a
run in such a batch logs bitwise the metrics of the same run launched alone.

Tolerance: fp32; the layouts change only the summation order (split matmuls, all-reduces,
all-to-alls, reduce-scatters), ~1e-7 relative per op; after 10 optimizer steps the losses agree
to ~1e-6. Those four layouts hold the loss to relative 1e-6 and the grad norm and aux loss to
1e-4; TP2 x EP2 with sequence parallelism and the pipeline layouts hold the loss, grad norm, aux
and z losses and the expert load to 1e-4. Either fails on any real error (a missed gradient sum
or a double-counted shard moves the loss at step 2 by > 1e-3).
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from model import MixtralConfig
from model.parallel.groups import ParallelGroups, local_experts
from tests.runs import REPO, WEIGHT_ATOL, ds_variant, kill_after_step, launch, rows

# Router jitter stays on (tests/runs.SMALL: 0.01, the Switch default): each sample's noise is
# seeded from its global index and the per-step seed leaves out tp and ep, so every tp x ep layout
# draws the control's noise. Pipeline stages draw from their own seed, so their noise differs
# and flips a few routing decisions (the expert load then differs by whole tokens): the pipeline
# runs use tiny Mixtral's own value, 0.
RECIPE_JITTER = ["model.moe.router_jitter=0.0"]
LAYOUTS = {"tp2": (2, ["parallel.tensor_parallel_size=2"]),
           "ep2": (2, ["parallel.expert_parallel_size=2"]),
           "tp2xep2": (4, ["parallel.tensor_parallel_size=2", "parallel.expert_parallel_size=2"]),
           "tp2-sp": (2, ["parallel.tensor_parallel_size=2", "parallel.sequence_parallel=true"])}


# Pipeline parallelism: DeepSpeed's PipelineEngine (1F1B), ZeRO 0/1 only. The MoE aux losses of
# the first stage's blocks reach the loss through the stage I/O (training/engine/pipeline.py).
PP2 = ["parallel.pipeline_parallel_size=2"]
# Multi-head latent attention (model/mla.py) with a query latent and YaRN x2 on the default recipe,
# and two MTP depths (model/mtp.py), at TP2, TP2 + SP under ZeRO-3, EP2 and PP2 (the depths on the
# last stage, training/engine/pipe_layers.py), against its own single-process control.
MLA = ["model.attention=mla", "model.num_kv_heads=4", "model.q_lora_rank=24", "model.kv_lora_rank=16",
       "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8", "model.v_head_dim=8",
       "model.rope_scaling=yarn", "model.rope_factor=2.0", "model.rope_original_max_seq_len=32",
       "model.yarn_mscale_all_dim=1.0"]
MTP = ["model.mtp_depth=2", "model.mtp_loss_coef=0.3"]
MLA_LAYOUTS = {"tp2-1": (1, LAYOUTS["tp2"][1] + MTP), "tp2-sp-3": (3, LAYOUTS["tp2-sp"][1] + MTP),
               "ep2-1": (1, LAYOUTS["ep2"][1] + MTP), "pp2-1": (1, PP2 + MTP)}
# Micro-batch 2 x accumulation 4 (test_pp2_1f1b_over_four_micro_batches_matches_its_control).
# The tied case also runs one MTP depth: the embedding then serves three layers on two stages.
FOUR_MICRO = [("zero1_fp32", []), ("zero0_fp32", ["model.tie_embeddings=true", "model.mtp_depth=1"])]
# Muon (training/optim/muon.py) from the JSON {"type": "Muon", "params": {lr, weight_decay}}: each
# layout against the single-process run of the same JSON; ZeRO-1/2/3 on the dense model over two
# data-parallel ranks (micro-batch 4, the control's 8 sequences per step: the MoE router losses are
# per micro-batch, so an MoE model over dp2 would change the objective, not only the layout).
# name: (processes, ZeRO stage, extra keys, control); dense-zero2 also saves every 3 steps (resume test).
MUON = {"type": "Muon", "params": {"lr": 0.0006, "weight_decay": 0.1}}
# Every Muon run is MuonClip: tau below every head's largest logit of the tiny model (0.11-0.14 at
# init), so heads are clipped at every step and every layout; one more run logs its logits with a
# tau no logit reaches (nothing clipped).
QK_CLIP, QK_LOG_ONLY = ["train.qk_clip_tau=0.1"], ["train.qk_clip_tau=1000000"]
DENSE = ["model.family=dense", "model.moe=null"]
MUON_LAYOUTS = {"tp2": (2, 1, LAYOUTS["tp2"][1], "muon-control"),
                "tp2-sp": (2, 3, LAYOUTS["tp2-sp"][1], "muon-control"),
                "ep2": (2, 2, LAYOUTS["ep2"][1], "muon-control"),
                "pp2": (2, 1, PP2, "muon-control"),
                "tp2xep2": (4, 0, LAYOUTS["tp2xep2"][1], "muon-control"),
                **{f"dense-zero{s}": (2, s, DENSE + ["train.save_every=3"] * (s == 2), "muon-dense-control")
                   for s in (1, 2, 3)}}


def _muon_config(tmp, stage: int, micro: int = 8, precision: str = "_fp32") -> str:
    path = tmp / f"muon-zero{stage}{precision}-micro{micro}.json"
    cfg = json.loads((REPO / "ds_configs" / f"zero{stage}{precision}.json").read_text())
    path.write_text(json.dumps({**cfg, "optimizer": MUON, "train_micro_batch_size_per_gpu": micro}))
    return str(path)


# Where users train: bf16 at ZeRO-1 (TP2) and ZeRO-3 (dense, two data-parallel ranks), MuonClip on.
MUON_BF16 = {"bf16-tp2-zero1": (1, 8, LAYOUTS["tp2"][1], "muon-control"),
             "bf16-dense-zero3": (3, 4, DENSE, "muon-dense-control")}


@pytest.fixture(scope="module")
def runs(warm_launcher, tmp_path_factory):
    """Every run of this module but the killed one, made once: the runs of one world size one
    after another in one launched process group (``WarmLauncher.launch_many``), each the same
    command line as ``launch`` would start. Name -> run directory."""
    tmp = tmp_path_factory.mktemp("layouts")
    four = {config: ds_variant(tmp, config, train_micro_batch_size_per_gpu=2,
                               gradient_accumulation_steps=4) for config, _ in FOUR_MICRO}
    batches = {1: [("control", "ds_configs/zero2_fp32.json", []),
                   ("control-nj", "ds_configs/zero2_fp32.json", RECIPE_JITTER)]
               + [(f"4micro-control-{c}", four[c], RECIPE_JITTER + x) for c, x in FOUR_MICRO]
               + [("mla-control", "ds_configs/zero1_fp32.json", RECIPE_JITTER + MLA + MTP)]
               + [("muon-control", _muon_config(tmp, 1), RECIPE_JITTER + QK_CLIP),
                  ("muon-no-clip", _muon_config(tmp, 1), RECIPE_JITTER + QK_LOG_ONLY),
                  ("muon-dense-control", _muon_config(tmp, 0), DENSE + QK_CLIP)],
               2: [(f"{layout}-{stage}", f"ds_configs/zero{stage}_fp32.json", extra)
                   for layout, (nproc, extra) in LAYOUTS.items() if nproc == 2 for stage in range(4)]
               + [(f"pp2-{stage}", f"ds_configs/zero{stage}_fp32.json", RECIPE_JITTER + PP2) for stage in (0, 1)]
               + [(f"4micro-pp2-{c}", four[c], RECIPE_JITTER + x + PP2) for c, x in FOUR_MICRO]
               + [(f"4micro-pp2-zero0_fp32-{s}", four["zero0_fp32"], RECIPE_JITTER + FOUR_MICRO[1][1] + PP2
                   + [f"parallel.pipeline_schedule={s}"]) for s in ("gpipe", "zb-h1")]
               + [("ep2-full", "ds_configs/zero2_fp32.json", LAYOUTS["ep2"][1] + ["train.save_every=3"])]
               + [(f"mla-{name}", f"ds_configs/zero{stage}_fp32.json", RECIPE_JITTER + MLA + extra)
                  for name, (stage, extra) in MLA_LAYOUTS.items()],
               4: [(f"tp2xep2-{stage}", f"ds_configs/zero{stage}_fp32.json", LAYOUTS["tp2xep2"][1])
                   for stage in range(4)]
               + [(f"tp2xep2-sp-{stage}", f"ds_configs/zero{stage}_fp32.json",
                   LAYOUTS["tp2xep2"][1] + ["parallel.sequence_parallel=true"]) for stage in (1, 3)]}
    for name, (nproc, stage, extra, _) in MUON_LAYOUTS.items():
        micro = 4 if name.startswith("dense") else 8
        batches[nproc].append((f"muon-{name}", _muon_config(tmp, stage, micro), RECIPE_JITTER + QK_CLIP + extra))
    for name, (stage, micro, extra, _) in MUON_BF16.items():
        batches[2].append((f"muon-{name}", _muon_config(tmp, stage, micro, ""), RECIPE_JITTER + QK_CLIP + extra))
    warm = warm_launcher
    for nproc, batch in batches.items():
        warm.launch_many([(tmp / name, config, extra) for name, config, extra in batch], nproc=nproc,
                         timeout=1200)
    return {name: tmp / name for batch in batches.values() for name, _, _ in batch}


@pytest.fixture(scope="module")
def control(runs):
    return runs["control"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_the_single_process_control(layout, stage, control, runs):
    run_dir = runs[f"{layout}-{stage}"]
    ref, got = rows(control), rows(run_dir)
    assert len(got) == len(ref) == 10
    for a, b in zip(ref, got):
        # 1e-6: with jitter on, as off (a tp/ep rank drawing its own noise moves it by 1e-6 to 3e-5).
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6), (layout, stage, a["step"])
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (layout, stage, a["step"])
        assert b["aux_loss"] == pytest.approx(a["aux_loss"], rel=1e-4)
        assert b["tokens"] == a["tokens"]
        if b["step"] % 5 == 0:          # train.log_every: the router replicas were compared
            assert b["router_divergence"] == 0.0, (layout, stage, b["step"])
    _assert_layer_norms(ref, got, (layout, stage))
    assert ref[-1]["loss"] < ref[0]["loss"]
    if layout == "ep2" and stage == 2:
        _check_experts(control, run_dir)
    if layout == "tp2xep2" and stage in (0, 1):
        # The shards of all four ranks merge back into the control's model (export/eval path).
        from interop.consolidate import load_run_model
        ours, ctrl = load_run_model(run_dir)[0], load_run_model(control)[0]
        for (name, p), q in zip(ours.named_parameters(), ctrl.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=WEIGHT_ATOL, msg=name)


@pytest.mark.parametrize("stage", [1, 3])
def test_tp2_x_ep2_with_sequence_parallelism_matches_the_control(stage, control, runs):
    run_dir = runs[f"tp2xep2-sp-{stage}"]
    _assert_same_metrics(rows(control), rows(run_dir), ("tp2xep2-sp", stage))


@pytest.mark.parametrize("name", list(MLA_LAYOUTS))
def test_mla_layout_matches_its_single_process_control(name, runs):
    """MLA's tp split of heads (latents replicated, gathered once under SP), its ep and pipeline
    stages, with MTP's depths: loss, grad norm, router losses, per-layer norms and each depth's
    MTP loss as the control's, every step."""
    ref, got = rows(runs["mla-control"]), rows(runs[f"mla-{name}"])
    _assert_same_metrics(ref, got, ("mla", name))
    _assert_same_mtp_losses(ref, got, depths=2)


def test_pp2_mtp_checkpoint_is_the_controls_model(runs):
    """The PP2 run's per-layer checkpoint files consolidate to the Transformer's keys, the MTP
    modules' included (``mtp.K``, written by the last stage), with the control's weights."""
    from interop.consolidate import load_run_model
    ctrl, pp2 = (load_run_model(runs[name])[0].state_dict() for name in ("mla-control", "mla-pp2-1"))
    assert sorted(pp2) == sorted(ctrl) and any(k.startswith("mtp.1.block.") for k in pp2)
    for name, p in pp2.items():
        torch.testing.assert_close(p, ctrl[name], rtol=1e-4, atol=WEIGHT_ATOL, msg=name)


def _assert_same_mtp_losses(ref: list[dict], got: list[dict], depths: int) -> None:
    for a, b in zip(ref, got):
        assert b["mtp_loss"] == pytest.approx(a["mtp_loss"], rel=1e-4), a["step"]
    # each depth its own loss, learning
    assert len(ref[0]["mtp_loss"]) == depths and ref[-1]["mtp_loss"][0] < ref[0]["mtp_loss"][0]


def _assert_same_metrics(ref: list[dict], got: list[dict], what) -> None:
    # DeepSpeed back-propagates each stage output (hidden, aux sum, z sum) separately, so
    # gradients differ from the control's by summation order only (fp32 rounding).
    assert len(got) == len(ref) == 10
    for a, b in zip(ref, got):
        for key in ("loss", "grad_norm", "aux_loss", "z_loss", "expert_load_max_over_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-4), (what, key, a["step"])
        assert (b["tokens"], b["lr"]) == (a["tokens"], a["lr"])
    _assert_layer_norms(ref, got, what)
    assert ref[-1]["loss"] < ref[0]["loss"]


def _assert_layer_norms(ref: list[dict], got: list[dict], what) -> None:
    """Every train.log_every (5) steps both rows carry the per-layer gradient norms: equal to the
    control's (1e-4, as grad_norm), and making up the row's grad_norm (1e-6: the same gradient
    pieces summed in another order; ZeRO 1-3 take DeepSpeed's norm, measured 6e-8 off)."""
    for a, b in zip(ref, got):
        assert ("grad_norm_layers" in b) == ("grad_norm_layers" in a) == (a["step"] % 5 == 0), what
        if "grad_norm_layers" in b:
            la, lb = ([x["embed"], *x["blocks"], x["head"]] for x in (a["grad_norm_layers"], b["grad_norm_layers"]))
            assert lb == pytest.approx(la, rel=1e-4), (what, "grad_norm_layers", a["step"])
            assert sum(v * v for v in lb) ** 0.5 == pytest.approx(b["grad_norm"], rel=1e-6), (what, a["step"])


@pytest.mark.parametrize("stage", [0, 1])
def test_pp2_matches_the_single_process_control(stage, runs):
    control, run_dir = runs["control-nj"], runs[f"pp2-{stage}"]
    _assert_same_metrics(rows(control), rows(run_dir), ("pp2", stage))
    evals = [[json.loads(line)["eval_loss"] for line in (d / "metrics.jsonl").open()
              if "eval_loss" in line] for d in (control, run_dir)]    # via engine.eval_batch
    assert evals[1] == pytest.approx(evals[0], rel=1e-4) and len(evals[0]) == 2


@pytest.mark.parametrize("config, extra", FOUR_MICRO)
def test_pp2_1f1b_over_four_micro_batches_matches_its_control(config, extra, runs):
    """Micro-batch 2 x accumulation 4: the 1F1B schedule interleaves forwards and backwards, and
    DeepSpeed's division of the loss by the accumulation steps is undone exactly. The router
    losses are per micro-batch, so the control runs the same micro-batches on one process.

    Tied embeddings: the embedding lives on both stages (DeepSpeed sums its gradient between
    them). Under ZeRO-0 fp32 DeepSpeed's own clipping would count it twice and clip steps it
    should not (grad norm off by 3e-4 at step 7 here); the trainer clips with its norm instead.
    """
    ref, got = rows(runs[f"4micro-control-{config}"]), rows(runs[f"4micro-pp2-{config}"])
    _assert_same_metrics(ref, got, (config, extra))
    if "model.mtp_depth=1" in extra:
        _assert_same_mtp_losses(ref, got, depths=1)


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_mtp_on_the_last_stage_under_every_pipeline_schedule(schedule, runs):
    """GPipe (every forward first) and ZB-H1 (the MTP block's and the head's weight gradients
    deferred) with tied embeddings and one MTP depth, as its single-process control."""
    ref, got = rows(runs["4micro-control-zero0_fp32"]), rows(runs[f"4micro-pp2-zero0_fp32-{schedule}"])
    _assert_same_metrics(ref, got, schedule)
    _assert_same_mtp_losses(ref, got, depths=1)


@pytest.mark.parametrize("config, extra, message", [
    ("zero2_fp32", [],
     r"zero_optimization\.stage \(2\) with parallel\.pipeline_parallel_size \(2\)"),
    ("zero0", ["parallel.tensor_parallel_size=2"],
     r"ds_config: ZeRO-0 with bf16/fp16 reports a wrong gradient norm"),
])
def test_pp2_refuses_what_deepspeed_pipelines_cannot_run(config, extra, message, tmp_path,
                                                         monkeypatch, capsys):
    from launch import train
    monkeypatch.setenv("WORLD_SIZE", "4")
    rc = train.main(["--config", f"ds_configs/{config}.json", "--run-dir", str(tmp_path / "run"),
                     "--set", *PP2, *extra])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and re.search(message, err), err
    assert not (tmp_path / "run").exists()


def _check_experts(control, run_dir):
    """After training, each EP rank's experts differ from the other rank's and equal the
    control's experts of the same ids."""
    def module(path):
        return torch.load(path, map_location="cpu", weights_only=False)["module"]
    ctrl = module(control / "checkpoints" / "step00000010" / "mp_rank_00_model_states.pt")
    num_experts = MixtralConfig().moe.num_experts
    held = []
    for ep_rank in range(2):
        mine = module(run_dir / "checkpoints" / "step00000010" / f"mp_rank_{ep_rank:02d}_model_states.pt")
        ids = local_experts(num_experts, ParallelGroups(ep=2, ep_rank=ep_rank))
        for name, tensor in mine.items():
            if ".experts." in name:
                torch.testing.assert_close(tensor, ctrl[name][ids], rtol=1e-4, atol=WEIGHT_ATOL, msg=name)
        held.append(mine["layers.0.mlp.experts.gate_proj"])
    assert not torch.allclose(held[0], held[1])


def test_ep2_kill_and_resume_reproduces_the_uninterrupted_run(warm_launcher, runs, tmp_path):
    extra = LAYOUTS["ep2"][1] + ["train.save_every=3"]
    full = runs["ep2-full"]
    run_dir = tmp_path / "killed"
    kill_after_step(launch(run_dir, "ds_configs/zero2_fp32.json", extra=extra, wait=False), run_dir, 7)
    warm = warm_launcher                 # the same command again
    warm.launch(run_dir, "ds_configs/zero2_fp32.json", extra=extra)
    for a, b in zip(rows(full), rows(run_dir), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6), a["step"]


@pytest.mark.parametrize("name", list(MUON_LAYOUTS))
def test_muon_layout_matches_its_single_process_control(name, runs):
    """Muon with QK-clip at each layout as one process with the same JSON: loss, grad norm (the
    raw gradient's) and each layer's largest logit every step, relative 1e-5 (measured: 1.2e-7,
    1e-8 and 3.5e-7 at worst; each rank clips its own heads, ZeRO-3 its partitions), and every
    parameter after the last step. Muon's matrices: rtol 1e-5, atol 1e-6 (measured < 1e-6); an
    update per element is ~lr 0.2 sqrt(max(A, B)) / sqrt(min(A, B)) ~ 1e-4, and Newton-Schulz of a
    tp shard instead of the whole matrix changes it by tens of percent (test_muon.py), 30x this
    bound within one step. The AdamW parameters: the bound of every AdamW layout test
    (``WEIGHT_ATOL``: a rare token's embedding row)."""
    from interop.consolidate import load_run_model
    from training.optim.muon import is_muon
    control = runs[MUON_LAYOUTS[name][3]]
    ref, got = rows(control), rows(runs[f"muon-{name}"])
    assert len(got) == len(ref) == 10
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (name, a["step"])
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), (name, a["step"])
        assert b["max_logit"] == pytest.approx(a["max_logit"], rel=1e-5), (name, a["step"])
        assert b["lr"] == a["lr"]
    assert ref[-1]["loss"] < ref[0]["loss"]
    ours, ctrl = load_run_model(runs[f"muon-{name}"])[0], load_run_model(control)[0]
    ctrl_params = dict(ctrl.named_parameters())
    for pname, p in ours.named_parameters():
        tol = dict(rtol=1e-5, atol=1e-6) if is_muon(pname, p) else dict(rtol=1e-4, atol=WEIGHT_ATOL)
        torch.testing.assert_close(p, ctrl_params[pname], **tol, msg=f"{name} {pname}")


def test_muon_lists_its_groups_at_start_up_and_in_config_json(runs):
    """Which parameters go to Muon and which to AdamW: one line per group in the log, and the
    same groups in config.json."""
    run_dir = runs["muon-control"]
    log = (run_dir.parent / f"{run_dir.name}.log").read_text()
    groups = json.loads((run_dir / "config.json").read_text())["optimizer"]["groups"]
    assert set(groups) == {"decay-muon", "decay-adam", "no_decay-adam"}
    assert groups["decay-muon"]["optimizer"] == "Muon"
    assert {"mlp.experts.gate_proj", "self_attn.q_proj.weight"} <= set(groups["decay-muon"]["kinds"])
    assert set(groups["decay-adam"]["kinds"]) == {"lm_head.weight", "mlp.gate.weight"}   # head, router
    assert "embed_tokens.weight" in groups["no_decay-adam"]["kinds"]
    for group in groups:
        assert len(re.findall(rf"^optimizer group {group}: ", log, re.M)) == 1, group


def test_muon_kill_and_resume_reproduces_the_uninterrupted_run(warm_launcher, runs, tmp_path):
    """Killed after step 7 and resumed from step 6 at ZeRO-2 over two data-parallel ranks: each
    rank's momentum of the matrices it owns and the AdamW moments come back, so steps 7-10 are
    the uninterrupted run's."""
    _, stage, extra, _ = MUON_LAYOUTS["dense-zero2"]
    config = _muon_config(tmp_path, stage, micro=4)
    run_dir = tmp_path / "killed"
    kill_after_step(launch(run_dir, config, extra=RECIPE_JITTER + QK_CLIP + extra, wait=False), run_dir, 7)
    assert (run_dir / "checkpoints" / "step00000006" / "trainer_state_rank00001.pt").is_file()
    warm_launcher.launch(run_dir, config, extra=RECIPE_JITTER + QK_CLIP + extra)
    for a, b in zip(rows(runs["muon-dense-zero2"]), rows(run_dir), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6), a["step"]


def test_muonclip_holds_the_logits_near_tau(runs):
    """MuonClip at tau 0.1 against the same run without a clip (which passes tau at every step):
    from step 2 on, every layer's largest logit (measured in the forward, before that step's
    clip) is below the unclipped run's and held near tau, within the step-to-step spread of the
    largest of 512 tokens' logits (up to 1.25 tau allowed; that the clip brings each clipped
    head to exactly tau on the batch it measured is tests/model/test_qk_clip.py). Every layout
    clips as one process: test_muon_layout_matches_its_single_process_control."""
    clip, free = rows(runs["muon-control"]), rows(runs["muon-no-clip"])
    assert all(v > 0.1 for r in free for v in r["max_logit"])
    assert clip[0]["max_logit"] == free[0]["max_logit"]          # measured before the first clip
    for a, b in zip(free[1:], clip[1:]):
        assert all(c < f and c <= 0.125 for f, c in zip(a["max_logit"], b["max_logit"])), a["step"]
    assert clip[-1]["loss"] != free[-1]["loss"]


def test_muon_momentum_is_divided_over_the_data_parallel_ranks(runs):
    """At ZeRO-2 over two data-parallel ranks each Muon matrix's momentum lives on one rank (its
    owner): the ranks' checkpointed momenta hold every Muon matrix once, their elements are what
    the memory estimator counts (``planning/muon_cost.py``), and the two ranks hold about half
    each (balanced by elements: within the largest matrix)."""
    from interop.consolidate import load_run_model
    from planning import memory_model as mm
    from planning.muon_cost import muon_elements
    from tests.runs import SMALL
    from training.config.recipe import REPO_ROOT, load_recipe
    from training.optim.muon import is_muon
    folder = runs["muon-dense-zero2"] / "checkpoints" / "step00000010"
    held = [torch.load(folder / f"trainer_state_rank{r:05d}.pt", weights_only=True)["muon"]["momentum"]
            for r in range(2)]
    assert not set(held[0]) & set(held[1])
    model = load_run_model(runs["muon-dense-zero2"])[0]
    want = {n: p.numel() for n, p in model.named_parameters() if is_muon(n, p)}
    assert {n: v.numel() for h in held for n, v in h.items()} == want
    recipe = load_recipe(REPO_ROOT / "recipes" / "tiny_mixtral.yaml", SMALL + RECIPE_JITTER + DENSE)
    est = muon_elements(recipe, mm.Layout(2, 1, 1, 1, False, 8))
    assert est[0]["params"] == sum(want.values())
    per_rank = [sum(v.numel() for v in h.values()) for h in held]
    assert abs(per_rank[0] - per_rank[1]) <= max(want.values())


@pytest.mark.parametrize("name", list(MUON_BF16))
def test_muon_in_bf16_trains_as_its_fp32_control(name, runs):
    """bf16 (Newton-Schulz in bf16 too, as torch.optim.Muon runs it) at ZeRO-1 with TP2 and at
    ZeRO-3 over two data-parallel ranks, QK-clip on: every step finite, and the loss within 5e-4
    (relative) of the fp32 single-process run's at every step (bf16 rounding: measured about 1e-5
    over 10 steps on the tiny model); a run whose updates were lost would stay at the first
    step's loss, 1e-3 above the control's by step 3."""
    ref, got = rows(runs[MUON_BF16[name][3]]), rows(runs[f"muon-{name}"])
    assert len(got) == len(ref) == 10
    for a, b in zip(ref, got):
        assert math.isfinite(b["grad_norm"]) and all(math.isfinite(v) for v in b["max_logit"]), a["step"]
        assert b["loss"] == pytest.approx(a["loss"], rel=5e-4), (name, a["step"])
    assert got[-1]["loss"] < got[0]["loss"]
