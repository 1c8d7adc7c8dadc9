"""Resuming: the newest checkpoint that verifies, loaded into the engine at this run's layout.

``load`` tries the candidates of ``layout.candidates`` in order (``latest`` first), checks each
against its manifest (``manifest.verify``, every rank a share of the files), warns about any it
skips, and refuses to start over when checkpoints exist but none verifies. A checkpoint saved at
another data- or model-parallel layout is refused with the command that converts it
(``launch/to_universal.py``); a universal conversion is loaded when the DeepSpeed JSON asks for
it. DeepSpeed reads its files through ``safe_load`` (weights only). What the trainer carries
besides the engine (``client_state``, per-rank files) is ``state.py``'s.
"""

from __future__ import annotations

import sys
from pathlib import Path

from training.checkpoint import manifest, safe_load, universal_load
from training.checkpoint.layout import LATEST, LATEST_UNIVERSAL, UNIVERSAL, candidates, universal_tag
from training.checkpoint.state import TrainState

def _verified_tag(engine, ckpt_dir: Path) -> str | None:
    """The first of ``candidates`` whose files match its manifest (the same tag on every rank),
    or None when there is no checkpoint (or only folders of saves never published). Skipped candidates are one warning line on rank 0;
    ValueError (one line) when there are candidates but none verifies."""
    tags = candidates(ckpt_dir)
    if not tags:
        return None
    if not (Path(ckpt_dir) / LATEST).is_file() and not any(
            (Path(ckpt_dir) / t / manifest.MANIFEST).is_file() for t in tags):
        # No save was ever published: the folders are saves a kill cut short (a background
        # save's writers run for a while), not checkpoints. Start from step 0, and say so.
        if engine.global_rank == 0:
            print(f"warning: {ckpt_dir} holds only unfinished saves ({', '.join(tags)}: no "
                  f"manifest, never published); starting from step 0", file=sys.stderr, flush=True)
        return None
    device = next(engine.module.parameters()).device
    skipped = []
    for tag in tags:
        why = manifest.verify(ckpt_dir / tag, engine.global_rank, engine.world_size, device)
        if why is None:
            break
        skipped.append(f"{tag} {why}")
    else:
        raise ValueError(f"no checkpoint in {ckpt_dir} verifies ({', '.join(skipped)}): restore "
                         f"{tags[0]} from a copy, or move {ckpt_dir} aside to start from step 0 "
                         f"(a checkpoint without a manifest counts as unverified)")
    if skipped and engine.global_rank == 0:
        print(f"warning: skipping checkpoints in {ckpt_dir} that do not verify "
              f"({', '.join(skipped)}); resuming from {ckpt_dir / tag}", file=sys.stderr, flush=True)
    return tag


def _model_states_file(folder: Path) -> Path | None:
    """DeepSpeed's model-states file of model-parallel rank 0 (ZeRO 0-2 or ZeRO-3 name)."""
    found = sorted(Path(folder).glob("*mp_rank_00_model_states.pt"),
                   key=lambda f: (len(f.name), f.name))
    return found[0] if found else None


def read_states(path: Path) -> dict:
    """A DeepSpeed ``*_model_states.pt`` memory-mapped (tensors are read only when touched);
    ValueError (one line) when it cannot be read."""
    try:
        return safe_load.load(path, mmap=True)
    except ValueError:                      # a pickled object that is not plain data
        raise
    except Exception as e:  # torch raises many types on a corrupted file
        first = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(f"checkpoint {Path(path).parent} cannot be read ({type(e).__name__}: "
                         f"{first}); restore it, or delete it and point {LATEST} at an older "
                         f"tag") from None


def _layout_mismatch(engine, folder: Path) -> str | None:
    """Why ``folder`` (a native DeepSpeed checkpoint) cannot be loaded at this run's layout, or
    None. DeepSpeed itself fails with a traceback on a data-parallel change when the optimizer
    state is sharded per dp rank (``*optim_states.pt``: ZeRO; fp32 ZeRO-0 keeps it whole in
    ``mp_rank_XX_model_states.pt``) or on a model-parallel change (shards per mp rank)."""
    states = _model_states_file(folder)
    if states is None:
        return None                                      # DeepSpeed reports the missing files
    meta = read_states(states)
    saved_dp, saved_mp = meta.get("dp_world_size"), meta.get("mp_world_size")
    dp, mp = engine.dp_world_size, engine.mp_world_size
    if saved_mp != mp or (saved_dp != dp and any(Path(folder).glob("*optim_states.pt"))):
        return (f"saved by data-parallel size {saved_dp} x model-parallel size {saved_mp} (pipeline "
                f"stages x tp x ep), this run has {dp} x {mp}")
    # Same mp size, other split (tp2 vs ep2): shards have the same shapes on every mp rank of
    # one layout, so every rank compares its own with rank 0's and all decide alike.
    shapes = {k: tuple(v) for group in meta.get("param_shapes") or [] for k, v in group.items()}
    mine = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in engine.module.named_parameters()}
    if any(shapes.get(n, s) != s for n, s in mine.items()):
        return "saved at another tensor/expert-parallel layout (its parameter shapes differ)"
    return None


def load(engine, ckpt_dir: Path, state: TrainState) -> int | None:
    """Load the newest checkpoint that verifies (``_verified_tag``) into ``engine`` and the
    trainer's ``state`` (every registered part, ``state.py``); return its step, or None when
    there is no checkpoint.

    With ``"checkpoint": {"load_universal": true}`` in the DeepSpeed JSON, the universal
    conversion of the newest checkpoint (``launch/to_universal.py``, under
    ``<ckpt>/universal/``) is loaded at this run's layout (``universal_load.py``), with the
    trainer's ``client_state`` it carries. A newer
    native checkpoint, i.e. one this layout saved after resuming from the conversion, is loaded
    natively, so the same command keeps resuming.
    """
    tag = _verified_tag(engine, Path(ckpt_dir))
    if tag is None:
        return None
    folder, load_dir = Path(ckpt_dir) / tag, Path(ckpt_dir)
    universal = bool(engine.load_universal_checkpoint())
    converted = universal_tag(ckpt_dir) if universal else None
    if universal and converted != tag:
        universal = False                       # load the native checkpoint (next check decides)
    problem = None if universal else _layout_mismatch(engine, folder)
    if problem:
        hint = (f"{LATEST_UNIVERSAL} points to {converted}, not the newest checkpoint; "
                if converted else "")
        raise ValueError(f"checkpoint {folder} was {problem}: {hint}resume at its layout, or "
                         f"convert it with `python launch/to_universal.py --run-dir "
                         f"{Path(ckpt_dir).parent}` and set \"checkpoint\": {{\"load_universal\": "
                         f"true}} in the DeepSpeed JSON")
    if universal:
        load_dir = Path(ckpt_dir) / UNIVERSAL
        client_state = universal_load.load(engine, load_dir / tag)
    else:
        saved_flag = engine._config.load_universal_checkpoint
        engine._config.load_universal_checkpoint = False    # DeepSpeed reads it at load time only
        safe_load.install(engine)                  # DeepSpeed's own reads: weights only
        try:
            path, client_state = engine.load_checkpoint(str(load_dir), tag=tag)
        finally:
            engine._config.load_universal_checkpoint = saved_flag
        if path is None:
            raise ValueError(f"checkpoint {load_dir / tag} could not be loaded (corrupted or "
                             f"incomplete): delete it and point {LATEST} at an older tag")
    fresh = [name for name, part in state.per_rank.items() if not hasattr(part, "load_universal")]
    if universal and fresh and engine.global_rank == 0:
        print(f"warning: {', '.join(fresh)} start afresh: per-rank state does not carry "
              f"over a layout change", file=sys.stderr, flush=True)
    return state.load(client_state, folder, same_world=not universal, universal=load_dir / tag if universal else None)
