"""Local multi-process runs for the tests and the benchmarks: a free port for a rendezvous, a
function run on N gloo ranks on 127.0.0.1 (the first failing rank's error re-raised), and the rows
those ranks send back.

Not used by the trainer (``launch/train.py`` runs under torchrun or DeepSpeed's launcher, which
set the ranks up); here because both ``tests/`` and ``benchmarks/`` spawn ranks and neither may
import the other's helpers.
"""

from __future__ import annotations

import os
import socket
import sys
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands out for outgoing connections and bind(0) (Linux)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for MASTER_PORT), drawn below the
    kernel's ephemeral range: a port from bind(0) is free when asked but can be handed again,
    between its release and the store's bind, to another process's outgoing connection (the
    many gloo connections of tests running beside it), and torchrun's store then waits 60 s
    on a port it did not open."""
    import random
    floor = _ephemeral_floor()
    if floor > 11000:
        rng = random.SystemRandom()
        for _ in range(100):
            port = rng.randrange(10000, floor)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, errors):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
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
    # One thread per rank, as the ranks share the cores: set in the environment they start with,
    # since a spawned child imports torch (unpickling ``fn``) before ``_worker`` runs.
    threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        for p in procs:
            p.start()
    finally:
        if threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = threads
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


def gather_rows(fn, world_size: int, *args, rows: int, timeout: float = 1800.0) -> list:
    """``run_ranks(fn, world_size, *args, out)``, where ``fn``'s rank 0 puts ``rows`` objects in
    the queue ``out`` (its last argument): those objects, in the order put."""
    out = mp.get_context("spawn").SimpleQueue()
    run_ranks(fn, world_size, *args, out, timeout=timeout)
    return [out.get() for _ in range(rows)]
