"""The GPU day's suite (``benchmarks/gpu_suite.sh``), rehearsed on this CPU: both parts run at tiny
sizes in an emulated device image (``benchmarks/gpu/device_image.py``: only the image's packages,
deepspeed and pydantic from the wheel kit that ``benchmarks/gpu_kit.sh`` builds, installed with
pip's offline line), every section is in the summary, every step ends within its cap, the caps
fit the device's command limits and ``$OUT`` holds what the device tool returns. Plus the
figures script on short runs and the NCCL check at world size 1."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.gpu import gpu_figures

ROOT = Path(__file__).resolve().parents[3]
SECTIONS = ["device contract", "dense", "MoE", "GPU microbench", "MoE layer", "end to end", "compile",
            "NCCL check", "overlap_comm", "gpu tests"]


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    """(exit code, output, folder, seconds, alone): the rehearsal ``.ci/run`` ran alone on the
    machine before the tests (``$GPU_SUITE_REHEARSED``), else one run here, beside other tests."""
    done = os.environ.get("GPU_SUITE_REHEARSED")
    if done and (Path(done) / "rc").is_file():
        where = Path(done)
        return (int((where / "rc").read_text()), (where / "rehearsal.log").read_text(), where,
                float((where / "seconds").read_text()), True)
    where = tmp_path_factory.mktemp("rehearsal")
    env = dict(os.environ, GPU_SUITE_REHEARSAL_DIR=str(where))
    env.pop("OUT", None)
    t0 = time.perf_counter()
    proc = subprocess.run(["bash", "benchmarks/gpu_suite.sh", "--rehearsal"], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    return proc.returncode, proc.stdout, where, time.perf_counter() - t0, False


def test_the_rehearsal_runs_every_step_of_both_parts(rehearsal):
    rc, output, where, seconds, alone = rehearsal
    assert rc == 0, output[-6000:]
    assert "rehearsal: ok" in output
    summary = (where / "out" / "summary.md").read_text()
    titles = re.findall(r"^## (.+)$", summary, flags=re.M)
    assert titles == SECTIONS, titles
    statuses = re.findall(r"^status: (\w+.*?), (\d+) s of a (\d+) s cap$", summary, flags=re.M)
    assert len(statuses) == len(SECTIONS) and all(s[0] == "ok" for s in statuses), statuses
    assert all(int(took) <= int(cap) for _, took, cap in statuses)
    if alone:      # CI's run, from a fresh clone, the kit fetched and built in it
        # The contract is 4 minutes from a fresh clone, run alone (.ci/run runs it before pytest):
        # measured 184 s on the 2-core machine.
        print(f"gpu suite rehearsal: {seconds:.0f} s in CI (at most 240 s)")
        assert seconds <= 240, f"the rehearsal took {seconds:.0f} s in CI; it must take at most 240 s"


def test_the_microbench_section_has_its_tables(rehearsal):
    """The GPU microbench step's section: the bandwidth table with a figure per op and the matmul
    table with a column per dtype, its first (bf16, smallest GEMM) cell measured whatever the budget."""
    summary = (rehearsal[2] / "out" / "summary.md").read_text()
    section = summary.split("## GPU microbench\n", 1)[1].split("\n## ", 1)[0]
    assert "| matmul | M x K x N | FLOP/byte (bf16) | fp32 | tf32 | bf16 | fp16 | fp8 |" in section, section
    copy = re.search(r"^\| copy \| [\d.]+ MiB \| [\d.]+ MiB \| ([\d.]+) \|", section, re.M)
    assert copy and float(copy[1]) > 0, section
    first = re.search(r"^\| expert gate/up [^|]*\| [^|]*\| [^|]*\| [^|]*\| [^|]*\| ([^|]+) \|", section, re.M)
    assert first and float(first[1]) > 0, section          # bf16 of the smallest GEMM, measured first
    assert (rehearsal[2] / "work" / "gpu_microbench.json").is_file()


def test_the_caps_fit_the_device_commands(rehearsal):
    """Part 1's step caps sum to at most 330 s and part 2's to 255 s; with the kit's 30 s install
    each, a part fits 6 and 4.75 minutes."""
    text = (ROOT / "benchmarks" / "gpu" / "gpu_suite.sh").read_text()
    caps = {p: sum(int(c) for c in re.findall(r":(\d+)", re.search(rf'^PART{p}="([^"]+)"', text, re.M)[1]))
            for p in (1, 2)}
    kit = int(re.search(r"^KIT_CAP=(\d+)", text, re.M)[1])
    assert caps[1] <= 330 and caps[2] <= 255, caps
    assert caps[1] + kit <= 360 and caps[2] + kit <= 285


def test_out_holds_what_the_device_tool_returns(rehearsal):
    where = rehearsal[2]
    out = where / "out"
    files = [p for p in out.rglob("*") if p.is_file()]
    assert 1 <= len(files) <= 8, files
    assert all(len(p.relative_to(out).parts) <= 3 for p in files)
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", p.name) for p in files)
    assert sorted(p.name for p in files) == ["part1.log", "part2.log", "summary.md"]


def test_no_checkpoint_is_saved_and_wandb_is_off(rehearsal):
    where = rehearsal[2]
    for run in ("dense", "moe", "device_contract"):
        run_dir = where / "work" / "runs" / run
        assert (run_dir / "metrics.jsonl").is_file()
        assert not any((run_dir / "checkpoints").glob("*")), run
        assert not (run_dir / "wandb").exists()


def test_the_kit_is_one_version_of_each_and_small(rehearsal):
    where = rehearsal[2]
    wheels = sorted(p.name for p in (where / "kit").glob("*.whl"))
    names = [w.split("-")[0].lower() for w in wheels]
    assert sorted(names) == ["annotated_types", "deepspeed", "hjson", "pydantic", "pydantic_core",
                             "typing_inspection"], wheels
    assert sum(p.stat().st_size for p in (where / "kit").glob("*.whl")) <= 40 * 2**20


def test_the_emulated_image_has_no_deepspeed_without_the_kit(rehearsal):
    where = rehearsal[2]
    py = str(where / "venv" / "bin" / "python")
    code = ("import importlib.util as u, importlib.metadata as m\n"
            "print([u.find_spec(n) is None for n in ('deepspeed', 'pydantic', 'wandb', 'datasets', 'hjson')])\n"
            "import torch, transformers, tokenizers, safetensors, pyarrow, yaml\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([py, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[True, True, True, True, True]", out.stderr[-2000:]


def _metrics(tmp_path: Path, rows: list[dict]) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_figures_of_a_short_run_without_gpu_metrics(tmp_path):
    """Three steps, an evaluation row and a save row (they have no tokens_per_s): the warm-up
    shrinks to keep the last step, and what was not logged reads n/a."""
    rows = [{"step": s, "loss": 5.0 - s, "tokens_per_s": 100.0 * s} for s in (1, 2, 3)]
    rows += [{"step": 3, "eval_loss": 4.0}, {"step": 3, "save_stall_s": 0.1}]
    line = gpu_figures.run_row(_metrics(tmp_path, rows), warmup=5)
    assert line == "| run | 3 (1 timed) | 300 | n/a | n/a | n/a | n/a | n/a | n/a | 4.000 -> 2.000 |"


def test_figures_with_gpu_metrics_and_the_estimate(tmp_path):
    rows = [{"step": s, "loss": 3.0, "tokens_per_s": t, "mfu": m, "mfu_full_attn": m + 0.02, "mem_gb": g}
            for s, t, m, g in ((1, 10.0, 0.1, 50.0), (2, 1000.0, 0.40, 61.5), (3, 1200.0, 0.44, 61.0),
                               (4, 1100.0, 0.42, 60.0))]
    run = _metrics(tmp_path, rows)
    est = tmp_path / "est.json"
    est.write_text(json.dumps({"worst": {"gpu_total": 63.2e9},
                               "predicted": {"tokens_per_s_per_gpu": 1375.0}}))
    line = gpu_figures.run_row(run, est, warmup=1)
    # the planner's prediction beside the measurement: 1,100 / 1,375 = 0.80
    assert line == ("| run | 4 (3 timed) | 1,100 | 42.0% | 44.0% | 61.5 | 63.2 | 1,375 | 0.80 "
                    "| 3.000 -> 3.000 |")


def test_figures_refuse_a_run_that_did_not_start(tmp_path):
    out = subprocess.run([sys.executable, "-m", "benchmarks.gpu.gpu_figures", str(tmp_path / "none")], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.startswith("error: gpu_figures.py: ") and out.stderr.count("\n") == 1


def test_nccl_check_at_world_size_one_reports_no_bus_bandwidth():
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                          "-m", "benchmarks.gpu.nccl_check", "--backend", "gloo", "--device", "cpu", "--mb", "4",
                          "--rounds", "2"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "world 1): values ok" in out.stdout and "bus bandwidth: n/a at world size 1" in out.stdout


def test_nccl_check_sweeps_sizes_with_bus_bandwidth():
    """Two gloo ranks on the CPU: every size from 32 KB to --mb (x4) timed, with a bus bandwidth
    (there is a link between two ranks) and no planner figure (not a GPU it knows)."""
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "-m", "benchmarks.gpu.nccl_check", "--backend", "gloo", "--device", "cpu", "--mb", "2",
                          "--rounds", "2", "--sweep"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and " MB |" in line]
    assert [r.split(" | ")[0] for r in rows] == ["| 0.0312 MB", "| 0.125 MB", "| 0.5 MB", "| 2 MB"], out.stdout
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[2]) >= 0 and float(cells[4]) >= 0 and cells[5] == "n/a", row
