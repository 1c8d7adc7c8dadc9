"""Fixtures every test module may use."""

from __future__ import annotations

import os

import pytest

# For every process the tests start: W&B writes offline (no network, no key), tokenizers keep to
# their thread, and glibc's malloc keeps large freed blocks instead of handing them back to the
# kernel at every step (system time; docs/performance/cpu-allocator.md). Set here, so that
# the README's test command is all CI runs.
for _key, _value in (("WANDB_MODE", "offline"), ("WANDB_SILENT", "true"), ("TOKENIZERS_PARALLELISM", "false"),
                     ("MALLOC_MMAP_THRESHOLD_", "4294967296"), ("MALLOC_TRIM_THRESHOLD_", "68719476736")):
    os.environ.setdefault(_key, _value)

from tests.runs import shared_launcher


@pytest.fixture(scope="session")
def warm_launcher():
    """This pytest process's warm launcher (``tests.runs.WarmLauncher``): its server imports
    torch, DeepSpeed and transformers once, and every launch forks its ranks from it."""
    return shared_launcher()
