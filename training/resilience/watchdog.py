"""Hangs and lost ranks: a step watchdog on every rank, heartbeats that name the rank that stopped.

At 64-1,024 GPUs a job rarely ends with a clean signal: one rank dies (a GPU error, a lost node,
the kernel's OOM killer) or stops (a hung kernel, a filesystem that blocks, a stopped process).
The backend then either raises on the survivors (gloo: "Connection closed by peer") or leaves
them waiting in a collective until the process-group timeout (NCCL, often; gloo when the peer
still holds its sockets), 30 minutes of a whole cluster idle. This module turns both into one
line naming the rank, and exit code ``EXIT_CODE``; the same command resumes from the newest
checkpoint, and the launch scripts' ``--max-restarts`` reruns it (``launch/common.sh``).

- **Heartbeats.** Every rank's watchdog thread writes ``<run dir>/heartbeats/rank<r>.json``
  every ``period_s`` seconds (a tenth of the timeout, 0.5-10 s), and a quarter period after a
  step completes: its launch, host, pid, last completed optimizer step, phase and a counter. A rank whose counter stops moving is not running (killed, stopped, or its node lost);
  files, not a collective, so that they name a stopped rank 0 too and work while every
  collective is stuck. A reader compares two reads of the counter ``STALE_PERIODS`` periods
  apart: no clock is compared across nodes. A rank on the reader's own host is checked at once
  through ``/proc`` (its pid is gone or a zombie). To keep a hang from turning into a storm of
  reads on a shared filesystem, a rank reads the files of the ranks below it until it finds one
  alive (usually rank 0, one file): only the lowest live rank reads them all and prints.
- **The watchdog.** When no progress (``beat``: the trainer calls it at every completed
  optimizer step, evaluation and checkpoint phase; the checkpoint writer at every file) comes
  within the allowed time, every live rank writes its Python stacks (``faulthandler``, every
  thread) to ``<run dir>/hang/stacks_rank<r>.txt`` and its Flight Recorder buffer (the
  collectives it issued and their states, when ``TORCH_NCCL_TRACE_BUFFER_SIZE`` or
  ``TORCH_FR_BUFFER_SIZE`` is set, as the launch scripts do) to
  ``<run dir>/hang/fr_trace_rank_<r>`` (read them with ``torchfrtrace <run dir>/hang --prefix
  fr_trace_rank_``), then the lowest live rank prints one line naming the ranks that stopped,
  kills those on its own host (a stopped process never finishes its step, and the launcher
  would otherwise wait out its grace period), and every live rank exits with ``EXIT_CODE``.
- **The allowed time.** ``train.hang_timeout_s`` when set; else ``AUTO_FACTOR`` x the slowest
  of the last ``AUTO_WINDOW`` step intervals, at least ``AUTO_FLOOR_S``. Until the first
  optimizer step completes (process groups, data, model, checkpoint load, the first step's
  compilation) the start-up allowance holds: ``startup_allowance``, which also bounds the ranks'
  wait for rank 0's start-up work (``training/run/distributed.py`` ``DistContext.rank0_first``).
- **A lost peer.** ``peer_lost`` recognises the backends' errors for a peer that went away
  (``is_peer_lost``) and prints the same kind of line from the lowest surviving rank.

The module needs no collective and no GPU: a thread, files and ``os._exit``. Hand-written:
PyTorch's NCCL watchdog and heartbeat monitor abort a stuck communicator and dump the Flight
Recorder (the launch scripts turn them on), but name no rank, cover no host-side hang (a
filesystem, a data loader) and do nothing on gloo; torchrun's agent notices a dead worker but
not a stopped one.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from training.files import atomic_write, record_exit_code

EXIT_CODE = 76          # a rank was lost or stopped making progress: rerun the command to resume
AUTO_FACTOR = 10.0      # the automatic timeout: this many times the slowest recent step ...
AUTO_FLOOR_S = 300.0    # ... and at least this (an evaluation or a save between steps)
AUTO_WINDOW = 20        # step intervals the automatic timeout looks back over
STARTUP_S = 7200.0      # before the first step: data preparation on rank 0, model build, compile
STALE_PERIODS = 2.5     # a counter unchanged over this many heartbeat periods: not running
HEARTBEATS, HANG = "heartbeats", "hang"

# The backends' messages for a peer that went away (gloo's, NCCL's, the TCP store's).
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe",
              "remote process exited", "ncclremoteerror", "communicator was aborted",
              "connection refused", "socket closed", "end of file")


def startup_allowance(hang_timeout_s: float) -> float:
    """The seconds a rank may spend before its first optimizer step completes."""
    return max(STARTUP_S, hang_timeout_s)


def is_peer_lost(err: BaseException) -> bool:
    """Whether ``err`` is a collective failing because another rank went away."""
    import torch.distributed as dist
    text = str(err).lower()
    return isinstance(err, getattr(dist, "DistNetworkError", ())) or any(p in text for p in _PEER_LOST)


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
        self.period_s = min(10.0, max(0.5, self.fixed / 10)) if self.fixed else 10.0
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.launch = None                  # set by ``attach``: heartbeats on
        self.step, self.counter, self.state = None, 0, "running"
        self._last = time.monotonic()
        self._step_times: list[float] = []
        self._step_at: float | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
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
        self._write()

    def beat(self, step: int | None = None) -> None:
        """Progress: an optimizer step completed (``step``), or a phase or file of one."""
        now = time.monotonic()
        with self._lock:
            self._last = now
            if step is not None:
                if self._step_at is not None:
                    self._step_times = (self._step_times + [now - self._step_at])[-AUTO_WINDOW:]
                self.step, self._step_at = step, now

    def allowed_s(self) -> float:
        """The seconds of no progress allowed now."""
        if self.step is None:
            return startup_allowance(self.fixed or 0.0)
        if self.fixed:
            return self.fixed
        return max(AUTO_FLOOR_S, AUTO_FACTOR * max(self._step_times, default=0.0))

    def close(self, state: str | None = None) -> None:
        """Stop the thread; with ``state`` (``"finished"``), write it into the heartbeat."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.period_s)
        if state is not None:
            self.state = state
            self._write()

    # -- the thread

    def _run(self) -> None:
        # A heartbeat every period, and one sooner (a quarter period after the last) when a new
        # step completed, so that a stopped rank's file names a recent step.
        written, written_step = time.monotonic(), None
        while not self._stop.wait(self.period_s / 4):
            now = time.monotonic()
            if now - written >= self.period_s or (self.step != written_step
                                                   and now - written >= self.period_s / 4):
                written, written_step = now, self.step
                self._write()
            if now - self._last > self.allowed_s() and not self._stop.is_set():
                self._fire()

    def _write(self) -> None:
        if self.launch is None:
            return
        self.counter += 1
        phase = getattr(self.where, "phase", None)
        record = {"rank": self.rank, "launch": self.launch, "host": self.host, "pid": self.pid,
                  "step": self.step, "phase": phase, "state": self.state, "counter": self.counter}
        try:
            atomic_write(self.run_dir / HEARTBEATS / f"rank{self.rank}.json", json.dumps(record),
                         durable=False)      # rewritten every few seconds; worthless after a crash
        except OSError:
            pass                    # a full or blocked filesystem: the watchdog still fires

    def _fire(self) -> None:
        """No progress within the allowed time: stacks, Flight Recorder, one line, exit."""
        waited = time.monotonic() - self._last
        self.state = "hung"
        self._write()
        folder = self.run_dir / HANG
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / f"stacks_rank{self.rank}.txt", "w") as f:
                f.write(f"rank {self.rank} (pid {self.pid} on {self.host}): no progress for "
                        f"{waited:.0f} s, last completed step {self.step}, phase "
                        f"{getattr(self.where, 'phase', None)}\n")
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
            _dump_flight_recorder(folder / f"fr_trace_rank_{self.rank}")
        except OSError:
            pass
        printer, stopped = self._survey()
        if printer:
            killed = _kill_local(stopped, self.host)
            line = hang_message(self.step, waited, self.fixed, stopped, killed, folder,
                                getattr(self.where, "phase", None))
            print(f"error: {line}", file=sys.stderr, flush=True)
        sys.stderr.flush()
        record_exit_code(EXIT_CODE)
        os._exit(EXIT_CODE)

    def peer_lost(self, err: BaseException) -> int:
        """A collective failed because a peer went away: from the lowest surviving rank, one
        line naming the lost ranks; returns ``EXIT_CODE``."""
        self._stop.set()
        self.state = "peer lost"
        self._write()
        printer, lost = self._survey()
        if printer:
            step = getattr(self.where, "step", None)
            during = f"during step {step}" if step is not None else "during start-up"
            first = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
            who = _ranks(lost) if lost else f"a rank (the backend said: {first})"
            print(f"error: {who} lost {during}: its process ended (killed, a GPU "
                  f"error, a node lost); rerun the same command to resume from the newest "
                  f"checkpoint (exit code {EXIT_CODE})", file=sys.stderr, flush=True)
        return EXIT_CODE

    def _survey(self) -> tuple[bool, list[dict]]:
        """``survey`` once heartbeats are on; before, rank 0 speaks and names nobody."""
        if self.launch is None:
            return self.rank == 0, []
        return survey(self.run_dir, self.rank, self.world, self.launch,
                      STALE_PERIODS * self.period_s)


# -- reading the heartbeats

def _read(run_dir: Path, rank: int) -> dict | None:
    try:
        return json.loads((run_dir / HEARTBEATS / f"rank{rank}.json").read_text())
    except (OSError, ValueError):
        return None


def _gone_locally(record: dict, host: str) -> bool | None:
    """For a rank on this host: whether its process has ended (None: another host)."""
    if record.get("host") != host:
        return None
    try:
        stat = Path(f"/proc/{record['pid']}/stat").read_text()
    except OSError:
        return True
    fields = stat.rsplit(")", 1)[-1].split()
    return bool(fields) and fields[0] in ("Z", "X", "T", "t")     # zombie, dead, stopped


def survey(run_dir: Path, rank: int, world: int, launch, observe_s: float) -> tuple[bool, list[dict]]:
    """Which ranks are not running, as far as this rank needs to know.

    Returns ``(printer, stopped)``: ``printer`` is True when no lower rank is alive (this rank
    speaks for the job), and then ``stopped`` lists the records of every rank that is not
    running (its last heartbeat; ``{"rank": r}`` when it wrote none in this launch). A rank
    is not running when its heartbeat is of another launch or missing, its process on this host
    has ended or stopped, or, on another host, its counter does not move in ``observe_s``.
    """
    host = socket.gethostname()
    first: dict[int, dict | None] = {}
    undecided: list[int] = []

    def alive_now(r: int) -> bool | None:
        rec = first[r] = _read(run_dir, r)
        if rec is None or rec.get("launch") != launch:
            first[r] = None                    # named without another launch's pid
            return False
        if rec.get("state") in ("hung", "peer lost", "finished"):
            return True                        # it was running when it wrote that
        gone = _gone_locally(rec, host)
        return None if gone is None else not gone

    def settle(ranks: list[int]) -> dict[int, bool]:
        verdict = {r: alive_now(r) for r in ranks}
        later = [r for r, v in verdict.items() if v is None]
        if later:
            time.sleep(observe_s)
            for r in later:
                rec = _read(run_dir, r)
                verdict[r] = rec is not None and rec.get("counter") != first[r].get("counter")
        return verdict

    for r in range(rank):                       # a lower rank alive speaks for the job
        if settle([r])[r]:
            return False, []
    undecided = [r for r in range(world) if r != rank]
    verdict = settle(undecided)
    return True, [first.get(r) or {"rank": r} for r in undecided if not verdict[r]]


def _kill_local(stopped: list[dict], host: str) -> list[int]:
    """SIGKILL the stopped ranks on this host (a stopped process keeps its launcher waiting)."""
    import signal
    killed = []
    for rec in stopped:
        if rec.get("host") == host and rec.get("pid") and rec.get("pid") != os.getpid():
            try:
                os.kill(rec["pid"], signal.SIGKILL)
                killed.append(rec["rank"])
            except OSError:
                pass
    return killed


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
