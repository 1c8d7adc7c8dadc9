"""Resume a checkpoint at another layout and ZeRO stage through a universal checkpoint.

Each cell trains to step 5 at layout A and stops, ``launch/to_universal.py`` (``interop/universal.py``)
converts its checkpoint, and the same command resumes at layout B with ``"checkpoint":
{"load_universal": true}`` to step 10. The runs are made once per module, packed into one
launched process group per world size (one run after another).

The control: an uninterrupted 10-step run that stands for A. Layouts of the same global batch
compute the same losses up to summation order (~1e-7 relative here), so the cells with one
global batch share one control, and each cell first asserts that its stopped run's steps 1-5
equal the control's to relative 1e-6 (the control is A's run, to the tolerance); steps 6-10 of
the resumed run must then continue it: loss and grad norm within relative 1e-6, lr and token
counts equal. The scheduler's lengths are explicit in the JSON, so ``--steps 5`` and then
``--steps 10`` follow the control's 10-step schedule.

Tolerance: fp32 (one cell in bf16, at the same data-parallel size: its bf16 weights are cast
from the same fp32 master weights on both sides, measured equal to 1e-7). The conversion is exact (fp32 master weights, Adam moments and step, Muon
momentum, expert biases are copied, not recomputed); the new layout only sums the same
gradients in another order. Relative 1e-6 fails on lost state: ``test_the_matrix_can_fail``
resumes from a conversion whose Adam moments were zeroed and sees step 6 or 7 move by more.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from tests.runs import REPO, env, rows

J = ["model.moe.router_jitter=0.0"]       # router noise is seeded by the dp coordinate
SAVE5 = ["train.save_every=5"]
PP2, TP2, EP2 = (["parallel.pipeline_parallel_size=2"], ["parallel.tensor_parallel_size=2"],
                 ["parallel.expert_parallel_size=2"])
DSV3 = ["model.family=mixtral"]            # replaced by the recipe below (see _recipe)
MUON = {"type": "Muon", "params": {"lr": 0.0006, "weight_decay": 0.1}}
DENSE = ["model.family=dense", "model.moe=null"]
TIED = DENSE + ["model.tie_embeddings=true"]
PSGD = ["parallel.grad_compression=powersgd", "parallel.powersgd_start_steps=2"]
LAMB = {"type": "Lamb", "params": {"lr": 0.002, "betas": [0.9, 0.999], "eps": 1e-06, "weight_decay": 0.01}}

# name: (control, (ranks, JSON, --set) at A, (ranks, JSON, --set) at B). Cells of one control
# have its global batch: 8 sequences (dp 1) or 16 (dp 2, or one rank with accumulation 2). The
# "jitter" cell keeps tests.runs.SMALL's router jitter: its noise is drawn from (seed, step,
# data-parallel coordinate), so a tp -> ep change at dp 1 must route with the control's noise
# (under pipelines the noise is not the one-rank control's, so those cells run without it).
CELLS = {
    "pp2-to-1": ("one", (2, "z1", J + PP2), (1, "z0", J)),
    "1-to-pp2": ("one", (1, "z1", J), (2, "z1", J + PP2)),
    "pp2-zbh1-to-tp2-sp": ("one", (2, "z1", J + PP2 + ["parallel.pipeline_schedule=zb-h1"]),
                           (2, "z1", J + TP2 + ["parallel.sequence_parallel=true"])),
    "pp2-gpipe-to-pp2xtp2": ("one", (2, "z1", J + PP2 + ["parallel.pipeline_schedule=gpipe"]), (4, "z1", J + PP2 + TP2)),
    "tied-pp2-to-1": ("tied", (2, "z1", TIED + PP2), (1, "z3", TIED)),
    "cp2-to-1": ("one", (2, "z1", J + ["parallel.context_parallel_size=2"]), (1, "z0", J)),
    "zero0-1-to-pp2": ("one", (1, "z0", J), (2, "z1", J + PP2)),
    "zero3-1-to-pp2": ("one", (1, "z3", J), (2, "z1", J + PP2)),
    "tp2-zero1-to-ep2-zero3": ("jitter", (2, "z1", TP2), (2, "z3", EP2)),
    "pp2xtp2-to-ep2xtp2": ("one", (4, "z1", J + PP2 + TP2), (4, "z1", J + EP2 + TP2)),
    "tp2xep2-to-pp2xep2": ("one", (4, "z1", J + TP2 + EP2), (4, "z1", J + PP2 + EP2)),
    "zero0-to-zero1": ("dp2", (2, "z0", J), (2, "z1", J)),
    "bf16-zero1-to-zero3": ("bf16-dp2", (2, "bf16-z1", J), (2, "bf16-z3", J)),
    "zero3-to-zero2-one-rank": ("dp2", (2, "z3", J), (1, "z2-acc2", J)),
    "zero3-to-zero3-one-rank": ("dp2", (2, "z3", J), (1, "z3-acc2", J)),
    "zero3-to-zero0-one-rank": ("dp2", (2, "z3", J), (1, "z0-acc2", J)),
    "zero0-to-zero3": ("dp2", (2, "z0", J), (2, "z3", J)),
    "dsv3-ep2-to-1": ("dsv3", (2, "z1", DSV3 + EP2), (1, "z1", DSV3)),
    "lamb-zero0-to-one-rank": ("lamb-dp2", (2, "lamb", J), (1, "lamb-acc2", J)),
    "muon-zero3-to-zero1-one-rank": ("muon-dp2", (2, "muon-z3", J + DENSE), (1, "muon-z1-acc2", J + DENSE)),
    "muon-pp2-to-tp2": ("muon-one", (2, "muon-z1", J + PP2), (2, "muon-z1", J + TP2)),
}
CONTROLS = {"one": (1, "z1", J), "jitter": (1, "z1", []), "dp2": (2, "z1", J), "dsv3": (1, "z1", DSV3), "tied": (1, "z1", TIED),
            "lamb-dp2": (2, "lamb", J), "bf16-dp2": (2, "bf16-z1", J),
            "muon-dp2": (2, "muon-z3", J + DENSE), "muon-one": (1, "muon-z1", J)}
JSONS = {"z0": ("zero0_fp32", {}), "z1": ("zero1_fp32", {}), "z3": ("zero3_fp32", {}),
         "z2-acc2": ("zero2_fp32", {"gradient_accumulation_steps": 2}),
         "z3-acc2": ("zero3_fp32", {"gradient_accumulation_steps": 2}),
         "z0-acc2": ("zero0_fp32", {"gradient_accumulation_steps": 2}),
         "lamb": ("zero0_fp32", {"optimizer": LAMB}), "bf16-z1": ("zero1", {}), "bf16-z3": ("zero3", {}),
         "lamb-acc2": ("zero0_fp32", {"optimizer": LAMB, "gradient_accumulation_steps": 2}),
         "muon-z1": ("zero1_fp32", {"optimizer": MUON}), "muon-z3": ("zero3_fp32", {"optimizer": MUON}),
         "muon-z1-acc2": ("zero1_fp32", {"optimizer": MUON, "gradient_accumulation_steps": 2})}


def _config(tmp, key: str, universal: bool = False) -> str:
    """The JSON ``key`` of JSONS with a fixed 10-step schedule (and ``load_universal``)."""
    base, changes = JSONS[key]
    cfg = json.loads((REPO / "ds_configs" / f"{base}.json").read_text())
    cfg["scheduler"]["params"].update(total_num_steps=10, warmup_num_steps=2)
    cfg.update(changes)
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    path = tmp / f"{key}{'-universal' if universal else ''}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _recipe(extra: list[str]) -> list[str]:
    """Tiny DeepSeek-V3 (MLA, MTP, sigmoid routing with loss-free balancing's expert bias) at
    the test's sizes: ``--set`` keys after the ``--recipe`` the launcher cannot pass, so the
    recipe's model section is given as keys."""
    if extra[:1] != DSV3:
        return extra
    return ["model.attention=mla", "model.q_lora_rank=32", "model.kv_lora_rank=32", "model.qk_nope_head_dim=16",
            "model.qk_rope_head_dim=16", "model.v_head_dim=16", "model.num_heads=4", "model.num_kv_heads=4",
            "model.mtp_depth=1", "model.mtp_loss_coef=0.3", "model.moe.num_experts=8", "model.moe.top_k=2",
            "model.moe.score_function=sigmoid", "model.moe.n_group=4", "model.moe.topk_group=2",
            "model.moe.expert_bias_update_rate=0.002", "model.moe.num_shared_experts=1",
            "model.moe.first_k_dense=1", "model.moe.router_jitter=0.0"] + extra[1:]


def _to_universal(run_dir):
    return subprocess.run([sys.executable, "launch/to_universal.py", "--run-dir", str(run_dir)],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)


def _close(ref: list[dict], got: list[dict], steps) -> list[str]:
    """Where ``got`` leaves ``ref`` at ``steps`` (relative 1e-6; lr and tokens exact)."""
    out = []
    for a, b in zip(ref, got):
        if a["step"] in steps and not (b["loss"] == pytest.approx(a["loss"], rel=1e-6)
                                       and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6)
                                       and (b["lr"], b["tokens"]) == (a["lr"], a["tokens"])):
            out.append(f"step {a['step']}: loss {b['loss']} vs {a['loss']}, grad_norm {b['grad_norm']} vs {a['grad_norm']}")
    return out


@pytest.fixture(scope="module")
def runs(warm_launcher, tmp_path_factory):
    """Every run of the module, each the command a user types: the controls and the runs stopped
    at step 5 (one launch per world size), the conversions (one through the command line, the
    rest through ``interop.universal.convert`` in this process), then the resumes (the
    ZeRO-3 -> one-rank resume twice: the second finds the native checkpoint the first saved)."""
    from interop.universal import check, convert
    tmp = tmp_path_factory.mktemp("universal")
    first, second = {}, {}
    for name, (ranks, key, extra) in CONTROLS.items():
        first.setdefault(ranks, []).append((tmp / f"control-{name}", _config(tmp, key), _recipe(extra) + SAVE5))
    for name, (_, (ranks, key, extra), _) in CELLS.items():
        first.setdefault(ranks, []).append((tmp / name, _config(tmp, key), _recipe(extra) + SAVE5, 5))
    first[2].append((tmp / "powersgd", _config(tmp, "z0"), J + PSGD + SAVE5, 5))
    for ranks, batch in sorted(first.items()):
        warm_launcher.launch_many(batch, nproc=ranks)
    convert(tmp / "powersgd", *check(tmp / "powersgd"), progress=None)
    for i, name in enumerate(CELLS):
        if i == 0:
            out = _to_universal(tmp / name)
            assert out.returncode == 0 and "wrote" in out.stdout, out.stderr[-2000:]
        else:
            convert(tmp / name, *check(tmp / name), progress=None)
    shutil.copytree(tmp / "pp2-to-1", tmp / "zeroed-moments")
    _zero_moments(tmp / "zeroed-moments" / "checkpoints" / "universal" / "step00000005")
    for name, (_, _, (ranks, key, extra)) in CELLS.items():
        second.setdefault(ranks, []).append((tmp / name, _config(tmp, key, universal=True), _recipe(extra) + SAVE5))
    second[1].append((tmp / "zeroed-moments", _config(tmp, "z1", universal=True), J + SAVE5))
    second[2].append((tmp / "powersgd", _config(tmp, "z0", universal=True), J + PSGD + SAVE5))
    second[1].append(second[1][[r[0].name for r in second[1]].index("zero3-to-zero2-one-rank")])
    for ranks, batch in sorted(second.items()):
        warm_launcher.launch_many(batch, nproc=ranks)
    return tmp


def _zero_moments(folder) -> None:
    """Zero every Adam moment of a conversion and write its manifest again (it verifies)."""
    from training.checkpoint import manifest
    for path in folder.glob("zero/*/exp_avg*.pt"):
        saved = torch.load(path, weights_only=True)
        torch.save({"param": torch.zeros_like(saved["param"])}, path)
    (folder / manifest.MANIFEST).unlink()
    manifest.write_share(folder, 0, 1)
    manifest.merge(folder, 5, {}, 1)


@pytest.mark.parametrize("name", list(CELLS))
def test_a_checkpoint_resumes_exactly_at_another_layout(name, runs):
    tmp = runs
    control = rows(tmp / f"control-{CELLS[name][0]}")
    got = rows(tmp / name)
    assert [r["step"] for r in got] == list(range(1, 11)), name
    assert not _close(control, got, range(1, 6)), (name, "A's own steps 1-5 leave the control")
    assert not _close(control, got, range(6, 11)), (name, _close(control, got, range(6, 11)))
    log = (tmp / f"{name}.log").read_text()
    resumed = [line for line in log.splitlines() if line.startswith("resumed from")]
    assert resumed[0] == f"resumed from {tmp / name / 'checkpoints' / 'step00000005'}", resumed


def test_the_matrix_can_fail(runs):
    """Fresh Adam moments (the conversion's zeroed, its manifest rewritten) move the resumed
    losses by more than the tolerance."""
    control, got = rows(runs / "control-one"), rows(runs / "zeroed-moments")
    assert _close(control, got, range(6, 11)), "zeroed moments went unnoticed"


def test_per_rank_state_without_a_universal_form_starts_afresh_with_one_line(runs):
    """PowerSGD's error feedback (per rank, ``trainer_state_rank<r>.pt``) does not go through
    the conversion: the resumed run says so in one warning line and trains on to step 10."""
    log = (runs / "powersgd.log").read_text().splitlines()
    warned = [ln for ln in log if ln.startswith("warning: grad_compression start afresh")]
    assert len(warned) == 1 and "does not carry over a layout change" in warned[0], warned
    assert [r["step"] for r in rows(runs / "powersgd")] == list(range(1, 11))


def test_the_conversion_carries_what_each_layout_keeps(runs):
    """The universal folder of each kind of source: the tied and pipeline names as the
    Transformer's, the expert biases, Muon's momentum instead of Adam's moments, a manifest."""
    tmp = runs
    pp = tmp / "pp2-to-1" / "checkpoints" / "universal" / "step00000005"
    assert (pp / "zero" / "layers.1.mlp.experts.up_proj" / "exp_avg_sq.pt").is_file()
    assert json.loads((pp / "universal.json").read_text())["source"] == {
        "pp": 2, "tp": 1, "ep": 1, "dp": 1, "zero_stage": 1, "kind": "flat"}
    assert (pp / "manifest.json").is_file() and (pp.parent / "latest_universal").read_text() == "step00000005"
    tied = tmp / "tied-pp2-to-1" / "checkpoints" / "universal" / "step00000005"
    assert (tied / "zero" / "embed_tokens.weight" / "exp_avg.pt").is_file()     # from the first stage
    assert not (tied / "zero" / "lm_head.weight").exists()
    lamb = tmp / "lamb-zero0-to-one-rank" / "checkpoints" / "universal" / "step00000005"
    assert torch.load(lamb / "zero" / "norm.weight" / "step.pt", weights_only=True) == 5     # LAMB's own count
    ds = tmp / "dsv3-ep2-to-1" / "checkpoints" / "universal" / "step00000005"
    assert sorted(p.name for p in (ds / "buffers").iterdir()) == [
        f"{m}.mlp.gate.e_score_correction_bias.pt" for m in ("layers.1", "mtp.0.block")]
    assert (ds / "zero" / "mtp.0.block.mlp.experts.down_proj" / "fp32.pt").is_file()
    for name in ("muon-zero3-to-zero1-one-rank", "muon-pp2-to-tp2"):
        muon = tmp / name / "checkpoints" / "universal" / "step00000005"
        assert (muon / "muon_momentum" / "layers.0.self_attn.q_proj.weight.pt").is_file(), name
        assert not (muon / "zero" / "layers.0.self_attn.q_proj.weight" / "exp_avg.pt").exists(), name
        assert (muon / "zero" / "norm.weight" / "exp_avg.pt").is_file(), name       # AdamW's, as before


def test_a_resume_after_the_conversion_continues_from_its_own_checkpoints(runs):
    """The resumed run saved step 10 at its own layout: the same command again resumes from
    that native checkpoint, not from the older conversion (and has nothing left to train)."""
    name = "zero3-to-zero2-one-rank"
    log = (runs / f"{name}.log").read_text()
    resumed = [line for line in log.splitlines() if line.startswith("resumed from")]
    assert resumed[1:] == [f"resumed from {runs / name / 'checkpoints' / 'step00000010'}"], resumed
    assert len(rows(runs / name)) == 10


def _hf_logits(run_dir, tag: str, out) -> torch.Tensor:
    """transformers' logits of ``launch/convert_hf.py export``'s work on checkpoint ``tag``."""
    from transformers import AutoModelForCausalLM
    from interop.consolidate import load_run_model
    from interop.hf_files import export_hf
    model, cfg, _ = load_run_model(run_dir, tag)
    export_hf(model, cfg, None, out)
    hf = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return hf(ids).logits


@pytest.mark.parametrize("name, tag", [("tp2xep2-to-pp2xep2", "step00000010"), ("cp2-to-1", "step00000005")])
def test_an_export_from_pp2_x_ep2_and_from_cp2_equals_the_single_process_one(name, tag, runs, tmp_path):
    """The PP2 x EP2 checkpoint (saved by the resumed run) and the CP2 one exported to
    transformers give the single-process control's logits at the same step: every expert and
    stage merged into place (relative 1e-6 of the logits' scale; summation order only)."""
    want = _hf_logits(runs / "control-one", tag, tmp_path / "control")
    got = _hf_logits(runs / name, tag, tmp_path / name)
    assert want.std() > 0.1
    assert (got - want).abs().max().item() <= 1e-6 * want.abs().max().item(), (got - want).abs().max().item()


def _tree(folder) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_damaged_conversion_or_none_is_one_line_and_loses_nothing(warm_launcher, runs, tmp_path):
    """Resuming at another layout without a conversion, or from a damaged one, is one line
    (exit 2) naming the fix, and leaves the run directory byte for byte as it was."""
    run_dir = tmp_path / "run"
    shutil.copytree(runs / "pp2-to-1", run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step00000010")
    (run_dir / "checkpoints" / "latest").write_text("step00000005")
    universal = run_dir / "checkpoints" / "universal" / "step00000005"
    victim = universal / "zero" / "norm.weight" / "exp_avg.pt"
    victim.write_bytes(victim.read_bytes()[:100])
    before = _tree(run_dir)
    for config, expected in ((_config(tmp_path, "z1", universal=True), "convert the run again"),
                             (_config(tmp_path, "z1"), "launch/to_universal.py")):
        assert warm_launcher.launch(run_dir, config, nproc=1, extra=J + SAVE5, check=False) == 2
        errors = [ln for ln in (tmp_path / "run.log").read_text().splitlines() if ln.startswith("error:")]
        assert len(errors) >= 1 and expected in errors[-1], errors
        (tmp_path / "run.log").unlink()
    after = _tree(run_dir)
    after.pop("metrics.jsonl", None), before.pop("metrics.jsonl", None)
    assert after.keys() == before.keys() and all(after[k] == before[k] for k in before)


def test_to_universal_errors_are_one_line(tmp_path):
    def run(*args):
        out = subprocess.run([sys.executable, "launch/to_universal.py", *args], cwd=REPO,
                             env=env(), capture_output=True, text=True, timeout=120)
        return out.returncode, out.stderr.strip()

    rc, err = run("--run-dir", str(tmp_path / "missing"))
    assert rc == 2 and len(err.splitlines()) == 1 and "no config.json" in err, err
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step00000005").mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps(
        {"recipe": {"model": {"family": "dense", "hidden_size": 64, "num_layers": 2, "num_heads": 4,
                              "num_kv_heads": 4, "vocab_size": 256, "ffn_hidden_size": 64}}, "ds_config": {}, "world": {}}))
    rc, err = run("--run-dir", str(run_dir))
    assert rc == 2 and len(err.splitlines()) == 1 and "no complete checkpoint" in err, err
    (run_dir / "checkpoints" / "latest").write_text("step00000005")
    states = run_dir / "checkpoints" / "step00000005" / "mp_rank_00_model_states.pt"
    torch.save({"module": {}, "optimizer": {"state": {}, "param_groups": []}}, states)
    rc, err = run("--run-dir", str(run_dir))       # a ZeRO-0 checkpoint of older code
    assert rc == 2 and len(err.splitlines()) == 1 and "recorded its parameters' names" in err, err
    states.write_bytes(b"not a checkpoint")
    rc, err = run("--run-dir", str(run_dir))
    assert rc == 2 and len(err.splitlines()) == 1 and "cannot be converted" in err, err
    assert not (run_dir / "checkpoints" / "universal").exists() or not any(
        p.name.startswith(".") for p in (run_dir / "checkpoints" / "universal").iterdir())


class _Payload:
    def __reduce__(self):
        return (print, ("the payload ran",))


def test_a_planted_pickle_in_a_checkpoint_is_refused_in_one_line(tmp_path):
    """Every read of a conversion is weights-only: a file that would run code when unpickled
    is refused with one line naming it, before anything of it runs."""
    run_dir = tmp_path / "run"
    folder = run_dir / "checkpoints" / "step00000005"
    folder.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps(
        {"recipe": {"model": {"family": "dense", "hidden_size": 64, "num_layers": 2, "num_heads": 4,
                              "num_kv_heads": 4, "vocab_size": 256, "ffn_hidden_size": 64}}, "ds_config": {}, "world": {}}))
    (run_dir / "checkpoints" / "latest").write_text("step00000005")
    torch.save({"module": {}, "optimizer": _Payload()}, folder / "mp_rank_00_model_states.pt")
    out = subprocess.run([sys.executable, "launch/to_universal.py", "--run-dir", str(run_dir)], cwd=REPO,
                         env=env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "the payload ran" not in out.stdout + out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "refusing to load" in out.stderr, out.stderr


@pytest.mark.parametrize("tp, ep, placement", [(2, 1, "contiguous"), (1, 2, "contiguous"),
                                                (2, 2, "round_robin"), (4, 1, "contiguous")])
def test_shard_maps_cut_and_merge_every_parameter_like_its_shard_spec(tp, ep, placement):
    from training.checkpoint.shard_maps import shard_maps
    from model import Transformer
    from model.parallel.groups import ParallelGroups
    from model.parallel.layers import take_shard
    from training.config.recipe import load_recipe
    from tests.runs import SMALL
    cfg = load_recipe(None, SMALL).model
    full = {n: p.detach() for n, p in Transformer(cfg, None, init_seed=3).named_parameters()}
    maps = shard_maps(cfg, tp, ep, placement)
    specs = {}
    for e in range(ep):
        for t in range(tp):
            with torch.device("meta"):
                model = Transformer(cfg, ParallelGroups(tp=tp, ep=ep, tp_rank=t, ep_rank=e,
                                                        expert_placement=placement),
                                    init_seed=None)                  # the cuts, no weights
            specs[e * tp + t] = {n: p.shard_spec for n, p in model.named_parameters()}
    assert maps.keys() == full.keys()
    for name, m in maps.items():
        shards = {r: take_shard(full[name], specs[r][name]) for r in specs}
        for r, shard in shards.items():
            assert torch.equal(m.extract(full[name], r), shard), (name, r)
        assert torch.equal(m.rebuild(shards), full[name]), name
