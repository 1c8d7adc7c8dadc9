"""Batches for the trainer: the step's packed windows from the blend of ``data.source``.

Nothing here downloads, imports DeepSpeed or calls torch.distributed: ranks and sizes come in as
ints. Which window each sample is, is ``data_pipeline/sampling.py`` (a pure function of the
sample's position); the sources and their streams are ``training/data/streams.py``.

Packing: a dataset's stream is cut into windows of ``seq_len + 1`` tokens that overlap by one
token, window i = tokens[i*seq_len : (i+1)*seq_len + 1], inputs = window[:-1], labels =
window[1:], so every token but the first is a label exactly once per epoch. The tokenizer's EOS
ends every document.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedTokenizerFast

from data_pipeline.sampling import Blend, TokenStream, permute, stable_key
from model.transformer import IGNORE_INDEX  # the label the loss ignores: padding in eval

# Bump when the sample order or packing changes: a checkpoint of another order is refused.
DATA_FORMAT_VERSION = 2


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
    # clone, not contiguous(): with one row both slices are already contiguous views of the same
    # storage, and masking the labels would write into the inputs.
    return w[:, :-1].clone(), w[:, 1:].clone()


class BlendedSampler:
    """Deterministic, resumable batches for one data-parallel rank from a blend of sources.

    Optimizer step s consumes the global sample positions [s*G, (s+1)*G); position p comes from
    source d (``Blend``: each source's share of every prefix within a few samples) as that
    source's k-th sample, which is its window ``permute(k % N_d, N_d, key(seed, d, k // N_d))``
    (N_d windows; a new order each epoch of that source). Rank r takes the contiguous slice
    [r*G/D, (r+1)*G/D) of the step and splits it into micro-batches. So a step's tokens depend
    on neither the micro-batch size, nor accumulation, nor the data-parallel size, and a resume
    needs only the step.
    """

    def __init__(self, streams: Sequence[TokenStream], names: Sequence[str],
                 weights: Sequence[float] | None, seq_len: int, layout: BatchLayout, seed: int) -> None:
        """Args:
        streams: Each source's training stream.
        names: Each source as written in ``data.source`` (``tokens_by_source``'s keys).
        weights: The blend's weights; None weighs each source by its windows.
        seq_len: Model sequence length; windows hold ``seq_len + 1`` tokens.
        layout: Batch sizes and this rank's place.
        seed: Sample-order seed (``train.seed``).
        """
        if seq_len < 1:
            raise ValueError(f"seq_len ({seq_len}) must be >= 1")
        self.streams, self.names, self.seq_len, self.layout, self.seed = list(streams), list(names), seq_len, layout, seed
        self.windows = [s.num_windows(seq_len) for s in self.streams]
        for name, stream, n in zip(self.names, self.streams, self.windows):
            if n < 1:
                raise ValueError(
                    f"data.source entry {name!r} has {stream.num_tokens} training tokens, fewer than "
                    f"seq_len + 1 = {seq_len + 1}; fix: add data, raise data.max_bytes or lower the "
                    f"model's max_seq_len")
        self.weights = tuple(float(w) for w in (weights if weights is not None else self.windows))
        self.blend = Blend.of(self.weights, seed)
        self._keys = [stable_key("windows", seed, i, name) for i, name in enumerate(self.names)]
        self.step = 0  # steps consumed (the trainer sets it); the only state that advances

    @property
    def num_samples(self) -> int:
        return sum(self.windows)

    def global_samples(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """The whole step's samples in order (all ranks together): (source, window) each."""
        g = self.layout.global_batch_size
        source, k = self.blend.assign(step * g, (step + 1) * g)
        window = np.empty_like(k)
        for d in np.unique(source).tolist():
            mine = source == d
            n = self.windows[d]
            epochs = k[mine] // n
            out = np.empty(int(mine.sum()), dtype=np.int64)
            for epoch in np.unique(epochs).tolist():        # one epoch, or two at a boundary
                sel = epochs == epoch
                out[sel] = permute(k[mine][sel] % n, n, stable_key(self._keys[d], epoch))
            window[mine] = out
        return source, window

    def batches_for_step(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches for optimizer ``step`` (0-based).

        Returns:
            ``grad_accum_steps`` pairs (input_ids, labels), each LongTensor (micro, seq_len).
        """
        lay = self.layout
        per_rank = lay.global_batch_size // lay.dp_size
        source, window = self.global_samples(step)
        mine = slice(lay.dp_rank * per_rank, (lay.dp_rank + 1) * per_rank)
        source, window = source[mine], window[mine]
        rows = np.empty((per_rank, self.seq_len + 1), dtype=np.int64)
        for d in np.unique(source).tolist():
            sel = source == d
            rows[sel] = self.streams[d].windows(window[sel], self.seq_len)
        m = lay.micro_batch_size
        return [_to_batch(rows[i : i + m]) for i in range(0, per_rank, m)]

    def tokens_by_source(self, steps: int) -> dict[str, int]:
        """Input tokens each source gave in the first ``steps`` optimizer steps, by name."""
        counts = self.blend.counts(steps * self.layout.global_batch_size)
        return {name: int(c) * self.seq_len for name, c in zip(self.names, counts.tolist())}

    @property
    def epoch(self) -> int:
        """Epoch of the largest source's next sample (for people; the order uses each source's own)."""
        d = int(np.argmax(self.weights))
        k = int(self.blend.counts(self.step * self.layout.global_batch_size)[d])
        return k // self.windows[d]

    def state_dict(self) -> dict:
        """Position and what must match on resume (for the checkpoint's client_state)."""
        return {"version": DATA_FORMAT_VERSION, "step": self.step, "epoch": self.epoch, "seed": self.seed,
                "sources": self.names, "windows": self.windows, "weights": list(self.weights),
                "num_samples": self.num_samples, "seq_len": self.seq_len,
                "global_batch_size": self.layout.global_batch_size,
                "tokens_by_source": self.tokens_by_source(self.step)}

    def load_state_dict(self, state: dict) -> None:
        """Resumes at ``state["step"]``; refuses state from different data, blend or batch
        settings, which would silently change the sample order."""
        mine = self.state_dict()
        for name in ("version", "seed", "sources", "windows", "weights", "seq_len", "global_batch_size"):
            theirs = state.get(name)
            if theirs != mine[name]:
                raise ValueError(
                    f"cannot resume the data order: checkpoint has {name}={theirs}, this run has "
                    f"{mine[name]}; fix: resume with the same data, blend, seed, sequence length "
                    f"and batch size")
        self.step = int(state["step"])


def blended_validation_windows(streams: Sequence[TokenStream], weights: Sequence[float] | None,
                               seq_len: int, num_windows: int | None) -> np.ndarray:
    """The validation windows of a blend, in a fixed order (no shuffle): position p is its
    source's k-th window (``Blend`` with seed 0; each source's windows in stream order, the short
    last one included); (n, seq_len + 1) int64, -1 past a stream's end."""
    counts = [s.num_windows(seq_len, partial=True) for s in streams]
    for n in counts:
        if n < 1:
            raise ValueError("a validation split has fewer than 2 tokens; fix: raise "
                             "data.val_fraction or data.max_bytes, or set data.val_source")
    total = sum(counts) if num_windows is None else num_windows
    if len(streams) == 1:
        return streams[0].windows(np.arange(min(total, counts[0])), seq_len)
    blend = Blend.of(weights if weights is not None else counts)
    source, k = blend.assign(0, total)
    rows = np.empty((total, seq_len + 1), dtype=np.int64)
    for d in np.unique(source).tolist():
        sel = source == d
        rows[sel] = streams[d].windows(k[sel] % counts[d], seq_len)
    return rows


def validation_batches(
    windows: np.ndarray, layout: BatchLayout
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of the validation ``windows`` ((n, seq_len + 1), -1 past a stream's end),
    as batches.

    The window set does not depend on micro-batch or DP size, so neither does the eval loss (sum
    of token losses / count of non-ignored labels, both summed over DP ranks). Rank r takes the
    r-th contiguous share; every rank gets the same number of batches (ZeRO-3 needs all ranks in
    every forward), padded with rows of ignored labels; labels past a stream's end are
    ``IGNORE_INDEX``.
    """
    micro_batch_size, dp_rank, dp_size = layout.micro_batch_size, layout.dp_rank, layout.dp_size
    n, width = windows.shape
    per_rank = -(-n // dp_size)
    rows = -(-per_rank // micro_batch_size) * micro_batch_size
    out = np.full((rows, width), -1, dtype=np.int64)
    mine = windows[dp_rank * per_rank : min((dp_rank + 1) * per_rank, n)]
    out[: len(mine)] = mine
    valid = out >= 0
    inputs, labels = _to_batch(np.where(valid, out, 0))  # (rows, seq_len) each
    labels[~torch.from_numpy(valid[:, 1:])] = IGNORE_INDEX
    return list(zip(inputs.split(micro_batch_size), labels.split(micro_batch_size)))


def text_windows(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """A token array (e.g. ``encode_texts`` of a text file) as validation windows, the short
    last one included."""
    stream = TokenStream(((tokens, 0, len(tokens)),))
    if stream.num_windows(seq_len, partial=True) < 1:
        raise ValueError(f"the text has {len(tokens)} tokens; at least 2 are needed")
    return stream.windows(np.arange(stream.num_windows(seq_len, partial=True)), seq_len)
