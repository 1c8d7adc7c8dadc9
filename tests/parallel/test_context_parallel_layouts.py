"""Context parallelism through the real training entry against the single-process control.

Each layout is ``launch/train.py`` with the command line a user types (``tests/runs.py``: the
tiny model, 10 steps, micro-batch 8, fp32), compared at every step with the same recipe on one
process: the loss, the grad norm, the per-layer gradient norms, the token count and, for
Mixtral, the aux and z losses and the expert load. Runs of one world size go one after another
in one launched process group (``WarmLauncher.launch_many``), as in ``test_train_layouts.py``.

    world 2: CP2 of Mixtral with a2a (ZeRO-1), p2p (ZeRO-2) and allgather (ZeRO-3); CP2 of
             the dense (Llama-family) model with a2a (ZeRO-0) and p2p (ZeRO-1); CP2 under
             document masking with a2a and p2p (ZeRO-1); CP2 of Mixtral with MLA (a2a, ZeRO-1);
             CP2 under activation checkpointing (full with p2p, attention with a2a; ZeRO-1);
             CP2 of Mixtral with two MTP depths under document masking (a2a, ZeRO-1) and with
             MLA and two MTP depths (DeepSeek-V3's pair, p2p, ZeRO-1), against
             a control with them (also each depth's mtp_loss every step)
    world 4: CP4 of Mixtral (a2a and p2p, ZeRO-1) and of the dense model (p2p at ZeRO-2, a2a at
             ZeRO-1: its 2 kv heads repeated to 4); CP2 x TP2 +
             SP (a2a, ZeRO-1); CP2 x EP2 (a2a, ZeRO-2); CP2 x DP2 (allgather, ZeRO-3, micro-batch
             4: the samples shard over dp only, ZeRO over dp x cp), against a control of
             micro-batch 4 x accumulation 2, whose micro-batches are the dp ranks' (the router
             losses are per micro-batch)
    world 4, DeepSpeed's pipeline engine (1F1B): CP2 x PP2 of Mixtral (a2a, ZeRO-1); CP2 x PP2
             with the two MTP depths on the last stage under document masking (p2p, ZeRO-1)

Also: the evaluation losses (steps 5 and 10) equal the control's; a CP2 run stopped after 5
steps and resumed from its checkpoint logs the same 10 steps (the same data order; DeepSpeed's
checkpoint of dp x cp shards loads back); the checkpoints of CP2 at ZeRO-3, CP2 x TP2 + SP and
CP2 x EP2 consolidate (``interop/consolidate.py``, what export and evaluation read) into the
control's weights.

Router jitter is off (``model.moe.router_jitter=0``) in every layout but one: CP2 of Mixtral
with jitter 0.1 and a capacity factor of 1.0 in training and eval (about 13% of the assignments
dropped at step 1), against a control with them (``cp2-jitter-capacity-1``, also the dropped
fraction every step): each cp rank draws the control's noise for its tokens and drops the tokens
the control drops (``tests/parallel/test_context_parallel_routing.py`` checks it token by token).
Before, each rank drew its own noise and counted the capacity on its S/cp tokens: the grad norm
at step 1 was 0.92475 against the control's 0.92429 (0.92486 with only the noise wrong, 0.92433
with only the capacity wrong), 50 to 600 times the tolerance below.

Tolerance: fp32, relative 1e-5 on every compared value. A cp rank computes the control's sums
over its part of the tokens and the exchanges add the parts in another order
(``tests/model/test_context_parallel.py``: at most 4.4e-7 per attention); DeepSpeed then
averages the cp ranks' gradients as data-parallel ones. Measured over the 10 steps of every
layout (2026-12-03, this machine): the loss within relative 1.8e-7, the grad norm 1.6e-7, the
aux and z losses 1.8e-7 and 1.1e-7, the per-layer norms 3.4e-8, each MTP depth's loss 2.1e-7,
the expert load equal: 1e-5 leaves 50x of room for the summation order, and a real error moves
far more: the loss scaled by dp instead of dp x cp halves the grad norm (measured 0.462 against
the control's 0.925 at step 1 of CP2, and 0.4627 against 0.9248 at CP2 x PP2 with the
pipeline's ce_scale missing cp, while AdamW's normalized update keeps the loss within
2e-7); MTP's tokens ahead and targets shifted after the cp split instead of before move the
grad norm by 6e-4 and depth 1's loss by 6e-5 at step 1 (0.94240 against 0.94300); a rank
holding the wrong tokens, positions or samples moves the loss at step 1 (the CP2 x DP2 run
with micro-batch 8 instead of 4, 16 samples a step: 8.3373 against 8.3419).
"""

from __future__ import annotations

import pytest

import json

import torch

from tests.runs import WEIGHT_ATOL, ds_variant, rows

NO_JITTER = ["model.moe.router_jitter=0.0"]
DENSE = ["model.family=dense", "model.moe=null"]
DOCS = ["data.document_masking=true"]
# Multi-head latent attention (model/mla.py) with a query latent and YaRN, as test_train_layouts.py
# runs it: its values are zero-padded to the query-key width, which the exchanges need too.
MLA = ["model.attention=mla", "model.num_kv_heads=4", "model.q_lora_rank=24", "model.kv_lora_rank=16",
       "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8", "model.v_head_dim=8",
       "model.rope_scaling=yarn", "model.rope_factor=2.0", "model.rope_original_max_seq_len=32",
       "model.yarn_mscale_all_dim=1.0"]


PP2 = ["parallel.pipeline_parallel_size=2"]
# Switch-style noise and token dropping on tiny Mixtral (top-2): 0.1 jitter, capacity 1.0.
JITTER_CAPACITY = ["model.moe.router_jitter=0.1", "model.moe.capacity_factor=1.0",
                   "model.moe.eval_capacity_factor=1.0"]
# Two MTP depths (model/mtp.py) under document masking: their tokens ahead and targets cross the
# cp chunks and the document boundaries, so each rank shifts them on the whole window first.
MTP_DOCS = ["model.mtp_depth=2", "model.mtp_loss_coef=0.3"] + DOCS


def _cp(size: int, comm: str) -> list[str]:
    return [f"parallel.context_parallel_size={size}", f"parallel.cp_comm={comm}"]


# name -> (world size, DeepSpeed JSON, recipe overrides, control); "m4": micro-batch 4 (x dp 2)
LAYOUTS = {
    "cp2-a2a-1": (2, 1, NO_JITTER + _cp(2, "a2a"), "mixtral"),
    "cp2-p2p-2": (2, 2, NO_JITTER + _cp(2, "p2p"), "mixtral"),
    "cp2-allgather-3": (2, 3, NO_JITTER + _cp(2, "allgather"), "mixtral"),
    "dense-cp2-a2a-0": (2, 0, DENSE + _cp(2, "a2a"), "dense"),
    "dense-cp2-p2p-1": (2, 1, DENSE + _cp(2, "p2p"), "dense"),
    "docs-cp2-a2a-1": (2, 1, NO_JITTER + DOCS + _cp(2, "a2a"), "docs"),
    "docs-cp2-p2p-1": (2, 1, NO_JITTER + DOCS + _cp(2, "p2p"), "docs"),
    "mla-cp2-a2a-1": (2, 1, NO_JITTER + MLA + _cp(2, "a2a"), "mla"),
    # Activation checkpointing recomputes the exchanges in backward: whole blocks (the ring's
    # forward sends again), and the attention sub-layer alone (the all-to-alls again).
    "ckpt-full-cp2-p2p-1": (2, 1, NO_JITTER + _cp(2, "p2p") + ["train.activation_checkpointing=full"], "mixtral"),
    "ckpt-attention-cp2-a2a-1": (2, 1, NO_JITTER + _cp(2, "a2a") + ["train.activation_checkpointing=attention"],
                                 "mixtral"),
    "cp2-jitter-capacity-1": (2, 1, JITTER_CAPACITY + _cp(2, "a2a"), "jitter-capacity"),
    "cp4-a2a-1": (4, 1, NO_JITTER + _cp(4, "a2a"), "mixtral"),
    "dense-cp4-p2p-2": (4, 2, DENSE + _cp(4, "p2p"), "dense"),
    "cp4-p2p-1": (4, 1, NO_JITTER + _cp(4, "p2p"), "mixtral"),
    "dense-cp4-a2a-1": (4, 1, DENSE + _cp(4, "a2a"), "dense"),
    "cp2xtp2-sp-1": (4, 1, NO_JITTER + _cp(2, "a2a") + ["parallel.tensor_parallel_size=2",
                                                         "parallel.sequence_parallel=true"], "mixtral"),
    "cp2xep2-2": (4, 2, NO_JITTER + _cp(2, "a2a") + ["parallel.expert_parallel_size=2"], "mixtral"),
    "cp2xdp2-allgather-3": (4, "3-m4", NO_JITTER + _cp(2, "allgather"), "mixtral-m4"),
    "mtp-docs-cp2-a2a-1": (2, 1, NO_JITTER + MTP_DOCS + _cp(2, "a2a"), "mtp-docs"),
    "mla-mtp-cp2-p2p-1": (2, 1, NO_JITTER + MLA + MTP_DOCS[:2] + _cp(2, "p2p"), "mla-mtp"),
    "cp2xpp2-a2a-1": (4, 1, NO_JITTER + _cp(2, "a2a") + PP2, "mixtral"),
    "mtp-docs-cp2xpp2-p2p-1": (4, 1, NO_JITTER + MTP_DOCS + _cp(2, "p2p") + PP2, "mtp-docs"),
}
# name -> (DeepSpeed JSON, recipe overrides): ZeRO-1 on one process
CONTROLS = {"mixtral": (1, NO_JITTER), "dense": (1, DENSE), "docs": (1, NO_JITTER + DOCS), "mla": (1, NO_JITTER + MLA),
            "mixtral-m4": ("1-m4x2", NO_JITTER), "mtp-docs": (1, NO_JITTER + MTP_DOCS),
            "mla-mtp": (1, NO_JITTER + MLA + MTP_DOCS[:2]), "jitter-capacity": (1, JITTER_CAPACITY)}


def _config(tmp, stage) -> str:
    """ZeRO ``stage``'s fp32 JSON; "S-m4": with micro-batch 4; "S-m4x2": and accumulation 2."""
    if isinstance(stage, int):
        return f"ds_configs/zero{stage}_fp32.json"
    stage, micro = stage.split("-")
    gas = 2 if micro.endswith("x2") else 1
    return ds_variant(tmp, f"zero{stage}_fp32", train_micro_batch_size_per_gpu=4,
                      gradient_accumulation_steps=gas)


@pytest.fixture(scope="module")
def runs(warm_launcher, tmp_path_factory):
    """Every run of this module, made once: the controls on one process (ZeRO-1), then the
    layouts of each world size in one launched process group. Name -> run directory."""
    tmp = tmp_path_factory.mktemp("cp_layouts")
    batches = {1: [(f"control-{name}", _config(tmp, stage), extra)
                   for name, (stage, extra) in CONTROLS.items()]}
    for name, (world, stage, extra, _) in LAYOUTS.items():
        batches.setdefault(world, []).append((name, _config(tmp, stage), extra))
    # The lr schedule of a 10-step run, written out: "auto" would fit it to the first run's 5 steps.
    schedule = ["ds.scheduler.params.total_num_steps=10", "ds.scheduler.params.warmup_num_steps=1"]
    resumed = ("cp2-a2a-1-resumed", _config(tmp, 1), LAYOUTS["cp2-a2a-1"][2] + schedule)
    for nproc, batch in batches.items():
        runs = [(tmp / name, config, extra) for name, config, extra in batch]
        if nproc == 2:          # stopped at step 5, then the same command to step 10: resumes
            runs += [(tmp / resumed[0], *resumed[1:], 5), (tmp / resumed[0], *resumed[1:], 10)]
        warm_launcher.launch_many(runs, nproc=nproc, timeout=1200)
    return {name: tmp / name for batch in batches.values() for name, _, _ in batch} | {resumed[0]: tmp / resumed[0]}


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-30)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_layout_matches_the_single_process_control(layout, runs):
    control = LAYOUTS[layout][3]
    ref, got = rows(runs[f"control-{control}"]), rows(runs[layout])
    assert len(got) == len(ref) == 10
    moe = not control.startswith("dense")
    keys = ["loss", "grad_norm"] + (["aux_loss", "z_loss", "expert_load_max_over_mean"] if moe else [])
    if "capacity" in control:                # tokens dropped: the same fraction every step
        keys.append("dropped_frac")
        assert all(a["dropped_frac"] > 0 for a in ref), layout
    worst = dict.fromkeys([*keys, "grad_norm_layers", "mtp_loss"], 0.0)
    for a, b in zip(ref, got):
        assert ("aux_loss" in b) == moe and (b["tokens"], b["lr"]) == (a["tokens"], a["lr"]), layout
        pairs = [(key, a[key], b[key]) for key in keys]
        assert ("grad_norm_layers" in b) == ("grad_norm_layers" in a) == (a["step"] % 5 == 0)
        if "grad_norm_layers" in a:         # every train.log_every (5) steps
            la, lb = ([x["embed"], *x["blocks"], x["head"]] for x in (a["grad_norm_layers"],
                                                                     b["grad_norm_layers"]))
            pairs += [("grad_norm_layers", x, y) for x, y in zip(la, lb)]
        if "mtp" in control:                 # each depth's mean cross-entropy
            assert len(a["mtp_loss"]) == len(b["mtp_loss"]) == 2, layout
            pairs += [("mtp_loss", x, y) for x, y in zip(a["mtp_loss"], b["mtp_loss"])]
        for key, want, have in pairs:
            assert have == pytest.approx(want, rel=1e-5), (layout, key, a["step"])
            worst[key] = max(worst[key], _relative(want, have))
    assert ref[-1]["loss"] < ref[0]["loss"]          # the control learns: not a flat line
    evals = [_eval_losses(runs[name]) for name in (f"control-{control}", layout)]
    assert len(evals[0]) == 2 and evals[1] == pytest.approx(evals[0], rel=1e-5), layout
    print(layout, "largest relative difference:", worst)


def _eval_losses(run_dir) -> list[float]:
    return [json.loads(line)["eval_loss"] for line in (run_dir / "metrics.jsonl").open()
            if "eval_loss" in line]


def test_resumed_context_parallel_run_logs_the_uninterrupted_steps(runs):
    ref, got = rows(runs["cp2-a2a-1"]), rows(runs["cp2-a2a-1-resumed"])
    assert [r["step"] for r in got] == list(range(1, 11))
    assert "resumed from" in (runs["cp2-a2a-1-resumed"].parent / "cp2-a2a-1-resumed.log").read_text()
    for a, b in zip(ref, got):      # the same ranks and order of operations: bitwise, as measured
        assert (b["loss"], b["grad_norm"], b["tokens"]) == (a["loss"], a["grad_norm"], a["tokens"]), a["step"]


@pytest.mark.parametrize("layout", ["cp2-allgather-3", "cp2xtp2-sp-1", "cp2xep2-2", "cp2xpp2-a2a-1"])
def test_context_parallel_checkpoint_consolidates_to_the_control_weights(layout, runs):
    """After 10 AdamW steps the weights agree to rtol 1e-4 and ``WEIGHT_ATOL`` (tests/runs.py:
    a near-zero gradient's rounding, scaled by AdamW; measured at most 4.7e-6 here)."""
    from interop.consolidate import load_run_model
    ours, ctrl = load_run_model(runs[layout])[0], load_run_model(runs["control-mixtral"])[0]
    names = [name for name, _ in ctrl.named_parameters()]
    assert [name for name, _ in ours.named_parameters()] == names
    for name, p, q in zip(names, ours.parameters(), ctrl.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=WEIGHT_ATOL, msg=f"{layout}: {name}")
