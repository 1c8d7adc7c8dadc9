"""Offline consolidation: a run directory's newest checkpoint as one full fp32 state dict.

Used by ``launch/evaluate.py`` and ``launch/convert_hf.py export``, on one process, with no
process group: ZeRO partitions are reassembled by DeepSpeed's ``zero_to_fp32`` (per
model-parallel rank under ZeRO-3); tensor/expert parallel shards and pipeline layer files are
merged back into full tensors from the cuts each parameter records (``shard_spec``,
model/parallel/layers.py).
"""

from __future__ import annotations

import dataclasses

import sys
from contextlib import redirect_stdout
from pathlib import Path

import torch

from training.checkpoint.layout import LATEST, latest_tag, read_run_config
from training.checkpoint import safe_load


def merge_model_parallel(cfg, world: dict, shards: dict[int, dict]) -> dict[str, torch.Tensor]:
    """Reassemble full tensors from the per-model-parallel-rank state dicts of a tp x ep run.

    Every parameter records how it was cut from its full tensor (``shard_spec``, see
    model/parallel/layers.py); building the model at each (tp_rank, ep_rank) without process
    groups recovers those cuts, and each shard is written back into place. Persistent buffers
    (the routers' ``e_score_correction_bias``) are the same on every rank: model-parallel rank
    0's copy is taken.
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
                model = Transformer(cfg, layout, init_seed=None)       # the cuts, no weights
            shard = shards[ep_rank * tp + tp_rank]
            for name, p in model.named_parameters():
                out = full.setdefault(name, torch.empty(p.full_shape))
                index = [torch.arange(n) for n in p.full_shape]
                for dim, idx in p.shard_spec:
                    index[dim] = index[dim][torch.as_tensor(idx)]
                out[torch.meshgrid(*index, indexing="ij")] = shard[name].float()
            for name, _ in model.named_buffers():     # persistent ones (expert biases): replicated
                if name in shard and name not in full:
                    full[name] = shard[name].float()
    return full


def consolidated_state_dict(ckpt_dir: Path, tag: str, zero_stage: int, cfg=None,
                            world: dict | None = None) -> dict[str, torch.Tensor]:
    """The full fp32 model state dict of one checkpoint, read offline on one process.

    ZeRO 1-3 keep the fp32 master weights in their (partitioned) optimizer files, which
    DeepSpeed's ``zero_to_fp32`` reassembles; ZeRO-0 keeps the module weights in
    ``mp_rank_00_model_states.pt``. Tensor/expert-parallel runs are merged from each
    model-parallel rank's weights: under ZeRO 0-2 the module weights of its ``mp_rank_XX`` file,
    under ZeRO-3 its fp32 master weights (``zero3_fp32_shard``); pipeline runs from their
    per-layer files (the model dtype: exact for fp32 runs, the bf16 weights for bf16 runs).
    """
    mp = 1 if world is None else world["tensor_parallel_size"] * world["expert_parallel_size"]
    if world is not None and world.get("pipeline_parallel_size", 1) > 1:
        # DeepSpeed's PipelineModule writes the module weights per layer and 'model' (tp x ep)
        # rank, ``layer_XX-model_YY-model_states.pt`` (the tied head's copy on the last stage
        # is not written); the layers' keys are the Transformer's (training/engine/pipeline.py), so the
        # layers of one 'model' rank together form its shard of the Transformer.
        shards = {}
        for r in range(mp):
            shards[r] = {}
            for f in sorted((Path(ckpt_dir) / tag).glob(f"layer_*-model_{r:02d}-model_states.pt")):
                shards[r].update(safe_load.load(f))
        if mp > 1:
            return merge_model_parallel(cfg, world, shards)
        return {k: v.float() for k, v in shards[0].items()}
    if mp > 1:
        if zero_stage == 3:
            shards = {r: zero3_fp32_shard(Path(ckpt_dir) / tag, r) for r in range(mp)}
        else:
            shards = {r: safe_load.load(Path(ckpt_dir) / tag /
                                         f"mp_rank_{r:02d}_model_states.pt")["module"]
                      for r in range(mp)}
        return merge_model_parallel(cfg, world, shards)
    if zero_stage > 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        with redirect_stdout(sys.stderr):
            sd = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
    else:
        states = safe_load.load(Path(ckpt_dir) / tag / "mp_rank_00_model_states.pt")
        sd = states["module"]
    return {k: v.float() for k, v in sd.items()}


def zero3_fp32_shard(folder: Path, mp_rank: int) -> dict[str, torch.Tensor]:
    """One model-parallel rank's fp32 weights (its tp x ep shard, whole) from a ZeRO-3 checkpoint.

    ZeRO-3 partitions each model-parallel rank's parameters over its data-parallel group: dp
    rank d writes ``zero_pp_rank_{d}_mp_rank_{mp:02d}_optim_states.pt`` (its slice of the fp32
    master weights) and ``..._model_states.pt`` (the parameter names and shapes). DeepSpeed's
    ``zero_to_fp32`` reassembles one model-parallel rank (its public entry point assumes
    mp 1 and would read every rank's files as one group): its parsers are run here on this
    rank's files only.
    """
    from deepspeed.utils import zero_to_fp32 as z

    folder = str(folder)
    model_files = z.get_checkpoint_files(folder, f"*mp_rank_{mp_rank:02d}_model_states.pt")
    optim_files = z.get_checkpoint_files(folder, f"*mp_rank_{mp_rank:02d}_optim_states.pt")
    with redirect_stdout(sys.stderr):      # zero_to_fp32 prints; stdout is the caller's
        model_states = z.parse_model_states(model_files)
        stage, dp, fp32_groups, _ = z.parse_optim_states(optim_files, folder)
        if stage != 3:
            raise ValueError(f"{optim_files[0]}: a ZeRO-{stage} checkpoint, not ZeRO-3")
        sd = z._get_fp32_state_dict_from_zero3_checkpoint(dp, fp32_groups, model_states,
                                                          exclude_frozen_parameters=False)
    return z.to_torch_tensor(sd)


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
    stage = int(resolved["ds_config"].get("zero_optimization", {}).get("stage", 0))
    try:
        world = dict(resolved.get("world", {}))
        world.setdefault("tensor_parallel_size", 1)
        world.setdefault("expert_parallel_size", 1)
        world.setdefault("expert_placement", resolved["recipe"].get("parallel", {}).get(
            "expert_placement", "contiguous"))
        sd = consolidated_state_dict(ckpt_dir, tag, stage, cfg, world)
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
