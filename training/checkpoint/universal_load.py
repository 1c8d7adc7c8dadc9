"""Loading a universal checkpoint (``launch/to_universal.py``) into an engine of any layout and stage.

Each rank reads, for every parameter it holds, the full tensors of the conversion (``zero/<name>/
fp32.pt`` and the optimizer state beside it), cuts its shard with the parameter's ``shard_spec``
(``model/parallel/draw.py``'s ``take_shard``) and puts it where the engine's optimizer keeps it:

- ZeRO-1/2 and DeepSpeed's bf16 optimizer: this rank's fragment of the fp32 master and of each
  Adam moment, through DeepSpeed's ``safe_set_full_fp32_param`` / ``safe_set_full_optimizer_state``
  (a parameter's fragment may be empty here); the module weight itself, which every rank holds whole;
- ZeRO-3: the same two calls cut the rank's partition; the partitioned module weights are then
  refreshed from the fp32 partitions, and the persistent ones gathered again;
- ZeRO-0: the torch optimizer's own state per parameter (bf16: its fp32 copies), written
  directly, since DeepSpeed has no optimizer of its own there.

Then the Adam ``step`` (one tensor per flat group or parameter, never shared), each optimizer
group's settings by the group's name (``decay``, ``no_decay``, ``...-muon``), the persistent
buffers (``buffers/``), DeepSpeed's counters and LR scheduler, and the trainer's ``client_state``
(``mp_rank_00_model_states.pt``). Why DeepSpeed's own universal loaders are not used:
docs/checkpoints.md ("How layout changes work"). A conversion whose manifest does not verify is
refused in one line before anything is loaded.
"""

from __future__ import annotations

from pathlib import Path

import torch

from model.parallel.draw import canonical_name, take_shard
from training.checkpoint import manifest, safe_load

# DeepSpeed's keys of the carried model-states file; the rest is the trainer's client_state.
_DEEPSPEED_KEYS = ("lr_scheduler", "global_steps", "global_samples", "skipped_steps", "dp_world_size",
                   "mp_world_size", "data_sampler", "random_ltd", "ds_config", "ds_version",
                   "checkpoint_parallel_dimensions", "sparse_tensor_module_names")


def _read(path: Path) -> torch.Tensor:
    try:
        return safe_load.load(path, mmap=True)["param"]
    except FileNotFoundError:
        raise ValueError(f"universal checkpoint {path.parent.parent.parent}: {path.relative_to(path.parents[2])} is "
                         f"missing (a parameter this layout has): convert the run again") from None


def _fp32_copies(opt) -> dict[int, torch.Tensor]:
    """ZeRO-0 bf16 (DeepSpeed's unfused fp16/bf16 optimizer): module weight id -> its fp32 copy."""
    if hasattr(opt, "fp16_groups") and hasattr(opt, "fp32_groups"):
        return {id(lp): hp for lps, hps in zip(opt.fp16_groups, opt.fp32_groups) for lp, hp in zip(lps, hps)}
    return {}


def _put(engine, param, values: dict[str, torch.Tensor], step, copies: dict) -> None:
    """This rank's shard of one parameter: ``values`` {"fp32": weight, key: optimizer state}."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
    weight = values.pop("fp32")
    if hasattr(param, "ds_id") or hasattr(param, "_hp_mapping"):       # ZeRO 1-3, bf16 optimizer
        safe_set_full_fp32_param(param, weight)
        for key, value in values.items():
            safe_set_full_optimizer_state(param, value, key)
        if not hasattr(param, "ds_id"):
            param.data.copy_(weight.to(param.dtype))
        return
    hp = copies.get(id(param), param)
    hp.data.copy_(weight)
    if hp is not param:
        param.data.copy_(weight.to(param.dtype))
    inner = engine.optimizer.optimizer if copies else engine.optimizer
    if values:
        state = inner.state[hp]
        for key, value in values.items():
            state[key] = value.to(hp.dtype).clone()
        state["step"] = step.clone() if torch.is_tensor(step) else step


def _flat_groups(opt) -> list[tuple[torch.Tensor, list]]:
    """(this rank's fp32 flat partition, its module parameters) of each group of a DeepSpeed
    ZeRO 1-3 or bf16 optimizer; empty for ZeRO-0's plain optimizers."""
    for flats, lps in (("fp32_partitioned_groups_flat", "fp16_groups"),        # ZeRO-3 sub-groups
                       ("single_partition_of_fp32_groups", "bit16_groups"),    # ZeRO-1/2
                       ("fp32_groups_flat_partition", "bf16_groups")):         # bf16 optimizer
        if hasattr(opt, flats):
            return list(zip(getattr(opt, flats), getattr(opt, lps)))
    return []


def _init_flat_state(engine, folder: Path) -> None:
    """Create the optimizer state of each flat group that the conversion has state for (torch's
    Adam creates it lazily, at the first step) and link every parameter's fragments to it, so
    that DeepSpeed's setters find them."""
    opt = engine.optimizer
    names = {id(p): canonical_name(n) for n, p in engine.module.named_parameters()}
    for flat, params in _flat_groups(opt):
        keys = {f.stem for p in params for f in (folder / "zero" / names.get(id(p), "")).glob("*.pt")}
        state = opt.optimizer.state[flat]
        for key in sorted(keys - {"fp32", "step"}):
            state.setdefault(key, torch.zeros_like(flat))
        if keys - {"fp32"}:
            state.setdefault("step", torch.zeros((), dtype=torch.float32))
    if hasattr(opt, "_hp_optimizer_states_linked"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()


def _zero_steps(engine, step) -> None:
    """The Adam step of every flat group (ZeRO 1-3, bf16 optimizer) that has optimizer state: its
    own tensor each (one shared tensor would be incremented once per group)."""
    opt = engine.optimizer
    for flat, _ in _flat_groups(opt):
        state = opt.optimizer.state.get(flat)
        if state and "step" in state:
            state["step"] = step.clone() if torch.is_tensor(step) else step


def _refresh_zero3(opt) -> None:
    """ZeRO-3: the partitioned module weights from the fp32 partitions just written (as
    DeepSpeed's own universal load does), then the persistent parameters gathered again."""
    for sg, fp32 in enumerate(opt.fp32_partitioned_groups_flat):
        if fp32.numel() > 0:
            opt.fp16_partitioned_groups_flat[sg].data.copy_(fp32.data)
    for sg, flat in enumerate(opt.fp16_partitioned_groups_flat):
        for part, q in zip(opt.fp16_partitioned_groups[sg], opt.unflatten(flat, opt.fp16_partitioned_groups[sg])):
            part.data = q.data
    opt.checkpoint_event_epilogue()


def load(engine, folder: Path) -> dict:
    """Load the universal checkpoint ``folder`` into ``engine``; returns the carried
    ``client_state``. ValueError (one line) when it does not verify or lacks a tensor."""
    folder = Path(folder)
    device = next(engine.module.parameters()).device
    why = manifest.verify(folder, engine.global_rank, engine.world_size, device)
    if why is not None:
        raise ValueError(f"universal checkpoint {folder} {why}: convert the run again with "
                         f"launch/to_universal.py (the native checkpoints are untouched)")
    opt = engine.optimizer
    _init_flat_state(engine, folder)
    copies, step = _fp32_copies(opt), None
    with torch.no_grad():
        for name, param in engine.module.named_parameters():
            canon = canonical_name(name)
            spec = getattr(param, "shard_spec", [])
            files = sorted((folder / "zero" / canon).glob("*.pt")) if (folder / "zero" / canon).is_dir() else []
            if not files:
                _read(folder / "zero" / canon / "fp32.pt")        # the one-line error
            values = {f.stem: take_shard(_read(f).float(), spec) for f in files if f.stem != "step"}
            if (folder / "zero" / canon / "step.pt").is_file():
                step = safe_load.load(folder / "zero" / canon / "step.pt")
            _put(engine, param, values, step, copies)
        if step is not None:
            _zero_steps(engine, step)
        if hasattr(opt, "fp32_partitioned_groups_flat"):
            _refresh_zero3(opt)
        for name, buf in engine.module.named_buffers():
            path = folder / "buffers" / f"{canonical_name(name)}.pt"
            if path.is_file():
                buf.copy_(_read(path))
    saved = safe_load.load(folder / "zero" / "optimizer_state.pt")
    by_name = {g.get("name"): g for g in saved.get("param_groups", [])}
    for group in opt.param_groups:
        settings = by_name.get(group.get("name"))
        if settings is not None:
            group.update({k: v for k, v in settings.items() if k not in ("params", "param_names")})
    states = safe_load.load(folder / "mp_rank_00_model_states.pt")
    engine.global_steps = states.get("global_steps", 0)
    engine.global_samples = states.get("global_samples", engine.global_steps * engine.train_batch_size())
    engine.skipped_steps = states.get("skipped_steps", 0)
    if engine.lr_scheduler is not None and states.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(states["lr_scheduler"])
    return {k: v for k, v in states.items() if k not in _DEEPSPEED_KEYS}
