"""Run on every rank by the checkpoint fault tests: ``launch.train.main(argv)`` with the writes of
the files of one checkpoint tag (env ``FAULT_TAG``, e.g. ``step00000006``) interfered with, on the
rank ``FAULT_RANK`` (default: every rank): ``torch.save`` to a path (DeepSpeed's writes with
``train.async_save`` false) and ``training.checkpoint.saving._write_file`` (the background writer's):

- ``FAULT=hold``: write the file, cut it to half its size, touch ``$FAULT_MARK.<rank>`` and
  sleep, so that the test can SIGKILL the run in the middle of a save;
- ``FAULT=enospc``: raise ``OSError(ENOSPC)``, as a full disk does, after writing nothing;
- ``FAULT=slow``: sleep 3 s before each write, as a slow shared filesystem would take.
"""

import errno
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from launch import train  # noqa: E402
from training.checkpoint import saving  # noqa: E402

_save, _write_file = torch.save, saving._write_file


def _faulty(write, f) -> None:
    here = os.environ.get("FAULT_RANK") in (None, os.environ.get("RANK", "0"))
    if not (here and isinstance(f, (str, os.PathLike)) and os.environ["FAULT_TAG"] in str(f)):
        return write()
    if os.environ["FAULT"] == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
    if os.environ["FAULT"] == "slow":
        time.sleep(3)
        return write()
    write()
    os.truncate(f, os.path.getsize(f) // 2)
    Path(f"{os.environ['FAULT_MARK']}.{os.environ.get('RANK', '0')}").touch()
    time.sleep(600)


torch.save = lambda obj, f, *args, **kwargs: _faulty(lambda: _save(obj, f, *args, **kwargs), f)
saving._write_file = lambda path, data: _faulty(lambda: _write_file(path, data), path)

if __name__ == "__main__":
    sys.exit(train.main(sys.argv[1:]))
