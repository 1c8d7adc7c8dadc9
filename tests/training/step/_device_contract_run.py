"""Run by test_device_contract.py on every rank: ``launch.train.main(argv)`` with every tensor
that this repository's code creates on the host tagged, and every torch.distributed collective
checked for tagged tensors.

On a GPU the default process group is NCCL, which refuses CPU tensors; on CPU everything is a CPU
tensor, so the device alone shows nothing. Instead a ``TorchFunctionMode`` follows where tensors
come from: a tensor is "host-born" when our code (``model/``, ``training/``, ``launch/``) makes it
with a factory function and no ``device=`` (``torch.zeros(n)``, ``torch.tensor(values)``), with a
literal CPU device (``device="cpu"``, ``torch.device("cpu")``), or with ``.cpu()``/``.numpy()``;
anything computed from a host-born tensor is host-born too, until an explicit ``.to(device)``
(an in-place op, e.g. ``param.copy_(host_tensor)``, leaves its destination where it was).
A collective given a host-born tensor would fail on NCCL: it is recorded in
``$DEVICE_CONTRACT.<rank>.json`` with the collective and our frame that made the tensor.
"""

import json
import linecache
import os
import sys
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

REPO = Path(__file__).resolve().parents[3]
# Our code, and the file test_device_contract.py injects a host tensor from (counted as ours).
OURS = (*(str(REPO / d) + os.sep for d in ("model", "training", "launch")),
        str(REPO / "tests" / "training" / "step" / "_device_contract_host_stats.py"))
TORCH = str(Path(torch.__file__).parent) + os.sep
FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "from_numpy",
             "randn", "rand", "randint", "linspace", "eye"}
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
               "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
               "all_to_all_single", "broadcast", "send", "recv", "isend", "irecv")

host_born: dict[int, tuple] = {}      # id(tensor) -> (weak reference, where it was made)
violations: list[dict] = []


def _mark(t: torch.Tensor, origin: str) -> None:
    key = id(t)
    host_born[key] = (weakref.ref(t, lambda _, key=key: host_born.pop(key, None)), origin)


def _origin(t: torch.Tensor):
    entry = host_born.get(id(t))
    return entry[1] if entry is not None and entry[0]() is t else None


def _our_frame():
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(TORCH):
        frame = frame.f_back
    if frame is not None and frame.f_code.co_filename.startswith(OURS):
        return frame
    return None


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _literal_cpu(frame, device) -> bool:
    if isinstance(device, str):
        return device.startswith("cpu")
    # A torch.device written in place (the statement may span a few lines).
    text = "".join(linecache.getline(frame.f_code.co_filename, frame.f_lineno + i) for i in range(3))
    return 'device("cpu")' in text or "device('cpu')" in text


class Provenance(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        origin = None
        if name in FACTORIES or name in ("cpu", "numpy"):
            frame = _our_frame()
            if frame is not None and (name in ("cpu", "numpy") or "device" not in kwargs
                                      or _literal_cpu(frame, kwargs["device"])):
                origin = f"{name} at {Path(frame.f_code.co_filename).relative_to(REPO)}:{frame.f_lineno}"
        elif name == "to" and (any(isinstance(a, (torch.device, str)) for a in args[1:]) or "device" in kwargs):
            for t in _tensors(out):            # an explicit move (on CPU the same object): trusted
                host_born.pop(id(t), None)
            return out
        elif name.endswith("_") and not name.startswith("__") and args:
            return out                         # in place: the destination keeps its device
        else:
            origin = next((o for o in map(_origin, _tensors((args, kwargs))) if o), None)
        if origin is not None:
            for t in _tensors(out):
                _mark(t, origin)
        return out


def _checked(name, fn):
    def run(*args, **kwargs):
        for t in _tensors((args, kwargs)):
            if _origin(t):
                violations.append({"collective": name, "tensor": _origin(t),
                                   "shape": list(t.shape), "dtype": str(t.dtype)})
        return fn(*args, **kwargs)
    return run


for _name in COLLECTIVES:           # before our modules import them
    if hasattr(dist, _name):
        setattr(dist, _name, _checked(_name, getattr(dist, _name)))

sys.path.insert(0, str(REPO))
from launch import train  # noqa: E402

if __name__ == "__main__":
    with Provenance():
        rc = train.main(sys.argv[1:])
    rank = os.environ.get("RANK", "0")
    Path(f"{os.environ['DEVICE_CONTRACT']}.{rank}.json").write_text(json.dumps(violations))
    sys.exit(rc)
