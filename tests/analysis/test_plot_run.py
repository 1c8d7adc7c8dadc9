"""``launch/plot_run.py`` on real runs: one tiny Mixtral run and one tiny dense run of
``launch/train.py`` (1 process, 10 steps, router statistics in ``metrics.jsonl`` every 5 steps).

Checked: the PNG files are written and are images of the stated size; what each plot drew is the
run's own metrics (losses, eval losses, the heatmap's shares computed from the logged per-layer
counts, which sum to top_k x tokens); a dense run gets no MoE plots; overlaying two runs draws one
line per run; bad input is one line and exit code 2.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from analysis import run_plots
from tests.runs import SMALL, python, rows, shared_launcher

TOKENS_PER_STEP = 8 * 64          # tests.runs.SMALL: micro-batch 8 x 64 tokens, one rank


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plots")
    shared_launcher().launch(tmp / "mixtral", "ds_configs/zero1_fp32.json", nproc=1)
    dense = [s for s in SMALL if not s.startswith("model.moe.")]
    proc = python("launch/train.py", "--config", "ds_configs/zero1_fp32.json", "--recipe",
                  "recipes/tiny_dense.yaml", "--run-dir", str(tmp / "dense"), "--steps", "10", "--set", *dense)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp


def _plot(*args: str) -> subprocess.CompletedProcess:
    return python("launch/plot_run.py", *args)


def test_metrics_rows_carry_each_layers_router_counts(runs):
    logged = [r for r in rows(runs / "mixtral") if "moe_layers" in r]
    assert [r["step"] for r in logged] == [5, 10]          # train.log_every=5
    for r in logged:
        layers = r["moe_layers"]
        assert layers["blocks"] == [0, 1]                  # SMALL: 2 Mixtral blocks
        for counts in layers["tokens_per_expert"]:
            assert len(counts) == 8 and sum(counts) == 2 * TOKENS_PER_STEP   # top-2
        assert max(layers["load_max_over_mean"]) == pytest.approx(r["expert_load_max_over_mean"])


def test_plots_of_one_moe_run(runs, tmp_path):
    out = tmp_path / "out"
    proc = _plot("--run-dir", str(runs / "mixtral"), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    names = ("training.png", "moe_balance.png", "moe_load_mixtral.png", "grad_norm_layers_mixtral.png")
    assert proc.stdout.split() == [str(out / n) for n in names]
    import matplotlib.image
    for name in names:
        height, width, _ = matplotlib.image.imread(out / name).shape
        assert width >= 400 and height >= 250, (name, width, height)

    train, evals = run_plots.read_metrics(runs / "mixtral")
    drawn = run_plots.plot_training({"m": (train, evals)}, tmp_path)
    assert drawn["loss"]["m"] == ([r["step"] for r in train], [r["loss"] for r in train])
    assert drawn["lr"]["m"][1] == [r["lr"] for r in train]
    assert evals and all("eval_loss" in r for r in evals)
    load = run_plots.plot_moe_load("m", train, tmp_path)
    assert load["steps"] == [5, 10] and load["blocks"] == [0, 1]
    for layer, grid in enumerate(load["shares"]):
        assert len(grid) == 8 and all(len(row) == 2 for row in grid)            # expert x step
        for j, step_row in enumerate(r for r in train if "moe_layers" in r):
            counts = step_row["moe_layers"]["tokens_per_expert"][layer]
            assert [grid[e][j] for e in range(8)] == pytest.approx(
                [c * 8 / sum(counts) for c in counts])
            assert sum(grid[e][j] for e in range(8)) == pytest.approx(8.0)
    layers = run_plots.plot_layer_grad_norms("m", train, tmp_path)     # train.log_every=5
    assert layers["steps"] == [5, 10] and list(layers["series"]) == ["embed", "block0", "block1", "head"]
    for j, r in enumerate(r for r in train if "grad_norm_layers" in r):
        drawn_sq = sum(layers["series"][k][j] ** 2 for k in layers["series"])
        assert drawn_sq ** 0.5 == pytest.approx(r["grad_norm"], rel=1e-6)


def test_overlay_and_dense_run(runs, tmp_path):
    proc = _plot("--run-dir", str(runs / "mixtral"), "--run-dir", str(runs / "dense"),
                 "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert sorted(Path(p).name for p in proc.stdout.split()) == [       # no MoE plot for the dense run
        "grad_norm_layers_dense.png", "grad_norm_layers_mixtral.png", "moe_balance.png",
        "moe_load_mixtral.png", "training.png"]
    both = {name: run_plots.read_metrics(runs / name) for name in ("mixtral", "dense")}
    drawn = run_plots.plot_training(both, tmp_path)
    assert sorted(drawn["loss"]) == ["dense", "mixtral"]
    assert sorted(run_plots.plot_moe_balance(both, tmp_path)["dropped_frac"]) == ["mixtral"]
    assert run_plots.plot_moe_load("dense", both["dense"][0], tmp_path) == {}
    assert "expert_bias_range" not in run_plots.plot_moe_balance(both, tmp_path)   # no bias


def test_the_bias_spread_gets_its_panel(runs, tmp_path):
    """A loss-free balancing run's ``expert_bias_range`` (here written into a copy of the
    Mixtral run's rows) is drawn as a third panel, its values as logged."""
    train, evals = run_plots.read_metrics(runs / "mixtral")
    biased = [{**r, "expert_bias_range": 0.002 * r["step"]} for r in train]
    drawn = run_plots.plot_moe_balance({"lfb": (biased, evals), "plain": (train, evals)}, tmp_path)
    steps = [r["step"] for r in train]
    assert drawn["expert_bias_range"] == {"lfb": (steps, [0.002 * s for s in steps]), "plain": ([], [])}
    import matplotlib.image
    height, width, _ = matplotlib.image.imread(tmp_path / "moe_balance.png").shape
    assert width >= 3 * 500 and height >= 250, (width, height)


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    cases = {tmp_path / "missing": "no such directory",
             tmp_path / "empty": "no metrics.jsonl",
             tmp_path / "partial": "line 2 is not JSON"}
    (tmp_path / "empty").mkdir()
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 8.3}) + '\n{"step": 2, "lo')
    for run_dir, message in cases.items():
        proc = _plot("--run-dir", str(run_dir))
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        line, = proc.stderr.strip().splitlines()
        assert line.startswith("error: ") and message in line, line
        assert not (run_dir / "plots").exists()
