"""Preemption: a signal makes every rank finish its optimizer step, save a checkpoint there, and exit.

Clusters stop jobs with a signal before they kill them: SLURM sends SIGTERM to every task (or the
signal chosen with ``--signal``, ahead of the time limit), and torchrun and DeepSpeed's launcher
forward SIGTERM to every rank, then SIGKILL some seconds later. The handler only records that a
signal came: a repeated signal (SLURM's and the launcher's copies both arrive) changes nothing and
never interrupts a save in progress. In every optimizer step the ranks agree whether any of them
was signalled (``Stepper._to_host``: one all-reduce of one number over the job, brought to the
host with the step's statistics), so that all of them save the same step and stop together (a
rank that stopped alone would leave the others waiting in the next step's collectives). A signal
that comes after that point of a step stops the run after the next one. The run then exits with
``EXIT_CODE``; the same command resumes from that step.

The handlers are in place from the start of ``Run.train``, before data preparation, the model
build and a checkpoint load: a signal in start-up is recorded, and the run saves its first step
and exits. SIGUSR1, the launch scripts' signal (``launch/common.sh``), is always among them.
"""

from __future__ import annotations

import signal
import sys

EXIT_CODE = 75      # EX_TEMPFAIL: stopped on request, checkpoint saved, run the command again
ALWAYS = ("SIGUSR1",)   # the launch scripts' preemption signal (launch/common.sh): never fatal


def handled(names: tuple[str, ...]) -> tuple[str, ...]:
    """The signals a run handles: ``train.preemption_signals`` and SIGUSR1, which the launch
    scripts send ahead of a preemption whatever the recipe lists."""
    return tuple(dict.fromkeys((*names, *ALWAYS)))


class Preemption:
    """Records the signals in ``names`` (e.g. ``("SIGTERM", "SIGUSR1")``) from construction until
    ``close``: ``received`` is the first one's name, or None."""

    def __init__(self, names: tuple[str, ...], announce: bool = True):
        self.received: str | None = None
        self.announce = announce
        self._previous = {}
        for name in names:
            signum = getattr(signal, name)
            self._previous[signum] = signal.signal(signum, self._handler)

    def _handler(self, signum, frame) -> None:
        if self.received is None and self.announce:
            print(f"received {signal.Signals(signum).name}: finishing this optimizer step, then "
                  f"saving a checkpoint and exiting", file=sys.stderr, flush=True)
        self.received = self.received or signal.Signals(signum).name

    def close(self) -> None:
        """Put back the handlers that were there before; SIGUSR1's default (the process killed)
        becomes ignored: a launch script's warning that reaches a rank after its run ended, as
        it exits, would otherwise turn a finished run's exit code 0 into -10."""
        for signum, previous in self._previous.items():
            late = signum == signal.SIGUSR1 and previous in (signal.SIG_DFL, None)
            signal.signal(signum, signal.SIG_IGN if late else previous)
        self._previous = {}
