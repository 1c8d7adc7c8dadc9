"""Which packed window each training sample is: shuffled windows per dataset, weighted blends.

The sampling layer of the data pipeline, above the storage format (``indexed.py``) and the
preparation (``prepare.py``), as Megatron-Core splits ``indexed_dataset`` / ``gpt_dataset`` /
``blended_dataset``. Megatron builds its document, sample, shuffle and blend indices ahead, one
int per sample, cached as ``.npy`` files, with a compiled helper for the blend. Here every index
is a pure function of the sample's position, computed when a step needs it, so nothing is built,
cached or held per sample, a resume needs only the step, and the order does not depend on the
data-parallel size or the micro-batch:

- **Windows.** A dataset split is a list of token segments (ranges of memory-mapped shards),
  read as one stream. Window ``i`` is ``stream[i*S : (i+1)*S + 1]`` (S = sequence length): the
  windows overlap by one token, so every token but the first is a label once per epoch.
- **Shuffle.** The k-th sample drawn from a dataset with N windows is window
  ``permute(k % N, N, key(seed, dataset, k // N))``: a keyed Feistel network over the next power
  of 4 >= N, cycle-walked into [0, N), a bijection on [0, N) for every epoch, O(1) memory (numpy
  has no lazily evaluated permutation; ``Generator.permutation`` needs N ints).
- **Blend.** Sample ``p`` comes from dataset ``d`` when ``u_p = (p*a + c) mod m`` falls in d's
  share of [0, m) (``m = 2**40``, ``a/m`` the golden ratio's fraction: a low-discrepancy
  Kronecker sequence). Every prefix of the run holds each dataset's share of samples to within a
  few samples, and how many of the first P samples came from d (needed to know which of d's
  samples ``p`` is) is counted exactly with a floor sum (``_count_below``) in O(log m) integer
  steps. Megatron's greedy blend has the same property; this one needs no index.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_M = 1 << 40
_A = int(_M * (5 ** 0.5 - 1) / 2) | 1            # odd: p -> p*a mod m is a bijection
_MASK64 = (1 << 64) - 1


def stable_key(*parts) -> int:
    """A 64-bit key from strings and ints, the same on every machine and Python run."""
    text = "|".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def permute(index: np.ndarray, n: int, key: int) -> np.ndarray:
    """The keyed permutation of [0, n) applied to ``index`` (each in [0, n)).

    A 4-round Feistel network on 2*h bits (4**h >= n) is a bijection of [0, 4**h); applying it
    again to the values that land at or above n (cycle walking) gives a bijection of [0, n).
    Fewer than 4 walks are expected per value, since 4**h < 4n.
    """
    if n < 1:
        raise ValueError(f"permute: n ({n}) must be >= 1")
    x = np.asarray(index, dtype=np.uint64).copy()
    if n == 1:
        return x.astype(np.int64)
    half = max(1, (int(n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    round_keys = [np.uint64(stable_key(key, r) & _MASK64) for r in range(4)]

    def feistel(v: np.ndarray) -> np.ndarray:
        left, right = v >> np.uint64(half), v & mask
        for rk in round_keys:
            left, right = right, left ^ (_mix(right ^ rk) & mask)
        return (left << np.uint64(half)) | right

    x = feistel(x)
    outside = x >= np.uint64(n)
    while outside.any():
        x[outside] = feistel(x[outside])
        outside = x >= np.uint64(n)
    return x.astype(np.int64)


def _floor_sum(n: int, m: int, a: int, b: int) -> int:
    """sum over i in [0, n) of floor((a*i + b) / m), for integers n, a, b >= 0 and m >= 1, in
    O(log m) steps (the Euclid-like reduction)."""
    total = 0
    while True:
        if a >= m:
            total += (n - 1) * n // 2 * (a // m)
            a %= m
        if b >= m:
            total += n * (b // m)
            b %= m
        y_max = a * n + b
        if y_max < m:
            return total
        n, b = y_max // m, y_max % m
        m, a = a, m


def _count_below(count: int, offset: int, threshold: int) -> int:
    """How many p in [0, count) have (p*a + offset) mod m < threshold (0 <= threshold <= m).

    With y = p*a + offset: [y mod m < X] = floor(y/m) - floor((y + m - X)/m) + 1.
    """
    if count <= 0:
        return 0
    return (_floor_sum(count, _M, _A, offset) - _floor_sum(count, _M, _A, offset + _M - threshold)
            + count)


@dataclass(frozen=True)
class Blend:
    """Weights over datasets -> the dataset of each sample position, and exact running counts.

    Attributes:
        weights: Normalized weights, one per dataset, each > 0.
        offset: Where the sequence starts in [0, m) (from the seed).
    """

    weights: tuple[float, ...]
    offset: int = 0

    @classmethod
    def of(cls, weights: Sequence[float], seed: int = 0) -> "Blend":
        total = float(sum(weights))
        if not weights or any(not w > 0 for w in weights) or not np.isfinite(total):
            raise ValueError(f"blend weights {list(weights)} must be positive numbers")
        return cls(tuple(float(w) / total for w in weights), stable_key("blend", seed) % _M)

    @property
    def thresholds(self) -> list[int]:
        """Cumulative shares of [0, m): dataset d owns [t[d], t[d+1])."""
        cum = np.cumsum((0.0,) + self.weights)
        out = [min(_M, round(c * _M)) for c in cum]
        out[-1] = _M
        return out

    def counts(self, count: int) -> np.ndarray:
        """Samples each dataset gives among positions [0, count), exactly (int64)."""
        below = [_count_below(count, self.offset, t) for t in self.thresholds]
        return np.diff(np.asarray(below, dtype=np.int64))

    def assign(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """For positions [start, stop): each one's dataset, and which of that dataset's samples
        (0, 1, 2, ... over the whole run) it is."""
        p = np.arange(start, stop, dtype=np.uint64)
        with np.errstate(over="ignore"):          # mod 2**64 wrapping keeps p*a mod 2**40 exact
            u = ((p * np.uint64(_A) + np.uint64(self.offset)) % np.uint64(_M)).astype(np.int64)
        dataset = np.searchsorted(np.asarray(self.thresholds[1:], dtype=np.int64), u, side="right")
        k = np.empty(stop - start, dtype=np.int64)
        before = self.counts(start)
        for d in np.unique(dataset).tolist():
            mine = dataset == d
            k[mine] = before[d] + np.arange(int(mine.sum()))
        return dataset.astype(np.int64), k


@dataclass(frozen=True)
class TokenStream:
    """Token ranges of memory-mapped arrays read as one stream (a dataset's split).

    Attributes:
        segments: (tokens, start, stop): ``tokens[start:stop]`` of each, in order.
    """

    segments: tuple[tuple[np.ndarray, int, int], ...]

    @property
    def num_tokens(self) -> int:
        return sum(stop - start for _, start, stop in self.segments)

    def num_windows(self, seq_len: int, partial: bool = False) -> int:
        """Windows of ``seq_len + 1`` tokens, overlapping by one; with ``partial`` the short one
        at the end counts too."""
        n = self.num_tokens - 1
        return max(0, -(-n // seq_len) if partial else n // seq_len)

    def read(self, offsets: np.ndarray) -> np.ndarray:
        """The tokens at stream positions ``offsets`` (any shape; each < num_tokens), int64."""
        flat = np.asarray(offsets, dtype=np.int64).ravel()
        out = np.empty(flat.shape, dtype=np.int64)
        ends = np.cumsum([stop - start for _, start, stop in self.segments])
        which = np.searchsorted(ends, flat, side="right")
        for i in np.unique(which).tolist():
            tokens, start, _ = self.segments[i]
            sel = which == i
            base = int(ends[i - 1]) if i else 0
            local = flat[sel] - base + start
            # Fancy indexing of the memmap touches only the pages of these positions; a slice
            # from the smallest to the largest would copy everything between (a whole shard, for
            # windows drawn across it).
            out[sel] = tokens[local].astype(np.int64)
        return out.reshape(np.shape(offsets))

    def windows(self, index: np.ndarray, seq_len: int) -> np.ndarray:
        """Windows ``index`` (1-D), (len(index), seq_len + 1) int64; positions past the end of the
        stream (the short last window) read as -1."""
        offsets = np.asarray(index, dtype=np.int64)[:, None] * seq_len + np.arange(seq_len + 1)
        valid = offsets < self.num_tokens
        out = np.full(offsets.shape, -1, dtype=np.int64)
        if valid.any():
            out[valid] = self.read(offsets[valid])
        return out
