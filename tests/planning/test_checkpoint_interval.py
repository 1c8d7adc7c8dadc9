"""planning/checkpoint_interval.py and ``launch/estimate_memory.py --checkpoint-interval``:
Young's and Daly's intervals against values worked out by hand, the expected lost fraction least
at the interval returned, and the command on a small ``metrics.jsonl`` written here (no training
run) with its one-line refusals.
"""

from __future__ import annotations

import json
import math

import pytest

from launch import estimate_memory
from planning.checkpoint_interval import (daly_interval, lost_fraction, mtbf_s, read_run,
                                          young_interval)

DAY = 86400.0


def test_young_and_daly_equal_values_worked_out_by_hand():
    # Young, delta = 30 s, M = 1 day: sqrt(2 x 30 x 86,400) = sqrt(5,184,000) = 2,276.840 s.
    assert young_interval(30.0, DAY) == pytest.approx(2276.840, abs=1e-3)
    # Daly: sqrt(30 / 172,800) = 0.0131762, / 3 = 0.00439208; 30 / (18 x 86,400) = 0.00001929;
    # 2,276.840 x 1.00441137 - 30 = 2,256.884 s.
    assert daly_interval(30.0, DAY) == pytest.approx(2256.884, abs=1e-3)
    # Daly's own examples (FGCS 22(3), 2006, figures 3-5: delta = 5 min, M = 24 h, 6 h, 15 min):
    # 117, 57 and 9.1 min.
    for mtbf, minutes, places in ((24 * 3600.0, 117, 0), (6 * 3600.0, 57, 0), (900.0, 9.1, 1)):
        assert round(daly_interval(300.0, mtbf) / 60, places) == minutes
    # A save as long as two MTBFs or longer: Daly's interval is the MTBF.
    assert daly_interval(200.0, 100.0) == 100.0 and daly_interval(250.0, 100.0) == 100.0
    # M = 1 / (failures per node-day x nodes) days: 0.5 x 4 nodes -> half a day.
    assert mtbf_s(0.5, 4) == 43200.0
    assert mtbf_s(419 / (54 * 2048), 2048) == pytest.approx(54 * DAY / 419)


def test_daly_reduces_to_young_when_the_save_is_short_against_the_mtbf():
    gaps = [abs(daly_interval(d, DAY) / young_interval(d, DAY) - 1) for d in (30.0, 3.0, 0.3, 0.03)]
    assert gaps == sorted(gaps, reverse=True) and gaps[-1] < 1e-3
    # The next terms: Daly - Young = Young x (sqrt(d / 2M) / 3 + d / 18M) - d, to first order -2d/3.
    assert daly_interval(0.03, DAY) - young_interval(0.03, DAY) == pytest.approx(-0.02, rel=0.05)


@pytest.mark.parametrize("delta,mtbf", [(30.0, DAY), (0.107, 356201.0), (1.788, 356201.0),
                                        (0.107, 11131.0), (600.0, 3600.0)])
@pytest.mark.parametrize("restart", [0.0, 300.0])
def test_the_lost_fraction_is_least_at_dalys_interval(delta, mtbf, restart):
    tau = daly_interval(delta, mtbf)
    at = lost_fraction(tau, delta, mtbf, restart)
    for k in (0.99, 1.01, 0.9, 1.1, 0.5, 2.0):
        assert lost_fraction(k * tau, delta, mtbf, restart) > at, k
    # First order, the loss is Young's delta/tau + tau/(2M) (no restart): 2 x sqrt(delta / 2M).
    if restart == 0 and delta < 1e-4 * mtbf:
        assert at == pytest.approx(math.sqrt(2 * delta / mtbf), rel=0.01)


def _run_dir(tmp_path, saves=True):
    """A run of 10 steps, 2.0 s each but a slow first step, saves at 3, 6, 9 and the last step
    (which waits for its files: 9.0 s), an eval row and a line cut by a kill."""
    rows = [{"step": s, "loss": 5.0, "step_time_s": 30.0 if s == 1 else 2.0} for s in range(1, 11)]
    if saves:
        rows += [{"step": 3, "save_stall_s": 0.4}, {"step": 6, "save_stall_s": 0.6},
                 {"step": 9, "save_stall_s": 0.5}, {"step": 10, "save_stall_s": 9.0}]
    rows.append({"step": 10, "eval_loss": 5.1})
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 11, "lo'
    (tmp_path / "metrics.jsonl").write_text(text)
    return tmp_path


def test_the_command_reads_the_runs_median_stall_and_step_time(tmp_path, capsys):
    run = _run_dir(tmp_path)
    assert read_run(run) == {"save_stall_s": 0.5, "saves": 3, "step_time_s": 2.0, "steps": 10}
    argv = ["--checkpoint-interval", "--run-dir", str(run), "--failures-per-node-day", "0.01",
            "--nodes", "16"]
    assert estimate_memory.main(argv) == 0
    out = capsys.readouterr().out
    mtbf = DAY / (0.01 * 16)                                  # 540,000 s
    tau = daly_interval(0.5, mtbf)                            # about 734.6 s
    k = round(tau / 2.0)
    assert f"train.save_every={k}" in out and "540,000 s" in out and "median of 3 saves" in out
    assert estimate_memory.main(argv + ["--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["save_every"] == k == 367
    assert result["young_s"] == pytest.approx(math.sqrt(2 * 0.5 * mtbf))
    assert result["daly_s"] == pytest.approx(tau)
    curve = {p["multiple"]: p["lost_fraction"] for p in result["curve"]}
    assert min(curve, key=curve.get) == 1.0
    # A figure given overrides the run's.
    assert estimate_memory.main(argv + ["--save-stall-s", "2.0", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["save_stall_s"], result["step_time_s"]) == (2.0, 2.0)
    # Without a run: both figures given.
    assert estimate_memory.main(["--checkpoint-interval", "--save-stall-s", "0.5", "--step-time-s", "2",
                                 "--failures-per-node-day", "0.01", "--nodes", "16"]) == 0
    assert f"train.save_every={k}" in capsys.readouterr().out


@pytest.mark.parametrize("case,argv,says", [
    ("no metrics", ["--run-dir", "{empty}", "--failures-per-node-day", "0.01"], "metrics.jsonl does not exist"),
    ("no saves", ["--run-dir", "{nosaves}", "--failures-per-node-day", "0.01"], "no save_stall_s row"),
    ("negative rate", ["--run-dir", "{run}", "--failures-per-node-day", "-0.01"], "--failures-per-node-day"),
    ("zero rate", ["--save-stall-s", "1", "--step-time-s", "1", "--failures-per-node-day", "0"],
     "--failures-per-node-day"),
    ("no rate", ["--run-dir", "{run}"], "needs --failures-per-node-day"),
    ("no nodes", ["--run-dir", "{run}", "--failures-per-node-day", "0.01", "--nodes", "0"], "--nodes"),
    ("no figures", ["--save-stall-s", "1", "--failures-per-node-day", "0.01"], "--step-time-s T"),
    ("negative stall", ["--save-stall-s", "-1", "--step-time-s", "1", "--failures-per-node-day", "0.01"],
     "--save-stall-s must be"),
    ("negative restart", ["--run-dir", "{run}", "--failures-per-node-day", "0.01", "--restart-s", "-5"],
     "--restart-s"),
])
def test_bad_input_is_refused_in_one_line_with_exit_code_2(tmp_path, capsys, case, argv, says):
    dirs = {"empty": tmp_path / "empty", "nosaves": tmp_path / "nosaves", "run": tmp_path / "run"}
    for d in dirs.values():
        d.mkdir()
    _run_dir(dirs["nosaves"], saves=False)
    _run_dir(dirs["run"])
    argv = [a.format(**dirs) for a in argv]
    assert estimate_memory.main(["--checkpoint-interval", *argv]) == 2, case
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], captured.err
    assert captured.out == ""
