#!/usr/bin/env python
"""`make demo`: the main job on the embedded default (the tiny MOSS-Image snapshot), on the CPU, offline.

Builds the tiny snapshot in the official file layouts, loads the three models through the real loaders (DiT from its
first shard and from the ComfyUI single file, Qwen3.5 from its first shard, the FLUX.2 VAE from the BFL file and from
the diffusers folder), encodes a prompt, runs one DiT forward on VAE latents and one VAE round trip, and says what it
did.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT = "A photo of a cat sitting on a windowsill, soft daylight."


def _say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def run(out: Path) -> None:
    import numpy as np
    import torch
    from PIL import Image

    from library.flux2_vae import load_flux2_vae, normalize_latents, patchify_latents
    from library.moss_image_utils import load_moss_image_model, load_text_encoder, resolve_snapshot
    from library.qwen35_text_encoder import encode_prompts, load_tokenizer, pad_and_stack
    from library.tiny_snapshot import build_tiny_snapshot

    t0 = time.perf_counter()
    snap = build_tiny_snapshot(out / "tiny_snapshot")
    paths = resolve_snapshot(snap)
    _say(f"tiny snapshot ready at {snap} ({sum(1 for p in snap.rglob('*') if p.is_file())} files, official layouts)")

    first_shard = sorted(paths.dit.glob("*-00001-of-*.safetensors"))[0]
    dit = load_moss_image_model("cpu", first_shard, dtype=torch.float32)
    comfy = load_moss_image_model("cpu", snap / "moss_image_base_bf16.safetensors", dtype=torch.float32)
    same = all(torch.equal(a, b) for a, b in zip(dit.state_dict().values(), comfy.state_dict().values()))
    n = sum(p.numel() for p in dit.parameters())
    _say(f"DiT loaded from {first_shard.name} (+ shards beside it): {dit.config.num_layers} blocks, width "
         f"{dit.config.hidden_size}, {n:,} parameters; ComfyUI fused-qkv file gives identical weights: {same}")

    te_first = sorted(paths.text_encoder.glob("model-00001-of-*.safetensors"))[0]
    te = load_text_encoder(te_first, dtype=torch.float32)
    tok = load_tokenizer(text_encoder_path=str(te_first))
    with torch.no_grad():
        (embeds, mask), = [pad_and_stack(encode_prompts(te, tok, [PROMPT]))]
        empty = pad_and_stack(encode_prompts(te, tok, [""]))
    _say(f"Qwen3.5 text encoder loaded from {te_first.name}; prompt -> hidden states {tuple(embeds.shape)} "
         f"(empty prompt -> {tuple(empty[0].shape)})")

    vae = load_flux2_vae(snap / "flux2-vae.safetensors")
    vae_diffusers = load_flux2_vae(paths.vae)
    g = torch.Generator().manual_seed(0)
    yy, xx = torch.meshgrid(torch.linspace(-1, 1, 64), torch.linspace(-1, 1, 64), indexing="ij")
    image = torch.stack([xx, yy, xx * yy])[None].clamp(-1, 1)
    with torch.no_grad():
        raw = vae.encode(image)
        raw_d = vae_diffusers.encode(image)
        recon = vae.decode(raw)
        latents = normalize_latents(patchify_latents(raw), vae.bn.running_mean, vae.bn.running_var)
        sigma = 0.6
        noisy = (1 - sigma) * latents + sigma * torch.randn(latents.shape, generator=g)
        velocity = dit(noisy, torch.tensor([sigma * 1000.0]), embeds, mask)
        velocity_skip = dit(noisy, torch.tensor([sigma * 1000.0]), embeds, mask, skip_layers=[22])
    _say(f"VAE (BFL file and diffusers folder agree: {torch.allclose(raw, raw_d)}): image {tuple(image.shape)} -> raw "
         f"latents {tuple(raw.shape)} -> DiT input {tuple(latents.shape)} -> decoded {tuple(recon.shape)}")
    _say(f"DiT forward at sigma {sigma}: velocity {tuple(velocity.shape)}, std {velocity.std():.3f}; "
         f"with block 22 skipped (CFG uncond branch) it differs by {(velocity - velocity_skip).abs().mean():.3f}")

    png = out / "vae_roundtrip.png"
    pixels = ((torch.cat([image, recon], dim=3)[0].clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0)
    Image.fromarray(np.ascontiguousarray(pixels.numpy())).save(png)
    _say(f"wrote {png} (input | round trip through the random tiny VAE); done in {time.perf_counter() - t0:.1f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="demo_out", help="output folder (default demo_out)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from library.errors import UserError

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        run(out)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
