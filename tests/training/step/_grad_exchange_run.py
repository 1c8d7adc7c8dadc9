"""Run by test_grad_compression_run.py on every rank: ``launch.train.main(argv)`` with each
optimizer step (``Stepper.train_step``) counting the bytes handed to
``torch.distributed.all_reduce``, by who hands them: ``deepspeed`` (its data-parallel all-reduce
and its scalars), ``powersgd`` (``model/parallel/powersgd.py``) or ``trainer`` (the step's
statistics and flags). It also records a fingerprint of the PowerSGD state after each step and,
with ``NAN_STEP`` set, makes that step's loss NaN (the final norm's output times NaN), so that the
step is skipped; with ``SPIKE_STEP`` (and ``SPIKE_FACTOR``, default 1000) multiplies that step's
objective (what backward sees, not the logged loss: ``Stepper._forward``'s return), so that its
gradient, and only its gradient, spikes. Writes ``{step: {"bytes": {...}, "state": fingerprint}}``
to ``$EXCHANGE_OUT.<rank>.json`` and, with ``LOADED_OUT`` set, the PowerSGD state the run starts
its first step with (after a resume: what it loaded) to ``$LOADED_OUT.<rank>.pt``.
"""

import hashlib
import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from deepspeed import comm as ds_comm

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from launch import train  # noqa: E402
from training.step import stepper  # noqa: E402

COMPRESSOR = os.path.join("model", "parallel", "powersgd.py")


def _caller() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if f"{os.sep}deepspeed{os.sep}" in name:
            return "deepspeed"
        if name.endswith(COMPRESSOR):
            return "powersgd"
        frame = frame.f_back
    return "trainer"


sent: Counter | None = None
all_reduce = dist.all_reduce


def counted_all_reduce(tensor, *args, **kwargs):
    if sent is not None:
        sent[_caller()] += tensor.numel() * tensor.element_size()
    return all_reduce(tensor, *args, **kwargs)


def _counted(name: str, position: int, module=dist):
    """``module.<name>`` counting the bytes of its argument ``position`` (what this rank hands
    over: a reduce-scatter's whole input, an all-gather's own shard, a reduce's tensor) under
    "<caller>:<name>"."""
    original = getattr(module, name)

    def counted(*args, **kwargs):
        if sent is not None and len(args) > position and torch.is_tensor(args[position]):
            sent[f"{_caller()}:{name}"] += args[position].numel() * args[position].element_size()
        return original(*args, **kwargs)
    return counted


OTHER_COLLECTIVES = {"reduce_scatter_tensor": 1, "all_gather_into_tensor": 1, "all_gather": 1, "reduce": 0,
                     "broadcast": 0}


def fingerprint(compressor) -> str | None:
    return None if compressor is None else state_fingerprint(compressor.state_dict())


def state_fingerprint(state: dict) -> str:
    """A hash of PowerSGD's ``state_dict`` (the count, Q and the errors; the same as
    ``test_grad_compression_run.fingerprint`` of a saved ``trainer_state_rank<r>.pt``)."""
    digest = hashlib.sha256(str(state["reductions"]).encode())
    for t in (state["q"] or []) + (state["errors"] or []):
        digest.update(t.numpy().tobytes())
    return digest.hexdigest()


records: dict[int, dict] = {}
train_step = stepper.Stepper.train_step
NAN_STEP = int(os.environ.get("NAN_STEP", "0"))
SPIKE_STEP, SPIKE_FACTOR = int(os.environ.get("SPIKE_STEP", "0")), float(os.environ.get("SPIKE_FACTOR", "1000"))
scale = {"value": 1.0}
forward = stepper.Stepper._forward


def spiked_forward(self, input_ids, labels, stats, gas):
    loss = forward(self, input_ids, labels, stats, gas)
    return loss * SPIKE_FACTOR if self.where.step == SPIKE_STEP else loss


def counted_train_step(self, step, batches):
    global sent
    if not hasattr(self, "_nan_hook"):
        self._nan_hook = self.model.norm.register_forward_hook(lambda m, i, out: out * scale["value"])
    scale["value"] = float("nan") if step == NAN_STEP else 1.0
    if not records and os.environ.get("LOADED_OUT") and self.compressor is not None:
        torch.save(self.compressor.state_dict(), f"{os.environ['LOADED_OUT']}.{os.environ.get('RANK', '0')}.pt")
    sent = Counter()
    try:
        out = train_step(self, step, batches)
    finally:
        records[step] = {"bytes": dict(sent), "state": fingerprint(self.compressor)}
        sent = None
    Path(f"{os.environ['EXCHANGE_OUT']}.{os.environ.get('RANK', '0')}.json").write_text(json.dumps(records))
    return out


dist.all_reduce = counted_all_reduce
for _name, _position in OTHER_COLLECTIVES.items():
    setattr(dist, _name, _counted(_name, _position))
# ZeRO-1's all-gather of the updated parameters goes through deepspeed.comm, which keeps its own
# reference to torch's function.
setattr(ds_comm, "all_gather_into_tensor", _counted("all_gather_into_tensor", 1, ds_comm))
stepper.Stepper.train_step = counted_train_step
stepper.Stepper._forward = spiked_forward

if __name__ == "__main__":
    sys.exit(train.main(sys.argv[1:]))
