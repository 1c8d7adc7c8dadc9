"""Sparse upcycling (``interop/upcycle.py``, ``launch/upcycle.py``).

(a) In every configuration ``exact_at_init`` calls exact, the upcycled MoE's logits equal the
    dense model's: copies with renormalized top-k (softmax top-1/top-2, sigmoid with groups, in
    eval and in train mode with router jitter), and slices (``--split``) with all experts
    selected; with shared experts (plain and Qwen2-MoE-gated, the MLP's output split between
    the shared FFN and the routed experts by ``--shared-fraction``). Tolerance 1e-5 on logits
    of magnitude ~1: fp32, and the MoE computes the same products summed in another order
    (w*y + (1-w)*y; the slices' partial sums), a few ulps per layer (measured <= 8.3e-7). The
    configurations it calls inexact differ by > 1e-3, so the check can fail.
(b) ``--noise s`` moves the logits by O(s): more than 100x the exact tolerance, less than
    5 s x max|logit| (first order, each expert weight moves by a relative s; measured 0.87 s x
    max|logit| at s = 0.01 with these MLP-heavy weights), and ten times the noise moves them
    about ten times as far (measured 9.8x).
(c) Bad input to the command: one line on stderr, exit code 2, no traceback, ``--out`` untouched.
(d) End to end: a dense run of launch/train.py, upcycled, trained with ``--init-from``: its first
    logged loss is the dense model's loss on the same batch, and it trains.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from interop import hf
from interop.upcycle import UpcycleOptions, exact_at_init, upcycle_state_dict
from launch import upcycle as upcycle_cli
from model import Transformer
from tests.runs import REPO, SMALL, env, python, rows, shared_launcher
from training.config.recipe import load_recipe

TOL = 1e-5
# Small enough for milliseconds per forward; init_std 0.05 makes the MLPs a large share of the
# residual stream, so that a wrong expert weight shows in the logits.
SIZE = ["model.hidden_size=64", "model.num_layers=2", "model.max_seq_len=64", "data.seq_len=64",
        "model.init_std=0.05"]
DENSE_FFN = 128


def _dense(ffn: int = DENSE_FFN) -> Transformer:
    cfg = load_recipe(REPO / "recipes" / "tiny_dense.yaml", SIZE + [f"model.ffn_hidden_size={ffn}"]).model
    return Transformer(cfg, init_seed=3).eval()


def _moe_cfg(*sets: str):
    return load_recipe(REPO / "recipes" / "tiny_mixtral.yaml", SIZE + list(sets)).model


def _ids() -> torch.Tensor:
    return torch.randint(0, 4096, (4, 64), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def _max_logit_diff(dense: Transformer, moe_cfg, opts: UpcycleOptions, train: bool = False) -> float:
    moe = Transformer(moe_cfg, init_seed=None)
    moe.load_state_dict(upcycle_state_dict(dense.cfg, dense.state_dict(), moe_cfg, opts), strict=True)
    moe.train(train)
    return (moe(_ids()).logits - dense(_ids()).logits).abs().max().item()


EXACT = {
    "copies, softmax top-2 renormalized (Mixtral)": ((f"model.ffn_hidden_size={DENSE_FFN}",), {}),
    "copies, top-1 renormalized": ((f"model.ffn_hidden_size={DENSE_FFN}", "model.moe.top_k=1"), {}),
    "copies, sigmoid, 4 groups, top-2 (DeepSeek-V3 routing)": (
        (f"model.ffn_hidden_size={DENSE_FFN}", "model.moe.score_function=sigmoid",
         "model.moe.n_group=4", "model.moe.topk_group=2"), {}),
    "copies, MoE every 2nd block": ((f"model.ffn_hidden_size={DENSE_FFN}", "model.moe.moe_layer_freq=2"), {}),
    "split 2, E=2, all selected, scale 2": (
        ("model.ffn_hidden_size=64", "model.moe.num_experts=2", "model.moe.top_k=2",
         "model.moe.routed_scaling_factor=2.0"), {"split": 2}),
    "split 4, 2 copies, E=8, all selected, scale 4": (
        ("model.ffn_hidden_size=32", "model.moe.top_k=8", "model.moe.routed_scaling_factor=4.0"),
        {"split": 4}),
    "copies + shared expert, sigmoid, 4 groups (DeepSeek-MoE)": (
        (f"model.ffn_hidden_size={DENSE_FFN}", "model.moe.score_function=sigmoid", "model.moe.n_group=4",
         "model.moe.topk_group=2", "model.moe.num_shared_experts=1"), {}),
    "copies + gated shared expert, fraction 0.3 (Qwen2-MoE)": (
        (f"model.ffn_hidden_size={DENSE_FFN}", "model.moe.num_shared_experts=1",
         "model.moe.shared_expert_gate=true"), {"shared_fraction": 0.3}),
    "split 4 via expert_ffn_hidden_size, block 0 dense, shared expert, all selected, scale 4": (
        (f"model.ffn_hidden_size={DENSE_FFN}", "model.moe.expert_ffn_hidden_size=32", "model.moe.top_k=8",
         "model.moe.routed_scaling_factor=4.0", "model.moe.first_k_dense=1",
         f"model.moe.shared_expert_ffn_hidden_size={DENSE_FFN}", "model.moe.num_shared_experts=1"),
        {"split": 4}),
    "split 2, E=2, all selected, unnormalized softmax x 2": (
        ("model.ffn_hidden_size=64", "model.moe.num_experts=2", "model.moe.top_k=2",
         "model.moe.normalize_top_k=false", "model.moe.routed_scaling_factor=2.0"), {"split": 2}),
}


@pytest.mark.parametrize("case", list(EXACT))
def test_upcycled_logits_equal_the_dense_models_at_init(case):
    sets, opts = EXACT[case]
    dense, cfg, opts = _dense(), _moe_cfg(*sets), UpcycleOptions(**opts)
    assert exact_at_init(cfg, opts) is None
    assert _max_logit_diff(dense, cfg, opts) <= TOL
    # Train mode: router jitter changes the routing, not the output of identical copies.
    jittered = _moe_cfg(*sets, "model.moe.router_jitter=0.1")
    assert _max_logit_diff(dense, jittered, opts, train=True) <= TOL


NOT_EXACT = {
    "copies, raw top-2 probabilities": ((f"model.ffn_hidden_size={DENSE_FFN}",
                                          "model.moe.normalize_top_k=false"), {}, "sum to 1"),
    "copies, capacity factor 0.5 drops tokens": ((f"model.ffn_hidden_size={DENSE_FFN}",
                                                  "model.moe.capacity_factor=0.5",
                                                  "model.moe.eval_capacity_factor=0.5"), {}, "drop"),
    "split 4, E=8, top-2": (("model.ffn_hidden_size=32",), {"split": 4}, "top_k (2) < num_experts (8)"),
    "split 2, all selected, scale 1": (("model.ffn_hidden_size=64", "model.moe.num_experts=2",
                                        "model.moe.top_k=2"), {"split": 2}, "routed_scaling_factor=2"),
    "split 2, all selected, scale 2, random router": (
        ("model.ffn_hidden_size=64", "model.moe.num_experts=2", "model.moe.top_k=2",
         "model.moe.routed_scaling_factor=2.0"), {"split": 2, "router_std": 0.5}, "--router-std 0"),
}


@pytest.mark.parametrize("case", list(NOT_EXACT))
def test_configurations_called_inexact_do_differ(case):
    sets, opts, reason = NOT_EXACT[case]
    dense, cfg, opts = _dense(), _moe_cfg(*sets), UpcycleOptions(**opts)
    assert reason in exact_at_init(cfg, opts)
    assert _max_logit_diff(dense, cfg, opts) > 1e-3


def test_expert_weights_are_the_dense_mlp_and_its_slices():
    dense = _dense()
    sd = dense.state_dict()
    gate, up, down = (sd[f"layers.1.mlp.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj"))
    copies = upcycle_state_dict(dense.cfg, sd, _moe_cfg(f"model.ffn_hidden_size={DENSE_FFN}"),
                                UpcycleOptions(seed=5))
    for e in range(8):
        assert torch.equal(copies["layers.1.mlp.experts.gate_proj"][e], gate.t())    # (H, I)
        assert torch.equal(copies["layers.1.mlp.experts.down_proj"][e], down.t())    # (I, H)
    for name in ("embed_tokens.weight", "lm_head.weight", "norm.weight", "layers.1.self_attn.k_proj.weight"):
        assert torch.equal(copies[name], sd[name])
    router = copies["layers.1.mlp.gate.weight"]                  # (E, H) normal(0, init_std)
    assert router.shape == (8, 64) and 0.04 < router.std().item() < 0.06
    # split 4: expert e is slice e mod 4 of the inner dim; the router starts at zero.
    sliced = upcycle_state_dict(dense.cfg, sd, _moe_cfg("model.ffn_hidden_size=32"), UpcycleOptions(split=4))
    for e in range(8):
        cut = slice(32 * (e % 4), 32 * (e % 4 + 1))
        assert torch.equal(sliced["layers.1.mlp.experts.up_proj"][e], up[cut].t())
        assert torch.equal(sliced["layers.1.mlp.experts.down_proj"][e], down[:, cut].t())
    assert not sliced["layers.0.mlp.gate.weight"].any()


def test_noise_moves_the_logits_slightly():
    dense, cfg = _dense(), _moe_cfg(f"model.ffn_hidden_size={DENSE_FFN}")
    with torch.no_grad():
        scale = dense(_ids()).logits.abs().max().item()
    small = _max_logit_diff(dense, cfg, UpcycleOptions(noise=0.01))
    large = _max_logit_diff(dense, cfg, UpcycleOptions(noise=0.1))
    assert "--noise 0.01" in exact_at_init(cfg, UpcycleOptions(noise=0.01))
    assert 100 * TOL < small < 5 * 0.01 * scale, (small, scale)
    assert 5 < large / small < 20, (small, large)
    noisy = upcycle_state_dict(dense.cfg, dense.state_dict(), cfg, UpcycleOptions(noise=0.1))
    experts = noisy["layers.0.mlp.experts.gate_proj"]            # (E, H, I): copies differ
    assert not torch.equal(experts[0], experts[1])
    ratio = experts / dense.state_dict()["layers.0.mlp.gate_proj.weight"].t()
    assert 0.08 < (ratio - 1).std().item() < 0.12                 # multiplicative, std 0.1


# ------------------------------------------------------------------------------- bad input

@pytest.fixture(scope="module")
def dense_init(tmp_path_factory) -> Path:
    """An init dir (what --init-from reads) holding the dense model."""
    path = tmp_path_factory.mktemp("upcycle") / "dense_init"
    dense = _dense()
    hf.save_init_dir(path, dense.cfg, dense.state_dict())
    return path


def _snapshot(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): (hashlib.sha256(p.read_bytes()).hexdigest()
                                             if p.is_file() else None, p.stat().st_mtime_ns)
            for p in [root, *sorted(root.rglob("*"))]}


def _refused(capsys, argv: list[str]) -> str:
    assert upcycle_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("upcycle.py: error: "), err
    return err[0]


def test_bad_inputs_are_one_line_and_leave_out_untouched(dense_init, tmp_path, capsys):
    out = tmp_path / "moe"
    base = ["--recipe", "recipes/tiny_mixtral.yaml", "--out", str(out), "--set", *SIZE]
    line = _refused(capsys, ["--from", str(dense_init), *base, "model.hidden_size=128"])
    assert "model.hidden_size (128)" in line and "--set model.hidden_size=64" in line
    line = _refused(capsys, ["--from", str(dense_init), *base, "model.ffn_hidden_size=64", "--split", "4"])
    assert "model.ffn_hidden_size (64)" in line and "--set model.ffn_hidden_size=32" in line and "--split 2" in line
    line = _refused(capsys, ["--from", str(dense_init), *base, "model.moe.num_experts=6",
                             "model.ffn_hidden_size=32", "--split", "4"])
    assert "model.moe.num_experts (6) is not a multiple of --split (4)" in line
    line = _refused(capsys, ["--from", str(tmp_path / "missing"), *base])
    assert f"--from {tmp_path / 'missing'}: no such directory" in line
    line = _refused(capsys, ["--from", str(dense_init), *base, "--noise", "-1"])
    assert "--noise (-1.0)" in line
    line = _refused(capsys, ["--from", str(dense_init), *base, "model.ffn_hidden_size=32",
                             "model.moe.num_shared_experts=2", "--split", "4"])            # shared FFN 2 x 32 = 64
    assert ("shared experts' inner size (64)" in line
            and "--set model.moe.shared_expert_ffn_hidden_size=128" in line)
    line = _refused(capsys, ["--from", str(dense_init), *base, "model.moe.expert_ffn_hidden_size=64",
                             "model.ffn_hidden_size=128", "--split", "4"])
    assert "model.moe.expert_ffn_hidden_size (64)" in line and "=32" in line
    line = _refused(capsys, ["--from", str(dense_init), *base, "model.ffn_hidden_size=64",
                             "model.moe.first_k_dense=1", "--split", "2"])
    assert "model.ffn_hidden_size (64) is the MLP of the blocks that stay dense" in line
    line = _refused(capsys, ["--from", str(dense_init), *base, "model.ffn_hidden_size=128",
                             "model.moe.first_k_dense=1", "--split", "2"])     # dense blocks keep 128
    assert ("model.moe.expert_ffn_hidden_size (unset, so model.ffn_hidden_size, 128)" in line
            and "fix: --set model.moe.expert_ffn_hidden_size=64" in line), line
    line = _refused(capsys, ["--from", str(dense_init), *base, "model.ffn_hidden_size=128",
                             "--shared-fraction", "1.5"])
    assert "--shared-fraction (1.5)" in line
    assert not out.exists()

    out.mkdir()
    (out / "keep.txt").write_text("user file")
    before = _snapshot(out)
    line = _refused(capsys, ["--from", str(dense_init), *base, "model.ffn_hidden_size=128"])
    assert f"--out {out} already exists" in line
    assert _snapshot(out) == before


def test_an_init_dir_upcycles_into_one_the_trainer_accepts(dense_init, tmp_path, capsys):
    out = tmp_path / "moe"
    sets = [*SIZE, "model.ffn_hidden_size=64", "model.moe.top_k=8", "model.moe.routed_scaling_factor=2.0"]
    assert upcycle_cli.main(["--from", str(dense_init), "--recipe", "recipes/tiny_mixtral.yaml",
                             "--out", str(out), "--split", "2", "--set", *sets]) == 0
    assert "computes the dense model's function" in capsys.readouterr().out
    recipe = load_recipe(REPO / "recipes" / "tiny_mixtral.yaml", sets)
    from training.run.preflight import check_init_from
    assert check_init_from(str(out), recipe) == out          # train.py --init-from's own check
    cfg, sd, tokenizer = hf.load_init_dir(out)
    assert tokenizer is None and sorted(p.name for p in out.iterdir()) == [
        "model.safetensors", "model_config.json", "upcycle.json"]
    record = json.loads((out / "upcycle.json").read_text())
    assert record["split"] == 2 and record["exact_at_init"] and record["router_std"] == 0.0
    dense = _dense()
    moe = Transformer(cfg, init_seed=None)
    moe.load_state_dict(sd, strict=True)
    with torch.no_grad():
        assert (moe.eval()(_ids()).logits - dense(_ids()).logits).abs().max().item() <= TOL


def test_a_real_subprocess_prints_one_line_and_no_traceback(dense_init, tmp_path):
    out = tmp_path / "moe"
    proc = subprocess.run([sys.executable, "launch/upcycle.py", "--from", str(dense_init), "--recipe",
                           "recipes/tiny_mixtral.yaml", "--out", str(out), "--set", *SIZE,
                           "model.num_layers=3"], cwd=REPO, env=env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "upcycle.py: error: model.num_layers (3) differs from the dense model's (2); fix: "
        "--set model.num_layers=2 or edit the recipe"]
    assert not out.exists()


# ------------------------------------------------------------------------------- end to end

DENSE_SMALL = [s for s in SMALL if not s.startswith("model.moe.")]


def _train_dense(run_dir: Path, steps: int, extra=()) -> None:
    proc = python("launch/train.py", "--config", "ds_configs/zero1_fp32.json", "--recipe",
                  "recipes/tiny_dense.yaml", "--run-dir", str(run_dir), "--steps", str(steps), "--set",
                  *DENSE_SMALL, *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_train_dense_upcycle_and_train_the_moe(tmp_path):
    # 1. A tiny dense model, 30 steps (SMALL's sizes: hidden 64, 2 layers, ffn 64).
    _train_dense(tmp_path / "dense", 30)
    # 2. Upcycle it into tiny_mixtral at the same sizes (SMALL's ffn 64 = the dense one: copies).
    out = tmp_path / "moe_init"
    proc = python("launch/upcycle.py", "--from", str(tmp_path / "dense"), "--recipe",
                  "recipes/tiny_mixtral.yaml", "--out", str(out), "--set", *SMALL, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "computes the dense model's function" in proc.stdout
    assert (out / "tokenizer" / "tokenizer.json").read_bytes() == \
        (tmp_path / "dense" / "tokenizer" / "tokenizer.json").read_bytes()
    # 3. The dense model itself from the same starting point (an init dir of its weights), and
    #    the MoE: same seed, so the same batches in the same order.
    from interop.consolidate import load_run_model
    model, cfg, tokenizer = load_run_model(tmp_path / "dense")
    hf.save_init_dir(tmp_path / "dense_init", cfg, model.state_dict(), tokenizer)
    _train_dense(tmp_path / "dense_cont", 20, ["--init-from", str(tmp_path / "dense_init")])
    shared_launcher().launch(tmp_path / "moe", "ds_configs/zero1_fp32.json", nproc=1, steps=20,
           extra=["--init-from", str(out)])
    dense_rows, moe_rows = rows(tmp_path / "dense_cont"), rows(tmp_path / "moe")
    # fp32; the MoE's output is the dense MLP's up to summation order (test (a): <= 8.3e-7 on the
    # logits), so its loss on the same batch agrees to ~1e-7 relative; 1e-5 leaves margin and is
    # far below what one training step changes (the dense run's first step moves it by ~1e-2).
    assert moe_rows[0]["loss"] == pytest.approx(dense_rows[0]["loss"], rel=1e-5)
    assert dense_rows[0]["loss"] < 8.0                # the dense run had learnt (ln 4096 = 8.32)
    # It trains: eval loss on the same validation batches falls (SMALL: eval every 5 steps).
    evals = [json.loads(x) for x in (tmp_path / "moe" / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval_loss"] for r in evals if "eval_loss" in r}
    assert evals[20] < evals[5] - 0.05, evals
    assert moe_rows[-1]["loss"] < moe_rows[0]["loss"] - 0.1
