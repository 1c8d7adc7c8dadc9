"""Convert a run's newest checkpoint into a universal one, to resume at any other layout.

    python launch/to_universal.py --run-dir DIR

Reads the newest checkpoint (``DIR/checkpoints/<tag>``, the tag ``checkpoints/latest`` names) of
any layout and ZeRO stage the trainer runs (dp, tp + sp, ep, cp, pipelines, ZeRO 0-3, Muon) one
parameter at a time and writes ``DIR/checkpoints/universal/<tag>/`` (DeepSpeed's universal format
plus the trainer's state, ``interop/universal.py``) and ``DIR/checkpoints/universal/latest_universal``;
older conversions there are removed. Then resume with the same command at the new layout, its
DeepSpeed JSON carrying ``"checkpoint": {"load_universal": true}`` and the same global batch
(micro x accumulation x data-parallel size) so the data order continues. docs/checkpoints.md has
the matrix of layout changes. A bad input or a failed conversion is one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from interop.universal import check, convert  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", required=True, help="run directory written by launch/train.py")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        folder, tag = check(Path(args.run_dir))
        target = convert(Path(args.run_dir), folder, tag)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {target}; resume with \"checkpoint\": {{\"load_universal\": true}} in the "
          f"DeepSpeed JSON")
    return 0


if __name__ == "__main__":
    sys.exit(main())
