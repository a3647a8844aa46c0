#!/usr/bin/env python
"""Where an image's decode goes: the FLUX.2 VAE of a snapshot decoding one image's latents as the inference script
decodes them (`library.sampling.generation.decode_to_pil`), in float32 as the script runs it and in the forms that
could replace it (channels-last memory, bfloat16 weights), each timed after warm-up, with the PSNR of its 8-bit
image against the float32 one, the host's part (the copy back, the 8-bit image) and the PNG encoding; `--profile`
adds the float32 decode's GPU time per kernel. One JSON.

    python -m bench.vae_decode --snapshot /tmp/full --out OUT/vae_decode.json [--image_size 1024 1024] [--profile]
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.convrot_int8 import time_ms
from bench.image_psnr import psnr
from bench.report import write_report

FORMS = {"float32": (torch.float32, torch.contiguous_format), "float32_channels_last": (torch.float32,
                                                                                        torch.channels_last),
         "bfloat16": (torch.bfloat16, torch.contiguous_format), "bfloat16_channels_last": (torch.bfloat16,
                                                                                          torch.channels_last)}


def _eight_bit(images: torch.Tensor) -> np.ndarray:
    """As `decode_to_pil` makes them: [-1, 1] -> uint8 HWC on the host."""
    img = images.clamp(-1, 1)[0]
    return ((img.float().cpu() + 1) * 127.5).round().byte().permute(1, 2, 0).numpy()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from library.moss_image.vae import load_flux2_vae

    device = torch.device(args.device)
    vae_path = Path(args.snapshot) / "vae"
    height, width = args.image_size
    reference = None
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
                           "torch": torch.__version__, "image_size": [height, width], "forms": {}}
    for name in args.forms.split(","):
        dtype, memory_format = FORMS[name]
        vae = load_flux2_vae(vae_path, dtype=dtype, device=device).to(memory_format=memory_format)
        latents = torch.randn(1, vae.config.z_channels, height // 8, width // 8,
                              generator=torch.Generator().manual_seed(0)).to(device)  # the same in every form
        latents = latents.to(memory_format=memory_format)

        def decode() -> torch.Tensor:
            return vae.decode(latents)

        timing = time_ms(decode, device.type, iters=args.iters, warmup=args.warmup)
        image = _eight_bit(decode())
        entry: dict[str, Any] = {**timing}
        if reference is None:
            reference = image
            t0 = time.perf_counter()
            for _ in range(3):
                _eight_bit(decode())
            entry["decode_and_host_ms"] = round((time.perf_counter() - t0) * 1e3 / 3, 2)
            from PIL import Image

            from library.sampling.generation import PNG_COMPRESS_LEVEL

            pil = Image.fromarray(np.ascontiguousarray(image))
            t0 = time.perf_counter()
            pil.save(io.BytesIO(), format="PNG", compress_level=PNG_COMPRESS_LEVEL)  # the level the scripts write at
            entry["png_encode_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
            if args.profile and device.type == "cuda":
                from bench.gpu_profile import kernel_profile

                entry["profile"] = kernel_profile(decode, steps=2, top=12)
        else:
            entry["psnr_db_vs_float32"] = round(psnr(image, reference), 2)
        out["forms"][name] = entry
        vae = latents = None  # freed before the next form loads
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--snapshot", type=Path, required=True, help="snapshot folder with vae/ (bench.make_full_snapshot)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON here")
    p.add_argument("--image_size", type=int, nargs=2, default=[1024, 1024], metavar=("HEIGHT", "WIDTH"))
    p.add_argument("--forms", default=",".join(FORMS), help=f"comma-separated, float32 first, of {', '.join(FORMS)}")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="the float32 decode's GPU time per kernel")
    args = p.parse_args(argv)
    if args.forms.split(",")[0] != "float32" or set(args.forms.split(",")) - set(FORMS):
        p.error(f"--forms: float32 first, then any of {', '.join(FORMS)}")
    write_report(run(args), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
