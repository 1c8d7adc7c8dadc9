"""Collectives on the GPUs of one node: an all-reduce and an all-to-all checked for their values,
then timed (256 MB all-reduce, 10 rounds), with bus bandwidth as nccl-tests defines it; with
``--sweep``, both timed at every size from 32 KB to ``--mb`` (x4 per size) beside the planner's
NVLink bus bandwidth for the GPU (``planning/hardware.py``).

    python -m torch.distributed.run --nproc_per_node N -m benchmarks.gpu.nccl_check --sweep     # N GPUs, NCCL
    python -m torch.distributed.run --nproc_per_node 2 -m benchmarks.gpu.nccl_check --backend gloo --device cpu

Bus bandwidth is ``2(n-1)/n x bytes / time`` for an all-reduce: the bytes each GPU's link
carries, comparable across world sizes. At world size 1 there is no link (NCCL copies the buffer
in place), so the check then runs and verifies the collectives and prints the single-GPU time, but
reports no bus bandwidth and says so: a number from one GPU is not a network figure. Every
collective goes through ``model/parallel/comm.py``, the trainer's own calls, on the compute
device, with a timeout on the process group.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from model.parallel import comm


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--mb", type=int, default=256, help="all-reduce size in MB (fp32)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--timeout-s", type=int, default=120, help="process-group timeout")
    p.add_argument("--sweep", action="store_true",
                   help="also time all-reduce and all-to-all from 32 KB up to --mb, x4 per size, and "
                        "print bus bandwidth beside the planner's NVLink figure for this GPU")
    return p.parse_args(argv)


def _timed(fn, rounds: int, device: torch.device) -> float:
    """Seconds per call of ``fn`` over ``rounds`` calls, after one untimed call."""
    fn()
    _sync(device)
    t = time.perf_counter()
    for _ in range(rounds):
        fn()
    _sync(device)
    return (time.perf_counter() - t) / rounds


def planner_busbw(device: torch.device) -> tuple[float, float] | None:
    """The planner's NCCL bus bandwidths inside a node for this GPU (all-reduce, all-to-all),
    GB/s (``planning/hardware.py``), or None off a GPU it knows."""
    if device.type != "cuda":
        return None
    from planning.hardware import DEVICES
    from training.gpus import detect_gpu
    gpu = detect_gpu(torch.cuda.get_device_name(device))
    known = DEVICES.get(gpu.name) if gpu is not None else None
    return (known.nvlink_busbw_gb_s, known.nvlink_a2a_gb_s) if known else None


def sweep(group, world: int, max_mb: int, rounds: int, device: torch.device) -> list[str]:
    """Markdown rows: per message size, all-reduce and all-to-all time and bus bandwidth
    (nccl-tests' definitions: all-reduce algbw x 2(n-1)/n, all-to-all algbw x (n-1)/n)."""
    planner = planner_busbw(device)
    note = f"{planner[0]:.0f} / {planner[1]:.0f}" if planner else "n/a"
    rows = ["| size | all-reduce | busbw GB/s | all-to-all | busbw GB/s | planner's NVLink busbw (all-reduce / all-to-all) |",
            "|---|---|---|---|---|---|"]
    size = 32 * 2**10
    while size <= max_mb * 2**20:
        n = max(world, size // 4 // world * world)           # fp32 elements, divisible by world
        x = torch.ones(n, device=device)
        t_ar = _timed(lambda: comm.all_reduce_sum(x, group), rounds, device)
        per = n // world
        t_a2a = _timed(lambda: comm.all_to_all(x.view(n, 1), [per] * world, [per] * world, group),
                       rounds, device)
        nbytes = n * 4

        def bus(t: float, factor: float) -> str:
            return f"{factor * nbytes / t / 1e9:.1f}" if world > 1 else "n/a"
        rows.append(f"| {nbytes / 2**20:.3g} MB | {t_ar * 1e6:.0f} us | {bus(t_ar, 2 * (world - 1) / world)} "
                    f"| {t_a2a * 1e6:.0f} us | {bus(t_a2a, (world - 1) / world)} | {note} |")
        size *= 4
    return rows


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> int:
    args = parse_args(argv)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("nccl check: skipped (no CUDA device)")
            return 0
        torch.cuda.set_device(local_rank)          # before the group: its context on this GPU
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    x = torch.full((args.mb * 2**20 // 4,), float(rank + 1), device=device)
    comm.all_reduce_sum(x, group)
    ok_reduce = bool((x[:1] == world * (world + 1) / 2).all().item())
    _sync(device)
    t = time.perf_counter()
    for _ in range(args.rounds):
        comm.all_reduce_sum(x, group)
    _sync(device)
    dt = (time.perf_counter() - t) / args.rounds
    # Rank r sends rows [4j, 4j+4) of its (4 world, 1) tensor to rank j; it receives, from every
    # rank s, that rank's rows for r: 4r + i + 100 s.
    send = torch.arange(world * 4, device=device, dtype=torch.float32).view(world * 4, 1) + 100 * rank
    rows = comm.all_to_all(send, [4] * world, [4] * world, group)
    want = torch.tensor([4 * rank + i + 100 * s for s in range(world) for i in range(4)],
                        device=device, dtype=torch.float32).view(-1, 1)
    ok_a2a = bool(torch.equal(rows, want))
    ok = torch.tensor([float(ok_reduce and ok_a2a)], device=device)
    comm.all_reduce_sum(ok, group)
    all_ok = int(ok.item()) == world
    if rank == 0:
        where = f"{args.backend} on {device.type}, world {world}"
        if world > 1:
            busbw = 2 * (world - 1) / world * x.numel() * 4 / dt / 1e9
            bw = f"bus bandwidth {busbw:.1f} GB/s"
        else:
            bw = "bus bandwidth: n/a at world size 1 (no link between GPUs; run with N >= 2)"
        print(f"nccl check ({where}): values {'ok' if all_ok else 'WRONG'}; all_reduce "
              f"{args.mb} MB {dt * 1e3:.2f} ms; {bw}", flush=True)
    if args.sweep and all_ok:
        rows = sweep(group, world, args.mb, args.rounds, device)
        if rank == 0:
            print("\n".join(rows), flush=True)
    dist.destroy_process_group()
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
