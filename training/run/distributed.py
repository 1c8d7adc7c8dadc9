"""This process's place in the job: the process groups, and the end of the process.

``init_distributed`` creates the default process group through DeepSpeed (gloo on CPU, NCCL on
GPU), or joins the one that exists (several runs in one launched process group, as the tests and
benchmarks do), then this rank's tensor/expert/data/pipeline groups (``model/parallel/groups.py``).
``DistContext`` is what the rest of the trainer knows of the job: rank, device, groups, the GPU,
and ``rank0_first`` for single-rank start-up work that the other ranks wait on through a file.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import random
import socket
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch

from model.parallel import comm
from model.parallel.groups import ParallelGroups, build_groups, check_node_size
from training.config.schema import Recipe
from training.files import CACHE_DIR, atomic_write, record_exit_code, wait_for_file
from model.flops import train_flops_per_token
from training.gpus import detect_gpu
from training.resilience.watchdog import startup_allowance

# Process groups.

@dataclass
class Handoff:
    """What rank 0's start-up work hands the other ranks (``DistContext.rank0_first``)."""

    value: object = None


@dataclass
class DistContext:
    """This process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    groups: ParallelGroups = None  # tp/ep/cp/dp/batch groups (model.parallel.groups)
    gpu: object = None             # training.gpus.GPUSpec when on a known GPU
    launch_id: int = 0             # the same on every rank of one launch, new at every launch
    timeout_s: float = 7200.0      # the longest a rank waits for rank 0's start-up work (a file)

    @contextmanager
    def rank0_first(self, name: str):
        """``with ctx.rank0_first(name) as handoff: work`` runs the work on rank 0 first: the
        other ranks poll for a marker file (no collective waits on single-rank work, see
        ``wait_for_file``) that rank 0 writes once its work is done, then run theirs. What rank 0
        puts in ``handoff.value`` (JSON: a path, a mapping) reaches the others in the marker, so
        that they need not redo the work's planning (a stat and a read per input at 1,024
        ranks); without it the work must leave a cache that makes the later runs fast."""
        marker = CACHE_DIR / "startup" / f"{self.launch_id}-{name}"
        handoff = Handoff()
        if self.rank != 0:
            wait_for_file(marker, f"rank 0 to finish: {name}", self.timeout_s)
            handoff.value = json.loads(marker.read_text() or "null")
        yield handoff
        if self.rank == 0:
            marker.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(marker, json.dumps(handoff.value), durable=False)   # whole, or not there

    def end_startup(self) -> None:
        """All ranks are past the single-rank work: drop this launch's markers (one barrier)."""
        comm.barrier()
        if self.rank == 0:
            for marker in (CACHE_DIR / "startup").glob(f"{self.launch_id}-*"):
                marker.unlink(missing_ok=True)

    @property
    def batch_group(self):
        """Every rank that sees different tokens (ep x cp x dp): loss and statistics sum over it."""
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


def exchange_node_size(recipe) -> int | None:
    """Ranks per node for ``parallel.expert_exchange: hierarchical`` (``parallel.node_size``, else
    the launcher's LOCAL_WORLD_SIZE), or None for the flat exchange. ValueError (one line) when
    neither says, or when the ep group does not span whole nodes."""
    par = recipe.parallel
    if par.expert_exchange == "flat":
        return None
    size = par.node_size or int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if not size:
        raise ValueError("parallel.expert_exchange hierarchical: the launcher did not set "
                         "LOCAL_WORLD_SIZE; set parallel.node_size to the ranks per node")
    check_node_size(par.tensor_parallel_size, par.expert_parallel_size, size)
    return size


def init_distributed(recipe: Recipe) -> DistContext:
    """Create the default process group (gloo on CPU, NCCL on GPU) through DeepSpeed, or join
    the one this process already has (DeepSpeed then only records it), then this run's
    tensor/expert/data/pipeline groups.

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
                          timeout, exchange_node_size(recipe), par.context_parallel_size, par.cp_comm)
    # One small collective, before any long work: markers of this launch cannot be stale ones.
    launch_id = torch.tensor([random.SystemRandom().getrandbits(62) if rank == 0 else 0],
                             dtype=torch.int64, device=device)
    launch_id = int(comm.job_sum(launch_id).item())
    return DistContext(rank, world, local_rank, device, groups, gpu, launch_id,
                       startup_allowance(recipe.train.hang_timeout_s))   # training/resilience/watchdog.py


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
