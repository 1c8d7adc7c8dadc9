"""The model at this rank's layout and the DeepSpeed engine around it.

``build_model``: the ``Transformer`` (every layout from the same full weights), its pipeline form
(``pipeline.py``) with pipeline stages, partitioned over dp x cp (DeepSpeed's data-parallel group)
as it is built under ZeRO-3 (``sharded_build.py``), blocks compiled when asked (``compile.py``). ``build_engine``:
``deepspeed.initialize`` with the trainer's parameter groups, optimizer and schedule
(``training/optim/``), and the process groups DeepSpeed reduces over.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path

from model import Transformer, TransformerConfig
from model.moe.layer import set_shared_expert_overlap
from model.parallel.groups import ParallelGroups
from model.parallel.draw import canonical_name
from training.checkpoint.shard_maps import enable_universal_checkpoint
from training.engine.compile import compile_blocks
from training.engine.sharded_build import build_partitioned, builds_partitioned
from training.optim import muon, optimizers, schedules


def build_model(recipe, init_from: Path | None, groups: ParallelGroups,
                ds: dict | None = None, eos_token_id: int | None = None) -> Transformer:
    """The model at this rank's layout; every layout starts from the same full weights. With
    pipeline stages, this rank's layers of a ``training.engine.pipeline.TransformerPipe``. Under ZeRO-3
    (``ds``, the run's DeepSpeed JSON) partitioned over dp x cp as it is built, so that no rank ever
    holds the whole model (``training/engine/sharded_build.py``). With ``data.document_masking`` the
    tokenizer's ``eos_token_id`` separates the documents (``model/document_mask.py``). With
    ``parallel.shared_expert_overlap`` the shared experts run while the dispatch is in flight."""
    model = _build_model(recipe, init_from, groups, ds, eos_token_id)
    set_shared_expert_overlap(model, recipe.parallel.shared_expert_overlap)
    return model


def _build_model(recipe, init_from: Path | None, groups: ParallelGroups,
                 ds: dict | None, eos_token_id: int | None) -> Transformer:
    if recipe.data.document_masking:
        if eos_token_id is None:
            raise ValueError("data.document_masking is true but build_model got no eos_token_id")
        recipe = dataclasses.replace(recipe, model=dataclasses.replace(
            recipe.model, document_separator_id=eos_token_id))      # validated by the Recipe
    if builds_partitioned(ds) and recipe.parallel.pipeline_parallel_size == 1:
        ds_for_init, _ = schedules.split_scheduler(deepspeed_view(ds, groups))    # DeepSpeed's keys only
        model = build_partitioned(recipe.model, groups, ds_for_init, recipe.train.seed, init_from)
        model.set_activation_checkpointing(recipe.train.activation_checkpointing)
        return compile_blocks(model, recipe.train.compile, ds)
    if recipe.parallel.pipeline_parallel_size > 1:
        from training.engine.pipeline import TransformerPipe
        from safetensors.torch import load_file
        init = None if init_from is None else load_file(str(init_from / "model.safetensors"))
        return compile_blocks(TransformerPipe(recipe.model, groups, recipe.train.seed,
                                              recipe.train.activation_checkpointing, init), recipe.train.compile)
    model = Transformer(recipe.model, groups, init_seed=recipe.train.seed)
    if init_from is not None:
        from safetensors.torch import load_file
        model.load_state_dict(load_file(str(init_from / "model.safetensors")), strict=True)
    model.set_activation_checkpointing(recipe.train.activation_checkpointing)
    return compile_blocks(model, recipe.train.compile)


def deepspeed_view(ds: dict, groups: ParallelGroups) -> dict:
    """The JSON as DeepSpeed gets it. Under context parallelism DeepSpeed's data-parallel group
    is dp x cp (``model/parallel/groups.py``) and it checks ``train_batch_size`` = micro x
    accumulation x that group's size, so there each sample counts once per cp rank (each holds
    S/cp of its tokens); the trainer's own ``train_batch_size`` (data, tokens, lr scaling,
    config.json) counts samples."""
    if groups.cp == 1:
        return ds
    return {**ds, "train_batch_size": ds["train_batch_size"] * groups.cp}


def build_engine(model: Transformer, ds: dict, total_steps: int, groups: ParallelGroups,
                 model_cfg: TransformerConfig | None = None, pipeline_schedule: str = "1f1b"):
    """``deepspeed.initialize`` with our parameter groups (muP's per-group lrs when ``model_cfg``
    asks for them), optimizer and scheduler choices; with pipeline stages, the training schedule
    ``pipeline_schedule`` (``pipe_schedules.py``)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    ds, our_sched = schedules.split_scheduler(deepspeed_view(ds, groups))
    wd = float(((ds.get("optimizer") or {}).get("params") or {}).get("weight_decay", 0.0))
    ds, no_decay_group = optimizers.split_no_decay_group(ds)     # the JSON's "no_decay_group"
    param_groups = optimizers.param_groups(model, wd, model_cfg, no_decay_group)
    ds = optimizers.apply_group_lr_scales(ds, param_groups)
    if muon.is_muon_type(ds):      # ours, where DeepSpeed's Muon cannot be exact (training/optim/muon.py)
        client_opt, ds = muon.build_optimizer(ds, model, param_groups)
    else:
        client_opt, ds = optimizers.maybe_build_client_optimizer(ds, param_groups, get_accelerator().device_name())
    lr_scheduler = None
    if our_sched is not None:      # DeepSpeed calls it with the optimizer it built
        lr_scheduler = partial(schedules.build_scheduler, our_sched, total_steps=total_steps)
    # DeepSpeed sees tp x ep as its model-parallel group and reduces/shards over dp x cp.
    mpu = groups if groups.tp * groups.ep * groups.cp > 1 else None
    if groups.pp > 1:   # the pipeline's grid is DeepSpeed's mpu (same rank order, training/engine/pipeline.py)
        from training.engine.pipeline import pipeline_ds_config
        mpu, ds = None, pipeline_ds_config(ds)
    if isinstance(model, Transformer):  # how each shard was cut, for ds_to_universal (not pipes)
        enable_universal_checkpoint(model, groups)
    # DeepSpeed keeps the last engine's mpu in a module global and never clears it: a later engine
    # of this process without one (several runs in one process) would reduce over the old groups.
    from deepspeed.utils import groups as ds_groups
    ds_groups.mpu = None
    # Each optimizer group's parameters by name, saved with every checkpoint: ZeRO-0's optimizer
    # state is indexed by position only (interop/universal_sources.py reads it by these names).
    named = {id(p): canonical_name(n) for n, p in model.named_parameters()}
    names = [[named[id(p)] for p in g["params"]]
             for g in (client_opt.param_groups if client_opt is not None else param_groups)]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups,
                                      optimizer=client_opt, lr_scheduler=lr_scheduler,
                                      config=ds, mpu=mpu)
    engine.group_param_names = names   # not param_names: DeepSpeed has its own
    if groups.pp > 1:
        from training.engine import pipe_schedules
        pipe_schedules.install(engine, pipeline_schedule)
    return engine


def optimizer_summary(engine) -> dict:
    """The optimizer DeepSpeed built from the JSON: the class that runs the update (``torch_adam``,
    ``fused``/``foreach`` and ``offload_optimizer`` decide it: torch's ``AdamW``, ``FusedAdam``,
    ``DeepSpeedCPUAdam``, ...) and the ZeRO or mixed-precision wrapper around it."""
    inner = engine.basic_optimizer or engine.optimizer
    flags = {k: inner.defaults[k] for k in ("foreach", "fused") if inner.defaults.get(k) is not None}
    if getattr(inner, "assignment", None) is not None:     # Muon: which group goes to which half
        flags["groups"] = inner.assignment
    return {"update": f"{type(inner).__module__}.{type(inner).__qualname__}", **flags,
            "wrapper": None if engine.optimizer is inner else type(engine.optimizer).__name__}
