"""NCCL sanity and bandwidth on the GPUs of one node: all-reduce and all-to-all of 256 MB.

    python -m torch.distributed.run --nproc_per_node N benchmarks/nccl_check.py
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model.parallel import comm  # noqa: E402


def main() -> None:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    group = dist.new_group(list(range(world)))
    x = torch.full((64 * 2**20,), float(rank + 1), device="cuda")        # 256 MB fp32
    comm.all_reduce_sum(x, group)
    assert x[0].item() == world * (world + 1) / 2
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        comm.all_reduce_sum(x, group)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / 10
    # Bus bandwidth as nccl-tests defines it: 2(n-1)/n x bytes / time.
    busbw = 2 * (world - 1) / max(world, 1) * x.numel() * 4 / dt / 1e9
    rows = comm.all_to_all(torch.arange(world * 4, device="cuda", dtype=torch.float32).view(world * 4, 1) + 100 * rank,
                           [4] * world, [4] * world, group)
    assert rows[:4, 0].tolist() == [4 * rank + i for i in range(4)]
    if rank == 0:
        print(f"nccl ok: world {world}, all_reduce 256MB {dt * 1e3:.2f} ms, bus bandwidth {busbw:.1f} GB/s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
