"""Every ds_configs/*.json loads, validates and is accepted by DeepSpeed; each config error is caught.

`DeepSpeedConfig(dict, mpu)` is the cheapest full check DeepSpeed offers: it parses every section
(pydantic models refuse unknown ZeRO keys) and asserts the batch arithmetic, with no process
group. Its world size comes from `mpu.get_data_parallel_world_size()` only after
`deepspeed.comm.get_rank()` succeeds, so the test patches that one call and passes a fake mpu to
check the batch math at a data-parallel size of 2 as well.
"""

import copy
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from training.run.spawn import free_port
from training.config import ds_checks as dsk
from training.config import ds_config as dsc
from training.optim.optimizers import apply_lr_scaling, maybe_build_client_optimizer
from training.optim.schedules import (DEEPSPEED_SCHEDULERS, OUR_SCHEDULERS, build_scheduler, resolve_auto, split_scheduler)

REPO = Path(__file__).resolve().parents[3]
CONFIGS = sorted((REPO / "ds_configs").glob("*.json"))
ZERO = [f"zero{s}" for s in range(4)]


class _FakeMpu:
    """The one mpu method DeepSpeedConfig reads."""

    def __init__(self, dp_size):
        self.dp_size = dp_size

    def get_data_parallel_world_size(self):
        return self.dp_size


def _prepare(path, dp_size, total_steps=200):
    """The trainer's path from a file to the dict handed to deepspeed.initialize."""
    cfg = dsk.validate_ds_config(dsc.load_ds_config(str(path)), dp_size)
    cfg = resolve_auto(apply_lr_scaling(cfg), total_steps)
    return split_scheduler(cfg)


def test_expected_files_exist():
    names = {p.stem for p in CONFIGS}
    expected = set(ZERO) | {f"{z}_fp32" for z in ZERO} | {"zero3_offload", "fp16", "zero0_lamb", "zero2_wsd"}
    assert expected <= names


@pytest.mark.parametrize("dp_size", [1, 2])
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_accepted_by_deepspeed(path, dp_size, monkeypatch):
    import deepspeed.comm
    from deepspeed.runtime import lr_schedules
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg, ours = _prepare(path, dp_size)
    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda group=None: 0)
    ds = DeepSpeedConfig(copy.deepcopy(cfg), mpu=_FakeMpu(dp_size))
    raw = json.loads(path.read_text())
    micro, acc = raw["train_micro_batch_size_per_gpu"], raw["gradient_accumulation_steps"]
    assert ds.world_size == dp_size
    assert ds.train_batch_size == cfg["train_batch_size"] == micro * acc * dp_size
    assert ds.zero_optimization_stage == raw["zero_optimization"]["stage"]
    assert ds.gradient_clipping == 1.0

    # The scheduler, with "auto" resolved, constructs: DeepSpeed's from the JSON, ours by us.
    params = [torch.nn.Parameter(torch.zeros(2))]
    optimizer = torch.optim.AdamW(params, lr=cfg.get("optimizer", {}).get("params", {}).get("lr", 1e-3))
    if ours is not None:
        assert ours["type"] in OUR_SCHEDULERS and ds.scheduler_name is None
        scheduler = build_scheduler(ours, optimizer, 200)
        optimizer.step()
        scheduler.step()
    else:
        assert ds.scheduler_name in DEEPSPEED_SCHEDULERS
        assert "auto" not in ds.scheduler_params.values()
        getattr(lr_schedules, ds.scheduler_name)(optimizer, **ds.scheduler_params).step()
    opt, _ = maybe_build_client_optimizer(cfg, [{"params": params, "name": "decay"}], "cpu")
    assert (opt is not None) == (raw["optimizer"]["type"] == "Lamb")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_conventions(path):
    cfg = json.loads(path.read_text())
    assert "train_batch_size" not in cfg  # derived by the trainer
    assert cfg["gradient_clipping"] == 1.0
    assert cfg["steps_per_print"] >= 1000 and cfg["wall_clock_breakdown"] is False
    sched = cfg["scheduler"]["params"]
    assert sched.get("warmup_num_steps") == "auto"
    assert sched.get("total_num_steps", "auto") == "auto"
    opt = cfg["optimizer"]
    if opt["type"] == "AdamW":
        # The zero{0..3} files are sized for the tiny CPU recipes (lr 6e-4); the rest use 3e-4.
        lr = 6e-4 if path.stem.removesuffix("_fp32") in ZERO else 3e-4
        assert opt["params"] == {"lr": lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                                 "torch_adam": True}
    name = path.stem
    if name in ZERO:
        assert cfg["bf16"]["enabled"] is True
    if name.endswith("_fp32"):
        twin = json.loads((path.parent / f"{name[:-5]}.json").read_text())
        twin["bf16"]["enabled"] = False
        assert cfg == twin  # the parity variants differ from their bf16 twin in precision only


def test_special_files():
    load = lambda name: json.loads((REPO / "ds_configs" / f"{name}.json").read_text())  # noqa: E731
    quick = load("zero3")
    assert quick["zero_optimization"]["stage"] == 3
    assert quick["train_micro_batch_size_per_gpu"] <= 8 and quick["gradient_accumulation_steps"] == 1
    assert quick["scheduler"]["type"] == "WarmupCosineLR"
    offload = load("zero3_offload")["zero_optimization"]
    assert offload["offload_optimizer"]["device"] == offload["offload_param"]["device"] == "cpu"
    fp16 = load("fp16")
    assert fp16["fp16"]["enabled"] and fp16["fp16"]["loss_scale"] == 0 and not fp16["bf16"]["enabled"]
    assert {"initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"} <= set(fp16["fp16"])
    assert any(json.loads(p.read_text())["scheduler"]["type"] in OUR_SCHEDULERS for p in CONFIGS)


def test_copied_lists_match_deepspeed():
    from deepspeed.runtime import config as ds_config_module
    from deepspeed.runtime import lr_schedules

    assert tuple(ds_config_module.DEEPSPEED_OPTIMIZERS) == dsk.DEEPSPEED_OPTIMIZERS
    assert set(ds_config_module._REMOVED_TOP_LEVEL_CONFIG_KEYS) == set(dsk.REMOVED_TOP_LEVEL_KEYS)
    assert set(ds_config_module._REMOVED_ZERO_CONFIG_KEYS) == set(dsk.REMOVED_ZERO_KEYS)
    assert tuple(lr_schedules.VALID_LR_SCHEDULES) == DEEPSPEED_SCHEDULERS
    for name, params in dsk.DEEPSPEED_SCHEDULER_PARAMS.items():
        signature = inspect.signature(getattr(lr_schedules, name)).parameters
        assert set(signature) - {"optimizer", "last_batch_iteration"} == set(params), name


def _base():
    return json.loads((REPO / "ds_configs" / "zero2.json").read_text())


def _set(path, value):
    def mutate(cfg):
        *parents, leaf = path.split(".")
        node = cfg
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return mutate


def _drop(path):
    def mutate(cfg):
        *parents, leaf = path.split(".")
        node = cfg
        for key in parents:
            node = node[key]
        del node[leaf]
    return mutate


BAD = [
    ("train_batch_size", _set("train_batch_size", 12), r"ds_config\.train_batch_size: 12 != .* 8 .* 1 .* 2 = 16"),
    ("lr_negative", _set("optimizer.params.lr", -0.001),
     r"^ds_config\.optimizer\.params\.lr: -0\.001 must be > 0 \(set a positive learning rate\)$"),
    ("lr_zero", _set("optimizer.params.lr", 0), r"optimizer\.params\.lr: 0 must be > 0"),
    ("accumulation", _set("gradient_accumulation_steps", 0), r"gradient_accumulation_steps: 0 must be"),
    ("micro_missing", _drop("train_micro_batch_size_per_gpu"), r"train_micro_batch_size_per_gpu: None is missing"),
    ("clipping", _set("gradient_clipping", -1.0), r"gradient_clipping: -1\.0 must be >= 0"),
    ("fp16_and_bf16", _set("fp16", {"enabled": True}), r"fp16\.enabled: True and bf16\.enabled are both true"),
    ("loss_scale_window", lambda c: (c.update(fp16={"enabled": True, "loss_scale_window": 0}),
                                     c.update(bf16={"enabled": False})), r"fp16\.loss_scale_window: 0"),
    ("removed_top", _set("elasticity", {"enabled": True}), r"ds_config\.elasticity: .* removed"),
    ("removed_amp", _set("amp", {"enabled": True}), r"ds_config\.amp: .* removed"),
    ("removed_zero", _set("zero_optimization.mics_shard_size", 8), r"zero_optimization\.mics_shard_size: 8 .*removed"),
    ("removed_optimizer", _set("optimizer.type", "OneBitAdam"), r"optimizer\.type: 'OneBitAdam' was removed"),
    ("unknown_optimizer", _set("optimizer.type", "AdamX"), r"optimizer\.type: 'AdamX' is not"),
    ("max_grad_norm", _set("optimizer.params.max_grad_norm", 1.0), r"optimizer\.params\.max_grad_norm"),
    ("betas", _set("optimizer.params.betas", [0.9]), r"optimizer\.params\.betas"),
    ("unknown_scheduler", _set("scheduler.type", "CosineWithWarmup"), r"scheduler\.type: 'CosineWithWarmup'"),
    ("scheduler_param", _set("scheduler.params.warmup_max_lr", 1e-3),
     r"scheduler\.params\.warmup_max_lr: 0\.001 is not a parameter of WarmupCosineLR"),
    ("warmup_type", _set("scheduler.params.warmup_type", "cosine"), r"scheduler\.params\.warmup_type: 'cosine'"),
    ("total_steps", _set("scheduler.params.total_num_steps", 0), r"scheduler\.params\.total_num_steps: 0"),
    ("our_scheduler_param", _set("scheduler", {"type": "WarmupStableDecayLR", "params": {"decay": 0.1}}),
     r"scheduler\.params\.decay: 0\.1 is not a parameter of WarmupStableDecayLR"),
    ("torch_scheduler_param", _set("scheduler", {"type": "StepLR", "params": {"step": 3}}),
     r"scheduler\.params\.step: 3 is not a parameter of StepLR"),
    ("zero_stage", _set("zero_optimization.stage", 4), r"zero_optimization\.stage: 4 must be"),
    ("offload_param", _set("zero_optimization.offload_param", {"device": "cpu"}),
     r"zero_optimization\.offload_param\.device: 'cpu' needs ZeRO stage >= 3, got 2"),
    ("lamb_zero2", _set("optimizer", {"type": "Lamb", "params": {"lr": 1e-3}}),
     r"optimizer\.type: 'Lamb' under ZeRO stage 2 .*trust ratio"),
    ("lr_scaling", _set("lr_scaling", {"rule": "cube", "base_batch_size": 8}), r"lr_scaling\.rule: 'cube'"),
]


@pytest.mark.parametrize("mutate, pattern", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_validation_errors(mutate, pattern):
    cfg = _base()
    mutate(cfg)
    with pytest.raises(ValueError, match=pattern) as info:
        dsk.validate_ds_config(cfg, 2)
    assert "\n" not in str(info.value) and "(" in str(info.value)  # one line, with a fix


def test_validation_accepts_and_derives():
    cfg = _base()
    cfg["train_batch_size"] = 16
    assert dsk.validate_ds_config(cfg, 2)["train_batch_size"] == 16
    only_total = {"train_batch_size": 32, "gradient_accumulation_steps": 2}
    assert dsk.validate_ds_config(only_total, 4)["train_micro_batch_size_per_gpu"] == 4
    no_accumulation = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}
    assert dsk.validate_ds_config(no_accumulation, 2)["gradient_accumulation_steps"] == 4
    opted_in = _base()
    opted_in.update(optimizer={"type": "Lamb", "params": {"lr": 1e-3}}, zero_allow_untested_optimizer=True)
    dsk.validate_ds_config(opted_in, 1)
    torch_sched = _base()
    torch_sched["scheduler"] = {"type": "StepLR", "params": {"step_size": 10, "gamma": 0.5}}
    dsk.validate_ds_config(torch_sched, 1)
    with pytest.raises(ValueError, match="dp_size"):
        dsk.validate_ds_config(_base(), 0)


def test_load_errors(tmp_path):
    with pytest.raises(ValueError, match=r"missing\.json: file not found"):
        dsc.load_ds_config(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "train_micro_batch_size_per_gpu": 4,\n  "gradient_clipping": 1.0,\n}\n')
    with pytest.raises(ValueError, match=r"bad\.json: invalid JSON at line 4 column 1") as info:
        dsc.load_ds_config(str(bad))
    assert "\n" not in str(info.value)
    dup = tmp_path / "dup.json"
    dup.write_text('{"gradient_clipping": 1.0, "gradient_clipping": 0.5}')
    with pytest.raises(ValueError, match=r"duplicate key 'gradient_clipping'"):
        dsc.load_ds_config(str(dup))
    arr = tmp_path / "arr.json"
    arr.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not an object"):
        dsc.load_ds_config(str(arr))


_ENGINE_SCRIPT = r"""
import json, sys, torch, deepspeed
sys.path.insert(0, sys.argv[1])
from training.config.ds_checks import validate_ds_config
from training.config.ds_config import load_ds_config
from training.optim.optimizers import apply_lr_scaling, maybe_build_client_optimizer, param_groups
from training.optim.schedules import build_scheduler, resolve_auto, split_scheduler
cfg = load_ds_config(f"{sys.argv[1]}/ds_configs/zero0_lamb.json")
cfg["scheduler"] = load_ds_config(f"{sys.argv[1]}/ds_configs/zero2_wsd.json")["scheduler"]
cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"] = 2, 1
cfg["lr_scaling"]["base_batch_size"] = 8  # sqrt(2 / 8): lr 2e-3 -> 1e-3
cfg, ours = split_scheduler(resolve_auto(apply_lr_scaling(validate_ds_config(cfg, 1)), 4))
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
groups = param_groups(model, 0.01)
opt, cfg = maybe_build_client_optimizer(cfg, groups, "cpu")
engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, optimizer=opt, config=cfg,
                                  lr_scheduler=lambda o: build_scheduler(ours, o, 4))
before = model[0].weight.detach().float().clone()
lrs = []
for _ in range(4):
    lrs.append(engine.get_lr()[0])
    loss = engine(torch.randn(2, 8, dtype=torch.bfloat16)).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
moved = (model[0].weight.detach().float() - before).abs().max().item() > 0
print("RESULT", json.dumps([type(engine.basic_optimizer).__name__, type(engine.lr_scheduler).__name__, lrs, moved]))
torch.distributed.destroy_process_group()
"""


def test_deepspeed_initialize_with_client_lamb_and_our_scheduler():
    """deepspeed.initialize takes our CPU Lamb (zero0_lamb.json) and our WSD scheduler (zero2_wsd.json)."""
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), DS_ACCELERATOR="cpu")
    # The first DeepSpeed launch on a machine JIT-builds its CPU shared-memory comm op (~40 s).
    result = subprocess.run([sys.executable, "-c", _ENGINE_SCRIPT, str(REPO)], env=env, capture_output=True,
                            text=True, timeout=600)
    lines = [line[len("RESULT "):] for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stdout[-2000:] + result.stderr[-4000:]
    optimizer, scheduler, lrs, moved = json.loads(lines[0])
    assert (optimizer, scheduler, moved) == ("Lamb", "LambdaLR", True)
    # 4 steps, auto warmup 1, decay over round(0.2 * 4) = 1 step (1-sqrt to 0): peak lr 1e-3 until the last.
    assert lrs == pytest.approx([1e-3, 1e-3, 1e-3, 0.0])


def test_fp16_json_builds_the_dynamic_loss_scaler_the_docs_describe(monkeypatch):
    """fp16 cannot train on a CPU, but its loss scaler is plain Python: ``fp16.json`` parsed by
    DeepSpeed and handed to ``CreateLossScaler`` as the engine does gives a dynamic scaler that
    starts at 2^16, spends the hysteresis (2) on the first overflow, halves on the second, never
    goes below ``min_loss_scale`` and doubles after ``loss_scale_window`` clean steps. (Finding the
    overflow is the ZeRO optimizer's own inf/NaN check, GPU-tested in ``tests/test_gpu.py``.)"""
    import deepspeed.comm
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler, DynamicLossScaler

    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda group=None: 0)
    cfg, _ = _prepare(REPO / "ds_configs" / "fp16.json", 1)
    fp16 = DeepSpeedConfig(copy.deepcopy(cfg), mpu=_FakeMpu(1)).float16_config
    assert fp16.enabled and fp16.loss_scale == 0                # 0: dynamic
    scaler = CreateLossScaler(torch.half, fp16.loss_scale, True, fp16.dynamic_loss_scale_args())
    assert isinstance(scaler, DynamicLossScaler)
    window = json.loads((REPO / "ds_configs" / "fp16.json").read_text())["fp16"]["loss_scale_window"]
    assert scaler.cur_scale == 2.0 ** 16 and scaler.scale_window == window
    scales = []
    for overflow in (False, False, True, True, False):
        scaler.update_scale(overflow)
        scales.append(scaler.cur_scale)
    assert scales == [2.0 ** 16, 2.0 ** 16, 2.0 ** 16, 2.0 ** 15, 2.0 ** 15]
    for _ in range(window):
        scaler.update_scale(False)
    assert scaler.cur_scale == 2.0 ** 16                         # doubled after the window
    floor = CreateLossScaler(torch.half, 0, True, {**fp16.dynamic_loss_scale_args(), "init_scale": 2.0})
    floor.raise_error_at_min_scale = False
    for _ in range(6):
        floor.update_scale(True)
    assert floor.cur_scale == fp16.dynamic_loss_scale_args()["min_scale"] == 1
