"""Run by test_step_memory.py on every rank: ``launch.train.main(argv)`` with every optimizer step
after the first (``Stepper.train_step``) run under ``torch.profiler`` with ``profile_memory``.

The profiler sees every allocation and free of the CPU allocator; replayed in order from zero, the
largest running total is how far the step rose above the memory held before it (parameters,
gradients and optimizer states at rest, which ``test_estimate_memory.py`` checks on their own). ``engine.step`` runs inside a
``record_function`` range, which splits the peaks into forward+backward and the optimizer step.
Writes ``{step: {phase: {"bytes": peak, "largest": [[bytes, "op < parent op"], ...]}}}`` to
``$STEP_MEMORY.<rank>.json``.
"""

import json
import os
import sys
from pathlib import Path

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from launch import train  # noqa: E402
from training.step import stepper  # noqa: E402


OPTIMIZER = "optimizer_step"


def _events(nodes):
    for node in nodes:
        yield node
        yield from _events(node.children)


peaks: dict[int, dict] = {}
train_step = stepper.Stepper.train_step


def profiled_train_step(self, step, batches):
    if step == 1:                     # DeepSpeed allocates its lasting buffers in the first step
        return train_step(self, step, batches)
    engine_step = self.engine.step

    def recorded_step(*args, **kwargs):
        with record_function(OPTIMIZER):
            return engine_step(*args, **kwargs)

    self.engine.step = recorded_step
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = train_step(self, step, batches)
    finally:
        del self.engine.step
    events = list(_events(prof.profiler.kineto_results.experimental_event_tree()))
    start = min(e.start_time_ns for e in events if e.name == OPTIMIZER)
    peaks[step] = _phase_peaks(events, start)
    Path(f"{os.environ['STEP_MEMORY']}.{os.environ.get('RANK', '0')}.json").write_text(json.dumps(peaks))
    return out


def _phase_peaks(events, start: int) -> dict:
    """Replay this profile's CPU allocations and frees in time order, from zero: the allocator's
    own running total (``total_allocated``) also carries what an earlier profile allocated and
    freed after it closed. Each phase's peak comes with the largest allocations alive at it and
    the ops that made them, so that an outlier names its cause."""
    allocs = sorted((e for e in events if e.tag == _EventType.Allocation
                     and e.extra_fields.device.type == "cpu"), key=lambda e: e.start_time_ns)
    live, total = {}, 0
    phases = {"forward_backward": {"bytes": 0, "largest": []}, OPTIMIZER: {"bytes": 0, "largest": []}}
    for e in allocs:
        size, ptr = e.extra_fields.alloc_size, e.extra_fields.ptr
        if size > 0:
            live[ptr] = e
        elif live.pop(ptr, None) is None:
            continue                  # allocated before the profile: not part of the rise
        total += size
        phase = phases[OPTIMIZER if e.start_time_ns >= start else "forward_backward"]
        if total > phase["bytes"]:
            phase["bytes"] = total
            phase["live"] = list(live.values())
    for phase in phases.values():
        big = sorted(phase.pop("live", []), key=lambda e: -e.extra_fields.alloc_size)[:4]
        phase["largest"] = [[e.extra_fields.alloc_size, " < ".join(_op_path(e))] for e in big]
    return phases


def _op_path(event) -> list[str]:
    names, node = [], event.parent
    while node is not None and len(names) < 4:
        names.append(node.name)
        node = node.parent
    return names


stepper.Stepper.train_step = profiled_train_step

if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(train.main(sys.argv[1:]))
