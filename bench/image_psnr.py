#!/usr/bin/env python
"""PSNR between the images of two runs: the PNGs of each folder in name order (the inference script names them by
time, prompt index and seed, so the same order is the same prompts), paired one to one. Prints JSON.

    python -m bench.image_psnr /tmp/infer_oneshot/0_compile /tmp/infer_oneshot/2_compile_no_codes [--out F.json]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
from PIL import Image

from bench.report import write_report


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio of two 8-bit images in dB (inf where they are equal)."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def compare(first: Path, second: Path) -> dict:
    a, b = sorted(first.glob("*.png")), sorted(second.glob("*.png"))
    if not a or len(a) != len(b):
        raise SystemExit(f"{first} has {len(a)} PNGs and {second} {len(b)}: give two folders of the same prompts")
    pairs = [{"first": x.name, "second": y.name,
              "psnr_db": round(psnr(np.asarray(Image.open(x).convert("RGB")), np.asarray(Image.open(y).convert("RGB"))),
                               2)} for x, y in zip(a, b)]
    return {"first": str(first), "second": str(second), "pairs": pairs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("first", type=Path)
    p.add_argument("second", type=Path)
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    write_report(compare(args.first, args.second), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
