"""The pieces ``train.py`` wires together: process groups, tokenizer, data, model, DeepSpeed
engine, resolved config and tracking (the up-front checks: ``training/preflight.py``).
``train.py`` reads as the straight line."""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import platform
import socket
import subprocess
import random
import sys
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import NoReturn

import torch

from training import data_sources as sources_lib
from training import data as data_lib
from training import optim, schedules
from training.hardware import detect_gpu, train_flops_per_token
from training.compile import compile_blocks
from training.files import atomic_write, record_exit_code, wait_for_file
from training.watchdog import startup_allowance
from training.recipe_schema import Recipe
from training.shard_maps import enable_universal_checkpoint
from training.sharded_build import build_partitioned, builds_partitioned
from data_pipeline.tokenizer import load_local_tokenizer, load_tokenizer, tokenizer_fingerprint
from training.tracking import MFU_NOTE, Progress, Tracker
from model import Transformer, TransformerConfig
from model.parallel import comm
from model.parallel.groups import ParallelGroups, build_groups

REPO = Path(__file__).resolve().parents[1]
CACHE_DIR = REPO / ".cache"


# ----------------------------------------------------------------------------------------------
# Process groups.

@dataclass
class DistContext:
    """This process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    groups: ParallelGroups = None  # tp/ep/dp/batch groups (model.parallel.groups)
    gpu: object = None             # training.hardware.GPUSpec when on a known GPU
    launch_id: int = 0             # the same on every rank of one launch, new at every launch
    timeout_s: float = 7200.0      # the longest a rank waits for rank 0's start-up work (a file)

    def rank0_first(self, name: str, work):
        """``work()`` on rank 0, then on the other ranks, which poll for a marker file meanwhile
        (no collective waits on single-rank work, see ``wait_for_file``). ``work`` must leave a
        cache that makes the later calls fast."""
        marker = CACHE_DIR / "startup" / f"{self.launch_id}-{name}"
        if self.rank == 0:
            result = work()
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
            return result
        wait_for_file(marker, f"rank 0 to finish: {name}", self.timeout_s)
        return work()

    def end_startup(self) -> None:
        """All ranks are past the single-rank work: drop this launch's markers (one barrier)."""
        comm.barrier()
        if self.rank == 0:
            for marker in (CACHE_DIR / "startup").glob(f"{self.launch_id}-*"):
                marker.unlink(missing_ok=True)

    @property
    def batch_group(self):
        """Every rank that sees different tokens (ep x dp): loss and statistics sum over it."""
        return self.groups.batch_group

    def flops_per_token(self, cfg, recipe: Recipe) -> tuple[float, float]:
        """Training FLOPs per token, attention causal-halved (``mfu``) and whole (``mfu_full_attn``)."""
        return (train_flops_per_token(cfg, recipe.seq_len),
                train_flops_per_token(cfg, recipe.seq_len, causal=False))

    def add_gpu_metrics(self, row: dict, flops_per_token: tuple[float, float]) -> None:
        if self.device.type != "cuda":
            return
        row["mem_gb"] = torch.cuda.max_memory_allocated(self.device) / 1e9
        if self.gpu is not None:
            rate = row["tokens_per_s"] / self.world_size / (self.gpu.bf16_tflops * 1e12)   # per GPU
            row["mfu"], row["mfu_full_attn"] = rate * flops_per_token[0], rate * flops_per_token[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(recipe: Recipe) -> DistContext:
    """Create the default process group (gloo on CPU, NCCL on GPU) through DeepSpeed, then the
    tensor/expert/data-parallel groups.

    Plain ``python launch/train.py`` gets single-process defaults: without them DeepSpeed falls
    back to MPI discovery and fails.
    """
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        # Before any process group, which opens its context on the current GPU (else GPU 0 for all).
        torch.cuda.set_device(local_rank)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = recipe.train.tf32
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    timeout = timedelta(minutes=recipe.parallel.timeout_minutes)
    backend = recipe.parallel.backend
    if backend == "auto":
        backend = get_accelerator().communication_backend_name()
    deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        gpu = detect_gpu(torch.cuda.get_device_name(device))
        moe = getattr(recipe.model, "moe", None)
        if moe is not None and moe.dispatch_dtype == "fp8" and torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError(f"model.moe.dispatch_dtype: fp8 needs a GPU with float8 (compute "
                             f"capability 8.9+, e.g. H100, L40S); this {torch.cuda.get_device_name(device)} "
                             f"has none: use bf16")
    else:
        device, gpu = torch.device("cpu"), None
    par = recipe.parallel
    groups = build_groups(par.tensor_parallel_size, par.expert_parallel_size,
                          par.pipeline_parallel_size, par.expert_placement, par.sequence_parallel,
                          timeout)
    # One small collective, before any long work: markers of this launch cannot be stale ones.
    launch_id = torch.tensor([random.SystemRandom().getrandbits(62) if rank == 0 else 0],
                             dtype=torch.int64, device=device)
    launch_id = int(comm.job_sum(launch_id).item())
    return DistContext(rank, world, local_rank, device, groups, gpu, launch_id,
                       startup_allowance(recipe.train.hang_timeout_s))   # training/watchdog.py


def shutdown() -> None:
    """Tear the process groups down before the interpreter exits, as torch asks: left to static
    destruction, NCCL may drop pending work and gloo's threads can abort the process at exit."""
    if torch.distributed.is_initialized():
        gc.collect()       # the run's engine and model, with any work handles they still hold
        torch.distributed.destroy_process_group()


def exit_now(code: int) -> NoReturn:
    """End the trainer's process with ``code`` once ``main`` has returned: everything is written,
    flushed and joined by then (checkpoints, pruning, metrics, W&B) and the process groups are
    destroyed. Skipping interpreter finalization keeps gloo's and NCCL's worker threads from
    aborting a finished run there ("terminate called without an active exception", exit -6: a
    successful job reported as failed; pytorch/pytorch#190489)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    record_exit_code(code)
    os._exit(code)


# ----------------------------------------------------------------------------------------------
# Tokenizer, data, model, engine.

def build_tokenizer(recipe: Recipe, init_from: Path | None, ctx: DistContext):
    """The run's tokenizer: ``tokenizer.path``; else the init dir's; else, when ``data.source``
    is prepared data only, the one its manifests name; else a byte-level BPE trained once on a
    sample of the raw sources (rank 0 first; the other ranks then read the cache). The trainer
    saves it into the run directory after the checkpoint load, with config.json."""
    path = recipe.tokenizer.path
    if init_from is not None and path is None and (init_from / "tokenizer").is_dir():
        path = str(init_from / "tokenizer")
    train_specs, _ = sources_lib.all_specs(recipe.data)
    if path is None and not sources_lib.raw_entries(train_specs):
        path = sources_lib.prepared_tokenizer_path(train_specs)
    if path is not None:
        tokenizer = load_local_tokenizer(path)
    else:
        budget = recipe.tokenizer.train_bytes
        tokenizer = ctx.rank0_first("tokenizer", lambda: load_tokenizer(
            None, sources_lib.training_sample(recipe.data, budget), recipe.tokenizer_vocab_size,
            CACHE_DIR, max_train_bytes=budget))
    if len(tokenizer) > recipe.model.vocab_size:
        raise ValueError(f"model.vocab_size ({recipe.model.vocab_size}) is smaller than the "
                         f"tokenizer ({len(tokenizer)} tokens): raise model.vocab_size")
    return tokenizer


def build_data(recipe: Recipe, ds: dict, tokenizer, dp_size: int, ctx: DistContext):
    """The training sampler for this rank and its validation batches. Raw sources are prepared
    into the cache first (rank 0 with worker processes; the other ranks find them prepared);
    prepared data is only opened, memory-mapped."""
    small = recipe.data.max_bytes is not None and recipe.data.max_bytes <= 16_000_000
    workers = 1 if small else max(1, min(8, os.cpu_count() or 1))    # a worker's start costs seconds
    prepared = ctx.rank0_first("prepare data", lambda: sources_lib.prepare_raw(
        recipe.data, tokenizer, CACHE_DIR, workers, progress=ctx.rank == 0))
    ctx.end_startup()
    train, val = sources_lib.open_sources(recipe.data, prepared, recipe.model.vocab_size,
                                          tokenizer_fingerprint(tokenizer))
    seq_len, micro = recipe.seq_len, ds["train_micro_batch_size_per_gpu"]
    layout = data_lib.BatchLayout(ds["train_batch_size"], micro, dp_size, ctx.groups.dp_rank)
    sampler = data_lib.BlendedSampler([s.train for s in train], [s.name for s in train],
                                      sources_lib.blend_weights(train), seq_len, layout, recipe.train.seed)
    held = val if val is not None else train
    windows = data_lib.blended_validation_windows(
        [s.train if val is not None else s.val for s in held], sources_lib.blend_weights(held),
        seq_len, recipe.eval.batches * micro * dp_size)
    return sampler, data_lib.validation_batches(windows, layout)


def build_model(recipe: Recipe, init_from: Path | None, groups: ParallelGroups,
                ds: dict | None = None, eos_token_id: int | None = None) -> Transformer:
    """The model at this rank's layout; every layout starts from the same full weights. With
    pipeline stages, this rank's layers of a ``training.pipeline.TransformerPipe``. Under ZeRO-3
    (``ds``, the run's DeepSpeed JSON) partitioned over dp as it is built, so that no rank ever
    holds the whole model (``training/sharded_build.py``). With ``data.document_masking`` the
    tokenizer's ``eos_token_id`` separates the documents (``model/document_mask.py``)."""
    if recipe.data.document_masking:
        if eos_token_id is None:
            raise ValueError("data.document_masking is true but build_model got no eos_token_id")
        recipe = dataclasses.replace(recipe, model=dataclasses.replace(
            recipe.model, document_separator_id=eos_token_id))      # validated by Recipe
    if builds_partitioned(ds) and recipe.parallel.pipeline_parallel_size == 1:
        ds_for_init, _ = schedules.split_scheduler(ds)    # DeepSpeed's keys only
        model = build_partitioned(recipe.model, groups, ds_for_init, recipe.train.seed, init_from)
        model.set_activation_checkpointing(recipe.train.activation_checkpointing)
        return compile_blocks(model, recipe.train.compile, ds)
    if recipe.parallel.pipeline_parallel_size > 1:
        from training.pipeline import TransformerPipe
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


def build_engine(model: Transformer, ds: dict, total_steps: int, groups: ParallelGroups,
                 model_cfg: TransformerConfig | None = None):
    """``deepspeed.initialize`` with our parameter groups (muP's per-group lrs when ``model_cfg``
    asks for them), optimizer and scheduler choices."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    ds, our_sched = schedules.split_scheduler(ds)
    wd = float(((ds.get("optimizer") or {}).get("params") or {}).get("weight_decay", 0.0))
    param_groups = optim.param_groups(model, wd, model_cfg)
    ds = optim.apply_group_lr_scales(ds, param_groups)
    client_opt, ds = optim.maybe_build_client_optimizer(ds, param_groups, get_accelerator().device_name())
    lr_scheduler = None
    if our_sched is not None:      # DeepSpeed calls it with the optimizer it built
        lr_scheduler = partial(schedules.build_scheduler, our_sched, total_steps=total_steps)
    # DeepSpeed sees tp x ep as its model-parallel group and reduces/shards over dp only.
    mpu = groups if groups.tp * groups.ep > 1 else None
    if groups.pp > 1:   # the pipeline's grid is DeepSpeed's mpu (same rank order, training/pipeline.py)
        from training.pipeline import pipeline_ds_config
        mpu, ds = None, pipeline_ds_config(ds)
    if isinstance(model, Transformer):  # how each shard was cut, for ds_to_universal (not pipes)
        enable_universal_checkpoint(model, groups)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups,
                                      optimizer=client_opt, lr_scheduler=lr_scheduler,
                                      config=ds, mpu=mpu)
    return engine


# ----------------------------------------------------------------------------------------------
# Outputs.

def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def optimizer_summary(engine) -> dict:
    """The optimizer DeepSpeed built from the JSON: the class that runs the update (``torch_adam``,
    ``fused``/``foreach`` and ``offload_optimizer`` decide it: torch's ``AdamW``, ``FusedAdam``,
    ``DeepSpeedCPUAdam``, ...) and the ZeRO or mixed-precision wrapper around it."""
    inner = engine.basic_optimizer or engine.optimizer
    flags = {k: inner.defaults[k] for k in ("foreach", "fused") if inner.defaults.get(k) is not None}
    return {"update": f"{type(inner).__module__}.{type(inner).__qualname__}", **flags,
            "wrapper": None if engine.optimizer is inner else type(engine.optimizer).__name__}


def resolved_config(recipe: Recipe, ds: dict, ctx: DistContext, dp_size: int, engine=None) -> dict:
    import deepspeed
    import transformers
    par = recipe.parallel
    return {
        "recipe": recipe.to_dict(),
        "ds_config": ds,
        "optimizer": optimizer_summary(engine) if engine is not None else None,
        "world": {"world_size": ctx.world_size, "data_parallel_size": dp_size,
                  "tensor_parallel_size": par.tensor_parallel_size,
                  "expert_parallel_size": par.expert_parallel_size,
                  "pipeline_parallel_size": par.pipeline_parallel_size,
                  "device": str(ctx.device.type), "gpu": ctx.gpu.name if ctx.gpu else None},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "deepspeed": deepspeed.__version__, "transformers": transformers.__version__},
        "git_commit": _git_commit(),
        "mfu_definition": MFU_NOTE,
    }


def write_config(run_dir: Path, config: dict) -> None:
    atomic_write(run_dir / "config.json", json.dumps(config, indent=2) + "\n")


def build_tracking(recipe: Recipe, run_dir: Path, rank0: bool, start_step: int, config: dict | None):
    """The metrics writer (and W&B, whose run config is ``config``: rank 0's ``resolved_config``)
    and the progress line."""
    tracker = Tracker(run_dir, rank0, recipe.tracking, config,
                      resume_step=start_step if start_step else None, run_name=recipe.name,
                      router_every=recipe.train.log_every)
    progress = Progress(recipe.train.steps, recipe.train.log_every, start_step, rank0)
    return tracker, progress
