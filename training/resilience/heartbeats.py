"""Heartbeat files: each rank's proof of life, written off the training thread, read to name the
rank that stopped.

``<run dir>/heartbeats/rank<r>.json``: the rank's launch, host, pid, last completed optimizer
step, phase, state and a counter. ``HeartbeatWriter`` writes it from a thread of its own, so that
a write that blocks (an NFS hard mount, a Lustre recovery, a full disk's retries) blocks only that
thread: the watchdog, which decides, never waits for the filesystem, and sees a write blocked
past its limit (``blocked_s``). A file is rewritten at most once per ``interval_s`` whatever the
step time (at 1,024 ranks and the automatic 10 s period, about 100 renames per second in the
folder), and never fsynced: it is worthless after a crash.

``survey`` reads them to say which ranks are not running: a rank on this host through ``/proc``,
another host's by a counter that stops moving over ``observe_s`` (no clock is compared across
nodes). It reads every file once, then waits ``observe_s`` once for all the ranks on other hosts
together (those below it and the rest) and reads theirs again, so it takes ``observe_s`` plus
two reads of the folder whatever the number of hosts (the watchdog bounds it by
``watchdog.survey_bound_s``: 2.5 heartbeat periods + 10 s). It reads rank 0 first, then the
ranks below it downwards, and stops at the first one found alive: rank 0 once it has marked its
own heartbeat hung (one file), else the rank just below, on the same host (two files). So on a
hang only the lowest live rank and the first rank of each host read every file.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

from training.files import atomic_write

HEARTBEATS = "heartbeats"


class HeartbeatWriter:
    """This rank's heartbeat file, written by a thread of its own (see the module docstring).

    Args:
        path: the file (``<run dir>/heartbeats/rank<r>.json``).
        interval_s: the least time between two writes.
    """

    def __init__(self, path: Path, interval_s: float):
        self.path, self.interval_s = Path(path), interval_s
        self._record: dict | None = None          # the newest record not yet written
        self._puts = self._written = 0            # records put; the number of the last one written
        self._writing_since: float | None = None  # when the write in progress began
        self._wake = threading.Condition()
        self._stop = False
        self._now = False                         # the waiting record skips the interval
        self._thread = threading.Thread(target=self._run, name="heartbeat-writer", daemon=True)
        self._thread.start()

    def put(self, record: dict, now: bool = False) -> None:
        """Write ``record`` soon (within ``interval_s`` of the last write; with ``now``, as soon
        as the write in progress is done: the first completed step, the final state); a newer
        one replaces a record still waiting."""
        with self._wake:
            self._record, self._puts = record, self._puts + 1
            self._now = self._now or now
            self._wake.notify()

    def blocked_s(self) -> float:
        """How long the write in progress has taken (0 when none is)."""
        since = self._writing_since
        return 0.0 if since is None else time.monotonic() - since

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the last record put so far to be written (or a newer one
        that replaced it); whether it was. Records put meanwhile are not waited for."""
        deadline = time.monotonic() + timeout_s
        with self._wake:
            target = self._puts
            while self._written < target:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.wait(min(left, 0.05))
        return True

    def close(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()

    def _run(self) -> None:
        last = 0.0
        while True:
            with self._wake:
                while self._record is None and not self._stop:
                    self._wake.wait()
                if self._record is None:
                    return
                self._wake.wait_for(lambda: self._now or self._stop,
                                    timeout=max(0.0, self.interval_s - (time.monotonic() - last)))
                record, self._record, self._now = self._record, None, False
                if record is None:
                    continue
                self._writing_since, number = time.monotonic(), self._puts
            try:
                atomic_write(self.path, json.dumps(record), durable=False)
            except OSError:
                pass                    # a full disk: the watchdog decides without this file
            finally:
                with self._wake:
                    self._writing_since, last, self._written = None, time.monotonic(), number
                    self._wake.notify_all()


def read(run_dir: Path, rank: int) -> dict | None:
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
    has ended or stopped, or, on another host, its counter does not move in ``observe_s``. One
    wait of ``observe_s`` covers every rank on another host (see the module docstring).
    """
    host = socket.gethostname()
    first: dict[int, dict | None] = {}

    def alive_now(r: int) -> bool | None:
        rec = first[r] = read(run_dir, r)
        if rec is None or rec.get("launch") != launch:
            first[r] = None                    # named without another launch's pid
            return False
        if rec.get("state") in ("hung", "peer lost", "finished"):
            return True                        # it was running when it wrote that
        gone = _gone_locally(rec, host)
        return None if gone is None else not gone

    # The lower ranks first: rank 0 (the usual speaker), then down from this rank (with ranks
    # placed host by host, those of its own host, judged at once), then the higher ones.
    others = [r for r in [0, *range(rank - 1, 0, -1), *range(rank + 1, world)] if r != rank]
    verdict: dict[int, bool | None] = {}
    for r in others:
        verdict[r] = alive_now(r)
        if r < rank and verdict[r]:
            return False, []                   # a lower rank alive speaks for the job
    later = [r for r in others if verdict[r] is None]
    if later:
        time.sleep(observe_s)                  # one window for every rank on another host
        for r in later:
            rec = read(run_dir, r)
            verdict[r] = rec is not None and rec.get("counter") != first[r].get("counter")
            if r < rank and verdict[r]:
                return False, []
    return True, [first.get(r) or {"rank": r} for r in sorted(others) if not verdict[r]]


def kill_local(stopped: list[dict], host: str) -> list[int]:
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
