#!/usr/bin/env python
"""`make demo`: the main job on the embedded default (the tiny MOSS-Image snapshot), on the CPU, offline.

1. builds the tiny snapshot in the official file layouts (DiT shards, Qwen3.5 shards, tokenizer, VAE, ComfyUI files);
2. writes a small learnable dataset (a red square on grey, one caption) with a dataset config TOML;
3. trains a DiT LoRA with moss_image_train_network.py (cached latents and text-encoder outputs, validation loss,
   sample images, metadata) and reports how the validation loss went;
4. generates with moss_image_minimal_inference.py without and with the LoRA, and says what changed.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

CAPTION = "a red square on a grey background"


def _say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def write_dataset(root: Path, n: int = 8, size: int = 64) -> Path:
    import numpy as np
    from PIL import Image

    folder = root / "images"
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        arr = np.full((size, size, 3), 128, np.uint8)
        o = 4 * (i % 3)
        arr[size // 4 + o : 3 * size // 4 + o, size // 4 : 3 * size // 4] = (220, 30, 30)
        Image.fromarray(arr).save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(CAPTION)
    config = root / "dataset.toml"
    config.write_text(
        "[general]\nresolution = 64\ncaption_extension = \".txt\"\nenable_bucket = true\nbucket_reso_steps = 16\n"
        "min_bucket_reso = 32\nmax_bucket_reso = 128\n\n[[datasets]]\nbatch_size = 2\nvalidation_split = 0.25\n\n"
        f"[[datasets.subsets]]\nimage_dir = \"{folder.as_posix()}\"\nnum_repeats = 4\n"
    )
    return config


def train(snapshot: Path, config: Path, out: Path, prompts: Path) -> tuple[Path, list[tuple[int, float]]]:
    import moss_image_train_network as trainer

    argv = [
        "--snapshot", str(snapshot), "--dataset_config", str(config), "--output_dir", str(out),
        "--output_name", "demo_lora", "--network_module", "networks.lora_generic", "--network_dim", "8",
        "--network_alpha", "8", "--network_train_unet_only", "--optimizer_type", "AdamW", "--learning_rate", "2e-3",
        "--lr_scheduler", "constant", "--max_train_steps", "40", "--seed", "42",
        "--timestep_sampling", "sigma", "--weighting_scheme", "logit_normal", "--logit_mean", "-1.09",
        "--logit_std", "0.95", "--discrete_flow_shift", "1.0", "--cache_latents", "--cache_latents_to_disk",
        "--cache_text_encoder_outputs", "--cache_text_encoder_outputs_to_disk", "--max_data_loader_n_workers", "0",
        "--validate_every_n_steps", "10", "--sample_prompts", str(prompts), "--sample_every_n_steps", "40",
        "--save_every_n_steps", "20", "--save_state",
    ]
    args = trainer.setup_parser().parse_args(argv)
    run = trainer.MossImageNetworkTrainer().train(args)
    return out / "demo_lora.safetensors", run.validation_history


def infer(snapshot: Path, out: Path, lora: Path | None) -> Path:
    import moss_image_minimal_inference as inference

    argv = ["--snapshot", str(snapshot), "--prompt", CAPTION, "--image_size", "64", "64", "--infer_steps", "8",
            "--seed", "1", "--save_path", str(out)]
    if lora is not None:
        argv += ["--lora_weight", str(lora), "--lora_multiplier", "1.0"]
    return inference.run(inference.setup_parser().parse_args(argv))[0]


def run(out: Path) -> None:
    import numpy as np
    from PIL import Image

    from library.files.model_spec import file_model_hash
    from library.files.safetensors_io import read_metadata
    from library.moss_image.tiny_snapshot import build_tiny_snapshot

    t0 = time.perf_counter()
    snapshot = build_tiny_snapshot(out / "tiny_snapshot")
    _say(f"tiny snapshot at {snapshot} ({sum(1 for p in snapshot.rglob('*') if p.is_file())} files in the official"
         " layouts: 3 DiT shards, 4 text-encoder shards, tokenizer, diffusers VAE, BFL VAE, ComfyUI DiT)")
    config = write_dataset(out / "dataset")
    prompts = out / "dataset" / "sample_prompts.txt"
    prompts.write_text(f"{CAPTION} --w 64 --h 64 --s 8 --d 1\n")
    _say(f"dataset: 8 images + captions, config {config}")

    lora, history = train(snapshot, config, out / "train", prompts)
    meta = read_metadata(lora)
    _say("validation loss (fixed sigmas 0.2/0.4/0.6/0.8, fixed noise): "
         + ", ".join(f"step {s}: {v:.4f}" for s, v in history))
    _say(f"LoRA saved to {lora}: {meta['ss_network_dim']}-rank, {meta['ss_steps']} steps, modelspec.architecture "
         f"{meta['modelspec.architecture']}, sshs_model_hash verified: {file_model_hash(lora) == meta['sshs_model_hash']}")
    samples = sorted((out / "train" / "sample").glob("*.png"))
    _say(f"sample images written during training: {', '.join(p.name for p in samples)}")

    base = infer(snapshot, out / "infer" / "base", None)
    tuned = infer(snapshot, out / "infer" / "lora", lora)
    diff = np.abs(np.asarray(Image.open(base), np.float32) - np.asarray(Image.open(tuned), np.float32)).mean()
    _say(f"inference: {base} (base) and {tuned} (LoRA merged at load); mean pixel difference {diff:.1f}/255")
    _say(f"done in {time.perf_counter() - t0:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
