"""``benchmarks/dense_vs_sparse.py`` on real runs: the three tiny recipes, 3 steps (eval at 2 and
3), 1 seed.

Checked: ``results.json`` has one row per family with the stated fields; the eval loss it reports
is the run's own last eval loss; the families' active parameters match the dense model's within
the recipes' stated 1%, and the MoE families hold more in total; ``flops_per_token`` is the
repository's formula (``train_flops_per_token``, and for dense by hand); every family saw the
same seed and number of tokens; the plots are PNG images whose drawn data are the runs' curves;
the sweep summary and plot work on the same runs' router statistics; bad input is one line and
exit code 2 with nothing written.
"""

from __future__ import annotations

import json
import subprocess
import sys

import matplotlib.image
import pytest

from analysis import dense_vs_sparse as dvs
from tests.runs import REPO, env
from model.flops import train_flops_per_token
from training.config.recipe import load_recipe

STEPS = 3
TOKENS_PER_STEP = 8 * 128          # ds_configs/zero1_fp32.json micro-batch 8 x the recipes' seq_len


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "benchmarks/dense_vs_sparse.py", *args], cwd=REPO,
                          env=env(), capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("dvs") / "out"
    proc = _bench("--steps", str(STEPS), "--seeds", "1", "--eval-every", "2", "--eval-batches", "1",
                  "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads((out / "results.json").read_text())


def test_results_rows_are_the_runs_own_numbers(study):
    out, rows = study
    assert [r["family"] for r in rows] == ["dense", "switch", "mixtral"]
    for r in rows:
        for key in ("family", "active_params", "total_params", "flops_per_token", "eval_loss", "tokens_per_s"):
            assert key in r, (r["family"], key)
        assert set(r["eval_loss"]) >= {"mean", "spread", "spread_kind"}
        assert r["eval_loss"]["spread_kind"] == "max - min over seeds" and r["eval_loss"]["spread"] == 0.0
        run_dir = out / "runs" / r["family"] / "run000"
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        evals = [m["eval_loss"] for m in metrics if "eval_loss" in m]
        assert len(evals) == 2 and r["eval_loss"]["mean"] == evals[-1]
        assert r["steps"] == STEPS and r["tokens"] == STEPS * TOKENS_PER_STEP
        assert json.loads((run_dir / "config.json").read_text())["recipe"]["train"]["seed"] == dvs.FIRST_SEED
        assert r["tokens_per_s"] > 0 and not (run_dir / "checkpoints").exists()
        assert ("load_max_over_mean_final" in r) == (r["family"] != "dense")
    assert "| dense | 1,639,552 |" in (out / "results.md").read_text()


def test_equal_active_params_and_the_repo_flops_formula(study):
    _, rows = study
    dense = rows[0]
    assert dense["total_params"] == dense["active_params"]
    for r in rows:
        assert r["active_params"] == pytest.approx(dense["active_params"], rel=dvs.ACTIVE_TOLERANCE)
        recipe = load_recipe(REPO / dvs.RECIPES[r["family"]])
        assert r["flops_per_token"] == train_flops_per_token(recipe.model, recipe.seq_len)
        assert r["flops_per_token"] == pytest.approx(dense["flops_per_token"], rel=dvs.ACTIVE_TOLERANCE)
        assert r["train_flops"] == r["tokens"] * r["flops_per_token"]
    assert rows[1]["total_params"] > 1.5 * rows[1]["active_params"] < rows[2]["total_params"]
    # Dense by hand: 6 x (head + L x (attention + SwiGLU)) + 6 x L x h x seq.
    h, f, layers, vocab, seq, head_dim, heads, kv = 128, 256, 4, 4096, 128, 32, 4, 2
    matmul = vocab * h + layers * (h * head_dim * (2 * heads + 2 * kv) + 3 * h * f)
    assert dense["flops_per_token"] == 6 * matmul + 6 * layers * h * seq


def test_plots_draw_the_curves(study, tmp_path):
    out, rows = study
    for name in ("eval_loss_vs_tokens.png", "eval_loss_vs_flops.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert matplotlib.image.imread(out / name).shape[:2] == (450, 700)
    runs = {r["family"]: (r, [dvs.curve(out / "runs" / r["family"] / "run000")]) for r in rows}
    drawn = dvs.plot_eval(runs, tmp_path)
    for r in rows:
        tokens, losses = drawn["tokens"][r["family"]]
        assert tokens == [2 * TOKENS_PER_STEP, STEPS * TOKENS_PER_STEP]     # evals at steps 2 and 3
        assert losses[-1] == r["eval_loss"]["mean"] and losses[0] != losses[-1]
        assert drawn["flops"][r["family"]][0] == [t * r["flops_per_token"] for t in tokens]
    # The sweep summary and plot, on the MoE families' router statistics.
    moe = {r["family"]: runs[r["family"]][1] for r in rows[1:]}
    arms = [dvs.Arm(name, name) for name in moe]
    summary = [dvs.summarize(a, rows[i + 1], moe[a.name]) for i, a in enumerate(arms)]
    points = dvs.plot_sweep("aux", summary, moe, tmp_path)
    assert points["switch"] == ([moe["switch"][0]["load_max_over_mean"][-1]], [rows[1]["eval_loss"]["mean"]])
    assert (tmp_path / "sweep_aux.png").read_bytes()[:4] == b"\x89PNG"
    assert summary[1]["dropped_frac"]["mean"] == 0.0          # Mixtral is dropless


@pytest.mark.parametrize("args,message", [
    (["--steps", "0"], "--steps 0: must be >= 1"),
    (["--steps", "3", "--families", "dense,moe"], "unknown family 'moe'"),
    (["--steps", "3", "--sweeps", "capacity", "topk"], "unknown sweep 'topk'"),
    (["--steps", "3", "--seeds", "-1"], "--seeds -1: must be >= 1"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    from benchmarks.studies import dense_vs_sparse as bench
    assert bench.main([*args, "--out", str(tmp_path / "out")]) == 2
    line, = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and message in line, line
    assert not (tmp_path / "out").exists()


def test_an_out_directory_holding_other_files_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    proc = _bench("--steps", "3", "--out", str(tmp_path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    line, = proc.stderr.strip().splitlines()
    assert line == f"error: --out {tmp_path}: exists and is not an empty directory; choose a new one"
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
