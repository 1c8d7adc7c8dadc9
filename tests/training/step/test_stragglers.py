"""The straggler metrics name the rank that is slow in its own work of a step.

``_straggler_run.py`` runs the trainer on 2 gloo ranks (ZeRO-1 in bf16, micro-batch 2, data
parallel only, ``train.log_every`` 2) with one rank sleeping 0.3 s in the first forward of every
step: inside the span a rank's busy time measures, before the step's statistics all-reduce
(``training/step/stats.py``, "Stragglers"). The sleep is put on each rank in turn, so a metric
that named a fixed rank, measured the wall time (the same on both ranks) or counted the fast
rank's wait in the all-reduce as busy fails one of the checks.
"""

from __future__ import annotations

import pytest
import torch

from tests.runs import ds_variant, rows
from training.step.stats import BusyTime, busy_row, straggler_metrics

SLEEP_S = 0.3
LOG_EVERY = 2
STEPS = 6
SCRIPT = "tests/training/step/_straggler_run.py"


@pytest.mark.parametrize("slow_rank", [1, 0])
def test_the_rank_that_stalls_in_its_step_is_the_slowest(warm_launcher, tmp_path, slow_rank):
    run_dir = tmp_path / "run"
    config = ds_variant(tmp_path, "zero1", train_micro_batch_size_per_gpu=2)   # a short forward
    warm_launcher.launch(run_dir, config, nproc=2, steps=STEPS, script=SCRIPT,
           extra=[f"train.log_every={LOG_EVERY}", "eval.every=0"],
           extra_env={"STRAGGLER_RANK": str(slow_rank), "STRAGGLER_SLEEP_S": str(SLEEP_S)})
    metrics = rows(run_dir)
    assert [r["step"] for r in metrics] == list(range(1, STEPS + 1))
    for row in metrics:
        fields = {k: row[k] for k in ("step_busy_s_max", "step_busy_s_median", "slowest_rank") if k in row}
        if row["step"] % LOG_EVERY:
            assert not fields, row           # logged on log steps only
            continue
        assert fields["slowest_rank"] == slow_rank, row
        # Every step of the slow rank's window holds the whole sleep (time.sleep waits at least
        # that long), so its mean cannot be less, however loaded the machine.
        assert fields["step_busy_s_max"] >= SLEEP_S, row
        # With 2 ranks the median is the mean of the two, so this gap is half their difference:
        # it holds while the fast rank's own work is less than 0.1 s longer than the slow rank's
        # (tens of milliseconds here, and nothing in it waits for the other rank), and
        # fails if the fast rank's wait in the all-reduce (~0.3 s) counted as busy.
        assert fields["step_busy_s_max"] - fields["step_busy_s_median"] >= SLEEP_S / 3, row


def test_one_hot_rows_summed_over_the_job_give_every_rank_its_busy_seconds():
    busy = [0.05, 0.42, 0.07, 0.06]
    shares = [busy_row(seconds, rank, len(busy)) for rank, seconds in enumerate(busy)]
    for rank, row in enumerate(shares):
        assert [i for i, v in enumerate(row) if v] == [rank]
    summed = [sum(column) for column in zip(*shares)]      # what ``comm.job_sum`` computes
    assert summed == busy
    metrics = straggler_metrics(summed)
    assert metrics["slowest_rank"] == 1 and metrics["step_busy_s_max"] == 0.42
    assert metrics["step_busy_s_median"] == pytest.approx((0.06 + 0.07) / 2)
    assert straggler_metrics([0.3, 0.1, 0.2])["step_busy_s_median"] == 0.2     # odd count: the middle
    assert straggler_metrics([0.25]) == {"step_busy_s_max": 0.25, "step_busy_s_median": 0.25,
                                        "slowest_rank": 0}       # one rank: trivially rank 0


def test_busy_time_on_cpu_averages_the_steps_since_the_last_mean(monkeypatch):
    clock = iter([10.0, 10.5, 20.0, 20.1, 30.0, 30.9])      # (start, arrival) of 3 steps
    monkeypatch.setattr("training.step.stats.time.perf_counter", lambda: next(clock))
    busy = BusyTime(torch.device("cpu"))
    assert busy.take_mean() is None                         # no step yet
    for _ in range(2):
        busy.start()
        busy.arrive()
        busy.synced()
    assert busy.take_mean() == pytest.approx((0.5 + 0.1) / 2)
    busy.start()
    busy.arrive()
    assert busy.take_mean() == pytest.approx(0.9)           # a new window: the third step only


def test_busy_time_on_a_gpu_counts_a_step_once_its_events_are_read(monkeypatch):
    """On a GPU a step's busy time is read after the step's host copy, so the mean a log step
    sends holds the steps before it; the log step itself opens the next window."""
    times = iter([0.0, 0.5, 1.0, 1.2])                    # (start, arrival) of 2 steps, seconds

    class Event:                                          # torch.cuda.Event, on a fake clock
        def __init__(self, enable_timing: bool):
            assert enable_timing

        def record(self):
            self.t = next(times)

        def elapsed_time(self, end) -> float:
            return (end.t - self.t) * 1000.0              # milliseconds, as CUDA reports

    monkeypatch.setattr(torch.cuda, "Event", Event)
    busy = BusyTime(torch.device("cuda"))
    busy.start()
    busy.arrive()
    assert busy.take_mean() is None                       # step 1, a log step: nothing read yet
    busy.synced()
    busy.start()
    busy.arrive()
    assert busy.take_mean() == pytest.approx(0.5)         # step 2, a log step: step 1 alone
    busy.synced()
    assert busy.take_mean() == pytest.approx(0.2)         # then step 2
