"""Blocking point-to-point transfers between pipeline stages (tuples of tensors).

DeepSpeed's pipeline engine moves activations with its own ``deepspeed.runtime.pipe.p2p``; these
helpers serve code that runs a schedule by hand (``benchmarks/pipeline_schedules.py``). Shapes
and dtypes are agreed in advance (every micro-batch has the same shapes), so no metadata is sent.
Ranks are global ranks; gloo and NCCL both pair each ``send`` with the matching ``recv`` in
order, so both sides must issue their transfers in the same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def send_tensors(tensors: tuple[torch.Tensor, ...], dst: int) -> None:
    """Send each tensor of ``tensors`` to global rank ``dst``, in order."""
    for t in tensors:
        dist.send(t.detach().contiguous(), dst)


def recv_tensors(like: tuple[torch.Tensor, ...], src: int) -> tuple[torch.Tensor, ...]:
    """Receive tensors shaped and typed like ``like`` from global rank ``src``, in order."""
    out = tuple(torch.empty_like(t) for t in like)
    for t in out:
        dist.recv(t, src)
    return out
