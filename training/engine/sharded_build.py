"""Build a model that no rank holds whole: ZeRO-3's ``deepspeed.zero.Init``.

Without it every rank constructs its tensor/expert-parallel shard whole in fp32 on the host, and
DeepSpeed partitions it only in ``deepspeed.initialize``: Mixtral 8x7B at ZeRO-3 with ep 1 would
need 187 GB per rank just to start. Under ``zero.Init`` each module's parameters are partitioned
over the data-parallel group as soon as its constructor returns, in the training dtype, on the
device (or where ``offload_param`` puts them).

The weights must still be the full tensors every layout draws (``model/parallel/draw.py``), but
our layers create their parameters empty and the model initializes them after construction,
when they are already partitioned. So the model is built uninitialized, then each parameter in
turn: every data-parallel rank draws this model-parallel rank's shard in fp32 on the host (only
the blocks of the full tensor that meet it, the same values on every rank), copies its own
ZeRO-3 partition of it into ``ds_tensor`` and frees the rest (``write_partition``): the
initialization gathers and broadcasts nothing.
``GatheredParameters(modifier_rank=None)`` with the same draw on every rank would be the public
route, but DeepSpeed 0.19.8 discards in-place writes on exit (``partition(has_been_updated=
False)``); ``modifier_rank=0`` adds an all-gather and a broadcast of every tensor (measured on 2
gloo ranks, 0.8B fp32: 51 s and +2.7-3.2 GB of peak RSS per rank, against 20 s and +1.9-2.2 GB
here).

Peak memory per rank (``planning/build_memory.py``): this rank's partition of the model as
built, plus, while a module is created, the module whole and ``zero.Init``'s broadcast of it
from dp rank 0; then, while a tensor is drawn, its fp32 tp/ep shard and one block. On a
GPU the partitions and the module live on the device and the host holds only the draw.

``zero.Init`` creates every floating tensor of a constructor in the training dtype, buffers
included: the RoPE frequencies are recomputed in fp32 afterwards (``Transformer.reset_buffers``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from model import Transformer
from model.parallel.groups import ParallelGroups
from model.parallel.draw import fill_from_full


def builds_partitioned(ds: dict | None) -> bool:
    """Whether a run with DeepSpeed JSON ``ds`` builds its model under ``zero.Init`` (ZeRO-3)."""
    return ds is not None and int((ds.get("zero_optimization") or {}).get("stage", 0)) == 3


def build_partitioned(cfg, groups: ParallelGroups, ds: dict, seed: int,
                      init_from: Path | None = None) -> Transformer:
    """The model at this rank's layout, partitioned over the data-parallel group as it is built.

    Args:
        cfg: the model config.
        groups: the job's groups; ZeRO partitions over dp x cp (``get_data_parallel_group``; tp x ep
            is DeepSpeed's ``mpu``).
        ds: the DeepSpeed JSON as ``deepspeed.initialize`` gets it (dtype, ZeRO settings).
        seed: init seed (the same full weights as every other layout).
        init_from: optional init dir (``--init-from``) whose full weights are loaded instead,
            one tensor at a time.

    Communicates over the data-parallel group (``zero.Init``'s broadcast of each new parameter).
    """
    import deepspeed

    zero = ds.get("zero_optimization") or {}
    if (zero.get("offload_param") or {}).get("device") == "nvme" or zero.get("zero_hpz_partition_size", 1) > 1:
        raise ValueError("zero_optimization: offload_param to nvme and zero_hpz_partition_size > 1 "
                         "are not supported by the partitioned build (training/engine/sharded_build.py): "
                         "offload to cpu, or leave zero_hpz_partition_size at 1")
    # mpu: DeepSpeed checks the JSON's batch sizes against dp x cp.
    with deepspeed.zero.Init(config_dict_or_path=ds, mpu=groups,
                             data_parallel_group=groups.get_data_parallel_group()):
        model = Transformer(cfg, groups, init_seed=None)
    model.reset_buffers()
    if init_from is None:
        model.reset_parameters(seed, write_partition)
        return model
    from safetensors import safe_open
    with safe_open(str(Path(init_from) / "model.safetensors"), framework="pt") as f:
        names, stored = {n for n, _ in model.named_parameters()}, set(f.keys())
        if stored != names:
            raise ValueError(f"--init-from {init_from}: model.safetensors does not hold this "
                             f"model's weights (missing {sorted(names - stored)[:3]}, unexpected "
                             f"{sorted(stored - names)[:3]}); re-create the init dir with "
                             f"`python launch/convert_hf.py import`")
        fill_from_full(model, lambda name, shape: f.get_tensor(name), write_partition)
    return model


@torch.no_grad()
def write_partition(param: torch.nn.Parameter, shard: torch.Tensor) -> None:
    """Store this data-parallel rank's ZeRO-3 partition of ``shard`` (``param``'s whole tensor
    at this model-parallel rank) in ``param.ds_tensor``, as DeepSpeed 0.19.8 lays it out
    (``partition_parameters.py``, ``_partition_param``): the flattened tensor, padded to a
    multiple of the partition group's size, rank r holding elements [r n, (r + 1) n). Only
    between ``zero.Init`` and ``deepspeed.initialize``: no other copy of the weights exists yet
    (the engine's fp32 master partition is made from ``ds_tensor``)."""
    import deepspeed.comm as ds_dist

    assert tuple(shard.shape) == tuple(param.ds_shape), (shard.shape, param.ds_shape)
    part = param.ds_tensor                                   # (n,) this rank's partition
    n = part.numel()
    start = n * ds_dist.get_rank(group=param.ds_process_group)
    flat = shard.reshape(-1)
    count = max(0, min(n, flat.numel() - start))
    part[:count].copy_(flat[start:start + count])
    part[count:].zero_()                                     # padding
