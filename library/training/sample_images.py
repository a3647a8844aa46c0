"""Sample images during training (`--sample_prompts`, `--sample_every_n_steps/epochs`, `--sample_at_first`).

Files: `<output_dir>/sample/<output_name>_<e000001|000010>_<i:02d>_<YYYYmmddHHMMSS>_<seed>.png`, each with its prompt,
seed and settings in the PNG metadata. The text-encoder outputs of the prompts come from the cache made before the
encoder left the GPU (with --cache_text_encoder_outputs) or from the encoder itself, on the device it runs on (the
CPU with --te_device cpu). The RNG states of the run are saved and restored around sampling, so sampling never
changes the training randomness.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from library.errors import UserError
from library.sampling.generation import GenerationSettings, PngWriter, denoise
from library.sampling.sampler import load_prompts, parse_uncond_skip_layers
from library.text_encoder.encoding import encode_captions, model_device, text_encoder_batch_size
from library.text_encoder.loading import place_text_encoder

logger = logging.getLogger(__name__)


def is_due(args: Any, epoch: int | None, step: int) -> bool:
    if not args.sample_prompts:
        return False
    if epoch is None:
        if step == 0:
            return bool(args.sample_at_first)
        return bool(args.sample_every_n_steps) and step % args.sample_every_n_steps == 0
    return bool(args.sample_every_n_epochs) and epoch % args.sample_every_n_epochs == 0


def sample_images_if_due(trainer: Any, run: Any, epoch: int | None, step: int) -> list[Path]:
    args, acc = run.args, run.accelerator
    if not is_due(args, epoch, step):
        return []
    acc.wait_for_everyone()
    if not acc.is_main_process:
        acc.wait_for_everyone()
        return []
    rng_state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        paths = _generate_all(trainer, run, epoch, step)
    finally:
        torch.set_rng_state(rng_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state_all(cuda_state)
    acc.wait_for_everyone()
    return paths


def _text_outputs(trainer: Any, run: Any, texts: list[str]) -> dict[str, Any]:
    cached = trainer.sample_prompts_te_outputs or {}
    missing = [t for t in texts if t not in cached]
    if not missing:
        return cached
    te = run.text_encoders[0] if run.text_encoders else None
    if te is None:
        raise UserError(
            f"The sample prompt file '{run.args.sample_prompts}' changed during training ({len(missing)} new texts) and"
            " the text encoder is no longer loaded (--cache_text_encoder_outputs): restore the file, or restart the run."
        )
    te_was = model_device(te)
    place_text_encoder(te, trainer.te_device or run.accelerator.device)  # the CPU with --te_device cpu
    encoded = encode_captions(te, trainer.tokenizer, missing, run.args.moss_max_token_length,
                              text_encoder_batch_size(run.args.text_encoder_batch_size))
    if not trainer.is_train_text_encoder(run.args):
        place_text_encoder(te, te_was)  # a bitsandbytes encoder never moves
    return {**cached, **dict(zip(missing, encoded))}


def _generate_all(trainer: Any, run: Any, epoch: int | None, step: int) -> list[Path]:
    args, acc = run.args, run.accelerator
    prompts = load_prompts(args.sample_prompts)
    skip = parse_uncond_skip_layers(args.sample_uncond_skip_layers, run.unet.config.num_layers)
    texts = list(dict.fromkeys(t for p in prompts for t in (p.get("prompt", ""), p.get("negative_prompt") or "")))
    outputs = _text_outputs(trainer, run, texts)
    out_dir = Path(args.output_dir) / "sample"
    suffix = f"e{epoch:06d}" if epoch is not None else f"{step:06d}"
    stamp = time.strftime("%Y%m%d%H%M%S")
    name = args.output_name or "last"
    dit = run.unet
    was_training = dit.training
    dit.eval()
    run.vae.to(acc.device)
    autocast = run.weight_dtype if run.weight_dtype != torch.float32 else None
    # each PNG encoded and written by a writer thread while the next prompt denoises
    with torch.no_grad(), PngWriter(run.vae) as writer:
        for i, p in enumerate(prompts):
            settings = GenerationSettings.from_prompt_dict(p, skip, default_seed=(args.seed or 0) + i)
            cond = outputs[settings.prompt]
            uncond = outputs[settings.negative_prompt] if settings.scale != 1.0 else None
            latents = denoise(dit, settings, cond, uncond, acc.device, autocast)
            writer.add(latents, out_dir / f"{name}_{suffix}_{i:02d}_{stamp}_{settings.seed}.png", settings,
                       {"step": step, "epoch": epoch})
        paths = writer.finish()
    if args.cache_latents and not args.highvram:  # otherwise the VAE stays: batches are encoded on the fly
        run.vae.to("cpu")
    if was_training:
        dit.train()
    logger.info("wrote %d sample images to %s", len(paths), out_dir)
    return paths
