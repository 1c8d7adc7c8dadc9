"""Saving checkpoints: every rank's files, verified, then published; in the background by default.

A save has two halves. The first runs in the training loop on every rank: DeepSpeed's
``save_checkpoint`` builds each file's state and hands it to its checkpoint engine's ``save``.
The second writes the files, hashes them into the manifest (``training/checkpoint/manifest.py``) and
publishes the checkpoint: rank 0 writes ``manifest.json``, then moves ``latest``, then prunes.

With ``train.async_save`` (the default) the engine's ``save`` is replaced for the call by a
snapshot: every tensor's storage copied to host memory (``_snapshot``; a memory copy, a GPU's
device-to-host). Training then goes on while one thread per rank serializes the snapshots with
``torch.save`` (the same bytes DeepSpeed would write), fsyncs each file and hashes it into the
rank's share of the manifest (or leaves a ``.failed`` marker). Rank 0's writer then waits for
every share and publishes at once: a checkpoint counts as soon as it is durable everywhere, even
if the run dies before its next step. The ranks learn the outcome together: in every step they
already sum a flag over the job (``Stepper._to_host``), the count of busy writers rides in the
same all-reduce, and at the first step boundary at which none is busy they agree in one small
all-reduce whether the save succeeded. At most one save is in flight: the next save, and every
save the run ends with, waits for it first. The snapshot costs host memory, one rank's share of
the checkpoint until its files are written.

Why our own writer: DeepSpeed 0.19's decoupled and fast checkpoint engines need its ``async_io``
op (libaio), which cannot build where libaio is missing, as on the CPU test machine, and
``torch.distributed.checkpoint.async_save`` writes DCP's format, not the DeepSpeed files that
the resume path, ``launch/to_universal.py`` and the offline tools read.

Durability: nothing is published before it is on the disk. Every file of the checkpoint is
fsynced once written (a synchronous save fsyncs DeepSpeed's files after ``torch.save``), the
ranks' shares and ``manifest.json`` through ``files.atomic_write`` (the file, then the rename, then
its directory), the tag folder's entries before ``manifest.json`` and the checkpoint directory's
before ``latest`` moves. Pruning runs only after that, so a power or node crash leaves either
the previous checkpoint as ``latest`` or the new one whole, never a pruned old one and a lost new
one (``tests/training/checkpoint/test_durability.py``).

A save fails when a rank cannot write its part (a full disk, a permission, an I/O error): the
ranks agree on it in one all-reduce, the one rank prints why, ``latest`` keeps naming the
previous checkpoint, rank 0 removes the partial folder, and the run goes on or stops
(``train.on_save_error``; a save the run ends with must succeed). A process killed mid-write
leaves a folder without a manifest, which a resume skips with a warning.
"""

from __future__ import annotations

import copy
import os
import shutil
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from model.parallel import comm
from training.checkpoint import manifest
from training.checkpoint.layout import LATEST, PARAM_NAMES, tag_for_step
from training.checkpoint.state import TrainState, rank_file
from training.files import atomic_write, sync_directory, sync_path

SAVE_FAILED = 74                        # EX_IOERR: a checkpoint the run had to have was not written
FINISH_POLL_S = 0.5                     # between the ranks' checks that every writer is done
MAX_POLL_S = 2.0                        # rank 0's writer lists the folder at most this rarely


@dataclass
class _Save:
    """One save between its two halves."""

    step: int
    """The optimizer step it holds."""
    folder: Path
    """``<ckpt>/<tag>``."""
    errors: list[str] = field(default_factory=list)
    """This rank's write errors, one line each (the first is printed)."""
    files: list[tuple[Path, object]] = field(default_factory=list)
    """Background saves: each file's path and state (on the host, ``_snapshot``), until written."""
    thread: threading.Thread | None = None
    """Background saves: the writer."""
    abandon: threading.Event = field(default_factory=threading.Event)
    """Set when another rank's writer failed: rank 0's writer stops waiting for its share."""


class Saver:
    """The run's checkpoint saves on this rank (every rank has one and calls it alike)."""

    def __init__(self, engine, ckpt_dir: Path, keep_last: int, background: bool,
                 stop_on_error: bool, progress=None, wait_timeout_s: float = 7200.0):
        self.engine, self.ckpt_dir, self.keep_last = engine, Path(ckpt_dir), keep_last
        self.background, self.stop_on_error = background, stop_on_error
        self.progress = progress or (lambda: None)   # called at every file written (the watchdog)
        self.wait_timeout_s = wait_timeout_s         # rank 0's wait for the other ranks' shares
        self.device = next(engine.module.parameters()).device
        self.pending: _Save | None = None
        self.published: str | None = None      # the tag this run last published
        self.stop_reason: str | None = None    # set when a failed save must stop the run
        self.stall_s = 0.0                     # the training loop's wait in the last save()

    @property
    def writing(self) -> bool:
        """Whether this rank's writer is still busy (summed over the job each step)."""
        return self.pending is not None and self.pending.thread is not None and \
            self.pending.thread.is_alive()

    @property
    def failed(self) -> bool:
        """Whether this rank's writer has ended in an error (summed over the job each step:
        rank 0's writer then stops waiting for this rank's share, ``peer_failed``)."""
        return self.pending is not None and bool(self.pending.errors) and not self.writing

    def peer_failed(self) -> None:
        """A rank's writer failed (the step's job-wide sum said so): rank 0's writer stops
        waiting for the shares, and the next step boundary agrees on the failure."""
        if self.pending is not None:
            self.pending.abandon.set()

    def save(self, step: int, state: TrainState, wait: bool) -> None:
        """Save ``step`` with every part of ``state`` (``state.py``): the previous save is
        finished first; with ``wait`` (or without background saves) this one is finished before
        returning, else it is left in flight."""
        t0 = time.perf_counter()
        self.finish()
        save = _Save(step, self.ckpt_dir / tag_for_step(step))
        if self.engine.global_rank == 0:       # an earlier save of this tag (before a fallback resume)
            for stale in (save.folder / manifest.MANIFEST, *save.folder.glob("manifest.rank*")):
                stale.unlink(missing_ok=True)  # DeepSpeed's first barrier orders this before any write
        rank_state = state.rank_state()
        with _engine_writes(self.engine, save, self.background, self.progress):
            names = {PARAM_NAMES: self.engine.group_param_names} if hasattr(self.engine, "group_param_names") else {}
            self.engine.save_checkpoint(str(self.ckpt_dir), tag=save.folder.name,
                                        client_state={**state.client_state(step), **names}, save_latest=False)
            if rank_state is not None:      # through the engine's writer: snapshotted, fsynced, hashed
                save.folder.mkdir(parents=True, exist_ok=True)
                self.engine.checkpoint_engine.save(rank_state, str(rank_file(save.folder, state.rank)))
        self.pending = save
        if self.background:
            rank, world = self.engine.global_rank, self.engine.world_size
            publish = (lambda: self._publish(save)) if rank == 0 else None
            # Rank 0's writer also waits for the other ranks' shares: a daemon when there are
            # others, so that a job whose other ranks died cannot keep rank 0 from exiting.
            save.thread = threading.Thread(target=_write, args=(save, rank, world, publish,
                                                                self.progress, self.wait_timeout_s),
                                           name="checkpoint-writer", daemon=rank == 0 and world > 1)
            save.thread.start()
        if wait or not self.background:
            self.finish(final=wait)
        self.stall_s = time.perf_counter() - t0

    def finish(self, final: bool = False) -> None:
        """Wait for the save in flight, if any, and make sure every rank knows how it went; every
        rank calls this at the same point (after a step in which ``writing`` was false
        everywhere, or in ``save``). A background save was published by rank 0's writer as soon
        as every share was written; one written in the loop is hashed and published here.
        Collectives over the default group: one small all-reduce after each stage, in which the
        ranks agree whether every one of them succeeded."""
        save, self.pending = self.pending, None
        if save is None:
            return
        if save.thread is not None:
            # Every rank's writer done, agreed in one small all-reduce per poll, the watchdog told
            # of the wait meanwhile: a rank done first does not sit in one long collective while a
            # slower one writes, and a rank that failed frees rank 0's writer from its wait.
            while True:
                busy, failed = comm.job_sum(torch.tensor(
                    [float(save.thread.is_alive()), float(bool(save.errors) and not save.thread.is_alive())],
                    device=self.device)).tolist()
                if busy == 0:
                    break
                if failed:
                    save.abandon.set()
                self.progress()
                save.thread.join(timeout=FINISH_POLL_S)
        rank, world = self.engine.global_rank, self.engine.world_size
        stages = (None,) if self.background else (
            None, lambda: manifest.write_share(save.folder, rank, world, self.progress),
            lambda: rank == 0 and self._publish(save))
        for stage in stages:
            if stage is not None:
                try:
                    stage()
                except OSError as err:
                    save.errors.append(f"{err.strerror or err}: {err.filename or save.folder}")
            if comm.job_sum(torch.tensor([float(bool(save.errors))], device=self.device)).item() > 0:
                self._failed(save, final)
                return
        self.published = save.folder.name

    def _failed(self, save: _Save, final: bool) -> None:
        if save.errors:
            print(f"warning: rank {self.engine.global_rank} could not write checkpoint "
                  f"{save.folder} ({save.errors[0]}); {LATEST} still names the previous checkpoint",
                  file=sys.stderr, flush=True)
        if self.engine.global_rank == 0:
            shutil.rmtree(save.folder, ignore_errors=True)
        if final or self.stop_on_error:
            self.stop_reason = (f"its checkpoint for step {save.step} could not be written (exit "
                                f"code {SAVE_FAILED}); free space")

    def _publish(self, save: _Save) -> None:
        """Rank 0, once every share is hashed: the manifest, then ``latest``, then pruning."""
        engine = self.engine
        layout = {"world_size": engine.world_size, "dp_world_size": engine.dp_world_size,
                  "mp_world_size": engine.mp_world_size}
        sync_directory(save.folder)                 # every file's name on the disk, then the manifest
        manifest.merge(save.folder, save.step, layout, engine.world_size,
                       hash_the_rest=self.background, progress=self.progress)
        sync_directory(self.ckpt_dir)               # the tag folder's own name, before latest names it
        atomic_write(self.ckpt_dir / LATEST, save.folder.name)
        wait_for_pruning()                          # the previous save's deletions, if still running
        old = _prunable(self.ckpt_dir, save.folder.name, self.keep_last)
        if old:
            _PRUNER[0] = threading.Thread(target=_remove, args=(old,), name="checkpoint-pruning")
            _PRUNER[0].start()

    def close(self) -> None:
        """Finish the save in flight and the pruning (the end of a run)."""
        self.finish(final=True)
        wait_for_pruning()


@contextmanager
def _engine_writes(engine, save: _Save, background: bool, progress=lambda: None):
    """DeepSpeed's file writes for the duration of one ``save_checkpoint``: snapshotted into
    ``save.files`` (background), or written with OSError recorded in ``save.errors`` instead of
    raised, so that a rank whose disk is full still reaches DeepSpeed's own barriers (a raise
    would leave the other ranks waiting there); after the first error the rank writes nothing."""
    write = engine.checkpoint_engine.save

    def guarded(state_dict, path):
        if save.errors:
            return None
        if background:
            save.files.append((Path(path), _snapshot(state_dict, {})))
            return None
        try:
            written = write(state_dict=state_dict, path=path)
            sync_path(Path(path))           # on the disk before the manifest names it
            progress()                      # a file done: the watchdog's progress
            return written
        except OSError as err:
            save.errors.append(f"{err.strerror or err}: {path}")
        return None

    engine.checkpoint_engine.save = guarded
    try:
        yield
    finally:
        del engine.checkpoint_engine.save


def _snapshot(obj, storages: dict):
    """``obj`` with every tensor on the host, in storage the training loop does not write: each
    storage copied once (a GPU's to the host), views rebuilt on the copies, so that ``torch.save``
    writes the bytes it would have written from the originals (it saves whole storages, shared
    ones once). Containers are rebuilt; other objects (a loss scaler, the client state's
    numbers) are deep-copied."""
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        key = (storage.device, storage.data_ptr())
        if key not in storages:
            storages[key] = storage.clone() if storage.device.type == "cpu" else storage.cpu()
        host = torch.empty((0,), dtype=obj.dtype)
        return host.set_(storages[key], obj.storage_offset(), obj.size(), obj.stride())
    if isinstance(obj, dict):
        out = copy.copy(obj)            # keeps the type (OrderedDict, ...) and its attributes
        out.clear()
        out.update((k, _snapshot(v, storages)) for k, v in obj.items())
        return out
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_snapshot(v, storages) for v in obj)
    return copy.deepcopy(obj)


def _write(save: _Save, rank: int, world: int, publish=None, progress=lambda: None,
           timeout_s: float = 7200.0) -> None:
    """The background writer: every file of this rank saved and fsynced, its size and CRC-32
    into this rank's manifest share (or a ``.failed`` marker); each snapshot released once
    written. On rank 0 (``publish``), then: wait until every rank's share is there and publish,
    so that a checkpoint counts as soon as it is durable everywhere, not at a later step."""
    entries = {}
    try:
        while save.files and not save.errors:
            path, state = save.files.pop(0)
            _write_file(path, state)
            del state
            progress()
            size, crc = manifest.checksum(path, progress)
            entries[path.relative_to(save.folder).as_posix()] = {"bytes": size, "crc32": crc}
        if not save.errors:
            manifest.write_entries(save.folder, rank, entries)
    except OSError as err:
        save.errors.append(f"{err.strerror or err}: {err.filename or save.folder}")
    save.files.clear()
    if save.errors:
        try:
            atomic_write(save.folder / f"manifest.rank{rank}.failed", save.errors[0])
        except OSError:
            pass                         # the boundary's all-reduce still reports the failure
        return
    try:
        if publish is None or not _all_shares_written(save.folder, world, timeout_s, save.abandon):
            return
        publish()
    except (OSError, ValueError) as err:
        save.errors.append(str(err))


def _all_shares_written(folder: Path, world: int, timeout_s: float,
                        abandon: threading.Event | None = None, poll_s: float = 0.05) -> bool:
    """Rank 0's writer: wait until every rank's share or failure marker exists; False when a
    rank failed (its marker, or ``abandon``: the step's job-wide sum said so, when the marker
    could not be written either); after ``timeout_s`` a ValueError naming the ranks whose share
    is missing. The folder is listed less often as the wait goes on (0.05 s doubling up to
    ``MAX_POLL_S``): at 1,024 ranks a listing is a thousand entries on a shared filesystem."""
    start = time.monotonic()
    while True:
        if abandon is not None and abandon.is_set():
            return False
        names = {p.name for p in folder.glob("manifest.rank*")}
        if any(n.endswith(".failed") for n in names):
            return False
        missing = [r for r in range(world) if f"manifest.rank{r}.json" not in names]
        if not missing:
            return True
        if time.monotonic() - start > timeout_s:
            shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
            raise ValueError(f"waited {timeout_s:.0f} s for the checkpoint share of rank(s) "
                             f"{shown} in {folder}: those ranks died, or their writes to this "
                             f"filesystem block (is {folder.parent} shared by every node?)")
        (abandon or threading.Event()).wait(poll_s)
        poll_s = min(2 * poll_s, MAX_POLL_S)


def _write_file(path: Path, state) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def _prunable(ckpt_dir: Path, tag: str, keep_last: int) -> list[Path]:
    """The folders to delete once ``tag`` (its manifest written) is ``latest``: of those up to
    ``tag``, the ones with a manifest beyond the newest ``keep_last`` and every one without
    (failed saves). Newer folders, left by a run that resumed from an older checkpoint, stay
    until this run saves over them. ``keep_last`` 0 keeps everything."""
    if keep_last <= 0:
        return []
    folders = sorted((p for p in ckpt_dir.glob("step*") if p.is_dir() and p.name <= tag),
                     reverse=True)
    complete = [p for p in folders if (p / manifest.MANIFEST).is_file()]      # tag first
    return complete[keep_last:] + [p for p in folders if p not in complete]


_PRUNER: list[threading.Thread | None] = [None]


def _remove(folders: list[Path]) -> None:
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def wait_for_pruning() -> None:
    """Join the background deletion of old checkpoints (rank 0), if one is running."""
    if _PRUNER[0] is not None:
        _PRUNER[0].join()
        _PRUNER[0] = None
