"""Our LR schedules against closed-form values computed by hand in this file: the JSON params,
the "auto" values, the warmup and step convention and the floors, i.e. how we map onto the
library shapes (transformers' WSD and inverse sqrt), not the shapes' own math. DeepSpeed's
schedulers are DeepSpeed's to test; here only their "auto" values are.

Convention (ours): `lrs[s]` is the lr in force for update s + 1, i.e. after s scheduler steps.
"""

import math

import pytest
import torch

from training.optim.schedules import (OUR_SCHEDULERS, auto_warmup_steps, build_scheduler, lr_multiplier, resolve_auto, split_scheduler)

BASE_LR = 0.2


def _optimizer(lr=BASE_LR, cls=torch.optim.SGD):
    return cls([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def _our_lrs(sched_type, params, total):
    """The lr of each of `total` updates under one of our schedules."""
    opt = _optimizer()
    sched = build_scheduler({"type": sched_type, "params": params}, opt, total)
    lrs = []
    for _ in range(total):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


# ---------------------------------------------------------------------------------- ours


def test_warmup_step_decay():
    # W=10, warmup_min_ratio 0.1, x0.5 every 20 steps after the peak step P = 9.
    lrs = _our_lrs("WarmupStepDecayLR",
                   {"warmup_num_steps": 10, "warmup_min_ratio": 0.1, "step_size": 20, "gamma": 0.5}, 100)
    expected = {
        0: 0.1 + 0.9 * 1 / 10,  # first update already moves: (s + 1) / W
        4: 0.1 + 0.9 * 5 / 10,
        9: 1.0,                 # peak
        28: 1.0,                # d = 19
        29: 0.5,                # d = 20
        69: 0.125,              # d = 60
        99: 0.0625,             # d = 90
    }
    for s, ratio in expected.items():
        assert lrs[s] == pytest.approx(BASE_LR * ratio, rel=1e-12), s


def test_warmup_exponential_with_floor():
    lrs = _our_lrs("WarmupExponentialLR", {"warmup_num_steps": 4, "gamma": 0.9, "min_ratio": 0.05}, 60)
    assert lrs[0] == pytest.approx(BASE_LR * 0.25)
    assert lrs[3] == pytest.approx(BASE_LR)
    assert lrs[13] == pytest.approx(BASE_LR * 0.9**10)          # d = 13 - 3
    assert lrs[59] == pytest.approx(BASE_LR * max(0.05, 0.9**56))  # 0.9**56 = 0.0027 < floor


def test_warmup_inverse_sqrt():
    # timescale defaults to W, so after the peak ratio = sqrt(W / (s + 1)), the Transformer rule.
    lrs = _our_lrs("WarmupInverseSqrtLR", {"warmup_num_steps": 16}, 200)
    assert lrs[7] == pytest.approx(BASE_LR * 8 / 16)
    assert lrs[15] == pytest.approx(BASE_LR)
    assert lrs[63] == pytest.approx(BASE_LR * math.sqrt(16 / 64))  # = 0.5
    assert lrs[143] == pytest.approx(BASE_LR * math.sqrt(16 / 144))
    explicit = _our_lrs("WarmupInverseSqrtLR", {"warmup_num_steps": 0, "timescale": 4}, 20)
    assert explicit[0] == pytest.approx(BASE_LR)                  # no warmup: peak at step 0
    assert explicit[12] == pytest.approx(BASE_LR * math.sqrt(4 / 16))


def test_warmup_cosine_restarts():
    # W=5 (P=4), cycles of 10 then 20 steps (mult 2), second cycle peaks at 0.5, floor 0.1.
    lrs = _our_lrs("WarmupCosineRestartsLR",
                   {"warmup_num_steps": 5, "cycle_num_steps": 10, "cycle_mult": 2.0, "cycle_decay": 0.5,
                    "min_ratio": 0.1}, 60)
    cos = lambda top, t, n: 0.1 + (top - 0.1) * 0.5 * (1 + math.cos(math.pi * t / n))  # noqa: E731
    assert lrs[4] == pytest.approx(BASE_LR)                       # d = 0
    assert lrs[9] == pytest.approx(BASE_LR * cos(1.0, 5, 10))     # mid first cycle = 0.55
    assert lrs[13] == pytest.approx(BASE_LR * cos(1.0, 9, 10))
    assert lrs[14] == pytest.approx(BASE_LR * 0.5)                # restart: d = 10
    assert lrs[24] == pytest.approx(BASE_LR * cos(0.5, 10, 20))   # = 0.3
    assert lrs[34] == pytest.approx(BASE_LR * 0.25)               # third cycle, d = 30
    auto = _our_lrs("WarmupCosineRestartsLR", {"warmup_num_steps": 10}, 100)
    assert auto[9] == pytest.approx(BASE_LR)
    assert auto[99] == pytest.approx(BASE_LR * 0.5 * (1 + math.cos(math.pi * 90 / 91)))  # one cycle, no restart
    assert min(auto[10:]) == auto[99]


@pytest.mark.parametrize("decay_type, shape", [
    ("linear", lambda f: 1 - f),
    ("1-sqrt", lambda f: 1 - math.sqrt(f)),
])
def test_warmup_stable_decay(decay_type, shape):
    # T=100, W=10, decay over the last 20 steps (s = 80..99) to the floor 0.1 at s = 99.
    lrs = _our_lrs("WarmupStableDecayLR",
                   {"warmup_num_steps": 10, "decay_fraction": 0.2, "decay_type": decay_type, "min_ratio": 0.1}, 100)
    assert lrs[0] == pytest.approx(BASE_LR * 0.1)
    assert lrs[9] == lrs[50] == lrs[79] == pytest.approx(BASE_LR)
    for s in (80, 89, 95):
        frac = (s - 80 + 1) / 20
        assert lrs[s] == pytest.approx(BASE_LR * (0.1 + 0.9 * shape(frac))), s
    assert lrs[99] == pytest.approx(BASE_LR * 0.1)
    steps = _our_lrs("WarmupStableDecayLR", {"warmup_num_steps": 2, "decay_num_steps": 4, "decay_type": decay_type},
                     10)
    assert steps[5] == pytest.approx(BASE_LR) and steps[9] == pytest.approx(0.0)
    no_decay = _our_lrs("WarmupStableDecayLR", {"warmup_num_steps": 2, "decay_num_steps": 0}, 10)
    assert no_decay[9] == pytest.approx(BASE_LR)                  # stable through the last step


def test_auto_values_and_resolve():
    assert [auto_warmup_steps(n) for n in (1, 19, 40, 1000, 10**6)] == [1, 1, 2, 50, 100]
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "scheduler": {"type": "WarmupDecayLR",
                         "params": {"total_num_steps": "auto", "warmup_num_steps": "auto", "warmup_max_lr": "auto"}}}
    out = resolve_auto(cfg, 400)
    assert out["scheduler"]["params"] == {"total_num_steps": 400, "warmup_num_steps": 20, "warmup_max_lr": 1e-3}
    assert cfg["scheduler"]["params"]["total_num_steps"] == "auto"  # input untouched
    one = resolve_auto({"scheduler": {"type": "OneCycle", "params": {
        "cycle_min_lr": 0.0, "cycle_max_lr": 1.0, "cycle_first_step_size": "auto",
        "cycle_second_step_size": "auto"}}}, 9)["scheduler"]["params"]
    assert (one["cycle_first_step_size"], one["cycle_second_step_size"]) == (4, 5)
    ours = resolve_auto({"scheduler": {"type": "WarmupStableDecayLR", "params": {}}}, 200)["scheduler"]["params"]
    assert ours == {"total_num_steps": 200, "warmup_num_steps": 10, "warmup_min_ratio": 0.0, "decay_fraction": 0.2,
                    "decay_num_steps": 40, "decay_type": "1-sqrt", "min_ratio": 0.0}
    with pytest.raises(ValueError, match=r"scheduler\.params\.cos_min_ratio"):
        resolve_auto({"scheduler": {"type": "WarmupCosineLR", "params": {"cos_min_ratio": "auto"}}}, 10)
    # total_num_steps fixed in the JSON wins over the run length.
    fixed = lr_multiplier({"type": "WarmupStableDecayLR", "params": {"total_num_steps": 50, "warmup_num_steps": 0,
                                                                     "decay_num_steps": 10, "decay_type": "linear"}},
                          1000)
    assert fixed(49) == pytest.approx(0.0) and fixed(39) == pytest.approx(1.0)


def test_split_scheduler():
    ours = {"train_micro_batch_size_per_gpu": 1, "scheduler": {"type": "WarmupInverseSqrtLR", "params": {}}}
    rest, sched = split_scheduler(ours)
    assert "scheduler" not in rest and sched["type"] == "WarmupInverseSqrtLR"
    assert "scheduler" in ours  # input untouched
    theirs = {"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10}}}
    rest, sched = split_scheduler(theirs)
    assert sched is None and rest == theirs
    assert split_scheduler({}) == ({}, None)


@pytest.mark.parametrize("sched_type, params, field", [
    ("WarmupStepDecayLR", {"step_size": 10, "decay_rate": 0.5}, "scheduler.params.decay_rate"),
    ("WarmupStepDecayLR", {}, "scheduler.params.step_size"),
    ("WarmupExponentialLR", {"gamma": 1.5}, "scheduler.params.gamma"),
    ("WarmupInverseSqrtLR", {"warmup_num_steps": -1}, "scheduler.params.warmup_num_steps"),
    ("WarmupInverseSqrtLR", {"warmup_num_steps": True}, "scheduler.params.warmup_num_steps"),
    ("WarmupCosineRestartsLR", {"cycle_mult": 0.5}, "scheduler.params.cycle_mult"),
    ("WarmupStableDecayLR", {"decay_type": "step"}, "scheduler.params.decay_type"),
    ("WarmupStableDecayLR", {"warmup_num_steps": 90, "decay_num_steps": 20}, "scheduler.params.decay_num_steps"),
    ("WarmupStableDecayLR", {"warmup_num_steps": 200}, "scheduler.params.warmup_num_steps"),
])
def test_bad_params_name_the_field(sched_type, params, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")) as info:
        build_scheduler({"type": sched_type, "params": params}, _optimizer(), 100)
    assert "\n" not in str(info.value)


def test_unknown_type_and_resume():
    with pytest.raises(ValueError, match=r"scheduler\.type"):
        build_scheduler({"type": "WarmupCosineLR"}, _optimizer(), 10)
    cfg = {"type": "WarmupCosineRestartsLR", "params": {"warmup_num_steps": 3, "cycle_num_steps": 7}}
    opt = _optimizer()
    sched = build_scheduler(cfg, opt, 50)
    for _ in range(12):
        opt.step()
        sched.step()
    state = sched.state_dict()
    opt2 = _optimizer()
    sched2 = build_scheduler(cfg, opt2, 50)
    sched2.load_state_dict(state)
    opt2.step()
    sched2.step()
    opt.step()
    sched.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])
    assert set(OUR_SCHEDULERS) == {"WarmupStepDecayLR", "WarmupExponentialLR", "WarmupInverseSqrtLR",
                                   "WarmupCosineRestartsLR", "WarmupStableDecayLR"}
