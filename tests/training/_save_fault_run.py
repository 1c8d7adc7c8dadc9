"""Run on every rank by the checkpoint fault tests: ``launch.train.main(argv)`` with ``torch.save``
interfered with for the files of one checkpoint tag (env ``FAULT_TAG``, e.g. ``step00000006``),
on the rank ``FAULT_RANK`` (default: every rank):

- ``FAULT=hold``: write the file, cut it to half its size, touch ``$FAULT_MARK.<rank>`` and
  sleep, so that the test can SIGKILL the run in the middle of a save;
- ``FAULT=enospc``: raise ``OSError(ENOSPC)``, as a full disk does, after writing nothing.
"""

import errno
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from launch import train  # noqa: E402

_save = torch.save


def faulty_save(obj, f, *args, **kwargs):
    here = os.environ.get("FAULT_RANK") in (None, os.environ.get("RANK", "0"))
    if not (here and isinstance(f, (str, os.PathLike)) and os.environ["FAULT_TAG"] in str(f)):
        return _save(obj, f, *args, **kwargs)
    if os.environ["FAULT"] == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
    _save(obj, f, *args, **kwargs)
    os.truncate(f, os.path.getsize(f) // 2)
    Path(f"{os.environ['FAULT_MARK']}.{os.environ.get('RANK', '0')}").touch()
    time.sleep(600)


torch.save = faulty_save

if __name__ == "__main__":
    sys.exit(train.main(sys.argv[1:]))
