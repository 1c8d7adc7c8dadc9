"""Fixtures every test module may use."""

from __future__ import annotations

import pytest

from tests.runs import shared_launcher


@pytest.fixture(scope="session")
def warm_launcher():
    """This pytest process's warm launcher (``tests.runs.WarmLauncher``): its server imports
    torch, DeepSpeed and transformers once, and every launch forks its ranks from it."""
    return shared_launcher()
