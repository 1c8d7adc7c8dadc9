"""Run by test_step_memory.py on every rank: ``launch.train.main(argv)`` with every optimizer step
after the first (``Stepper.train_step``) run under ``torch.profiler`` with ``profile_memory``.

The profiler sees every allocation and free of the CPU allocator, each with the allocator's total
counted from the moment profiling started; the largest such total is how far the step rose above
the memory held before it (parameters, gradients and optimizer states at rest, which
``test_estimate_memory.py`` checks on their own). ``engine.step`` runs inside a
``record_function`` range, which splits the peaks into forward+backward and the optimizer step.
Writes ``{step: {"forward_backward": bytes, "optimizer_step": bytes}}`` to
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
from training import stepping  # noqa: E402


OPTIMIZER = "optimizer_step"


def _events(nodes):
    for node in nodes:
        yield node
        yield from _events(node.children)


peaks: dict[int, dict] = {}
train_step = stepping.Stepper.train_step


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
    phases = {"forward_backward": 0, OPTIMIZER: 0}
    for e in events:
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            key = OPTIMIZER if e.start_time_ns >= start else "forward_backward"
            phases[key] = max(phases[key], e.extra_fields.total_allocated)
    peaks[step] = phases
    Path(f"{os.environ['STEP_MEMORY']}.{os.environ.get('RANK', '0')}.json").write_text(json.dumps(peaks))
    return out


stepping.Stepper.train_step = profiled_train_step

if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(train.main(sys.argv[1:]))
