"""The largest live tensors of this process, one row per storage, named where we can tell.

Used by the out-of-memory report (``planning/oom.py``): a ``gc`` scan finds every tensor, views of
one storage (e.g. the slices of a flat ZeRO buffer) share a row, and the names come from the
objects the trainer handed over (``training.step.stepper.StepContext``): the model's parameters,
their gradients and ZeRO-3 partitions, the optimizer's states and the buffers of DeepSpeed's ZeRO
optimizer. Tensors none of these own (activations, communication buffers) stay unnamed.
"""

from __future__ import annotations

import gc
import warnings

import torch


def largest(model, engine, top: int) -> list[dict]:
    """The ``top`` largest live storages: MB, shape, dtype, device and name (or None).

    Args:
        model: the ``torch.nn.Module`` being trained, or None.
        engine: the DeepSpeed engine (its ``optimizer``), or None.
        top: how many rows.
    """
    labels = _labels(model, engine)
    storages: dict[tuple, tuple[int, torch.Tensor]] = {}
    with warnings.catch_warnings():            # isinstance() on deprecated torch objects warns
        warnings.simplefilter("ignore")
        objects = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in objects:
        try:
            if obj.device.type == "meta":
                continue
            key, nbytes = _storage_key(obj), obj.untyped_storage().nbytes()
        except Exception:            # sparse, fake or otherwise storage-less tensors
            continue
        if nbytes and (key not in storages or obj.numel() > storages[key][1].numel()):
            storages[key] = (nbytes, obj)
    rows = []
    for key, (nbytes, t) in sorted(storages.items(), key=lambda kv: -kv[1][0])[:top]:
        names = labels.get(key, [])
        name = names[0] if len(names) == 1 else (
            f"{names[0]} + {len(names) - 1} more (views of one buffer)" if names else None)
        rows.append({"mb": nbytes / 1e6, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                     "device": str(t.device), "name": name})
    return rows


def _storage_key(t: torch.Tensor) -> tuple:
    return t.device.type, t.device.index, t.untyped_storage().data_ptr()


class _Names:
    """Storage -> names; each tensor object keeps its first (most telling) name."""

    def __init__(self):
        self.labels: dict[tuple, list[str]] = {}
        self.seen: set[int] = set()

    def add(self, t, name: str) -> None:
        if isinstance(t, torch.Tensor) and t.numel() and id(t) not in self.seen:
            self.seen.add(id(t))
            self.labels.setdefault(_storage_key(t), []).append(name)

    def add_all(self, value, name: str, depth: int = 2) -> None:
        """Tensors in lists, dicts and DeepSpeed's plain objects (e.g. its gradient buckets)."""
        if isinstance(value, torch.Tensor):
            self.add(value, name)
        elif depth and isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                self.add_all(v, f"{name}[{i}]", depth - 1)
        elif depth and isinstance(value, dict):
            for k, v in value.items():
                self.add_all(v, f"{name}[{k!r}]", depth - 1)
        elif depth and type(value).__module__.startswith("deepspeed") and hasattr(value, "__dict__"):
            for k, v in vars(value).items():
                self.add_all(v, f"{name}.{k}", depth - 1)


def _labels(model, engine) -> dict[tuple, list[str]]:
    """Parameters, their gradients and ZeRO-3 partitions first, then optimizer states, then the
    ZeRO optimizer's own buffers."""
    names, param_names = _Names(), {}
    for name, p in (model.named_parameters() if model is not None else ()):
        param_names[id(p)] = name
        names.add(p, name)
        names.add(p.grad, f"grad of {name}")
        names.add(getattr(p, "ds_tensor", None), f"{name} (ZeRO-3 partition)")
    opt = getattr(engine, "optimizer", None)
    inner = getattr(opt, "optimizer", opt)           # DeepSpeed's ZeRO wrappers hold a torch one
    if isinstance(inner, torch.optim.Optimizer):
        for g, group in enumerate(inner.param_groups):
            for p in group["params"]:
                pname = param_names.get(id(p)) or f"fp32 flat partition of param group {g}"
                if id(p) not in param_names:
                    names.add(p, pname)
                for key, value in inner.state.get(p, {}).items():
                    names.add(value, f"optimizer {key} of {pname}")
    if opt is not None and opt is not inner:
        for attr, value in vars(opt).items():
            names.add_all(value, f"{type(opt).__name__}.{attr}")
    return names.labels
