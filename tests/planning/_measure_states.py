"""Measure the model-state bytes each rank holds under DeepSpeed ZeRO 1, 2 and 3 (bf16 and fp32).

Run by ``tests/planning/test_estimate_memory.py`` as
``python -m torch.distributed.run --nproc_per_node 2 tests/planning/_measure_states.py OUT.json``.

For each of ``ds_configs/zero{1,2,3}[_fp32].json`` it builds ``model.Transformer`` for the tiny
dense recipe widened to hidden 256 (so that DeepSpeed's partition padding is well under 1%), runs
``deepspeed.initialize`` with the JSON's optimizer (torch ``AdamW``: ``"torch_adam": true``), one
full step (so that Adam's states exist) and a second forward + backward (so that the gradient
partitions are full), then sums, per rank, the bytes of the distinct storages it holds:

- ``params``: the module's parameters (``p.ds_tensor``, the partition, under ZeRO-3);
- ``grads``: ``p.grad`` where set, ZeRO-1/2's ``averaged_gradients`` / ``grads_in_partition``,
  ZeRO-3's ``grad_partitions_flat_buffer``;
- ``optimizer``: the fp32 master partitions (``single_partition_of_fp32_groups`` /
  ``fp32_partitioned_groups_flat``) when they are not the parameters themselves, and every tensor
  in the torch optimizer's ``state`` (``exp_avg``, ``exp_avg_sq``; the scalar ``step``).

Reduce/prefetch buckets are left out (they are buffers, not model states; the JSON's are shrunk
here so that 2 ranks x 6 engines stay small). Rank 0 writes one JSON object
``{config: {psi, dp, params, grads, optimizer}}``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

CONFIGS = ["zero1", "zero2", "zero3", "zero1_fp32", "zero2_fp32", "zero3_fp32"]
OVERRIDES = ["model.hidden_size=256", "model.ffn_hidden_size=512", "data.seq_len=32"]


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _tensors(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def held_bytes(engine) -> dict[str, int]:
    """Bytes of distinct storages per kind (a storage counts once, under its first kind)."""
    opt = engine.optimizer
    seen: set[int] = set()
    out = {"params": 0, "grads": 0, "optimizer": 0}

    def add(kind, tensors):
        for t in tensors:
            if t is None or t.numel() == 0:
                continue
            ptr, nbytes = _storage_key(t)
            if ptr not in seen:
                seen.add(ptr)
                out[kind] += nbytes

    params = list(engine.module.parameters())
    add("params", (getattr(p, "ds_tensor", p) for p in params))
    add("grads", (p.grad for p in params))
    for name in ("averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer"):
        add("grads", _tensors(getattr(opt, name, None)))
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        add("optimizer", _tensors(getattr(opt, name, None)))
    inner = getattr(opt, "optimizer", opt)
    add("optimizer", _tensors(list(inner.state.values())))
    return out


def main(out_path: str) -> None:
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from training.config.ds_checks import validate_ds_config
    from training.config.ds_config import load_ds_config
    from training.config.recipe import load_recipe
    from model import Transformer

    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    recipe = load_recipe(REPO / "recipes" / "tiny_dense.yaml", OVERRIDES)
    results = {}
    for name in CONFIGS:
        cfg = load_ds_config(str(REPO / "ds_configs" / f"{name}.json"))
        cfg.pop("scheduler", None)
        cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"] = 2, 1
        cfg["train_batch_size"] = 2 * world
        zero = cfg["zero_optimization"]
        for key in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size"):
            if key in zero:
                zero[key] = 100_000
        cfg = validate_ds_config(cfg, world)
        torch.manual_seed(0)
        model = Transformer(recipe.model)
        psi = sum(p.numel() for p in model.parameters())
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        assert type(engine.optimizer.optimizer).__name__ == "AdamW", type(engine.optimizer.optimizer)
        dtype = next(p for p in engine.module.parameters()).dtype
        gen = torch.Generator().manual_seed(rank)
        for step in range(2):
            ids = torch.randint(0, recipe.model.vocab_size, (2, recipe.seq_len), generator=gen)
            out = engine(ids, ids)
            engine.backward(out.ce_sum / out.num_target_tokens)
            if step == 0:
                engine.step()
        row = held_bytes(engine)
        row.update(psi=psi, dp=world, stage=zero["stage"], dtype=str(dtype))
        results[name] = row
        engine.destroy()
        del engine, model
    if rank == 0:
        Path(out_path).write_text(json.dumps(results, indent=1))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
