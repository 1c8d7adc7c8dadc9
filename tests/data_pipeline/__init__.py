"""Helpers shared by the data pipeline's tests: a tiny tokenizer, a small corpus, megatron-core."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
         "sigma tau upsilon phi chi psi omega def return import class self None True").split()


def text(i: int) -> str:
    """A deterministic document of a few dozen words (some non-ASCII, so bytes != characters)."""
    n = 5 + (i * 7) % 40
    return " ".join(WORDS[(i * 13 + j * j) % len(WORDS)] for j in range(n)) + (" é" if i % 3 else "\n")


def save_tokenizer(path: Path, vocab_size: int = 320) -> Path:
    """A byte-level BPE trained on the test texts, saved as an HF tokenizer folder."""
    from data_pipeline.tokenizer import train_bpe_tokenizer

    train_bpe_tokenizer([text(i) for i in range(300)], vocab_size).save_pretrained(str(path))
    return path


def write_jsonl(path: Path, first: int, count: int, key: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i in range(first, first + count):
            f.write(json.dumps({key: text(i), "id": i}) + "\n")
    return path


def megatron_indexed():
    """megatron-core's indexed_dataset module, the reference; a failure (not a skip) without it."""
    try:
        with warnings.catch_warnings():     # "Transformer Engine and Apex are not installed"
            warnings.simplefilter("ignore", UserWarning)
            from megatron.core.datasets import indexed_dataset
    except ImportError as e:
        pytest.fail(f"megatron-core is needed as the reference ({e}); fix: "
                    "pip install -r requirements.txt (it lists megatron-core)")
    return indexed_dataset
