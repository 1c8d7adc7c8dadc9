"""The gradient noise scale (``training/step/noise_scale.py``): the estimators on synthetic gradients
with a known answer, and in real runs (tiny dense, 2 data-parallel ranks) the micro-batch norm
the trainer measured against an independent autograd replay of that micro-batch, and the keys
absent where the layout does not allow an exact measurement."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.runs import SMALL, ds_variant, rows
from training.step import noise_scale

REPO = Path(__file__).resolve().parents[3]
KEYS = ("gns_grad_sq", "gns_trace", "gradient_noise_scale")
MICRO, SEQ = 2, 64                  # SMALL's data.seq_len
DENSE = ["--recipe", "recipes/tiny_dense.yaml"]
SMALL_DENSE = [k for k in SMALL if not k.startswith("model.moe.")] + ["eval.every=0"]


def _synthetic(trials: int, b_small: int, b_big: int, dim: int = 64, seed: int = 0):
    """Per-sample gradients ``G + noise`` (noise ~ N(0, diag(var))) averaged over a small batch
    that is the first part of a big one, as the first micro-batch is part of the step."""
    gen = torch.Generator().manual_seed(seed)
    true_g = torch.randn(dim, generator=gen, dtype=torch.float64)
    true_g *= 0.5 / true_g.norm()                                       # |G|^2 = 0.25
    var = torch.rand(dim, generator=gen, dtype=torch.float64)
    var *= 25.0 / var.sum()                                             # tr(Sigma) = 25
    samples = true_g + var.sqrt() * torch.randn(trials, b_big, dim, generator=gen, dtype=torch.float64)
    small_sq = samples[:, :b_small].mean(1).pow(2).sum(-1)
    big_sq = samples.mean(1).pow(2).sum(-1)
    return small_sq.tolist(), big_sq.tolist()


def test_estimators_recover_the_gradient_and_the_noise_on_synthetic_gradients():
    """Known |G|^2 = 0.25 and tr(Sigma) = 25 (B_simple = 100): over 4000 steps the means of the
    two per-step estimates are within 5 % (their standard errors are about 1.5 % and 0.5 %), and
    the EMA ratio the trainer logs lands within 25 % of 100 (EMA over about 20 steps, noisy)."""
    b_small, b_big = 8, 64
    small, big = _synthetic(4000, b_small, b_big)
    pairs = [noise_scale.estimates(s, b_small, b, b_big) for s, b in zip(small, big)]
    grad_sq = sum(p[0] for p in pairs) / len(pairs)
    trace = sum(p[1] for p in pairs) / len(pairs)
    assert grad_sq == pytest.approx(0.25, rel=0.05)
    assert trace == pytest.approx(25.0, rel=0.05)
    # The data follow the model E|G_B|^2 = |G|^2 + tr(Sigma) / B: the small batch's squared norm
    # is mostly noise (3.375, of which 0.25 is signal).
    assert sum(small) / len(small) == pytest.approx(0.25 + 25 / b_small, rel=0.05)

    gns = noise_scale.NoiseScale(b_small, b_big, gas=8, dp_size=2)
    ratios = [gns.row(2 * s, b ** 0.5, applied=True)["gradient_noise_scale"] for s, b in zip(small, big)]
    late = ratios[len(ratios) // 2:]
    assert sum(late) / len(late) == pytest.approx(100.0, rel=0.25)
    # A skipped step or a non-finite norm leaves the EMAs alone and logs nothing.
    state = gns.state_dict()
    assert gns.row(1.0, None, applied=True) == {} and gns.row(1.0, 1.0, applied=False) == {}
    assert gns.row(float("nan"), 1.0, applied=True) == {} and gns.state_dict() == state
    # A resumed run (the state rides in the checkpoint's monitor state) continues the EMAs.
    resumed = noise_scale.NoiseScale(b_small, b_big, gas=8, dp_size=2)
    resumed.load_state_dict(state)
    assert resumed.row(2 * small[0], big[0] ** 0.5, True) == gns.row(2 * small[0], big[0] ** 0.5, True)


def _groups(tp=1, ep=1, pp=1, cp=1):
    return SimpleNamespace(tp=tp, ep=ep, pp=pp, cp=cp)


def test_only_layouts_where_grad_holds_the_micro_batch_gradient():
    fp32 = {"gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1}}
    assert noise_scale.unavailable_reason(fp32, _groups()) is None
    assert noise_scale.unavailable_reason({**fp32, "zero_optimization": {"stage": 0}}, _groups()) is None
    bf16 = {**fp32, "bf16": {"enabled": True}}             # bf16 gradients accumulate in .grad
    assert noise_scale.unavailable_reason(bf16, _groups()) is None
    assert noise_scale.unavailable_reason({**bf16, "data_types": {"grad_accum_dtype": "bf16"}}, _groups()) is None
    refused = [({**fp32, "zero_optimization": {"stage": 2}}, _groups()),
               ({**fp32, "zero_optimization": {"stage": 1, "overlap_comm": True}}, _groups()),
               ({**bf16, "data_types": {"grad_accum_dtype": "fp32"}}, _groups()),
               ({**fp32, "fp16": {"enabled": True}}, _groups()),
               ({**fp32, "gradient_accumulation_steps": 1}, _groups()),
               (fp32, _groups(tp=2)), (fp32, _groups(ep=2)), (fp32, _groups(pp=2)), (fp32, _groups(cp=2))]
    for ds, groups in refused:
        assert noise_scale.unavailable_reason(ds, groups), (ds, groups)
    for compression in ("bf16", "powersgd"):     # grad_norm is the compressed exchange's
        assert "grad_compression" in noise_scale.unavailable_reason(fp32, _groups(), compression)


@pytest.mark.parametrize("config", ["zero1_fp32", "zero0_fp32", "zero1"])
def test_trainer_measures_the_first_micro_batch_gradient(warm_launcher, tmp_path, config):
    """The per-rank |G_small|^2 the trainer took from ``.grad`` after the first backward
    (averaged over the two ranks in the statistics all-reduce) equals a plain autograd replay
    of each rank's first micro-batch on the same weights, within 1e-5 relative. ``zero1`` is
    bf16 (weights and the accumulated ``.grad`` in bf16): the replay's loss (ce / tokens) and the
    trainer's (ce x dp / step tokens) differ by a power of two here (2 micro-batches, 2 ranks),
    so their bf16 backwards round alike (measured 3.6e-15)."""
    ds = ds_variant(tmp_path, config, train_micro_batch_size_per_gpu=MICRO, gradient_accumulation_steps=2)
    out = tmp_path / "replay"
    _launch(warm_launcher, tmp_path / "run", ds, steps=3, script="tests/training/step/_noise_scale_run.py",
            GNS_REPLAY=str(out))
    replay = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(2)]
    assert all(r["tokens"] == r["nominal"] == MICRO * SEQ for r in replay)    # B_small in tokens
    metrics = rows(tmp_path / "run")
    assert all(key in row for row in metrics for key in KEYS), metrics
    first = metrics[0]
    b_small, b_big = MICRO * SEQ, MICRO * SEQ * 2 * 2
    measured = first["grad_norm"] ** 2 + first["gns_trace"] * (1 / b_small - 1 / b_big)
    expected = sum(r["small_sq"] for r in replay) / 2
    assert measured == pytest.approx(expected, rel=1e-5)
    # The two ranks saw different tokens: the mean is not one rank's value.
    assert abs(replay[0]["small_sq"] - replay[1]["small_sq"]) > 1e-3 * expected
    # |G|^2 from the same numbers, and the ratio of the first step's EMAs is the step's ratio.
    assert first["gns_grad_sq"] == pytest.approx(
        (b_big * first["grad_norm"] ** 2 - b_small * expected) / (b_big - b_small), rel=1e-4)
    assert first["gradient_noise_scale"] == pytest.approx(first["gns_trace"] / first["gns_grad_sq"])


def _launch(warm, run_dir: Path, ds: str, steps: int, script: str = "launch/train.py", **extra_env) -> None:
    """tiny dense (SMALL's sizes) on 2 data-parallel ranks, as torchrun starts them."""
    warm.script(script, ["--config", ds, *DENSE, "--run-dir", str(run_dir), "--steps", str(steps),
                         "--set", *SMALL_DENSE], run_dir.parent / f"{run_dir.name}.log", extra_env=extra_env)


def test_keys_absent_at_zero2_and_without_accumulation(warm_launcher, tmp_path):
    for name, config in (("zero2", ds_variant(tmp_path, "zero2_fp32", train_micro_batch_size_per_gpu=MICRO,
                                              gradient_accumulation_steps=2)),
                         ("acc1", ds_variant(tmp_path, "zero1_fp32", train_micro_batch_size_per_gpu=MICRO,
                                             gradient_accumulation_steps=1))):
        run = tmp_path / name
        _launch(warm_launcher, run, config, steps=2)
        metrics = rows(run)
        assert metrics and all("grad_norm" in row and not set(KEYS) & set(row) for row in metrics), metrics


def test_keys_absent_under_grad_compression(warm_launcher, tmp_path):
    """``parallel.grad_compression`` bf16 or powersgd (fp32 ZeRO-0, accumulation 2, 2 ranks, the
    default ``train.noise_scale: true``): no ``gns_*`` or ``gradient_noise_scale`` in any row,
    as the plain run beside them has in every row. ``grad_norm`` there is the norm of the
    compressed exchange's result (PowerSGD's: a rank-r approximation plus the fed-back error),
    not the step's mean gradient's: the estimates would be biased."""
    ds = ds_variant(tmp_path, "zero0_fp32", train_micro_batch_size_per_gpu=MICRO, gradient_accumulation_steps=2)
    runs = {"plain": [], "bf16": ["parallel.grad_compression=bf16"],
            "powersgd": ["parallel.grad_compression=powersgd", "parallel.powersgd_start_steps=1"]}
    warm_launcher.launch_many([(tmp_path / name, ds, ["eval.every=0", *extra]) for name, extra in runs.items()],
                              steps=2)
    for name in runs:
        metrics = rows(tmp_path / name)
        assert len(metrics) == 2 and all("grad_norm" in row for row in metrics), (name, metrics)
        present = [set(KEYS) <= set(row) for row in metrics]
        assert all(present) if name == "plain" else not any(set(KEYS) & set(row) for row in metrics), (name, metrics)
