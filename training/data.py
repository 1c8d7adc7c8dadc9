"""Token streams and batches: documents -> cached token stream -> packed, sharded batches.

Nothing here downloads, imports DeepSpeed or calls torch.distributed: ranks and sizes come in as
ints, and the sample order is seeded PCG64. The documents come from ``training/corpus.py``.

Cache layout (under `cache_dir`)::

    tokens/{digest16}.npy    # uint16/uint32 token stream, EOS after every document; memory-mapped
    tokens/{digest16}.json   # what it holds (documents, tokens, timing), for people
    # digest: sha256 of DATA_FORMAT_VERSION, tokenizer fingerprint, every document's key+fingerprint

Packing: the stream is cut into windows of `seq_len + 1` tokens that overlap by one token, so
window i is tokens[i*seq_len : (i+1)*seq_len + 1], inputs = window[:-1], labels = window[1:], and
every token but the first is a label exactly once per epoch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedTokenizerFast

from model.transformer import IGNORE_INDEX  # the label the loss ignores: padding in eval
from training.corpus import Document
from training.tokenization import tokenizer_fingerprint

logger = logging.getLogger(__name__)

# Bump when tokenized-stream layout or packing changes, so stale caches are not reused.
DATA_FORMAT_VERSION = 1


def _token_dtype(tokenizer: PreTrainedTokenizerFast) -> np.dtype:
    return np.dtype(np.uint16 if len(tokenizer) <= 2**16 else np.uint32)


def _encode_batches(
    texts: Iterator[tuple[int, str]], tokenizer: PreTrainedTokenizerFast, batch_bytes: int
) -> Iterator[tuple[int, int, np.ndarray]]:
    """Yields (documents, bytes, tokens) per batch, EOS appended after every document."""
    backend = tokenizer.backend_tokenizer
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # no offsets: faster
    eos, dtype = tokenizer.eos_token_id, _token_dtype(tokenizer)
    if eos is None:
        raise ValueError("the tokenizer has no eos_token, which separates packed documents; fix: set one")

    def flush(batch: list[str], size: int) -> tuple[int, int, np.ndarray]:
        ids = [np.asarray(e.ids + [eos], dtype=dtype) for e in encode(batch, add_special_tokens=False)]
        return len(batch), size, np.concatenate(ids)

    batch, size = [], 0
    for nbytes, text in texts:
        batch.append(text)
        size += nbytes
        if size >= batch_bytes:  # big batches keep the Rust thread pool busy
            yield flush(batch, size)
            batch, size = [], 0
    if batch:
        yield flush(batch, size)


def encode_texts(texts: Sequence[str], tokenizer: PreTrainedTokenizerFast) -> np.ndarray:
    """Tokenizes texts in memory (no cache), EOS after each; e.g. for evaluating a text file."""
    chunks = [t for _, _, t in _encode_batches(((len(x), x) for x in texts), tokenizer, 4_000_000)]
    return np.concatenate(chunks) if chunks else np.zeros(0, _token_dtype(tokenizer))


def _write_stream(docs: Sequence[Document], tokenizer, npy_path: Path, log_every: int, batch_bytes: int):
    """Tokenizes `docs` into a .npy file with bounded memory; returns what it wrote."""
    dtype, start = _token_dtype(tokenizer), time.perf_counter()
    stats, logged = {"documents": 0, "bytes": 0, "tokens": 0}, 0
    raw_path = npy_path.with_suffix(".raw")
    with raw_path.open("w+b") as raw:
        texts = ((d.num_bytes, d.read()) for d in docs)
        for n_docs, n_bytes, tokens in _encode_batches(texts, tokenizer, batch_bytes):
            raw.write(tokens.tobytes())
            stats["documents"] += n_docs
            stats["bytes"] += n_bytes
            stats["tokens"] += len(tokens)
            if stats["documents"] // log_every > logged or stats["documents"] == len(docs):
                logged, secs = stats["documents"] // log_every, time.perf_counter() - start
                logger.info(
                    "tokenized %d/%d documents, %.1f MB, %d tokens (%.0f docs/s, %.2f MB/s)",
                    stats["documents"], len(docs), stats["bytes"] / 1e6, stats["tokens"],
                    stats["documents"] / secs, stats["bytes"] / 1e6 / secs,
                )
        # The .npy header holds the length, known only now: write it, then copy the tokens after it.
        raw.seek(0)
        with npy_path.open("wb") as npy:
            header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False}
            np.lib.format.write_array_header_1_0(npy, {**header, "shape": (stats["tokens"],)})
            shutil.copyfileobj(raw, npy)
    raw_path.unlink()
    return {**stats, "dtype": dtype.name, "seconds": round(time.perf_counter() - start, 3)}


def tokenize_documents(
    docs: Sequence[Document],
    tokenizer: PreTrainedTokenizerFast,
    cache_dir: str | os.PathLike,
    log_every: int = 200,
    batch_bytes: int = 4_000_000,
) -> np.ndarray:
    """Returns the documents' token stream (EOS after each), memory-mapped from `cache_dir/tokens/`.

    The first call tokenizes with the fast tokenizer's batch encoder (about `batch_bytes` per call,
    a progress line every `log_every` documents) and publishes the file atomically (temporary
    file, then rename), so concurrent ranks never read a partial one. Later calls only map it.

    Returns:
        A read-only 1-D uint16 (vocab <= 65536) or uint32 array.
    """
    if not docs:
        raise ValueError("no documents to tokenize; fix: check data.source")
    fingerprint = tokenizer_fingerprint(tokenizer)
    h = hashlib.sha256(f"tokens|v{DATA_FORMAT_VERSION}|{fingerprint}".encode())
    for d in docs:
        h.update(f"\n{d.key}\t{d.fingerprint}".encode())
    root = Path(cache_dir) / "tokens"
    final = root / f"{h.hexdigest()[:16]}.npy"
    if not final.is_file():
        root.mkdir(parents=True, exist_ok=True)
        # A private directory beside the target: the renames below stay on one filesystem (atomic),
        # and a crash leaves only a dot-directory that is never read.
        with tempfile.TemporaryDirectory(prefix=f".{final.stem}.", dir=root) as tmp:
            tmp_npy = Path(tmp) / final.name
            meta = {"format_version": DATA_FORMAT_VERSION, "tokenizer_fingerprint": fingerprint}
            meta.update(_write_stream(docs, tokenizer, tmp_npy, log_every, batch_bytes))
            tmp_npy.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
            os.replace(tmp_npy.with_suffix(".json"), final.with_suffix(".json"))
            os.replace(tmp_npy, final)  # last: the .npy's presence means the entry is complete
    return np.load(final, mmap_mode="r")


@dataclass(frozen=True)
class BatchLayout:
    """How one optimizer step's samples are divided.

    Attributes:
        global_batch_size: Samples per optimizer step over all data-parallel ranks (DeepSpeed's
            `train_batch_size`).
        micro_batch_size: Samples per forward/backward on one rank (`train_micro_batch_size_per_gpu`).
        dp_size: Data-parallel ranks; tensor/expert/pipeline peers share a `dp_rank` and its data.
        dp_rank: This rank's data-parallel index.
    """

    global_batch_size: int
    micro_batch_size: int
    dp_size: int = 1
    dp_rank: int = 0

    def __post_init__(self) -> None:
        g, m, d = self.global_batch_size, self.micro_batch_size, self.dp_size
        if min(g, m, d) < 1:
            raise ValueError(f"batch sizes and dp_size must be >= 1 (got {g}, {m}, {d})")
        if g % (d * m):
            raise ValueError(
                f"train_batch_size ({g}) is not divisible by data-parallel size ({d}) x "
                f"train_micro_batch_size_per_gpu ({m}) = {d * m}; fix: make it a multiple of {d * m}"
            )
        if not 0 <= self.dp_rank < d:
            raise ValueError(f"dp_rank ({self.dp_rank}) must be in [0, {d})")

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per optimizer step on each rank."""
        return self.global_batch_size // (self.dp_size * self.micro_batch_size)


def _to_batch(windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.from_numpy(windows.astype(np.int64))  # (micro, seq_len + 1)
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


class PackedSampler:
    """Deterministic, resumable batches of packed windows for one data-parallel rank.

    Global sample position p (counted from the start of training) maps to epoch p // N and to
    window perm_epoch[p % N], where N is the number of windows and perm_epoch is a PCG64
    permutation seeded by (seed, epoch). Optimizer step s consumes positions [s*G, (s+1)*G);
    rank r takes the contiguous slice [r*G/D, (r+1)*G/D) and splits it into micro-batches. So
    a step's tokens do not depend on micro-batch size, accumulation or DP size.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, layout: BatchLayout, seed: int) -> None:
        """Args:
        tokens: The training token stream (from `tokenize_documents`).
        seq_len: Model sequence length; windows hold `seq_len + 1` tokens.
        layout: Batch sizes and this rank's place.
        seed: Sample-order seed (`train.seed`).
        """
        if seq_len < 1:
            raise ValueError(f"seq_len ({seq_len}) must be >= 1")
        self.tokens, self.seq_len, self.layout, self.seed = tokens, seq_len, layout, seed
        self.num_samples = (len(tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise ValueError(
                f"the training split has {len(tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
                "fix: raise data.max_bytes or lower the model's max_seq_len"
            )
        self.step = 0  # steps consumed (the trainer sets it); the only state that advances
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # steps move forward: keep only the two newest epochs
                self._perms.pop(min(self._perms))
            # Argsort of raw PCG64 output: numpy keeps SeedSequence and bit-generator streams stable
            # across versions (Generator.permutation carries no such promise).
            raw = np.random.PCG64(np.random.SeedSequence([self.seed, epoch])).random_raw(self.num_samples)
            self._perms[epoch] = np.argsort(raw, kind="stable")
        return self._perms[epoch]

    def global_samples(self, step: int) -> np.ndarray:
        """Window indices the whole step consumes, in order (all ranks together)."""
        g, n = self.layout.global_batch_size, self.num_samples
        positions = np.arange(step * g, (step + 1) * g)
        out = np.empty(g, dtype=np.int64)
        for epoch in np.unique(positions // n).tolist():  # one epoch, or two at a boundary
            sel = positions // n == epoch
            out[sel] = self._perm(epoch)[positions[sel] % n]
        return out

    def batches_for_step(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches for optimizer `step`.

        Returns:
            `grad_accum_steps` pairs (input_ids, labels), each LongTensor (micro, seq_len).
        """
        lay = self.layout
        per_rank = lay.global_batch_size // lay.dp_size
        mine = self.global_samples(step)[lay.dp_rank * per_rank : (lay.dp_rank + 1) * per_rank]
        offsets = mine[:, None] * self.seq_len + np.arange(self.seq_len + 1)  # (per_rank, seq_len + 1)
        windows = self.tokens[offsets.ravel()].reshape(offsets.shape)
        m = lay.micro_batch_size
        return [_to_batch(windows[i : i + m]) for i in range(0, per_rank, m)]

    @property
    def epoch(self) -> int:
        """Epoch of the next step's first sample."""
        return self.step * self.layout.global_batch_size // self.num_samples

    def state_dict(self) -> dict:
        """Position and what must match on resume (for the checkpoint's client_state)."""
        return {"version": DATA_FORMAT_VERSION, "step": self.step, "epoch": self.epoch, "seed": self.seed,
                "num_samples": self.num_samples, "seq_len": self.seq_len,
                "global_batch_size": self.layout.global_batch_size}

    def load_state_dict(self, state: dict) -> None:
        """Resumes at `state["step"]`; refuses state from different data or batch settings, which
        would silently change the sample order."""
        mine = self.state_dict()
        for name in ("seed", "num_samples", "seq_len", "global_batch_size"):
            if state[name] != mine[name]:
                raise ValueError(
                    f"cannot resume the data order: checkpoint has {name}={state[name]}, this run has "
                    f"{mine[name]}; fix: resume with the same data, seed, sequence length and batch size"
                )
        self.step = int(state["step"])


def validation_batches(
    tokens: np.ndarray, seq_len: int, layout: BatchLayout, num_windows: int | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of the first `num_windows` validation windows, in stream order.

    Windows are laid out as in training; the last may be short, its missing labels set to
    `IGNORE_INDEX`. The window set does not depend on micro-batch or DP size, so neither does the
    eval loss (sum of token losses / count of non-ignored labels, both summed over DP ranks).
    Rank r takes the r-th contiguous share; every rank gets the same number of batches (ZeRO-3
    needs all ranks in every forward), padded with rows of ignored labels.

    Args:
        tokens: Validation token stream.
        seq_len: Model sequence length.
        layout: Its `micro_batch_size` (windows per batch), `dp_size` and `dp_rank` are used.
        num_windows: How many windows to evaluate (None: all).

    Returns:
        (input_ids, labels) pairs, LongTensor (micro_batch_size, seq_len) each.
    """
    if len(tokens) < 2:
        raise ValueError(
            f"the validation split has {len(tokens)} tokens; fix: raise data.val_fraction or data.max_bytes"
        )
    micro_batch_size, dp_rank, dp_size = layout.micro_batch_size, layout.dp_rank, layout.dp_size
    total = -(-(len(tokens) - 1) // seq_len)  # ceil: the short tail window counts too
    n = total if num_windows is None else min(num_windows, total)
    per_rank = -(-n // dp_size)
    rows = -(-per_rank // micro_batch_size) * micro_batch_size
    windows = np.zeros((rows, seq_len + 1), dtype=np.int64)
    valid = np.zeros((rows, seq_len + 1), dtype=bool)
    first = dp_rank * per_rank
    for row, w in enumerate(range(first, min(first + per_rank, n))):
        chunk = np.asarray(tokens[w * seq_len : (w + 1) * seq_len + 1], dtype=np.int64)
        windows[row, : len(chunk)], valid[row, : len(chunk)] = chunk, True
    inputs, labels = _to_batch(windows)  # (rows, seq_len) each
    labels[~torch.from_numpy(valid[:, 1:])] = IGNORE_INDEX
    return list(zip(inputs.split(micro_batch_size), labels.split(micro_batch_size)))
