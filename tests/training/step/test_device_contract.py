"""Every tensor our code hands to a collective lives on the compute device: the contract NCCL
enforces on a GPU, made observable on CPU by ``_device_contract_run.py`` (tensors made on the
host by our code are tagged, and the collectives refuse tagged tensors).

Covers a data-parallel run with fp32 ZeRO-0 (our gradient-norm and clipping path) and evaluation,
an expert-parallel run (the all-to-all exchange and its counts) and a pipeline run (stage
statistics, evaluation sums). ``test_the_check_sees_a_host_tensor`` proves the check can fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.runs import SMALL

REPO = Path(__file__).resolve().parents[3]
RUNS = {"dp2-zero0-fp32": ("ds_configs/zero0_fp32.json", []),
        "ep2-zero1": ("ds_configs/zero1_fp32.json", ["parallel.expert_parallel_size=2"]),
        "pp2-zero0-fp32": ("ds_configs/zero0_fp32.json", ["parallel.pipeline_parallel_size=2"])}


def _run(warm, tmp_path: Path, config: str, extra: list[str], script: str = "_device_contract_run.py"):
    out = tmp_path / "violations"
    warm.script(f"tests/training/step/{script}",
                ["--config", config, "--run-dir", str(tmp_path / "run"), "--steps", "2", "--set", *SMALL,
                 "eval.every=2", *extra], tmp_path / "run.log", timeout=400,
                extra_env={"DEVICE_CONTRACT": str(out)})
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("eval_loss" in r for r in rows), "the run did not evaluate"
    return [v for r in range(2) for v in json.loads(Path(f"{out}.{r}.json").read_text())]


@pytest.mark.parametrize("name", list(RUNS))
def test_collectives_get_device_tensors(warm_launcher, tmp_path, name):
    config, extra = RUNS[name]
    assert _run(warm_launcher, tmp_path, config, extra) == []


def test_the_check_sees_a_host_tensor(warm_launcher, tmp_path):
    """The stats vector made on the host, as the trainer once did: every step's all-reduce of it
    is reported."""
    found = _run(warm_launcher, tmp_path, "ds_configs/zero1_fp32.json", [], script="_device_contract_host_stats.py")
    assert found and {v["collective"] for v in found} == {"all_reduce"}, found
    assert all("_device_contract_host_stats.py" in v["tensor"] for v in found), found
