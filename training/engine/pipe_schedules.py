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
"""

from __future__ import annotations

from types import MethodType

from deepspeed.runtime.pipe import schedule as ds_schedule

SCHEDULES = ("1f1b", "gpipe")


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


def schedule_for(name: str, micro_batches: int, stages: int, stage_id: int) -> ds_schedule.PipeSchedule:
    """The training schedule ``name`` for one stage."""
    cls = {"1f1b": ds_schedule.TrainSchedule, "gpipe": GPipeSchedule}[name]
    return cls(micro_batches=micro_batches, stages=stages, stage_id=stage_id)


def install(engine, name: str) -> None:
    """Make ``engine.train_batch`` (a ``PipelineEngine``) run schedule ``name``."""
    if name == "1f1b":
        return
    engine._train_schedule = MethodType(
        lambda self: schedule_for(name, self.micro_batches, self.num_stages, self.stage_id), engine)
    # One loss per buffer on the last stage (see the module docstring).
    table = dict(engine._INSTRUCTION_MAP)
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

    table[ds_schedule.ForwardPass], table[ds_schedule.BackwardPass] = forward_pass, backward_pass
    engine._INSTRUCTION_MAP = table
