#!/usr/bin/env python
"""Write a full-size MOSS-Image DiT with random bf16 weights in the official layout, for benchmarks:

    OUT/transformer/diffusion_pytorch_model-0000{1,2,3}-of-00003.safetensors
    OUT/transformer/diffusion_pytorch_model.safetensors.index.json
    OUT/transformer/config.json

The tensors are generated one at a time (on the GPU when there is one) and streamed into the shard after its header:
one tensor in memory at a time, never a copy of the model. Each shard is written to a temporary name and renamed.
Values follow the scale of real weights (norm weights near 1, Linear weights ~ N(0, 1/fan_in)) so that activations
stay in range. Usage: python bench/make_full_dit.py OUT [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import struct
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from library.moss_image_models import MossImage, MossImageConfig  # noqa: E402

logger = logging.getLogger("make_full_dit")

SHARDS = 3
STEM = "diffusion_pytorch_model"


def tensor_specs(config: MossImageConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every DiT tensor, from the model built on the meta device."""
    with torch.device("meta"):
        model = MossImage(config)
    return [(k, tuple(v.shape)) for k, v in model.state_dict().items()]


def split_by_size(specs: list[tuple[str, tuple[int, ...]]], shards: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Consecutive groups of about equal byte size (the official shards split the key order the same way)."""
    sizes = [torch.Size(s).numel() for _, s in specs]
    target = sum(sizes) / shards
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    acc = 0
    for spec, size in zip(specs, sizes):
        if acc >= target * len(groups) and len(groups) < shards:
            groups.append([])
        groups[-1].append(spec)
        acc += size
    return groups


def random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator, device: torch.device) -> torch.Tensor:
    if len(shape) == 1 and "norm" in name:
        return (1.0 + 0.05 * torch.randn(shape, generator=gen, device=device)).to(torch.bfloat16)
    if name.endswith("scale_shift_table"):
        return (0.05 * torch.randn(shape, generator=gen, device=device)).to(torch.bfloat16)
    fan_in = shape[-1] if len(shape) > 1 else 1
    return (torch.randn(shape, generator=gen, device=device) / max(fan_in, 1) ** 0.5).to(torch.bfloat16)


def header_bytes(group: list[tuple[str, tuple[int, ...]]]) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in group:
        size = torch.Size(shape).numel() * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_shard(path: Path, group: list[tuple[str, tuple[int, ...]]], gen: torch.Generator,
                device: torch.device) -> int:
    tmp = path.with_name(f".{path.name}.tmp")
    written = 0
    with open(tmp, "wb") as f:
        f.write(header_bytes(group))
        for name, shape in group:
            t = random_tensor(name, shape, gen, device).cpu().contiguous()
            f.write(memoryview(t.view(torch.uint8).numpy()))
            written += t.numel() * 2
            del t
    os.replace(tmp, path)
    return written


def write_full_dit(out: Path, seed: int = 0, config: MossImageConfig | None = None) -> Path:
    config = config or MossImageConfig()
    folder = out / "transformer"
    folder.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=device).manual_seed(seed)
    groups = split_by_size(tensor_specs(config), SHARDS)
    weight_map, total = {}, 0
    for i, group in enumerate(groups, start=1):
        name = f"{STEM}-{i:05d}-of-{SHARDS:05d}.safetensors"
        t0 = time.perf_counter()
        total += write_shard(folder / name, group, gen, device)
        weight_map.update({k: name for k, _ in group})
        logger.info("wrote %s: %d tensors in %.1f s", name, len(group), time.perf_counter() - t0)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    for fname, payload in ((f"{STEM}.safetensors.index.json", index),
                           ("config.json", {"_class_name": "MossImageTransformer2DModel",
                                            **{k: v for k, v in asdict(config).items() if k != "extra"}})):
        tmp = folder / f".{fname}.tmp"
        tmp.write_text(json.dumps(payload, indent=2))
        os.replace(tmp, folder / fname)
    logger.info("full-size DiT: %.2f GiB in %d shards under %s", total / 2**30, SHARDS, folder)
    return folder / f"{STEM}-00001-of-{SHARDS:05d}.safetensors"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path, help="output folder (gets a transformer/ sub-folder)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(write_full_dit(args.out, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
