"""Run by test_oom.py in its own process: ``launch.train.main(argv)`` with the model's forward
raising a CUDA-style out-of-memory error at call ``OOM_AT_CALL`` (env), as a GPU would.

Before raising it waits for the background writer of the last save (it publishes the checkpoint
as soon as its files are durable, whatever the training thread does next) and records the state
of ``<run-dir>/checkpoints`` (what ``latest`` says, and every
file's size and mtime) in ``<run-dir>.before_oom.json``, so that the test can check that the
report left the checkpoints exactly as the last completed step did.
"""

import json
import os
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from launch import train  # noqa: E402
from model.transformer import Transformer  # noqa: E402


def checkpoint_state(ckpt_dir: Path) -> dict:
    return {p.relative_to(ckpt_dir).as_posix(): [p.stat().st_size, p.stat().st_mtime_ns,
                                                 p.read_text() if p.name == "latest" else None]
            for p in sorted(ckpt_dir.rglob("*")) if p.is_file()}


def main(argv: list[str]) -> int:
    run_dir = Path(argv[argv.index("--run-dir") + 1])
    oom_at, calls = int(os.environ["OOM_AT_CALL"]), [0]
    forward = Transformer.forward

    def forward_until_oom(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == oom_at:
            for thread in threading.enumerate():     # step 2's background save, if still writing
                if thread.name == "checkpoint-writer":
                    thread.join()
            state = checkpoint_state(run_dir / "checkpoints")
            Path(f"{run_dir}.before_oom.json").write_text(json.dumps(state))
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of "
                "79.19 GiB of which 1.21 GiB is free.")
        return forward(self, *args, **kwargs)

    Transformer.forward = forward_until_oom
    return train.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
