#!/usr/bin/env python
"""Write the embedded tiny MOSS-Image snapshot (official file layouts, deterministic random weights) to OUT_DIR."""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir", help="folder to write (created; replaced with --overwrite)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    parser.add_argument("--overwrite", action="store_true", help="rebuild even if OUT_DIR already holds a snapshot")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from library.errors import UserError
    from library.moss_image.tiny_snapshot import build_tiny_snapshot

    try:
        out = build_tiny_snapshot(args.out_dir, seed=args.seed, overwrite=args.overwrite)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for p in sorted(out.rglob("*")):
        if p.is_file():
            print(f"{p.relative_to(out)}  {p.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
