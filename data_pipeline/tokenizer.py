"""The tokenizer step: a user's local HF tokenizer directory, or a byte-level BPE trained and cached.

Nothing here downloads. Without `tokenizer.path` the recipe's tokenizer is a byte-level BPE
(GPT-2 style, so any byte sequence round-trips exactly) trained with `tokenizers` on at most
`max_train_bytes` of the training corpus, wrapped in `transformers.PreTrainedTokenizerFast` so it
saves, reloads with `AutoTokenizer` and ships inside HF exports.

Cache layout (under `cache_dir`)::

    tokenizer/bpe-v{FORMAT}-vocab{V}-{digest16}/   # digest: sha256 of training text, V, FORMAT
        tokenizer.json  tokenizer_config.json      # what save_pretrained writes
        meta.json                                  # how it was trained (for people, not code)

Every rank may call `load_tokenizer` at once: each trains into a private temporary directory and
renames it into place, so readers never see a half-written tokenizer. Calling it on one rank
first and the others after a barrier only saves duplicate work. `train_tokenizer` is the same
training published into a directory the user names (``launch/prepare_data.py --train-tokenizer``).

Prepared data records `tokenizer_fingerprint`; the trainer compares it with its tokenizer's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizers import ByteLevelBPETokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

# Bump when training settings or the saved layout change, so old caches are not reused.
TOKENIZER_FORMAT_VERSION = 1
# One special token serves as BOS, EOS, pad and unk, as in GPT-2: byte-level BPE never needs unk,
# but HF exports expect the field to be set.
EOS_TOKEN = "<|endoftext|>"
DEFAULT_MAX_TRAIN_BYTES = 8_000_000
# Byte-level BPE starts from 256 byte symbols plus the special token.
_MIN_VOCAB_SIZE = 258


def read_text_file(path: Path) -> str:
    """Reads a file as UTF-8, replacing undecodable bytes (a few stdlib tests are Latin-1)."""
    return path.read_bytes().decode("utf-8", errors="replace")


def select_training_text(corpus: Sequence[os.PathLike | str], max_bytes: int) -> list[str]:
    """Picks about `max_bytes` of the corpus (file bytes / UTF-8 bytes of texts), deterministically.

    Items are visited in a fixed pseudo-random order (not the given order) so that a cap spreads
    over the whole corpus instead of its alphabetically first files; the item that crosses the
    cap is truncated. The picked texts are returned in the corpus's own order.

    Args:
        corpus: Paths (files read as UTF-8) or strings (document texts).
        max_bytes: Byte budget; `<= 0` means no cap.

    Returns:
        The selected texts.
    """
    sizes = [os.stat(it).st_size if isinstance(it, os.PathLike) else len(it.encode()) for it in corpus]
    if max_bytes <= 0 or sum(sizes) <= max_bytes:
        picked = {i: None for i in range(len(corpus))}
    else:
        # Argsort of raw PCG64 output: numpy keeps bit-generator streams stable across versions
        # (Generator.permutation carries no such promise).
        order = np.argsort(np.random.PCG64(0).random_raw(len(corpus)), kind="stable")
        picked, budget = {}, max_bytes
        for i in order.tolist():
            if budget <= 0:
                break
            picked[i] = budget if sizes[i] > budget else None  # None = take it whole
            budget -= sizes[i]
    texts = []
    for i in sorted(picked):
        item = corpus[i]
        text = read_text_file(Path(item)) if isinstance(item, os.PathLike) else item
        if picked[i] is not None:
            text = text.encode()[: picked[i]].decode("utf-8", errors="ignore")
        texts.append(text)
    return texts


def train_bpe_tokenizer(
    texts: Sequence[str], vocab_size: int, min_frequency: int = 2
) -> PreTrainedTokenizerFast:
    """Trains a byte-level BPE on `texts` and wraps it for transformers.

    Args:
        texts: Training documents.
        vocab_size: Target vocabulary including the special token; a small corpus may yield fewer.
        min_frequency: Pairs seen fewer times are never merged.

    Returns:
        A fast tokenizer with `<|endoftext|>` as BOS, EOS, pad and unk, adding no special tokens
        on its own (the data pipeline appends EOS after each document).
    """
    if vocab_size < _MIN_VOCAB_SIZE:
        raise ValueError(
            f"tokenizer.vocab_size ({vocab_size}) is below {_MIN_VOCAB_SIZE}, the 256 bytes plus "
            f"{EOS_TOKEN}; fix: set tokenizer.vocab_size to at least {_MIN_VOCAB_SIZE} (e.g. 8192)"
        )
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        texts, vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS_TOKEN],
        show_progress=False,
    )
    specials = {name: EOS_TOKEN for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, **specials)


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerFast) -> str:
    """A hex digest that changes whenever the tokenizer's output could change (used in cache keys)."""
    h = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode())
    h.update(f"|eos={tokenizer.eos_token_id}".encode())
    return h.hexdigest()


def _cache_key(texts: Sequence[str], vocab_size: int, min_frequency: int) -> str:
    h = hashlib.sha256(f"bpe|v{TOKENIZER_FORMAT_VERSION}|vocab={vocab_size}|minf={min_frequency}".encode())
    for text in texts:
        data = text.encode()
        # Length prefix so ["ab", "c"] and ["a", "bc"] hash differently.
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def load_local_tokenizer(path: str | os.PathLike, field: str = "tokenizer.path") -> PreTrainedTokenizerFast:
    """Loads a tokenizer from a local directory (never the Hub) and checks it can be used here.

    Args:
        path: An HF tokenizer folder (``save_pretrained`` output: tokenizer.json and friends).
        field: The setting that named `path`, for the error message (``--tokenizer`` on the
            preparation command line).

    Raises:
        ValueError: one line naming `field` when the directory is missing, holds no tokenizer
            that loads, the tokenizer is not a fast one, or it has no EOS token.
    """
    where = f"{field} ({str(path)!r})"
    if not Path(path).is_dir():
        raise ValueError(
            f"{where} is not a local directory; fix: point it at a folder holding tokenizer.json "
            "(e.g. written by save_pretrained), or leave it unset to train a BPE tokenizer on the corpus"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types, with a paragraph; the user needs one line
        first = (str(e).splitlines() or [""])[0][:160]
        raise ValueError(
            f"{where} is not a tokenizer folder ({type(e).__name__}: {first}); fix: point it at a "
            "folder written by save_pretrained (with tokenizer.json)"
        ) from None
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ValueError(
            f"{where} loads as {type(tokenizer).__name__}, not a fast tokenizer; fix: use a directory "
            "with a tokenizer.json"
        )
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"{where} has no eos_token, which separates packed documents; fix: set eos_token in its "
            "tokenizer_config.json"
        )
    return tokenizer


def check_new_dir(out_dir: str | os.PathLike, field: str = "--train-tokenizer") -> Path:
    """Refuses an existing directory (a trained tokenizer never overwrites anything)."""
    out = Path(out_dir)
    if out.exists():
        raise ValueError(
            f"{field} ({str(out)!r}) already exists; fix: pass --tokenizer {out} to use the tokenizer "
            "in it, or name a new directory"
        )
    return out


def train_tokenizer(texts: Sequence[str], vocab_size: int, out_dir: str | os.PathLike,
                    field: str = "--train-tokenizer") -> PreTrainedTokenizerFast:
    """Trains a byte-level BPE on `texts` and publishes it, complete, at `out_dir`.

    Raises:
        ValueError: `out_dir` already exists (nothing is overwritten), or the vocabulary is too small.
    """
    out = check_new_dir(out_dir, field)
    if vocab_size < _MIN_VOCAB_SIZE:
        raise ValueError(f"--vocab-size ({vocab_size}) is below {_MIN_VOCAB_SIZE}, the 256 bytes plus "
                         f"{EOS_TOKEN}; fix: use at least {_MIN_VOCAB_SIZE} (e.g. 32768)")
    if not texts:
        raise ValueError(f"{field}: the input holds no text to train a tokenizer on; fix: check --input")
    texts = list(texts)
    _train_and_publish(texts, vocab_size, 2, out, _cache_key(texts, vocab_size, 2))
    return load_local_tokenizer(out, field)


def load_tokenizer(
    path: str | os.PathLike | None,
    corpus: Sequence[os.PathLike | str],
    vocab_size: int,
    cache_dir: str | os.PathLike,
    max_train_bytes: int = DEFAULT_MAX_TRAIN_BYTES,
) -> PreTrainedTokenizerFast:
    """Returns the recipe's tokenizer: the one at `path`, or a cached BPE trained on `corpus`.

    Args:
        path: A local HF tokenizer directory (`tokenizer.path`), or None to train a BPE.
        corpus: Training documents as file paths (`pathlib.Path` or other `os.PathLike`) or as
            texts (`str`); ignored when `path` is given. Pass only the training split.
        vocab_size: Target BPE vocabulary; ignored when `path` is given. The trained tokenizer may
            be smaller on a tiny corpus; size the model's embedding from `len(tokenizer)`.
        cache_dir: Root of the cache; the tokenizer lives under `cache_dir/tokenizer/`.
        max_train_bytes: At most this many bytes of `corpus` train the BPE (`<= 0`: all of it).

    Returns:
        A fast tokenizer whose `eos_token_id` separates documents.
    """
    if path is not None:
        return load_local_tokenizer(path)
    if not corpus:
        raise ValueError(
            "cannot train a tokenizer on an empty corpus; fix: check data.source or set tokenizer.path"
        )
    min_frequency = 2
    texts = select_training_text(corpus, max_train_bytes)
    key = _cache_key(texts, vocab_size, min_frequency)
    root = Path(cache_dir) / "tokenizer"
    final = root / f"bpe-v{TOKENIZER_FORMAT_VERSION}-vocab{vocab_size}-{key[:16]}"
    if (final / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(final), local_files_only=True)

    _train_and_publish(texts, vocab_size, min_frequency, final, key)
    # Reload from disk so a fresh run and a cached run return exactly the same object type/state.
    return AutoTokenizer.from_pretrained(str(final), local_files_only=True)


def _train_and_publish(texts: list[str], vocab_size: int, min_frequency: int, final: Path,
                       key: str) -> None:
    """Train the BPE and publish it at ``final`` atomically: a complete folder renamed into
    place, so concurrent ranks never read a partial one."""
    num_bytes = sum(len(t.encode()) for t in texts)
    logger.info(
        "training byte-level BPE (vocab %d) on %d documents, %.1f MB", vocab_size, len(texts), num_bytes / 1e6
    )
    start = time.perf_counter()
    tokenizer = train_bpe_tokenizer(texts, vocab_size, min_frequency)
    seconds = time.perf_counter() - start
    logger.info("trained tokenizer (%d tokens) in %.1f s; caching it in %s", len(tokenizer), seconds, final)

    final.parent.mkdir(parents=True, exist_ok=True)
    # Same directory as the target, so the rename below is atomic (same filesystem).
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        tokenizer.save_pretrained(str(tmp))
        meta = {
            "format_version": TOKENIZER_FORMAT_VERSION,
            "vocab_size_requested": vocab_size,
            "vocab_size": len(tokenizer),
            "min_frequency": min_frequency,
            "train_documents": len(texts),
            "train_bytes": num_bytes,
            "train_seconds": round(seconds, 3),
            "corpus_sha256": key,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        try:
            os.rename(tmp, final)
        except OSError:
            # Another rank renamed its copy first; theirs is complete and equivalent.
            if not (final / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
