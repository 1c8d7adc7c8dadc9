"""Tokenizing batches of texts in N worker processes, results in submission order.

Each worker loads the tokenizer once (the backend's JSON, handed over at start-up) and encodes
with the ``tokenizers`` batch encoder, single-threaded, so that N workers use N cores and no more
(a SLURM task's ``--cpus-per-task``). On 2 cores a second worker process buys what the Rust
encoder's own threads do (``docs/performance/data-pipeline.md``), so with both they would only
oversubscribe the cores. One worker encodes in this process, with no start-up cost.

At most ``2 * workers`` batches are in flight, so memory stays a few batches whatever the corpus
size; every wait for a result has a timeout, and a worker that dies is one line, not a hang;
after an error the workers are killed, not waited for (a hung one would never finish).
The workers are spawned (never forked: the caller may hold threads or a CUDA context), so they
import the main script again: keep its work under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Iterable, Iterator

import numpy as np

RESULT_TIMEOUT_S = 900.0          # one batch is about a second of work: only a hung worker takes this
START_TIMEOUT_S = 180.0
KILL_WAIT_S = 5.0                 # for each killed worker to be reaped after an error
ENCODE_GROUP_CHARS = 128_000
_PARALLELISM = "TOKENIZERS_PARALLELISM"
_state: dict = {}


def init_worker(tokenizer_json: str, eod: int | None, dtype: str) -> None:
    """Loads the tokenizer into this process (the pool's initializer, or the in-process encoder)."""
    from tokenizers import Tokenizer

    _state.update(tokenizer=Tokenizer.from_str(tokenizer_json), eod=eod, dtype=np.dtype(dtype))


def encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray, int]:
    """Encodes a batch: (tokens concatenated, int32 tokens per document, largest id or -1).

    The encoding is the tokenizer's with ``add_special_tokens=False``, then the EOD id after each
    document when one is set (Megatron's ``--append-eod``). The batch goes to the encoder in
    groups of about ``ENCODE_GROUP_CHARS``, each turned into numpy before the next: the encoder's
    own objects take about 100 bytes per token, so this bounds a worker's memory by the group
    (or the longest document), not by the batch.
    """
    tokenizer, eod, dtype = _state["tokenizer"], _state["eod"], _state["dtype"]
    extra = [] if eod is None else [eod]
    chunks, lengths, group, size = [], [], [], 0
    for i, text in enumerate(texts):
        group.append(text)
        size += len(text)
        if size >= ENCODE_GROUP_CHARS or i == len(texts) - 1:
            for e in tokenizer.encode_batch_fast(group, add_special_tokens=False):
                ids = np.array(e.ids + extra, dtype=np.int64)
                chunks.append(ids)
                lengths.append(len(ids))
            group, size = [], 0
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, np.int64)
    max_id = int(tokens.max()) if len(tokens) else -1
    return tokens.astype(dtype), np.array(lengths, dtype=np.int32), max_id


def _ready() -> int:
    return os.getpid()


def _pool_init(tokenizer_json: str, eod: int | None, dtype: str) -> None:
    os.environ[_PARALLELISM] = "false"      # one thread per worker: see the module docstring
    init_worker(tokenizer_json, eod, dtype)


@contextlib.contextmanager
def _single_threaded():
    """The Rust encoder reads TOKENIZERS_PARALLELISM at each call: off for this call only, so the
    caller's setting is left as it was."""
    saved = os.environ.get(_PARALLELISM)
    os.environ[_PARALLELISM] = "false"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(_PARALLELISM, None)
        else:
            os.environ[_PARALLELISM] = saved


class Encoder:
    """Encodes batches with ``workers`` processes (or in this one for 1), in order.

    Used as a context manager: ``with Encoder(json, eod, dtype, workers) as enc:
    for tokens, lengths, max_id in enc.map(batches): ...``.
    """

    def __init__(self, tokenizer_json: str, eod: int | None, dtype, workers: int = 1):
        if workers < 1:
            raise ValueError(f"--workers ({workers}) must be >= 1; fix: use e.g. the CPU count")
        self._args = (tokenizer_json, eod, np.dtype(dtype).name)
        self.workers, self._pool = workers, None

    def __enter__(self) -> "Encoder":
        if self.workers == 1:
            init_worker(*self._args)
        else:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            self._pool = ProcessPoolExecutor(self.workers, multiprocessing.get_context("spawn"),
                                             initializer=_pool_init, initargs=self._args)
            # Start every worker now, so one that cannot start fails here, in bounded time.
            try:
                for future in [self._pool.submit(_ready) for _ in range(self.workers)]:
                    future.result(timeout=START_TIMEOUT_S)
            except Exception as e:
                self._pool.shutdown(wait=False, cancel_futures=True)
                raise RuntimeError(
                    f"tokenizer workers did not start within {START_TIMEOUT_S:.0f} s ({type(e).__name__}: "
                    f"{e}); fix: check the machine's load and memory, or use --workers 1") from None
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self._pool is not None:
            if exc_type is None:
                self._pool.shutdown(wait=True)
            else:
                # A worker may be hung (the result timeout) or dead: waiting would wait for it
                # (``shutdown(wait=True)`` joins the running task), so the workers are killed and
                # the error goes up at once. ``_processes``: the executor has no public handle on
                # them before Python 3.14's ``kill_workers``.
                workers = list((self._pool._processes or {}).values())
                self._pool.shutdown(wait=False, cancel_futures=True)
                for proc in workers:
                    proc.kill()
                for proc in workers:
                    proc.join(timeout=KILL_WAIT_S)
        _state.clear()

    def map(self, batches: Iterable[list[str]], where: str = "") -> Iterator[tuple]:
        """Yields ``encode(batch)`` for each batch, in order, reading batches only as fast as
        the workers take them."""
        if self._pool is None:
            for batch in batches:
                with _single_threaded():
                    yield encode(batch)
            return
        from concurrent.futures import TimeoutError as FutureTimeout
        from concurrent.futures.process import BrokenProcessPool

        pending = collections.deque()
        batches = iter(batches)
        while True:
            while len(pending) < 2 * self.workers:
                batch = next(batches, None)
                if batch is None:
                    break
                pending.append(self._pool.submit(encode, batch))
            if not pending:
                return
            try:
                yield pending.popleft().result(timeout=RESULT_TIMEOUT_S)
            except FutureTimeout:
                raise TimeoutError(
                    f"a tokenizer worker returned nothing for {RESULT_TIMEOUT_S:.0f} s{where}; fix: "
                    "check the machine's load and memory, or use fewer --workers") from None
            except BrokenProcessPool:
                raise RuntimeError(
                    f"a tokenizer worker died{where} (killed for memory?); fix: use fewer --workers, "
                    "then rerun: finished shards are kept") from None
