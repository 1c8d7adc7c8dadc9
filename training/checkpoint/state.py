"""What a checkpoint carries besides DeepSpeed's engine files, declared in one place.

Every stateful part of the run is registered once, by name, with the ``state_dict`` /
``load_state_dict`` pair (the ``Stateful`` protocol of torchtitan and ``torch.distributed
.checkpoint``); a save writes every part's state and a resume hands each part its own back, so a
new part needs one ``register`` line and nothing in the save or resume code. ``state_dict``
returns plain data (dicts, lists, numbers, strings): the checkpoint is read back weights-only
(``safe_load.py``).

Two kinds of part:

- **shared** (the same on every rank: the data order's position, the spike window, the token
  count): in DeepSpeed's ``client_state``, which its ``mp_rank_XX_model_states.pt`` files hold.
  The keys are the parts' names (``"data"``, ``"monitor"``) beside ``"step"``, the optimizer step
  the checkpoint holds.
- **per rank** (``per_rank=True``; each rank's own, e.g. a compressor's error feedback): one file
  per rank, ``trainer_state_rank<r>.pt`` in the checkpoint's folder, written through the same
  path as the engine's files (in the background writer, fsynced, in the manifest).

A checkpoint that lacks a registered part is refused in one line (``load``): resuming without
it would silently change the run.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Protocol

from training.checkpoint import safe_load

STEP = "step"
RANK_FILES = "trainer_state_rank*.pt"


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


def rank_file(folder: Path, rank: int) -> Path:
    """The per-rank state file of ``rank`` in the checkpoint folder ``folder``."""
    return Path(folder) / f"trainer_state_rank{rank:05d}.pt"


class TrainState:
    """The run's registered parts (see the module docstring).

    Args:
        rank: this process's global rank (names its per-rank file).
    """

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.shared: dict[str, Stateful] = {}
        self.per_rank: dict[str, Stateful] = {}

    def register(self, name: str, part: Stateful, per_rank: bool = False) -> None:
        """Carry ``part`` in every checkpoint under ``name``."""
        if name == STEP or name in self.shared or name in self.per_rank:
            raise ValueError(f"checkpoint state {name!r} is registered twice (or is {STEP!r})")
        (self.per_rank if per_rank else self.shared)[name] = part

    def client_state(self, step: int) -> dict:
        """DeepSpeed's ``client_state`` for a checkpoint of ``step``: every shared part."""
        return {STEP: step, **{name: part.state_dict() for name, part in self.shared.items()}}

    def rank_state(self) -> dict | None:
        """This rank's per-rank parts, or None when none is registered (no file is written)."""
        return {name: part.state_dict() for name, part in self.per_rank.items()} or None

    def load(self, client_state: dict, folder: Path, same_world: bool = True, universal: Path | None = None) -> int:
        """Hand each part its state from ``client_state`` (and this rank's file in ``folder``);
        returns the checkpoint's step. ``same_world`` False (a universal checkpoint loaded at
        another layout): per-rank state cannot be mapped onto other ranks; a part with
        ``load_universal(folder)`` reads its own from the conversion ``universal`` (Muon's
        momentum), the others keep their fresh state. ValueError (one line) for a missing part."""
        missing = [name for name in self.shared if name not in client_state]
        if missing:
            raise ValueError(f"checkpoint {folder} holds no {', '.join(missing)} state (it was written "
                             f"by a trainer without it): resume with the code that wrote it")
        for name, part in self.shared.items():
            part.load_state_dict(client_state[name])
        if not same_world and universal is not None:
            for part in self.per_rank.values():
                if hasattr(part, "load_universal"):
                    part.load_universal(universal)
        if self.per_rank and same_world:
            saved, world = len(list(Path(folder).glob(RANK_FILES))), _world_size()
            if saved and saved != world:
                self._load_other_world(Path(folder), saved, world)
                return int(client_state[STEP])
            path = rank_file(folder, self.rank)
            if not path.is_file():
                raise ValueError(f"checkpoint {folder} has no {path.name} (the per-rank state "
                                 f"{', '.join(self.per_rank)}): resume with the code that wrote it")
            states = safe_load.load(path)
            for name, part in self.per_rank.items():
                if name not in states:
                    raise ValueError(f"{path}: holds no {name!r} state: resume with the code that wrote it")
                part.load_state_dict(states[name])
        return int(client_state[STEP])

    def _load_other_world(self, folder: Path, saved: int, world: int) -> None:
        """The per-rank parts of a checkpoint written by ``saved`` ranks, at ``world`` ranks (a
        data-parallel size change that the engine's files allow, e.g. fp32 ZeRO-0). A part with
        ``load_other_world(read, saved, world)`` (``read(r)``: its state in rank r's file)
        reshards its state and returns what it did; any other keeps its fresh state. Rank 0
        prints one warning line per part."""
        for name, part in self.per_rank.items():
            reshard = getattr(part, "load_other_world", None)
            if reshard is not None:
                done = reshard(lambda r, name=name: self._rank_part(folder, r, name), saved, world)
            else:
                done = f"{name} starts afresh (per-rank state does not map onto another world size)"
            if self.rank == 0:
                print(f"warning: checkpoint {folder} was saved by {saved} ranks, this run has "
                      f"{world}: {done}", file=sys.stderr, flush=True)

    @staticmethod
    def _rank_part(folder: Path, rank: int, name: str):
        path = rank_file(folder, rank)
        if not path.is_file():
            raise ValueError(f"checkpoint {folder} has no {path.name} (the per-rank state {name} "
                             f"of rank {rank}): restore it from a copy")
        states = safe_load.load(path)
        if name not in states:
            raise ValueError(f"{path}: holds no {name!r} state: resume with the code that wrote it")
        return states[name]


def _world_size() -> int:
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
