"""Muon's momentum through DeepSpeed's universal checkpoint (``launch/to_universal.py``).

The momentum of each Muon matrix lives on its owner rank (``trainer_state_rank<r>.pt``, part
``muon``; ``training/optim/muon_update.py``), and the Muon groups of DeepSpeed's optimizer files
hold no state, while ``ds_to_universal`` reads ``exp_avg`` and ``exp_avg_sq`` of every group.
So the conversion runs on a view of the checkpoint (``muon_input``: links to its files, the ZeRO
1-2 optimizer files rewritten) in which each Muon group's ``exp_avg`` is the momentum laid out as
that rank's ZeRO partition, and ``exp_avg_sq`` zeros: ``ds_to_universal`` then merges the
momentum over the data-parallel partitions and the tensor- and expert-parallel shards like any
optimizer state (by the affine maps of ``training/checkpoint/shard_maps.py``). ``muon_output``
moves each Muon parameter's merged ``exp_avg.pt`` to ``muon_momentum/<name>.pt`` beside the
conversion's ``zero/`` folder and drops its ``exp_avg_sq.pt``, so DeepSpeed's universal load
restores only the fp32 weights of the Muon parameters and ``MuonUpdate.load_universal`` cuts each
rank's momentum out of the whole tensors at the new layout.

ZeRO-3 checkpoints keep their optimizer state in another structure and are refused in one line.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch

from training.optim.muon_update import MOMENTUM

_OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def _momenta(folder: Path) -> dict[int, dict[str, torch.Tensor]]:
    """Per model-parallel rank, every Muon matrix's momentum (each from the rank that owned it)."""
    from training.checkpoint import safe_load
    out: dict[int, dict[str, torch.Tensor]] = {}
    for path in sorted(folder.glob("trainer_state_rank*.pt")):
        part = safe_load.load(path).get("muon")
        if part is None:
            raise ValueError(f"{path}: holds no Muon state (part 'muon'): resume with the code that wrote it")
        out.setdefault(int(part.get("mp_rank", 0)), {}).update(part["momentum"])
    return out


def muon_input(folder: Path, scratch: Path) -> tuple[Path, list[str]]:
    """A view of checkpoint ``folder`` under ``scratch`` whose optimizer files carry the momentum
    (the module docstring), and the Muon parameters' names."""
    files = [(m, f) for f in folder.iterdir() if (m := _OPTIM.match(f.name))]
    if not files:
        raise ValueError(f"{folder}: no ZeRO-1/2 optimizer files (a Muon run converts from ZeRO-1 or -2; "
                         f"resume a ZeRO-3 Muon run at its layout)")
    momenta = _momenta(folder)
    view = scratch / folder.name
    view.mkdir(parents=True)
    for f in folder.iterdir():
        if not _OPTIM.match(f.name):
            os.symlink(f.resolve(), view / f.name)
    offsets: dict[tuple[int, str], int] = {}           # elements of each param in earlier partitions
    names: set[str] = set()
    for match, f in sorted(files, key=lambda x: (int(x[0].group(2)), int(x[0].group(1)))):
        mp = int(match.group(2))
        sd = torch.load(f, map_location="cpu", weights_only=False)     # our own checkpoint
        opt = sd["optimizer_state_dict"]
        base = opt["base_optimizer_state"]
        for gid, group in enumerate(base["param_groups"]):
            if not group.get("muon"):
                continue
            part = opt["single_partition_of_fp32_groups"][gid]
            exp_avg = torch.zeros_like(part, dtype=torch.float32)
            for name, frag in opt["param_slice_mappings"][gid].items():
                names.add(name)
                whole = momenta.get(mp, {}).get(name)
                start = offsets.get((mp, name), 0)
                if whole is not None:           # None: the step-0 momentum, zeros
                    exp_avg.narrow(0, frag.start, frag.numel).copy_(whole.reshape(-1).narrow(0, start, frag.numel))
                offsets[(mp, name)] = start + frag.numel
            base["state"][gid] = {"exp_avg": exp_avg, "exp_avg_sq": torch.zeros_like(exp_avg)}
        torch.save(sd, view / f.name)
    return view, sorted(names)


def muon_output(target: Path, names: list[str]) -> None:
    """Move the Muon parameters' merged momentum out of ``zero/`` (the module docstring)."""
    out = target / MOMENTUM
    out.mkdir()
    for name in names:
        param = target / "zero" / name
        os.replace(param / "exp_avg.pt", out / f"{name}.pt")
        (param / "exp_avg_sq.pt").unlink()


def cleanup(scratch: Path) -> None:
    shutil.rmtree(scratch, ignore_errors=True)
