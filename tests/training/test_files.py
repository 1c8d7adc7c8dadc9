"""training/files.py: atomic writes and the start-up wait, whose timeout is one line."""

from __future__ import annotations

import threading
import time

import pytest

from training.files import atomic_write, wait_for_file


def test_wait_for_file_returns_once_the_file_appears(tmp_path):
    marker = tmp_path / "done"
    threading.Timer(0.3, marker.touch).start()
    start = time.monotonic()
    wait_for_file(marker, "the test's marker", timeout_s=30, poll_s=0.05)
    assert marker.exists() and time.monotonic() - start < 10


def test_wait_for_file_times_out_with_one_line_naming_what_and_why(tmp_path):
    marker = tmp_path / "never"
    start = time.monotonic()
    with pytest.raises(ValueError) as err:
        wait_for_file(marker, "rank 0 to finish: prepare data", timeout_s=0.4, poll_s=0.05)
    assert 0.4 <= time.monotonic() - start < 10
    message = str(err.value)
    assert "\n" not in message and "rank 0 to finish: prepare data" in message
    assert str(marker) in message and "share the filesystem" in message and "prepare_data.py" in message


def test_atomic_write_replaces_whole(tmp_path):
    path = tmp_path / "latest"
    atomic_write(path, "step00000001")
    atomic_write(path, "step00000002")
    assert path.read_text() == "step00000002" and [p.name for p in tmp_path.iterdir()] == ["latest"]
