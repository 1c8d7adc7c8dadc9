"""Offline consolidation: a run directory's newest checkpoint as one full fp32 state dict.

Used by ``launch/evaluate.py`` and ``launch/convert_hf.py export``, on one process, with no
process group, for a checkpoint of any layout and ZeRO stage: the fp32 master weights (ZeRO 1-3,
bf16) or the module weights (fp32 ZeRO-0) are read by ``interop/universal_sources.py``, the
reader of the universal conversion (weights-only, memory-mapped; data-parallel pieces joined,
tp x ep shards merged by each parameter's ``shard_spec``, pipeline names read as the
Transformer's), with a check that every shard, every expert included, was found.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from interop.universal_sources import FP32, NativeCheckpoint, merge, source_specs
from training.checkpoint.layout import LATEST, latest_tag, read_run_config


def merge_model_parallel(cfg, world: dict, shards: dict[int, dict]) -> dict[str, torch.Tensor]:
    """Reassemble full tensors from the per-model-parallel-rank state dicts of a tp x ep run.

    Every parameter records how it was cut from its full tensor (``shard_spec``, see
    model/parallel/layers.py); building the model at each (tp_rank, ep_rank) on the meta device
    recovers those cuts (``universal_sources.source_specs``), and each shard is written back
    into place. Persistent buffers (the routers' ``e_score_correction_bias``) are the same on
    every rank: model-parallel rank 0's copy is taken.
    """
    tp, ep = world["tensor_parallel_size"], world["expert_parallel_size"]
    specs = source_specs(cfg, tp, ep, world.get("expert_placement", "contiguous"))
    full = {name: merge(name, specs, {r: sd[name] for r, sd in shards.items()}) for name in specs["full"]}
    full.update({name: shards[0][name].float() for name in specs["buffers"] if name in shards[0]})
    return full


def consolidated_state_dict(folder: Path, cfg, world: dict) -> dict[str, torch.Tensor]:
    """The full fp32 model state dict (weights and persistent buffers) of the checkpoint
    ``folder`` of a run at ``world`` (config.json's, with ``expert_placement``), read offline;
    ValueError when a shard is missing."""
    source = NativeCheckpoint(folder, cfg, world, world.get("expert_placement", "contiguous"))
    missing = sorted(set(source.specs["full"]) - set(source.copies))
    if missing:
        raise ValueError(f"{folder}: no shard of {missing[0]} ({len(missing)} parameters missing)")
    sd = {name: source.full(name, FP32) for name in source.specs["full"]}
    sd.update({name: source.buffer(name) for name in source.buffer_files})
    check_experts(cfg, sd, folder)
    return sd


def check_experts(cfg, sd: dict[str, torch.Tensor], where) -> None:
    """Every MoE layer's experts, counted against the config: ``cfg.num_moe_layers`` layers (the
    MTP modules' included) with ``num_experts`` experts in each stack; ValueError (one line)
    otherwise. (That each expert's values were read is ``merge``'s coverage check.)"""
    if cfg.moe is None:
        return
    stacks = {k: v for k, v in sd.items() if ".mlp.experts." in k}
    layers = {k.rsplit(".mlp.experts.", 1)[0] for k in stacks}
    wrong = [k for k, v in stacks.items() if v.shape[0] != cfg.moe.num_experts]
    if len(layers) != cfg.num_moe_layers or wrong:
        raise ValueError(f"{where}: {len(layers)} MoE layers with experts, the config has {cfg.num_moe_layers}"
                         + (f"; {wrong[0]} holds {stacks[wrong[0]].shape[0]} experts, the config "
                            f"{cfg.moe.num_experts}" if wrong else ""))


def load_run_model(run_dir: Path, tag: str | None = None):
    """The trained model of a run directory, in fp32 on CPU: checkpoint ``tag`` (a folder
    under ``checkpoints/``), by default the newest complete one.

    Returns:
        (model in eval mode, model config, tokenizer)
    """
    from model import Transformer
    from model.config import config_from_dict

    run_dir = Path(run_dir)
    resolved = read_run_config(run_dir)
    cfg = config_from_dict(resolved["recipe"]["model"])
    ckpt_dir = run_dir / "checkpoints"
    tag = tag or latest_tag(ckpt_dir)
    if tag is None:
        raise ValueError(f"--run-dir {run_dir}: no complete checkpoint under {ckpt_dir} "
                         f"(train with save_every, or let the run finish)")
    if resolved["recipe"].get("data", {}).get("document_masking") and cfg.document_separator_id is None:
        # The trainer fills the separator in at build time from the run's tokenizer: do the same.
        cfg = dataclasses.replace(cfg, document_separator_id=_tokenizer(run_dir).eos_token_id)
    try:
        world = dict(resolved.get("world", {}))
        world.setdefault("tensor_parallel_size", 1)
        world.setdefault("expert_parallel_size", 1)
        world.setdefault("expert_placement", resolved["recipe"].get("parallel", {}).get(
            "expert_placement", "contiguous"))
        sd = consolidated_state_dict(ckpt_dir / tag, cfg, world)
        model = Transformer(cfg, init_seed=None)        # every weight comes from the checkpoint
        model.load_state_dict(sd, strict=True)
    except Exception as e:  # torch and DeepSpeed raise many types on a corrupted checkpoint
        first = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(f"--run-dir {run_dir}: checkpoint {ckpt_dir / tag} cannot be read "
                         f"({type(e).__name__}: {first}); restore it, or delete it and point "
                         f"{ckpt_dir / LATEST} at an older tag") from None
    return model.eval(), cfg, _tokenizer(run_dir)


def _tokenizer(run_dir: Path):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(run_dir / "tokenizer"))
    except (OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(f"--run-dir {run_dir}: tokenizer/ cannot be loaded ({first}); restore "
                         f"the tokenizer folder train.py saved there") from None
