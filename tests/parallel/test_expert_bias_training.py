"""Loss-free balancing and shared experts through the real training entry (``launch/train.py``).

The model: tiny Mixtral (tests/runs.SMALL) with DeepSeek-V3 routing (sigmoid scores, 2 of 4
expert groups, routed_scaling_factor 2.5) and 2 shared experts with a gate, router jitter 0 (a
pipeline stage would draw other noise). Every run takes the same 6 steps of micro-batch 4 x
accumulation 2 (dp 1), so every step sees the same 8 sequences:

- the single-process control with ``expert_bias_update_rate`` 1e-3;
- EP2 (2 gloo ranks, each routes half of every micro-batch): the bias each rank saved in its
  own ``mp_rank_XX_model_states.pt`` is bitwise the same on both ranks and equal to the
  control's: the update uses the step's counts summed over both micro-batches and both ranks;
- PP2 (2 stages, each updates its own layers' biases), TP2, TP2 x EP2 (4 ranks), and EP2 and
  TP2 under fp32 ZeRO-3: the consolidated bias equals the control's, and the logged loss and grad norm
  match the control's;
- EP2 with rate 0: the bias stays exactly zero;
- EP2 under ZeRO-3 in bf16 (parameters partitioned, the model built under ``zero.Init``): the
  bias stays fp32 and the same on both ranks, and a copy of the run resumed from its step-3
  checkpoint ends with the uninterrupted run's bias (the bias is restored with the weights).

Each run is ``launch/train.py``'s command line on ranks forked from one process that has
imported the libraries (``tests.runs.WarmLauncher``): what is compared is what the trainer
computes, not how it is started (tests/launch/test_train.py covers torchrun).

Tolerances: the bias is a sum of +-rate steps (one per step and expert, from integer counts),
so equal routing decisions give bitwise equal biases and any differing decision moves an entry
by 2e-3: compared exactly. The logged losses of the layouts match the control's to relative
1e-4 (tests/parallel/test_train_layouts.py's bound; fp32, only summation orders differ), and
the logged per-step load ``expert_load_max_over_mean`` to 1e-6 (a ratio of integer counts).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from interop.consolidate import load_run_model
from tests.runs import ds_variant, rows

STEPS = 6
RATE = 1e-3
MODEL = ["model.moe.router_jitter=0.0", "model.moe.score_function=sigmoid", "model.moe.n_group=4",
         "model.moe.topk_group=2", "model.moe.routed_scaling_factor=2.5",
         "model.moe.num_shared_experts=2", "model.moe.shared_expert_gate=true",
         "train.save_every=3"]
ON = MODEL + [f"model.moe.expert_bias_update_rate={RATE}"]
EP2, PP2 = ["parallel.expert_parallel_size=2"], ["parallel.pipeline_parallel_size=2"]
TP2 = ["parallel.tensor_parallel_size=2"]


def _biases(state: dict) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k.endswith("mlp.gate.e_score_correction_bias")}


def _rank_biases(run_dir, mp_rank: int) -> dict[str, torch.Tensor]:
    """The biases one model-parallel rank saved at the last step (its module state dict; the
    file is ``zero_pp_rank_0_mp_rank_XX_model_states.pt`` under ZeRO-3)."""
    files = sorted((run_dir / "checkpoints" / f"step{STEPS:08d}").glob(
        f"*mp_rank_{mp_rank:02d}_model_states.pt"))
    assert len(files) == 1, files
    return _biases(torch.load(files[0], map_location="cpu", weights_only=False)["module"])


def _on_the_rate_grid(bias: torch.Tensor) -> bool:
    """A sum of STEPS steps of +-RATE (or 0): a whole multiple of RATE, at most STEPS of them."""
    steps = bias.double() / RATE
    return bool(torch.allclose(steps, steps.round(), atol=1e-3) and steps.abs().max() <= STEPS + 1e-3)


@pytest.fixture(scope="module")
def runs(warm_launcher, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bias")
    batch = dict(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2)
    config, zero3 = ds_variant(tmp, "zero1_fp32", **batch), ds_variant(tmp, "zero3", **batch)
    zero3_fp32 = ds_variant(tmp, "zero3_fp32", **batch)
    layouts = (("control", 1, ON, config), ("ep2", 2, ON + EP2, config), ("pp2", 2, ON + PP2, config),
               ("ep2-off", 2, MODEL + EP2, config), ("tp2", 2, ON + TP2, config),
               ("tp2xep2", 4, ON + TP2 + EP2, config), ("ep2-zero3", 2, ON + EP2, zero3_fp32),
               ("tp2-zero3", 2, ON + TP2, zero3_fp32), ("ep2-zero3-bf16", 2, ON + EP2, zero3))
    out = {name: tmp / name for name, _, _, _ in layouts}
    for nproc in (1, 2, 4):      # a world size's runs one after another in one process group
        warm_launcher.launch_many([(out[name], ds, extra, STEPS) for name, n, extra, ds in layouts if n == nproc],
                                  nproc=nproc)
    # Resume a copy of the ZeRO-3 run from its step-3 checkpoint (the same command again).
    out["resumed"] = tmp / "resumed"
    shutil.copytree(out["ep2-zero3-bf16"], out["resumed"])
    ckpt = out["resumed"] / "checkpoints"
    shutil.rmtree(ckpt / f"step{STEPS:08d}")
    (ckpt / "latest").write_text(f"step{STEPS // 2:08d}")
    warm_launcher.launch(out["resumed"], zero3, nproc=2, extra=ON + EP2, steps=STEPS)
    return out


def test_loss_free_balancing_updates_the_bias_identically_at_every_layout(runs):
    control = _biases(load_run_model(runs["control"])[0].state_dict())
    assert len(control) == 2                                           # every block is MoE
    for name, bias in control.items():
        assert bias.dtype == torch.float32 and bias.abs().max() > 0 and _on_the_rate_grid(bias), name
    rank0, rank1 = _rank_biases(runs["ep2"], 0), _rank_biases(runs["ep2"], 1)
    assert rank0.keys() == rank1.keys() == control.keys()
    for name in control:
        assert torch.equal(rank0[name], rank1[name]), name             # every replica alike
        assert torch.equal(rank0[name], control[name]), name           # counts over both ranks
    for layout in ("ep2", "pp2", "tp2", "tp2xep2", "ep2-zero3", "tp2-zero3"):  # pp2: per stage
        merged = _biases(load_run_model(runs[layout])[0].state_dict())
        for name in control:
            assert torch.equal(merged[name], control[name]), (layout, name)


def test_zero3_bf16_keeps_the_bias_fp32_alike_on_every_rank_and_resumes_it(runs):
    rank0, rank1 = _rank_biases(runs["ep2-zero3-bf16"], 0), _rank_biases(runs["ep2-zero3-bf16"], 1)
    resumed = _rank_biases(runs["resumed"], 1)
    assert len(rank0) == 2 and rank0.keys() == rank1.keys() == resumed.keys()
    for name, bias in rank0.items():
        assert bias.dtype == torch.float32 and bias.abs().max() > 0 and _on_the_rate_grid(bias), name
        assert torch.equal(bias, rank1[name]), name
        assert torch.equal(resumed[name], rank1[name]), name


def test_rate_zero_leaves_the_bias_at_zero(runs):
    for mp_rank in (0, 1):
        biases = _rank_biases(runs["ep2-off"], mp_rank)
        assert len(biases) == 2
        assert all(torch.equal(b, torch.zeros(8)) for b in biases.values())


@pytest.mark.parametrize("layout", ["ep2", "pp2", "tp2", "tp2xep2", "ep2-zero3", "tp2-zero3"])
def test_layouts_log_the_controls_losses_and_loads(runs, layout):
    """Loss, load-balancing loss and grad norm within 1e-4 of the control at every step (fp32 at
    ZeRO-1 and ZeRO-3; only summation orders differ), the load to 1e-6, the biases exactly."""
    ref, got = rows(runs["control"]), rows(runs[layout])
    assert len(ref) == len(got) == STEPS
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (layout, a["step"])
        assert b["aux_loss"] == pytest.approx(a["aux_loss"], rel=1e-4), (layout, a["step"])
        if layout != "pp2":                   # the pipeline engine logs no global grad norm
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (layout, a["step"])
        assert b["expert_load_max_over_mean"] == pytest.approx(a["expert_load_max_over_mean"], rel=1e-6)
        # The biases are bitwise the control's, and each rank adds 1/(dp x ep) of them: exact.
        assert b["expert_bias_range"] == a["expert_bias_range"], (layout, a["step"])
    assert ref[-1]["loss"] < ref[0]["loss"]


def test_the_logged_bias_is_the_one_the_step_routed_with(runs):
    """``expert_bias_range`` (metrics.jsonl): the widest spread, over MoE layers, of the biases
    a step routes with: zero at step 1, and at step 4 the spread of the biases the step-3
    checkpoint saved (float32 values, read back in float64: compared exactly)."""
    control, off = rows(runs["control"]), rows(runs["ep2-off"])
    assert control[0]["expert_bias_range"] == 0.0
    step3 = runs["control"] / "checkpoints" / f"step{STEPS // 2:08d}"
    state = torch.load(step3 / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    saved = _biases(state)
    assert len(saved) == 2
    spread = max(float(b.max()) - float(b.min()) for b in saved.values())
    assert spread > 0 and control[STEPS // 2]["expert_bias_range"] == spread
    assert all(r["expert_bias_range"] == 0.0 for r in off)           # rate 0: a frozen bias
    # Every train.log_every (5) steps the row holds each layer's biases: after 4 updates of
    # +-RATE (or 0) each, and their widest spread is the row's expert_bias_range.
    layers = control[4]["moe_layers"]
    assert layers["blocks"] == [0, 1] and [len(b) for b in layers["expert_bias"]] == [8, 8]
    for bias in layers["expert_bias"]:
        assert _on_the_rate_grid(torch.tensor(bias)) and max(abs(b) for b in bias) <= 4 * RATE + 1e-9
    assert control[4]["expert_bias_range"] == max(max(b) - min(b) for b in layers["expert_bias"])


def test_the_universal_conversion_carries_the_expert_biases(runs, tmp_path):
    """A pipeline run's biases (in its stages' layer files) go into the conversion's
    ``buffers/`` under the Transformer's names, bitwise the control's (interop/universal.py)."""
    from interop import universal
    run_dir = tmp_path / "pp2"
    shutil.copytree(runs["pp2"], run_dir)
    target = universal.convert(run_dir, *universal.check(run_dir), progress=None)
    control = _rank_biases(runs["control"], 0)
    got = {p.name[:-3]: torch.load(p, weights_only=True)["param"] for p in (target / "buffers").iterdir()}
    assert got.keys() == control.keys() and all(torch.equal(got[k], control[k]) for k in control)
