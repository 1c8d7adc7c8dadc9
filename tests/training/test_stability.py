"""A non-finite loss never reaches the weights; a loss spike is logged, skipped or stops the run.

Each case runs the real engine and ``Stepper`` in a fresh process (``_stability_run.py``): three
normal steps, then a step whose activations are multiplied by NaN, then one whose logits are
scaled 30x (a finite loss spike against a running mean of 2 steps with factor 1.5), then a
normal step.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runs import REPO, env


def _run(config: str, action: str) -> list[dict]:
    out = subprocess.run([sys.executable, str(Path(__file__).parent / "_stability_run.py"), config, action],
                         cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("config", ["ds_configs/zero0_fp32.json", "ds_configs/zero2.json"])
def test_nan_step_is_skipped_and_spike_is_skipped(config):
    rows = _run(config, "skip")
    # DeepSpeed's linear warmup spends the first updates at lr 0; by step 3 the weights move.
    assert rows[2]["changed"] and rows[2]["skipped"] is None
    nan = rows[3]
    assert nan["skipped"] and not nan["changed"] and nan["finite"]
    spike = rows[4]
    assert spike["loss"] > 1.5 * rows[2]["loss"]
    assert spike["skipped"].startswith("loss spike") and not spike["changed"]
    assert rows[5]["changed"] and rows[5]["finite"] and rows[5]["skipped"] is None


def test_spike_is_only_logged_or_stops_when_asked():
    logged = _run("ds_configs/zero1_fp32.json", "log")
    assert logged[3]["skipped"] and not logged[3]["changed"]      # NaN: always skipped
    assert logged[4]["skipped"] is None and logged[4]["changed"]  # spike: logged only
    assert logged[4]["spike"] and not logged[5]["spike"]
    stopped = _run("ds_configs/zero1_fp32.json", "stop")
    assert stopped[4]["stopped"].startswith("loss spike") and not stopped[4]["changed"]
