#!/usr/bin/env python
"""Write a full-size MOSS-Image DiT with random bf16 weights in the official layout, for benchmarks:

    OUT/transformer/diffusion_pytorch_model-0000{1,2,3}-of-00003.safetensors
    OUT/transformer/diffusion_pytorch_model.safetensors.index.json
    OUT/transformer/config.json

The DiT part of `bench.make_full_snapshot` (the same as `python -m bench.make_full_snapshot OUT --what dit`): tensors
drawn one row chunk at a time (on the GPU when there is one) and streamed into each shard after its header, never a
copy of the model in memory; each shard written to a temporary name and renamed. Usage, from the repository root:
python -m bench.make_full_dit OUT [--seed 0]
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from bench.make_full_snapshot import DIT_DIR, DIT_SHARDS, DIT_STEM, first_shard, dit_step, run_steps
from bench.stream_safetensors import RandomSource
from library.moss_image.dit import MossImageConfig

logger = logging.getLogger(__name__)


def write_full_dit(out: Path, seed: int = 0, config: MossImageConfig | None = None) -> Path:
    """Write the DiT under `out/transformer/`; returns the path of the first shard."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rng = RandomSource(seed, device)
    try:
        files = run_steps([dit_step(config or MossImageConfig(), rng)], out, dry_run=False)
    finally:
        rng.close()
    logger.info("DiT: %.2f GiB under %s", sum(f["bytes"] for f in files) / 2**30, out / DIT_DIR)
    return out / first_shard(DIT_DIR, DIT_STEM, DIT_SHARDS)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(prog="python -m bench.make_full_dit", description=(__doc__ or "").split("\n")[0])
    p.add_argument("out", type=Path, help="output folder (gets a transformer/ sub-folder)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(write_full_dit(args.out, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
