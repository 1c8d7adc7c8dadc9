"""Run a function on N gloo ranks on 127.0.0.1 and re-raise the first failing rank's error."""

from __future__ import annotations

import os
import socket
import sys
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, errors):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        fn(rank, world_size, *args)
        dist.barrier()
    except BaseException:   # report every failure, assertions included, to the parent
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Done and reported: leave without interpreter finalization, where gloo's worker threads
    # can still abort the process ("terminate called without an active exception", seen about
    # once a day here even after destroy_process_group; pytorch/pytorch#190489).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world_size: int, *args, timeout: float = 300.0) -> None:
    """Spawn ``world_size`` processes running ``fn(rank, world_size, *args)`` over gloo.

    ``fn`` must be importable (a module-level function). Raises AssertionError carrying the
    failing rank's traceback.
    """
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, errors))
             for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
    if not errors.empty():
        rank, tb = errors.get()
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise AssertionError(f"ranks exited with {bad} (timeout {timeout}s?)")
