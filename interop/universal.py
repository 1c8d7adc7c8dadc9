"""Conversion of a run's newest checkpoint, of any layout and ZeRO stage, into a universal one.

The output is DeepSpeed's universal format (``zero/<name>/fp32.pt``, ``exp_avg.pt``,
``exp_avg_sq.pt``, ``step.pt``: each parameter's full tensors under the Transformer's names, and
``zero/optimizer_state.pt``), plus what DeepSpeed's format has no place for: ``buffers/<name>.pt``
(the routers' expert bias), ``muon_momentum/<name>.pt`` (Muon's momentum, kept by the trainer),
``mp_rank_00_model_states.pt`` (the trainer's ``client_state``, the LR scheduler and DeepSpeed's
counters, without weights), ``universal.json`` (the source layout) and ``manifest.json`` (every
file's size and CRC-32; a resume refuses a conversion that does not verify).

It is written by this code, not by DeepSpeed's ``ds_to_universal``, which loads every shard file
whole (a 671B checkpoint would not fit one node), has no shard description for pipeline layer
files, needs ZeRO optimizer partitions (ZeRO-0 has none) and merges tensor-parallel shards by
name patterns that cannot describe experts cut over tp and ep (``universal_sources.py``). Each
parameter is read, merged, written and freed before the next. ``training/checkpoint/
universal_load.py`` loads the result at any layout and stage. Used by ``launch/to_universal.py``.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import torch

from interop.universal_sources import NativeCheckpoint
from model.parallel.draw import canonical_name
from training.checkpoint import layout, manifest, safe_load
from training.checkpoint.layout import PARAM_NAMES
from training.files import atomic_write
from training.optim.muon_update import MOMENTUM

FORMAT = 1
BUFFERS = "buffers"
INFO = "universal.json"
# DeepSpeed's keys of a model-states file that hold weights or this layout's bookkeeping: not
# carried (the rest is the trainer's client_state, the LR scheduler and the counters).
_LAYOUT_KEYS = ("module", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                "frozen_param_fragments", "buffer_names", "universal_checkpoint_info", PARAM_NAMES)


def check(run_dir: Path) -> tuple[Path, str]:
    """The newest checkpoint's folder and tag; ValueError (one line) when there is none."""
    ckpt_dir = Path(run_dir) / "checkpoints"
    layout.read_run_config(run_dir)
    tag = layout.latest_tag(ckpt_dir)
    if tag is None:
        raise ValueError(f"--run-dir {run_dir}: no complete checkpoint under {ckpt_dir} "
                         f"(train with train.save_every, or let the run finish)")
    return ckpt_dir / tag, tag


def source_of(run_dir: Path, folder: Path) -> NativeCheckpoint:
    """The checkpoint ``folder`` of run ``run_dir``, opened for reading (``universal_sources.py``)."""
    from model.config import config_from_dict
    resolved = layout.read_run_config(run_dir)
    cfg = config_from_dict(resolved["recipe"]["model"])
    placement = (resolved["recipe"].get("parallel") or {}).get("expert_placement", "contiguous")
    return NativeCheckpoint(folder, cfg, resolved.get("world") or {}, placement)


def _save(obj, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, path)


def _progress(done: int, total: int, t0: float, out) -> None:
    rate = done / max(time.perf_counter() - t0, 1e-9)
    print(f"converted {done}/{total} parameters ({rate:.1f}/s, ETA {(total - done) / rate:.0f} s)",
          file=out, flush=True)


def write(source: NativeCheckpoint, out: Path, momenta: dict | None = None, progress=sys.stderr) -> int:
    """Write ``source`` in the universal format into the new folder ``out``; returns the number
    of parameters. ``momenta``: Muon's, {tp x ep rank: {name: that rank's tensor}}."""
    names = list(source.copies)
    t0, last = time.perf_counter(), time.perf_counter()
    for i, name in enumerate(names):
        folder = out / "zero" / name
        for key in source.keys(name):
            _save({"param": source.full(name, key)}, folder / f"{key}.pt")   # one full tensor at a time
        step = source.step(name)
        if step is not None:
            _save(step, folder / "step.pt")
        if progress is not None and (time.perf_counter() - last > 10 or i + 1 == len(names)):
            _progress(i + 1, len(names), t0, progress)
            last = time.perf_counter()
    for name in source.buffer_files:
        _save({"param": source.buffer(name)}, out / BUFFERS / f"{name}.pt")
    for name in sorted({n for by_rank in (momenta or {}).values() for n in by_rank}):
        shards = {mp: by_rank[name] for mp, by_rank in momenta.items() if name in by_rank}
        _save({"param": source.merge(name, shards)}, out / MOMENTUM / f"{name}.pt")
    states = source.states(0)
    optimizer = {"param_groups": list(source.groups.values()), "zero_stage": source.stage,
                 "group_of": {n: next(iter(c.values())).group for n, c in source.copies.items()}}
    _save(optimizer, out / "zero" / "optimizer_state.pt")
    _save({k: v for k, v in states.items() if k not in _LAYOUT_KEYS}, out / "mp_rank_00_model_states.pt")
    info = {"format": FORMAT, "step": int(states.get("step", states.get("global_steps", 0))),
            "parameters": len(names), "source": {"pp": source.pp, "tp": source.tp, "ep": source.ep,
                                                  "dp": source.dp, "zero_stage": source.stage, "kind": source.kind}}
    atomic_write(out / INFO, json.dumps(info, indent=1) + "\n")
    manifest.write_share(out, 0, 1)
    manifest.merge(out, info["step"], info["source"], 1)
    return len(names)


def momenta(folder: Path, source: NativeCheckpoint) -> dict[int, dict[str, torch.Tensor]]:
    """Muon's momentum per tp x ep rank, each matrix from the rank that owned it
    (``trainer_state_rank<r>.pt``, part ``muon``, memory-mapped)."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for path in sorted(Path(folder).glob("trainer_state_rank*.pt")):
        part = safe_load.load(path, mmap=True).get("muon")
        if part is None:
            raise ValueError(f"{path}: holds no Muon state (part 'muon'): resume with the code that wrote it")
        mine = out.setdefault(int(part.get("mp_rank", 0)) % source.mp, {})
        mine.update({canonical_name(k): v for k, v in part["momentum"].items()})
    return out


def is_muon_run(run_dir: Path) -> bool:
    """Whether the run's resolved DeepSpeed JSON (``config.json``) trains with Muon."""
    from training.optim.muon import is_muon_type
    return is_muon_type(layout.read_run_config(run_dir).get("ds_config") or {})


def convert(run_dir: Path, folder: Path, tag: str, progress=sys.stderr) -> Path:
    """Convert checkpoint ``folder`` of run ``run_dir`` into ``<ckpt>/universal/<tag>/``:
    written into a scratch folder, then moved into place (a failed conversion leaves the
    previous one intact; older conversions are removed). ValueError (one line) on failure."""
    out_root = Path(folder).parent / layout.UNIVERSAL
    scratch = out_root / f".{tag}.tmp"
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        source = source_of(run_dir, Path(folder))
        if not source.optimizer_state:
            raise ValueError(f"{folder}: a ZeRO-0 checkpoint written before the trainer recorded its "
                             f"parameters' names (param_names): resume it at its layout, let it save once, "
                             f"and convert that checkpoint")
        write(source, scratch, momenta(folder, source) if is_muon_run(run_dir) else None, progress)
    except ValueError:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    except Exception as err:  # torch raises many types on a damaged or foreign checkpoint
        shutil.rmtree(scratch, ignore_errors=True)
        first = (str(err).strip().splitlines() or [""])[0]
        raise ValueError(f"{folder} cannot be converted ({type(err).__name__}: {first}): restore it "
                         f"from a copy, or convert an older checkpoint") from None
    target = out_root / tag
    shutil.rmtree(target, ignore_errors=True)
    scratch.rename(target)
    atomic_write(out_root / layout.LATEST_UNIVERSAL, tag)
    for old in out_root.iterdir():
        if old.is_dir() and old.name != tag and not old.name.startswith("."):
            shutil.rmtree(old, ignore_errors=True)
    return target
