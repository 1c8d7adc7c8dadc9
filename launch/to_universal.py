"""Convert a run's newest checkpoint into DeepSpeed's universal format, to resume at another layout.

    python launch/to_universal.py --run-dir DIR [--workers N]

Wraps ``python -m deepspeed.checkpoint.ds_to_universal`` for the newest checkpoint
(``DIR/checkpoints/<tag>``, the tag ``checkpoints/latest`` names) and writes
``DIR/checkpoints/universal/<tag>/`` plus ``DIR/checkpoints/universal/latest_universal``; older
conversions there are removed. Then resume with the same command at the new layout, its DeepSpeed
JSON carrying ``"checkpoint": {"load_universal": true}`` and the same global batch (micro x
accumulation x data-parallel size) so the data order continues. docs/checkpoints.md lists which
layout changes work. A bad input or a failed conversion is one line on stderr,
exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from interop.universal import check, convert, is_muon_run  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", required=True, help="run directory written by launch/train.py")
    p.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1),
                   help="processes that extract ZeRO shards (default: min(4, CPUs))")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        folder, tag, inject = check(Path(args.run_dir))
        target = convert(folder, tag, args.workers, inject, muon=is_muon_run(Path(args.run_dir)))
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {target}; resume with \"checkpoint\": {{\"load_universal\": true}} in the "
          f"DeepSpeed JSON")
    return 0


if __name__ == "__main__":
    sys.exit(main())
