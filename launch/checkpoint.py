"""Checkpoints: DeepSpeed's engine files plus the trainer's own state in ``client_state``.

Layout under ``<run-dir>/checkpoints/``::

    step00000050/      DeepSpeed's files for the checkpoint taken after optimizer step 50
    step00000100/
    latest             the newest COMPLETE tag; DeepSpeed's ``load_checkpoint`` reads it

DeepSpeed's ``save_checkpoint`` is told not to write ``latest`` itself; rank 0 writes it
(atomically) only after every rank has finished writing its shards, so a run killed mid-save
resumes from the previous checkpoint instead of a half-written one. Old tags beyond ``keep_last``
are deleted after the pointer has moved.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from model.parallel import comm

LATEST = "latest"


def tag_for_step(step: int) -> str:
    return f"step{step:08d}"


def latest_tag(ckpt_dir: Path) -> str | None:
    """The newest complete checkpoint tag, or None when there is none."""
    pointer = Path(ckpt_dir) / LATEST
    if not pointer.is_file():
        return None
    tag = pointer.read_text().strip()
    if not tag or not (Path(ckpt_dir) / tag).is_dir():
        raise ValueError(f"{pointer}: points to missing checkpoint {tag!r} (delete the file to "
                         f"start over, or restore the checkpoint folder)")
    return tag


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def save(engine, ckpt_dir: Path, step: int, client_state: dict, keep_last: int) -> str:
    """Save a checkpoint on every rank, then move ``latest`` and prune (rank 0).

    Communicates over the default group (barriers).
    """
    tag = tag_for_step(step)
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state, save_latest=False)
    comm.barrier()
    if engine.global_rank == 0:
        _atomic_write(Path(ckpt_dir) / LATEST, tag)
        tags = sorted(p.name for p in Path(ckpt_dir).iterdir() if p.is_dir() and p.name.startswith("step"))
        for old in tags[:-keep_last] if keep_last > 0 else []:
            if old != tag:
                shutil.rmtree(Path(ckpt_dir) / old, ignore_errors=True)
    comm.barrier()
    return tag


def load(engine, ckpt_dir: Path) -> dict | None:
    """Load the newest complete checkpoint into ``engine``; return its client state (or None)."""
    tag = latest_tag(ckpt_dir)
    if tag is None:
        return None
    path, client_state = engine.load_checkpoint(str(ckpt_dir), tag=tag)
    if path is None:
        raise ValueError(f"checkpoint {Path(ckpt_dir) / tag} could not be loaded (corrupted or "
                         f"incomplete): delete it and point {LATEST} at an older tag")
    return client_state


def rng_state() -> dict:
    """Every RNG stream the trainer uses (python, numpy, torch CPU and accelerator)."""
    import random

    import numpy as np
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    import random

    import numpy as np
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def merge_model_parallel(cfg, world: dict, shards: dict[int, dict]) -> dict[str, torch.Tensor]:
    """Reassemble full tensors from the per-model-parallel-rank state dicts of a tp x ep run.

    Every parameter records how it was cut from its full tensor (``shard_spec``, see
    model/parallel/layers.py); building the model at each (tp_rank, ep_rank) without process
    groups recovers those cuts, and each shard is written back into place.
    """
    from model import Transformer
    from model.parallel.groups import ParallelGroups

    tp, ep = world["tensor_parallel_size"], world["expert_parallel_size"]
    full: dict[str, torch.Tensor] = {}
    for ep_rank in range(ep):
        for tp_rank in range(tp):
            layout = ParallelGroups(tp=tp, ep=ep, tp_rank=tp_rank, ep_rank=ep_rank,
                                    expert_placement=world.get("expert_placement", "contiguous"))
            with torch.device("meta"):
                model = Transformer(cfg, layout)
            shard = shards[ep_rank * tp + tp_rank]
            for name, p in model.named_parameters():
                out = full.setdefault(name, torch.empty(p.full_shape))
                index = [torch.arange(n) for n in p.full_shape]
                for dim, idx in p.shard_spec:
                    index[dim] = index[dim][torch.as_tensor(idx)]
                out[torch.meshgrid(*index, indexing="ij")] = shard[name].float()
    return full


def consolidated_state_dict(ckpt_dir: Path, tag: str, zero_stage: int, cfg=None,
                            world: dict | None = None) -> dict[str, torch.Tensor]:
    """The full fp32 model state dict of one checkpoint, read offline on one process.

    ZeRO 1-3 keep the fp32 master weights in their (partitioned) optimizer files, which
    DeepSpeed's ``zero_to_fp32`` reassembles; ZeRO-0 keeps the module weights in
    ``mp_rank_00_model_states.pt``. Tensor/expert-parallel runs (ZeRO 0-2) are merged from the
    module weights of every ``mp_rank_XX`` file (the model dtype: exact for fp32 runs, the bf16
    weights for bf16 runs).
    """
    mp = 1 if world is None else world["tensor_parallel_size"] * world["expert_parallel_size"]
    if mp > 1:
        if zero_stage == 3:
            raise ValueError("consolidating a ZeRO-3 tensor/expert-parallel checkpoint is not "
                             "supported yet (train that layout with ZeRO 0-2 to export it)")
        shards = {r: torch.load(Path(ckpt_dir) / tag / f"mp_rank_{r:02d}_model_states.pt",
                                map_location="cpu", weights_only=False)["module"]
                  for r in range(mp)}
        return merge_model_parallel(cfg, world, shards)
    if zero_stage > 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        sd = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
    else:
        states = torch.load(Path(ckpt_dir) / tag / "mp_rank_00_model_states.pt",
                            map_location="cpu", weights_only=False)
        sd = states["module"]
    return {k: v.float() for k, v in sd.items()}


def read_run_config(run_dir: Path) -> dict:
    """The run directory's config.json, checked to be the one ``launch/train.py`` writes."""
    config_path = Path(run_dir) / "config.json"
    if not config_path.is_file():
        raise ValueError(f"--run-dir {run_dir}: no config.json (is this a run directory made "
                         f"by launch/train.py?)")
    try:
        resolved = json.loads(config_path.read_text(encoding="utf-8"))
        model, ds = resolved["recipe"]["model"], resolved["ds_config"]
        if not (isinstance(model, dict) and "family" in model and isinstance(ds, dict)):
            raise TypeError("recipe.model (with its family) and ds_config must be objects")
    except KeyError as e:
        problem = f"missing key {e}"
    except (ValueError, TypeError) as e:                # bad JSON or UTF-8, wrong shapes
        problem = str(e)
    else:
        return resolved
    raise ValueError(f"--run-dir {run_dir}: config.json is not one launch/train.py wrote "
                     f"({problem}); restore it or choose another run directory")


def load_run_model(run_dir: Path):
    """The trained model of a run directory (newest complete checkpoint), in fp32 on CPU.

    Returns:
        (model in eval mode, model config, tokenizer)
    """
    from transformers import AutoTokenizer

    from model import Transformer
    from model.config import config_from_dict

    run_dir = Path(run_dir)
    resolved = read_run_config(run_dir)
    cfg = config_from_dict(resolved["recipe"]["model"])
    ckpt_dir = run_dir / "checkpoints"
    tag = latest_tag(ckpt_dir)
    if tag is None:
        raise ValueError(f"--run-dir {run_dir}: no complete checkpoint under {ckpt_dir} "
                         f"(train with save_every, or let the run finish)")
    stage = int(resolved["ds_config"].get("zero_optimization", {}).get("stage", 0))
    try:
        world = dict(resolved.get("world", {}))
        world.setdefault("tensor_parallel_size", 1)
        world.setdefault("expert_parallel_size", 1)
        world.setdefault("expert_placement", resolved["recipe"].get("parallel", {}).get(
            "expert_placement", "contiguous"))
        sd = consolidated_state_dict(ckpt_dir, tag, stage, cfg, world)
        model = Transformer(cfg)
        model.load_state_dict(sd, strict=True)
    except Exception as e:  # torch and DeepSpeed raise many types on a corrupted checkpoint
        first = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(f"--run-dir {run_dir}: checkpoint {ckpt_dir / tag} cannot be read "
                         f"({type(e).__name__}: {first}); restore it, or delete it and point "
                         f"{ckpt_dir / LATEST} at an older tag") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(run_dir / "tokenizer"))
    except (OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(f"--run-dir {run_dir}: tokenizer/ cannot be loaded ({first}); restore "
                         f"the tokenizer folder train.py saved there") from None
    return model.eval(), cfg, tokenizer
