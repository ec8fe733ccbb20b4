"""`python -m training.unpack_reference PACKDIR --out models/`: restores a reference family packed by
`python -m training.build_reference --pack PACKDIR`, checking every file's SHA-256."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from training.pack import unpack_reference


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.unpack_reference", description=__doc__)
    parser.add_argument(
        "pack_dir", type=Path, help="directory holding small-files.tar.gz and the safetensors"
    )
    parser.add_argument("--out", type=Path, required=True, help="directory to restore the family into")
    args = parser.parse_args(argv)
    restored = unpack_reference(args.pack_dir, args.out)
    print(f"restored {len(restored)} files into {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
