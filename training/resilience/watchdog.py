"""Hangs and lost ranks: a step watchdog on every rank, heartbeats that name the rank that stopped.

At 64-1,024 GPUs a job rarely ends with a clean signal: one rank dies (a GPU error, a lost node,
the kernel's OOM killer) or stops (a hung kernel, a filesystem that blocks, a stopped process).
The backend then either raises on the survivors (gloo: "Connection closed by peer") or leaves
them waiting in a collective until the process-group timeout (NCCL, often; gloo when the peer
still holds its sockets), 30 minutes of a whole cluster idle. This module turns both into one
line naming the rank, and exit code ``EXIT_CODE``; the same command resumes from the newest
checkpoint, and the launch scripts' ``--max-restarts`` reruns it (``launch/common.sh``).

- **Heartbeats** (``heartbeats.py``): every rank's file, its launch, host, pid, last completed
  optimizer step, phase and a counter, rewritten every period (``heartbeat_period``: a tenth of
  the timeout within ``PERIOD_MIN_S``-``PERIOD_MAX_S``, 0.5-10 s; 10 s with the automatic
  timeout) by a writer thread of its own, and while the rank reports a hang too. A rank whose
  counter stops moving is not running (killed, stopped, or its node lost); files, not a
  collective, so that they name a stopped rank 0 too and work while every collective is stuck.
- **The watchdog** decides without touching the filesystem: its thread compares the time since
  the last progress (``beat``: the trainer calls it at every completed optimizer step, every
  evaluation batch, every checkpoint file written and every chunk hashed) with the allowed
  time, and also fires when one heartbeat write has been blocked longer than that (a hung
  filesystem: an NFS hard mount, a Lustre recovery). Firing: this rank's heartbeat marked
  ``hung`` at once (the others' surveys count it alive) and put every half period until the
  exit (the thread that puts them is the one reporting), the survey of the heartbeats (one
  observation of ``STALE_PERIODS`` periods for every rank on another host, and two reads of the
  files), bounded by ``survey_bound_s``: ``STALE_PERIODS`` x period + ``SURVEY_READS_S`` =
  2.5 x period + 10 s (35 s at the automatic 10 s period, 11.25 s at 0.5 s), then the one line
  from the lowest live rank naming the ranks that stopped (it kills those on its own host: a
  stopped process never finishes its step, and the launcher would otherwise wait out its grace
  period; the line bounded by ``REPORT_S``), then every live rank's Python stacks
  (``faulthandler``, every thread) to ``<run dir>/hang/stacks_rank<r>.txt`` and its Flight
  Recorder buffer (the collectives it issued and their states, when
  ``TORCH_NCCL_TRACE_BUFFER_SIZE`` or ``TORCH_FR_BUFFER_SIZE`` is set, as the launch scripts do)
  to ``<run dir>/hang/fr_trace_rank_<r>`` (read them with ``torchfrtrace <run dir>/hang --prefix
  fr_trace_rank_``), bounded by ``REPORT_S`` too, and the exit with ``EXIT_CODE`` whatever the
  filesystem does. A survey the filesystem does not answer in time leaves rank 0 to speak.
- **The allowed time.** ``train.hang_timeout_s`` when set; else ``AUTO_FACTOR`` x the slowest
  of the last ``AUTO_WINDOW`` step intervals, at least ``AUTO_FLOOR_S``. Until the first
  optimizer step completes (process groups, data, model, checkpoint load, the first step's
  compilation), and once the run's last step is done (``finishing``: the final save's wait, the
  metrics and W&B closing), the start-up allowance holds: ``startup_allowance``, which also
  bounds the ranks' wait for rank 0's start-up work (``training/run/distributed.py``
  ``DistContext.rank0_first``).
- **A lost peer.** ``peer_lost`` recognises the backends' errors for a peer that went away
  (``is_peer_lost``) and prints the same kind of line from the lowest surviving rank.

The module needs no collective and no GPU: threads, files and ``os._exit``. Hand-written:
PyTorch's NCCL watchdog and heartbeat monitor abort a stuck communicator and dump the Flight
Recorder (the launch scripts turn them on), but name no rank, cover no host-side hang (a
filesystem, a data loader) and do nothing on gloo; torchrun's agent notices a dead worker but
not a stopped one.
"""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
import threading
import time
from pathlib import Path

from training.files import record_exit_code
from training.resilience.heartbeats import HEARTBEATS, HeartbeatWriter, kill_local, read, survey

__all__ = ["EXIT_CODE", "HANG", "HEARTBEATS", "Watchdog", "hang_message", "heartbeat_period",
           "is_peer_lost", "read", "startup_allowance", "survey", "survey_bound_s"]

EXIT_CODE = 76          # a rank was lost or stopped making progress: rerun the command to resume
AUTO_FACTOR = 10.0      # the automatic timeout: this many times the slowest recent step ...
AUTO_FLOOR_S = 300.0    # ... and at least this (an evaluation or a save between steps)
AUTO_WINDOW = 20        # step intervals the automatic timeout looks back over
STARTUP_S = 7200.0      # before the first step: data preparation on rank 0, model build, compile
STALE_PERIODS = 2.5     # a counter unchanged over this many heartbeat periods: not running
PERIOD_MIN_S = 0.5      # the heartbeat period: a tenth of the timeout, at least this ...
PERIOD_MAX_S = 10.0     # ... and at most this (the automatic timeout's)
SURVEY_READS_S = 10.0   # the survey's bound past its observation window: two reads of every file
REPORT_S = 20.0         # at most this for the line, and again for the stacks, when firing
HANG = "hang"

# The backends' messages for a peer that went away (gloo's, NCCL's, the TCP store's).
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe",
              "remote process exited", "ncclremoteerror", "communicator was aborted",
              "connection refused", "socket closed", "end of file")


def startup_allowance(hang_timeout_s: float) -> float:
    """The seconds a rank may spend before its first optimizer step completes."""
    return max(STARTUP_S, hang_timeout_s)


def heartbeat_period(hang_timeout_s: float) -> float:
    """The heartbeat period for ``train.hang_timeout_s`` (0: automatic)."""
    if hang_timeout_s > 0:
        return min(PERIOD_MAX_S, max(PERIOD_MIN_S, hang_timeout_s / 10))
    return PERIOD_MAX_S


def survey_bound_s(period_s: float) -> float:
    """The most a survey takes on a filesystem that answers: one observation of every rank on
    another host (``STALE_PERIODS`` periods) and two reads of the files (``SURVEY_READS_S``)."""
    return STALE_PERIODS * period_s + SURVEY_READS_S


def is_peer_lost(err: BaseException) -> bool:
    """Whether ``err`` is a collective failing because another rank went away."""
    import torch.distributed as dist
    text = str(err).lower()
    return isinstance(err, getattr(dist, "DistNetworkError", ())) or any(p in text for p in _PEER_LOST)


def _bounded(fn, timeout_s: float, tick=None, every_s: float = 1.0):
    """``fn()`` in a thread of its own, waited for at most ``timeout_s``: its result, or None when
    it did not return in time (a filesystem that blocks) or raised ``OSError``; while it runs,
    ``tick()`` every ``every_s`` (the rank's heartbeat)."""
    box = []

    def run():
        try:
            box.append(fn())
        except OSError:
            pass
    thread = threading.Thread(target=run, name="watchdog-report", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while thread.is_alive() and (left := deadline - time.monotonic()) > 0:
        thread.join(min(left, every_s))
        if tick is not None and thread.is_alive():
            tick()
    return box[0] if box else None


class Watchdog:
    """This rank's watchdog thread and heartbeat file (one per rank, from start-up to exit).

    Args:
        run_dir: the run directory (heartbeats are written only after ``attach``).
        rank, world_size: this process's place in the job.
        hang_timeout_s: ``train.hang_timeout_s`` (0: automatic, see the module docstring).
        where: the trainer's ``training.step.stepper.StepContext`` (its phase goes into the files).
    """

    def __init__(self, run_dir: Path, rank: int, world_size: int, hang_timeout_s: float,
                 where=None):
        self.run_dir, self.rank, self.world = Path(run_dir), rank, world_size
        self.fixed = hang_timeout_s if hang_timeout_s > 0 else None
        self.where = where
        self.period_s = heartbeat_period(hang_timeout_s)
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.launch = None                  # set by ``attach``: heartbeats on
        self.step, self.counter, self.state = None, 0, "running"
        self.survey_s, self.report_s = survey_bound_s(self.period_s), REPORT_S
        self._last = time.monotonic()
        self._step_times: list[float] = []
        self._step_at: float | None = None
        self._finishing = False
        self._writer: HeartbeatWriter | None = None
        self._stop = threading.Event()
        self._lock, self._put_lock = threading.Lock(), threading.Lock()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._thread.start()

    # -- what the trainer calls

    def attach(self, launch_id: int, nccl: bool = False) -> None:
        """Start writing heartbeats (once the run directory may be written: the start accepted);
        with ``nccl``, make the folder NCCL's dump on a collective timeout writes into."""
        self.launch = launch_id
        (self.run_dir / HEARTBEATS).mkdir(parents=True, exist_ok=True)
        if nccl:
            (self.run_dir / HANG).mkdir(exist_ok=True)
        self._writer = HeartbeatWriter(self.run_dir / HEARTBEATS / f"rank{self.rank}.json", self.period_s)
        self._put()

    def beat(self, step: int | None = None) -> None:
        """Progress: an optimizer step completed (``step``), or a phase, batch, file or chunk."""
        now = time.monotonic()
        with self._lock:
            self._last = now
            if step is not None:
                if self._step_at is not None:
                    self._step_times = (self._step_times + [now - self._step_at])[-AUTO_WINDOW:]
                self.step, self._step_at = step, now

    def finishing(self) -> None:
        """The run's steps are done: what remains (the final save's wait, closing the metrics and
        W&B) is allowed the start-up allowance."""
        self._finishing = True

    def allowed_s(self) -> float:
        """The seconds of no progress allowed now."""
        if self.step is None or self._finishing:
            return startup_allowance(self.fixed or 0.0)
        if self.fixed:
            return self.fixed
        return max(AUTO_FLOOR_S, AUTO_FACTOR * max(self._step_times, default=0.0))

    def close(self, state: str | None = None) -> None:
        """Stop the thread; with ``state`` (``"finished"``), write it into the heartbeat."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.period_s)
        if self._writer is not None:
            if state is not None:
                self.state = state
                self._put(now=True)
                self._writer.flush(timeout_s=2 * self.period_s)
            self._writer.close()

    # -- the thread

    def _run(self) -> None:
        # A heartbeat every period, and one as soon as the writer allows when a new step
        # completed, so that a stopped rank's file names a recent step. Nothing here waits for
        # the filesystem: the writer thread writes.
        put, put_step = time.monotonic(), None
        while not self._stop.wait(self.period_s / 4):
            now = time.monotonic()
            if now - put >= self.period_s or self.step != put_step:
                self._put(now=put_step is None and self.step is not None)   # the first step: at once
                put, put_step = now, self.step
            allowed = self.allowed_s()
            blocked = self._writer.blocked_s() if self._writer is not None else 0.0
            if (now - self._last > allowed or blocked > allowed) and not self._stop.is_set():
                self._fire(blocked, stalled=now - self._last > allowed)

    def _put(self, now: bool = False) -> None:
        if self._writer is None:
            return
        with self._put_lock:                    # two threads put while this rank reports
            self.counter += 1
            record = {"rank": self.rank, "launch": self.launch, "host": self.host, "pid": self.pid,
                      "step": self.step, "phase": getattr(self.where, "phase", None),
                      "state": self.state, "counter": self.counter}
        self._writer.put(record, now=now)

    def _reporting(self, fn, timeout_s: float):
        """``_bounded(fn, timeout_s)`` with this rank's heartbeat put every half period while it
        waits: the thread that puts them is the one reporting, and a rank whose counter stopped
        would be named by the others' surveys."""
        return _bounded(fn, timeout_s, tick=self._put, every_s=self.period_s / 2)

    def _fire(self, blocked_s: float, stalled: bool) -> None:
        """No progress within the allowed time (``stalled``), or a heartbeat write blocked
        longer (``blocked_s``): the survey, one line, the stacks, exit; each part that may wait
        for the filesystem bounded (see the module docstring)."""
        waited = time.monotonic() - self._last
        self.state = "hung"
        self._put(now=True)                     # alive to the others' surveys from now on
        phase, folder = getattr(self.where, "phase", None), self.run_dir / HANG
        found = self._reporting(self._survey, self.survey_s)
        printer, stopped = found if found is not None else (self.rank == 0, [])
        killed = kill_local(stopped, self.host) if printer else []
        line = hang_message(self.step, waited, self.fixed, stopped, killed, folder, phase)
        if not stalled:
            line = (f"a write to the run directory has not returned for {blocked_s:.0f} s (its "
                    f"filesystem blocks): " + line)
        elif blocked_s or found is None:
            line += (f"; the run directory's filesystem blocks (a heartbeat write has not returned "
                     f"for {blocked_s:.0f} s, or its files could not be read)")
        if printer:
            self._reporting(lambda: print(f"error: {line}", file=sys.stderr, flush=True), self.report_s)
        self._reporting(lambda: self._write_report(folder, waited, phase), self.report_s)
        os._exit(EXIT_CODE)

    def _write_report(self, folder: Path, waited: float, phase) -> None:
        """This rank's part of a hang report: its heartbeat marked hung, its stacks, its Flight
        Recorder buffer, its exit code for the launch scripts (``files.record_exit_code``)."""
        self._put(now=True)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"stacks_rank{self.rank}.txt", "w") as f:
            f.write(f"rank {self.rank} (pid {self.pid} on {self.host}): no progress for "
                    f"{waited:.0f} s, last completed step {self.step}, phase {phase}\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        _dump_flight_recorder(folder / f"fr_trace_rank_{self.rank}")
        sys.stderr.flush()
        record_exit_code(EXIT_CODE)
        self._flush_heartbeat()

    def _flush_heartbeat(self) -> None:
        """Wait up to a period for this rank's last heartbeat (``hung``, ``peer lost``) to be
        written, unless a write has been blocked that long already: a rank that exits with its
        state unwritten, or cut in the middle of writing it, reads as stopped in the others'
        surveys."""
        if self._writer is not None and self._writer.blocked_s() < self.period_s:
            self._writer.flush(self.period_s)

    def peer_lost(self, err: BaseException) -> int:
        """A collective failed because a peer went away: from the lowest surviving rank, one
        line naming the lost ranks; returns ``EXIT_CODE``."""
        self._stop.set()
        self.state = "peer lost"
        self._put(now=True)
        found = self._reporting(self._survey, self.survey_s)
        printer, lost = found if found is not None else (self.rank == 0, [])
        if printer:
            step = getattr(self.where, "step", None)
            during = f"during step {step}" if step is not None else "during start-up"
            first = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
            who = _ranks(lost) if lost else f"a rank (the backend said: {first})"
            print(f"error: {who} lost {during}: its process ended (killed, a GPU "
                  f"error, a node lost); rerun the same command to resume from the newest "
                  f"checkpoint (exit code {EXIT_CODE})", file=sys.stderr, flush=True)
        self._flush_heartbeat()
        return EXIT_CODE

    def _survey(self) -> tuple[bool, list[dict]]:
        """``survey`` once heartbeats are on; before, rank 0 speaks and names nobody."""
        if self.launch is None:
            return self.rank == 0, []
        return survey(self.run_dir, self.rank, self.world, self.launch,
                      STALE_PERIODS * self.period_s)


def _ranks(records: list[dict]) -> str:
    parts = [f"rank {r['rank']}" + (f" (pid {r['pid']} on {r['host']})" if "pid" in r else
                                    " (no heartbeat in this launch)") for r in records]
    return ", ".join(parts)


def hang_message(step, waited: float, fixed, stopped: list[dict], killed: list[int],
                 folder: Path, phase=None) -> str:
    """The watchdog's line (without the ``error:`` prefix)."""
    limit = "train.hang_timeout_s" if fixed else "the automatic train.hang_timeout_s"
    when = f"after step {step}" if step is not None else f"in start-up ({phase})"
    if stopped:
        who = "; ".join(f"{_ranks([r])} stopped (its last heartbeat: step {r.get('step')}, "
                        f"{r.get('phase')})" if "pid" in r else _ranks([r]) for r in stopped)
        if killed:
            who += "; killed " + ", ".join(f"rank {k}" for k in killed)
    elif step is None:
        who = "no heartbeat is written before the first step: see where each rank is"
    else:
        who = ("every rank is still running: one is stuck outside the collective the others "
               "wait in (its stacks show where)")
    return (f"no progress for {waited:.0f} s {when} ({limit}): {who}; the live ranks' stacks "
            f"are in {folder}; rerun the same command to resume (exit code {EXIT_CODE})")


def _dump_flight_recorder(path: Path) -> None:
    """This rank's Flight Recorder buffer (PyTorch's record of its collectives), when enabled."""
    size = os.environ.get("TORCH_FR_BUFFER_SIZE", os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", ""))
    if not size.strip().isdigit() or int(size) == 0:
        return
    try:
        import torch
        data = torch._C._distributed_c10d._dump_fr_trace()
    except (AttributeError, RuntimeError):
        return
    path.write_bytes(data)
