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


def _worktree_changes() -> set[str] | None:
    """``git status --porcelain`` of the checkout, one entry per path (None outside a checkout)."""
    import subprocess
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], capture_output=True,
                             text=True, timeout=60, cwd=os.path.dirname(os.path.dirname(__file__)))
    except (OSError, subprocess.TimeoutExpired):
        return None
    return set(out.stdout.splitlines()) if out.returncode == 0 else None


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):      # the controller (or a run without xdist)
        session.config._worktree_before = _worktree_changes()


def pytest_sessionfinish(session, exitstatus):
    """The suite writes nothing into the checkout: a test that runs a study or benchmark with its
    default outputs would overwrite the committed results and figures."""
    before = getattr(session.config, "_worktree_before", None)
    after = _worktree_changes() if before is not None else None
    # A source file edited while the suite runs is someone's work, not the suite's output.
    new = {line for line in (after or set()) - (before or set())
           if line.startswith("??") or not line.endswith((".py", ".sh"))}
    if new:
        written = ", ".join(sorted(line[3:] for line in new))
        writer = session.config.get_terminal_writer()
        writer.line()
        writer.line(f"error: the tests wrote into the checkout: {written}", red=True)
        session.exitstatus = 1
