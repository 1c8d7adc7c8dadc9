"""The measured counterpart of ``planning/memory_model.py``'s activation model."""

from __future__ import annotations


def saved_activation_bytes(model, input_ids, labels, skip=None) -> int:
    """Measured counterpart of ``activation_bytes``: bytes of the distinct storages autograd
    saved during one forward and still holds at its end (a graph that was detached, e.g. router
    entropy, is freed), parameters excluded, and tensors for which ``skip(t)`` is true (e.g. the
    masks CPU kernels build where GPU kernels build none)."""
    import weakref

    import torch
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, list] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and not (skip and skip(t)):
            seen.setdefault(storage.data_ptr(), []).append((weakref.ref(t), storage.nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids, labels)
    alive = [v for v in seen.values() if any(ref() is not None for ref, _ in v)]
    del out
    return sum(max(n for _, n in v) for v in alive)
