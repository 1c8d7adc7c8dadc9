"""Pipeline schedules on DeepSpeed's ``PipelineEngine``: recipe key ``parallel.pipeline_schedule``.

``1f1b`` is DeepSpeed's ``TrainSchedule``: after a warm-up of p - s - 1 forwards, stage s
alternates one forward and one backward, so it holds at most p - s micro-batches' activations.
``gpipe`` (Huang et al., 2019) runs every micro-batch's forward, then every backward: the same
bubble, (p - 1) / (m + p - 1) of the step, and m micro-batches' activations held on every stage
(``docs/pipeline-parallelism.md``).

A schedule is a ``PipeSchedule`` whose ``steps()`` yield the engine's instructions
(``RecvActivation``, ``ForwardPass``, ``SendGrad``, ...); ``install`` makes ``engine.train_batch``
run it. DeepSpeed's engine was written for 1F1B: the last stage keeps one ``loss`` (the latest
forward's), which a backward then differentiates. Under GPipe all forwards come first, so
``install`` keeps each buffer's loss from its forward and hands it back to that buffer's
backward; the received gradient (one shared ``grad_layer``) is used right after its
``RecvGrad``, as in 1F1B. Hand-written because DeepSpeed ships no other training schedule.

``zb-h1`` (Qi et al., 2023, "Zero Bubble Pipeline Parallelism") splits each backward of stages
1..p-1 into B (``BackwardInputPass``: the input gradient, sent upstream at once, and the weight
gradients outside the deferrable linears) and W (``WeightPass``: the linears' weight gradients,
``model/parallel/weight_grad.py``). Stage s runs 1F1B's warm-up of p - s - 1 forwards, then
rounds of one forward and one B, and starts its W's only after s B's: the s held back fill the
cool-down, where 1F1B's stage waits for gradients. The bubble shrinks from (p - 1)(F + B + W)
to (p - 1)(F + B - W) per step (the paper's figure) while at most min(p - s, m) micro-batches
are between their forward and their B, as in 1F1B; W's inputs of up to s more stay held.
Stage 0 runs plain backwards: nobody waits for its input gradient. In a round the stage
receives its gradient before it sends its activation (RecvGrad before SendActivation), the
order in which neighbouring stages' blocking sends and receives match. Each B works on its own
copy of the received output gradient: the engine receives every micro-batch's into one buffer,
and a deferred W of the stage's last linear layer holds that tensor until it runs.

``install(..., timeline=[])`` records every executed instruction as ``(name, buffer_id, start,
end)`` in host seconds (``time.perf_counter``; CPU runs: the instruction's own time; on a GPU,
only its launch), which ``benchmarks/pipeline_schedules.py`` and the schedule tests read.
"""

from __future__ import annotations

import time
from types import MethodType

import torch

from deepspeed.runtime.pipe import schedule as ds_schedule

from model.parallel import weight_grad

SCHEDULES = ("1f1b", "gpipe", "zb-h1")


class BackwardInputPass(ds_schedule.BufferOpInstruction):
    """B: the backward of ``buffer_id`` with the deferrable weight gradients queued."""


class WeightPass(ds_schedule.BufferOpInstruction):
    """W: the queued weight gradients of the oldest B (``buffer_id``'s micro-batch)."""


class GPipeSchedule(ds_schedule.PipeSchedule):
    """All forwards, then all backwards (in micro-batch order), one buffer per micro-batch; the
    gradient reductions and the optimizer step after the last backward, as in ``TrainSchedule``."""

    def steps(self):
        first_or_last = self.stage_id in (0, self.stages - 1)
        for mb in range(self.micro_batches):
            cmds = []
            if self._valid_stage(self.prev_stage):
                cmds.append(ds_schedule.RecvActivation(mb))
            if first_or_last:
                cmds.append(ds_schedule.LoadMicroBatch(mb))
            cmds.append(ds_schedule.ForwardPass(mb))
            if self._valid_stage(self.next_stage):
                cmds.append(ds_schedule.SendActivation(mb))
            yield cmds
        for mb in range(self.micro_batches):
            cmds = []
            if self._valid_stage(self.next_stage):
                cmds.append(ds_schedule.RecvGrad(mb))
            cmds.append(ds_schedule.BackwardPass(mb))
            if self._valid_stage(self.prev_stage):
                cmds.append(ds_schedule.SendGrad(mb))
            if mb == self.micro_batches - 1:
                cmds += [ds_schedule.ReduceTiedGrads(), ds_schedule.ReduceGrads(), ds_schedule.OptimizerStep()]
            yield cmds

    def num_pipe_buffers(self) -> int:
        return max(2, self.micro_batches)


class ZeroBubbleH1Schedule(ds_schedule.PipeSchedule):
    """ZB-H1 (see the module docstring): 1F1B's order with each backward of stages 1..p-1 split
    into B and W, stage s holding its first s W's back; the gradient reductions and the
    optimizer step after the last W."""

    def order(self) -> list[list[tuple[str, int]]]:
        """The stage's steps as (pass, micro-batch) pairs: "F", "B" (a plain backward on stage
        0) and "W"."""
        m, s = self.micro_batches, self.stage_id
        warm = min(self.stages - s - 1, m)
        steps = [[("F", i)] for i in range(warm)]
        f, b, w = warm, 0, 0
        while b < m:
            step = [("F", f)] if f < m else []
            f += len(step)
            step.append(("B", b))
            b += 1
            if s > 0 and b > s:
                step.append(("W", w))
                w += 1
            steps.append(step)
        steps += [[("W", i)] for i in range(w, m)] if s > 0 else []
        return steps

    def steps(self):
        first, last = self.stage_id == 0, self.stage_id == self.stages - 1
        order = self.order()
        for n, step in enumerate(order):
            cmds = []
            passes = dict(step)
            if "F" in passes:
                buf = self._buffer_idx(passes["F"])
                cmds += [] if first else [ds_schedule.RecvActivation(buf)]
                cmds += [ds_schedule.LoadMicroBatch(buf)] if first or last else []
                cmds.append(ds_schedule.ForwardPass(buf))
            if "B" in passes:
                buf = self._buffer_idx(passes["B"])
                cmds += [] if last else [ds_schedule.RecvGrad(buf)]
            if "F" in passes and not last:      # after the RecvGrad: the neighbours' order
                cmds.append(ds_schedule.SendActivation(self._buffer_idx(passes["F"])))
            if "B" in passes:
                buf = self._buffer_idx(passes["B"])
                cmds.append(ds_schedule.BackwardPass(buf) if first else BackwardInputPass(buf))
                cmds += [] if first else [ds_schedule.SendGrad(buf)]
            if "W" in passes:
                cmds.append(WeightPass(self._buffer_idx(passes["W"])))
            if n == len(order) - 1:
                cmds += [ds_schedule.ReduceTiedGrads(), ds_schedule.ReduceGrads(), ds_schedule.OptimizerStep()]
            yield cmds

    def num_pipe_buffers(self) -> int:
        return max(2, min(self.stages - self.stage_id, self.micro_batches))


def schedule_for(name: str, micro_batches: int, stages: int, stage_id: int) -> ds_schedule.PipeSchedule:
    """The training schedule ``name`` for one stage."""
    cls = {"1f1b": ds_schedule.TrainSchedule, "gpipe": GPipeSchedule, "zb-h1": ZeroBubbleH1Schedule}[name]
    return cls(micro_batches=micro_batches, stages=stages, stage_id=stage_id)


def fp32_accumulator_sink(optimizer):
    """Where a deferred weight gradient goes under DeepSpeed's ``BF16_Optimizer`` (bf16 at
    ZeRO-0, and at ZeRO-1 with ``"data_types": {"grad_accum_dtype": "fp32"}``): its fp32
    accumulator. That optimizer zeroes ``.grad`` before every backward and adds it into the fp32
    accumulators after it (``update_hp_grads``), so a gradient added to ``.grad`` after its B is
    wiped by the next backward or, in the cool-down, never counted. The W adds its bf16 gradient
    in fp32 there, as ``update_hp_grads`` would have. None (``.grad``, where it is read at the
    reduction) for every other optimizer: DeepSpeed's ZeRO-1 keeps ``.grad`` until the
    ``ReduceGrads`` instruction, which runs after the last W."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    if type(optimizer) is not BF16_Optimizer:
        return None
    where = {id(p): (i, j) for i, group in enumerate(optimizer.bf16_groups) for j, p in enumerate(group)}

    def sink(param, grad) -> bool:
        i, j = where[id(param)]
        hp = optimizer.fp32_groups_gradients[i][j]
        hp.add_(grad.to(hp.dtype).view(hp.shape))
        param._hp_grad = hp
        optimizer.fp32_groups_has_gradients[i][j] = True
        return True
    return sink


def install(engine, name: str, timeline: list | None = None) -> None:
    """Make ``engine.train_batch`` (a ``PipelineEngine``) run schedule ``name``; with
    ``timeline``, record each executed instruction there (see the module docstring)."""
    weight_grad.STORE.configure(enabled=name == "zb-h1", reduce=engine.module.grad_sync.summed,
                                sink=fp32_accumulator_sink(engine.optimizer))
    table = dict(engine._INSTRUCTION_MAP)
    if name != "1f1b":
        engine._train_schedule = MethodType(
            lambda self: schedule_for(name, self.micro_batches, self.num_stages, self.stage_id), engine)
        # One loss per buffer on the last stage (see the module docstring).
        forward, backward = table[ds_schedule.ForwardPass], table[ds_schedule.BackwardPass]
        losses: dict[int, object] = {}

        def forward_pass(self, buffer_id):
            forward(self, buffer_id)
            if self.is_last_stage() and self.module.training:     # not eval_batch's forwards
                losses[buffer_id] = self.loss

        def backward_pass(self, buffer_id):
            if self.is_last_stage():
                self.loss = losses.pop(buffer_id)
            backward(self, buffer_id)

        def backward_input_pass(self, buffer_id):
            # The engine receives every micro-batch's output gradient into one buffer, and the
            # last linear's deferred W holds that very tensor (the residual passes it through):
            # B gets its own copy, so the next RecvGrad cannot overwrite what a W will read.
            received = self.grad_layer
            if received is not None:
                self.grad_layer = (received.clone() if torch.is_tensor(received)
                                   else type(received)(g.clone() for g in received))
            try:
                with weight_grad.STORE.deferring():
                    backward_pass(self, buffer_id)
            finally:
                self.grad_layer = received

        def weight_pass(self, buffer_id):
            weight_grad.STORE.run_oldest()

        table[ds_schedule.ForwardPass], table[ds_schedule.BackwardPass] = forward_pass, backward_pass
        table[BackwardInputPass], table[WeightPass] = backward_input_pass, weight_pass
    if timeline is not None:
        table = {cls: _timed(fn, cls.__name__, timeline) for cls, fn in table.items()}
    engine._INSTRUCTION_MAP = table


def _timed(fn, name: str, timeline: list):
    def timed(self, **kwargs):
        start = time.perf_counter()
        fn(self, **kwargs)
        timeline.append((name, kwargs.get("buffer_id"), start, time.perf_counter()))
    return timed
