"""Resume a checkpoint at another layout through DeepSpeed's universal checkpoint.

A run trains to step 5 and stops, ``launch/to_universal.py`` converts its checkpoint, and the
same command resumes at the new layout with ``"checkpoint": {"load_universal": true}`` to step
10; its losses must continue those of an uninterrupted run at the old layout.

The runs are made once per module, a world size's one after another in one launched process
group. The scheduler's lengths are explicit in the JSON (not "auto"), so ``--steps 5`` and then
``--steps 10`` follow the 10-step schedule of the control. The global batch is the same on both
sides (2 ranks x micro 8 -> 1 rank x micro 8 x accumulation 2), so the data order continues.

Tolerance: fp32. The conversion itself is exact (fp32 master weights and Adam moments are copied,
not recomputed); the new layout only sums the same gradients in another order (two micro-batches
on one rank instead of an all-reduce over two; split matmuls under tp/ep), ~1e-7 relative per
op. Relative 1e-6 on the losses of steps 6-10 fails on any lost state: resuming with fresh Adam
moments, a reset Adam step or a wrong weight shard moves the step-7 loss by > 1e-5.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from tests.runs import REPO, env, rows

NO_JITTER = ["model.moe.router_jitter=0.0"]   # noise is seeded by the dp coordinate: a dp change redraws it
SAVE5 = ["train.save_every=5"]


def _config(tmp, name: str, base: str = "zero2_fp32", **changes) -> str:
    """ds_configs/<base>.json with a fixed 10-step schedule, plus ``changes``."""
    cfg = json.loads((REPO / "ds_configs" / f"{base}.json").read_text())
    cfg["scheduler"]["params"].update(total_num_steps=10, warmup_num_steps=2)
    cfg.update(changes)
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _to_universal(run_dir):
    return subprocess.run([sys.executable, "launch/to_universal.py", "--run-dir", str(run_dir)],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)


def _assert_continues(ref: list[dict], got: list[dict]) -> None:
    assert [r["step"] for r in got] == list(range(1, 11))
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6), a["step"]
        assert (b["lr"], b["tokens"]) == (a["lr"], a["tokens"]), a["step"]


LAYOUTS = {"tp2": ["parallel.tensor_parallel_size=2"], "ep2": ["parallel.expert_parallel_size=2"]}
# Muon (training/optim/muon.py): its momentum goes through the conversion beside DeepSpeed's state
# (interop/muon_universal.py). The dense model over dp2 at ZeRO-2 to one rank, and tiny Mixtral
# from TP2 to EP2 at ZeRO-1.
MUON = {"type": "Muon", "params": {"lr": 0.0006, "weight_decay": 0.1}}
DENSE = ["model.family=dense", "model.moe=null"]
MODEL_PARALLEL_CHANGES = [("zero1_fp32", "ep2", "tp2"), ("zero3_fp32", "tp2", "ep2")]
# eval.batches counts micro-batches per rank: 4 x 8 on one rank = 2 x 8 on each of two.
ONE_RANK = NO_JITTER + SAVE5 + ["eval.batches=4"]


@pytest.fixture(scope="module")
def runs(warm_launcher, tmp_path_factory):
    """Every run of the module, made once, each the command a user types: the runs stopped at
    step 5 and their uninterrupted controls (one launched 2-rank process group, one run after
    another), ``launch/to_universal.py`` on copies of them, then the resumes at the new layouts
    (the one-rank resume twice: the second finds the native checkpoint the first saved).
    Returns the folder and the JSON of the 2-rank dp run."""
    tmp = tmp_path_factory.mktemp("universal")
    config = _config(tmp, "zero2")
    stopped = [(tmp / "dp2-control", config, NO_JITTER + SAVE5), (tmp / "dp2-stopped", config, NO_JITTER + SAVE5, 5)]
    resumes = []
    for base, source, target in MODEL_PARALLEL_CHANGES:
        # tp and ep changes keep the router noise (seeded without them): jitter stays on.
        cfg = _config(tmp, base, base=base)
        stopped += [(tmp / f"{base}-{source}-control", cfg, LAYOUTS[source]),
                    (tmp / f"{base}-{source}-to-{target}", cfg, LAYOUTS[source] + SAVE5, 5)]
        resumes.append((tmp / f"{base}-{source}-to-{target}",
                        _config(tmp, f"{base}_universal", base=base, checkpoint={"load_universal": True}),
                        LAYOUTS[target] + SAVE5))
    muon2 = _config(tmp, "muon-zero2", optimizer=MUON)
    muon1 = _config(tmp, "muon-zero1", base="zero1_fp32", optimizer=MUON)
    stopped += [(tmp / "muon-dp2-control", muon2, NO_JITTER + DENSE),
                (tmp / "muon-dp2-stopped", muon2, NO_JITTER + DENSE + SAVE5, 5),
                (tmp / "muon-tp2-control", muon1, LAYOUTS["tp2"]),
                (tmp / "muon-tp2-to-ep2", muon1, LAYOUTS["tp2"] + SAVE5, 5)]
    resumes.append((tmp / "muon-tp2-to-ep2", _config(tmp, "muon-zero1-universal", base="zero1_fp32", optimizer=MUON,
                                                      checkpoint={"load_universal": True}), LAYOUTS["ep2"] + SAVE5))
    warm = warm_launcher
    warm.launch_many(stopped)
    shutil.copytree(tmp / "dp2-stopped", tmp / "dp2-to-one-rank")
    shutil.copytree(tmp / "muon-dp2-stopped", tmp / "muon-dp2-to-one-rank")
    for run_dir in [tmp / "dp2-to-one-rank", tmp / "muon-dp2-to-one-rank"] + [r[0] for r in resumes]:
        out = _to_universal(run_dir)
        assert out.returncode == 0, out.stderr[-2000:]
    warm.launch_many(resumes)
    one_rank = _config(tmp, "acc2", gradient_accumulation_steps=2, checkpoint={"load_universal": True})
    muon_one = _config(tmp, "muon-acc2", gradient_accumulation_steps=2, optimizer=MUON,
                       checkpoint={"load_universal": True})
    warm.launch_many([(tmp / "dp2-to-one-rank", one_rank, ONE_RANK)] * 2
                     + [(tmp / "muon-dp2-to-one-rank", muon_one, ONE_RANK + DENSE)], nproc=1)
    return tmp, config


def test_dp2_to_one_rank_resumes_exactly_through_ds_to_universal(runs):
    tmp, _ = runs
    run_dir = tmp / "dp2-to-one-rank"
    universal = run_dir / "checkpoints" / "universal"
    assert (universal / "latest_universal").read_text() == "step00000005"
    assert (universal / "step00000005" / "zero" / "norm.weight" / "exp_avg.pt").is_file()
    log = (tmp / "dp2-to-one-rank.log").read_text()
    resumed = [line for line in log.splitlines() if line.startswith("resumed from")]
    assert resumed[0] == f"resumed from {run_dir / 'checkpoints' / 'step00000005'}", resumed
    _assert_continues(rows(tmp / "dp2-control"), rows(run_dir))
    evals = [[r["eval_loss"] for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
              if "eval_loss" in r] for d in (tmp / "dp2-control", run_dir)]
    assert evals[1] == pytest.approx(evals[0], rel=1e-6) and len(evals[1]) == 2

    # The resumed run saved step 10 at its own layout: the same command again resumes from that
    # native checkpoint, not from the older conversion (and has nothing left to train).
    assert resumed[1:] == [f"resumed from {run_dir / 'checkpoints' / 'step00000010'}"], resumed
    assert len(rows(run_dir)) == 10


def test_resuming_at_another_layout_without_conversion_is_one_line(warm_launcher, runs, tmp_path):
    tmp, config = runs
    run_dir = tmp_path / "run"
    shutil.copytree(tmp / "dp2-stopped", run_dir)
    warm = warm_launcher
    assert warm.launch(run_dir, config, nproc=1, extra=NO_JITTER + SAVE5, check=False) == 2
    log = (tmp_path / "run.log").read_text().splitlines()
    errors = [ln for ln in log if ln.startswith("error:")]
    assert len(errors) == 1, errors
    assert "data-parallel size 2" in errors[0] and "launch/to_universal.py" in errors[0]


@pytest.mark.parametrize("base, source, target", MODEL_PARALLEL_CHANGES)
def test_model_parallel_change_resumes_exactly(base, source, target, runs):
    """Experts split over ep (dim 0) <-> every weight split over tp (column dim 0, row dim 1):
    the shards merge by the affine maps built from each parameter's ``shard_spec`` and are cut
    again for the new ranks. dp = 1 on both sides: global batch 8. ZeRO-3 also needs the
    trainer's two fixes of DeepSpeed's ZeRO-3 universal load (training/checkpoint/resume.py)."""
    tmp, _ = runs
    _assert_continues(rows(tmp / f"{base}-{source}-control"), rows(tmp / f"{base}-{source}-to-{target}"))


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
        {"recipe": {"model": {"family": "mixtral"}}, "ds_config": {}}))
    rc, err = run("--run-dir", str(run_dir))
    assert rc == 2 and len(err.splitlines()) == 1 and "no complete checkpoint" in err, err
    (run_dir / "checkpoints" / "latest").write_text("step00000005")
    torch.save({"module": {}},
               run_dir / "checkpoints" / "step00000005" / "mp_rank_00_model_states.pt")
    rc, err = run("--run-dir", str(run_dir))
    assert rc == 2 and len(err.splitlines()) == 1 and "ZeRO-0" in err, err
    (run_dir / "checkpoints" / "step00000005" / "layer_01-model_00-model_states.pt").write_bytes(b"")
    rc, err = run("--run-dir", str(run_dir))
    assert rc == 2 and len(err.splitlines()) == 1 and "pipeline-parallel" in err, err


@pytest.mark.parametrize("name", ["muon-dp2-to-one-rank", "muon-tp2-to-ep2"])
def test_a_muon_run_resumes_at_another_layout_with_its_momentum(name, runs):
    """Muon's momentum, kept per matrix on its owner rank, goes through the conversion (merged
    over the data-parallel partitions and the tp shards as DeepSpeed merges Adam's moments) and
    is cut again at the new layout: steps 6-10 continue the uninterrupted run to 1e-6. Without
    it (the momenta zeroed in the conversion) step 7 moves by 1.6e-5 (measured, dp2 to one rank)."""
    tmp, _ = runs
    control = "muon-dp2-control" if name.startswith("muon-dp2") else "muon-tp2-control"
    universal = tmp / name / "checkpoints" / "universal" / "step00000005"
    assert (universal / "muon_momentum" / "layers.0.self_attn.q_proj.weight.pt").is_file()
    assert not (universal / "zero" / "layers.0.self_attn.q_proj.weight" / "exp_avg.pt").exists()
    assert (universal / "zero" / "norm.weight" / "exp_avg.pt").is_file()        # AdamW's, as before
    _assert_continues(rows(tmp / control), rows(tmp / name))
