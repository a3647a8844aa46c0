#!/usr/bin/env python
"""Minimal MOSS-Image inference: the official sampler, LoRA merged at load, PNGs with their settings.

    python moss_image_minimal_inference.py --dit DIT --text_encoder TE --vae VAE --prompt "A cat" \
        --image_size 1024 1024 --infer_steps 50 --guidance_scale 3.0 --seed 42 --save_path output \
        [--lora_weight my_lora.safetensors --lora_multiplier 1.0]

Memory order (seed 002): the text encoder encodes every prompt first and is freed before the DiT is read; all
prompts are denoised, the DiT leaves the GPU, then the VAE decodes (untiled: tiled decoding shifts colours). When
the free memory holds the text encoder, the DiT and the VAE together (`loads_overlap`: not with --blocks_to_swap or
--vram_budget), a second thread reads the DiT and then the VAE while the text encoder's code is imported and the
prompts are encoded (the model builds themselves one at a time), and the DiT is freed where it is: the same images,
sooner.

`--compile` compiles each of the DiT's main blocks with torch.compile (the trainer's `--compile_*` options, from
`library.runtime.compile`); the compilation happens during the first prompt's denoising.

Timings: a prompt or prompt-file run (`generate()`) logs one line with the seconds of each phase and one with where
the seconds since the process started went, and records them for `library.runtime.phase_timer.last_run_timings()`
(cleared by every `run()`; other modes leave them empty), so a benchmark can call `run(args)` in-process and read
them. Keys (`TIMING_KEYS`): text_encoder_load (the import of its code included), encode, dit_load (LoRA merge,
ConvRot quantisation, block swap set-up and compile wrapping included; in the second thread when loading together),
denoise (all prompts; the torch.compile time falls in the first one), vae_load and decode (decoding and PNG writing;
both 0.0 with --output_type latent), total = encode + denoise + decode (the work after loading), startup (process
start to the start of the run: interpreter, imports, option checks), text_encoder_import (transformers' model code)
and wall (process start to the last file written). CUDA is synchronised before each reading.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from library.errors import UserError
from library.files.safetensors_io import discover_shards
from library.memory.block_swap import check_block_swap_args
from library.moss_image.loaders import fill_paths_from_snapshot
from library.options import groups
from library.options.checks import check_attention_args
from library.options.implications import ATTENTION_IMPLICATIONS, apply_implications
from library.planning.run_options import add_vram_budget_argument, apply_inference_vram_budget
from library.runtime import phase_timer, startup
from library.runtime.compile import check_compile_args
from library.sampling.sampler import check_image_size, parse_uncond_skip_layers
from library.text_encoder.encoding import encode_captions, text_encoder_batch_size
from library.text_encoder.loading import TextEncoderOptions, load_text_encoder
from library.text_encoder.quant import check_text_encoder_memory_args, free_vram
from library.text_encoder.qwen35 import check_max_token_length, load_tokenizer

logger = logging.getLogger("moss_image_minimal_inference")

LATENT_SUFFIX = ".safetensors"
TIMING_KEYS = ("text_encoder_load", "encode", "dit_load", "denoise", "vae_load", "decode", "total", "startup",
               "text_encoder_import", "wall")
OVERLAP_HEADROOM_BYTES = 4 * 2**30  # beside the three models while they load together: the prompts' activations
# Held while a model is built and filled: the text encoder is built under accelerate's init_empty_weights, which
# patches nn.Module.register_parameter for every thread, so a DiT or VAE filled by load_state_dict(assign=True) in
# that window would get meta parameters. The loads run one at a time; the imports and the encoding overlap them.
_MODEL_BUILD_LOCK = threading.Lock()


def setup_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="MOSS-Image minimal inference",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    groups.add_model_file_arguments(p, dit_dest="dit", text_encoder=True, vae=True)
    groups.add_text_encoder_batch_argument(p.add_argument_group("text encoder"))
    g = p.add_argument_group("LoRA")
    g.add_argument("--lora_weight", type=str, nargs="*", default=[], help="LoRA files merged at load")
    g.add_argument("--lora_multiplier", type=float, nargs="*", default=[], help="one multiplier per LoRA (1.0)")
    groups.add_attention_arguments(p)
    groups.add_convrot_arguments(p, dit=True, text_encoder=True, backward=False)
    groups.add_memory_arguments(p, training=False)
    groups.add_text_encoder_memory_arguments(p)
    groups.add_compile_arguments(p)
    g = p.add_argument_group("device")
    groups.add_device_argument(g)
    g.add_argument("--dtype", type=str, default=None, choices=["bf16", "fp16", "fp32"],
                   help="DiT dtype (default bf16 on CUDA, fp32 on CPU); the text encoder always runs in bf16")
    g = p.add_argument_group("generation")
    g.add_argument("--prompt", type=str, default=None, help="the prompt (\\n becomes a line break)")
    g.add_argument("--negative_prompt", type=str, default="", help="negative prompt (default empty, as official)")
    g.add_argument("--image_size", type=int, nargs=2, default=[1024, 1024], metavar=("HEIGHT", "WIDTH"),
                   help="image height and width, multiples of 16")
    g.add_argument("--infer_steps", type=int, default=50, help="sampling steps")
    g.add_argument("--guidance_scale", type=float, default=3.0, help="CFG scale (1.0 disables CFG)")
    g.add_argument("--flow_shift", type=float, default=5.0, help="shift of the sampling grid")
    g.add_argument("--uncond_skip_layers", type=str, default="22",
                   help="DiT blocks skipped in the unconditional branch ('' disables)")
    groups.add_seed_argument(g)
    g.add_argument("--from_file", type=str, default=None, help="prompt file: one per line with --w --h --s --l --fs --n --d")
    g.add_argument("--interactive", action="store_true", help="read prompts from the console")
    g = p.add_argument_group("output")
    g.add_argument("--save_path", type=str, default="output", help="output folder")
    g.add_argument("--output_type", type=str, default="images", choices=["images", "latent", "both"],
                   help="save images, latents (decode later with --latent_path) or both")
    g.add_argument("--latent_path", type=str, nargs="*", default=None, help="saved latents to decode (no sampling)")
    add_vram_budget_argument(p.add_argument_group("memory plan"))
    return p


def planned_image_sizes(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(height, width) of every image the run may generate, for --vram_budget."""
    sizes = [(args.image_size[0], args.image_size[1])]
    if args.from_file:
        sizes += [(s.height, s.width) for s in prompt_settings(args)]
    return sizes


# ------------------------------------------------------------------------------------------------------- setup
def resolve_args(args: argparse.Namespace) -> None:
    """What the options imply, before any check: --snapshot fills the model paths not given, --xformers / nothing
    resolve --attn_mode (`library.options.implications`)."""
    fill_paths_from_snapshot(args, "dit", "text_encoder", "vae")
    apply_implications(args, ATTENTION_IMPLICATIONS)


def _check_paths(args: argparse.Namespace) -> None:
    needed = ["vae"] if args.latent_path else ["dit", "text_encoder", "vae"]
    missing = [n for n in needed if not getattr(args, n)]
    if missing:
        raise UserError(f"{', '.join('--' + n for n in missing)} required (or --snapshot with a snapshot folder).")


def _check_args(args: argparse.Namespace) -> None:
    check_block_swap_args(args, training=False, device=args.device)
    check_text_encoder_memory_args(args)
    check_compile_args(args)
    check_attention_args(args, training=False)
    h, w = args.image_size
    check_image_size(w, h, "--image_size")
    parse_uncond_skip_layers(args.uncond_skip_layers)
    check_max_token_length(args.moss_max_token_length)
    text_encoder_batch_size(args.text_encoder_batch_size)
    if args.lora_multiplier and len(args.lora_multiplier) != len(args.lora_weight):
        raise UserError("Give one --lora_multiplier per --lora_weight (or none for 1.0 each).")
    if not args.latent_path and not (args.prompt is not None or args.from_file or args.interactive):
        raise UserError("Nothing to generate: give --prompt, --from_file, --interactive or --latent_path.")
    _check_values_and_files(args)


def _check_values_and_files(args: argparse.Namespace) -> None:
    """Finite numbers, a seed in range, an output folder that is not a file, LoRA files without NaN."""
    from library.errors import UserError
    from library.training.nonfinite import check_file_finite, check_finite_options
    from library.training.run_checks import check_seed

    check_finite_options({"--guidance_scale": args.guidance_scale, "--flow_shift": args.flow_shift,
                          "--lora_multiplier": args.lora_multiplier})
    check_seed(args.seed, "--seed")
    if Path(args.save_path).exists() and not Path(args.save_path).is_dir():
        raise UserError(f"--save_path '{args.save_path}' is a file, not a folder: give a folder for the images.")
    for path in args.lora_weight:
        check_file_finite(path, "LoRA file")


def _device_and_dtype(args: argparse.Namespace) -> tuple[Any, Any]:
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    return device, {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _free(device: Any) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------- prompts
def prompt_settings(args: argparse.Namespace) -> list[Any]:
    """GenerationSettings for --prompt or --from_file, with the command-line values as defaults."""
    from library.sampling.sampler import load_prompts, parse_uncond_skip_layers

    skip = parse_uncond_skip_layers(args.uncond_skip_layers)
    if args.from_file:
        entries = load_prompts(args.from_file, cli_defaults(args))
    else:
        entries = [{**cli_defaults(args), "prompt": args.prompt.replace("\\n", "\n")}]
    return [_settings(args, e, skip, i) for i, e in enumerate(entries)]


def cli_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """The command-line values that a prompt line's own options override."""
    h, w = args.image_size
    return {"negative_prompt": args.negative_prompt, "width": w, "height": h, "sample_steps": args.infer_steps,
            "scale": args.guidance_scale, "flow_shift": args.flow_shift}


def _settings(args: argparse.Namespace, entry: dict[str, Any], skip: tuple[int, ...], index: int) -> Any:
    from library.sampling.generation import GenerationSettings

    seed = args.seed + index if args.seed is not None else None
    return GenerationSettings.from_prompt_dict(entry, skip, seed)


# ------------------------------------------------------------------------------------------------- models
def _lora_plan(args: argparse.Namespace, prefix: str, device: Any) -> Any:
    """--lora_weight: merged while the weights are read, the math on `device` when it is a GPU (also for weights
    read to the CPU: --convrot_int8, --blocks_to_swap), in fp32, rounded once."""
    from library.lora.merge import LoraMergePlan, load_lora_files

    if not args.lora_weight:
        return None
    plan = LoraMergePlan(load_lora_files(args.lora_weight, args.lora_multiplier), prefix, names=args.lora_weight,
                         device=device)
    return None if plan.is_empty else plan


def load_text_encoder_for(args: argparse.Namespace, device: Any) -> tuple[Any, Any]:
    """The text encoder (LoRA merged, --te_quant / ConvRot applied, on its run device) and the tokenizer."""
    plan = _lora_plan(args, "lora_te", device)
    loaded = load_text_encoder(TextEncoderOptions.from_args(args), device, tensor_hook=plan.merge if plan else None)
    if plan:
        plan.finish()
    return loaded.model, load_tokenizer(args.tokenizer_cache_dir, args.text_encoder)


def encode_texts(args: argparse.Namespace, te: Any, tokenizer: Any, texts: list[str]) -> dict[str, Any]:
    """Each text encoded once, kept on the CPU."""
    outputs = encode_captions(te, tokenizer, texts, args.moss_max_token_length,
                              text_encoder_batch_size(args.text_encoder_batch_size))
    return {t: (e.cpu(), m.cpu()) for t, (e, m) in zip(texts, outputs)}


def load_dit(args: argparse.Namespace, device: Any, dtype: Any, float_fits: bool = False) -> Any:
    """The DiT on `device` (block swap: the blocks that stream stay on the CPU), LoRA merged while reading. With
    --convrot_int8 its float weights are read to the CPU and quantised layer by layer on the device, so that the
    device never holds them all; `float_fits` (the free memory was checked to hold them: `loads_overlap`) reads them
    straight to the device and quantises them there, without the round trip through the host."""
    from library.moss_image.loaders import load_moss_image_model

    plan = _lora_plan(args, "lora_unet", device)
    on_cpu = args.blocks_to_swap or (args.convrot_int8 and not float_fits)
    dit = load_moss_image_model(device, args.dit, args.attn_mode, args.split_attn,
                                loading_device="cpu" if on_cpu else device,
                                dtype=dtype,
                                disable_mmap=args.disable_mmap_load_safetensors,
                                tensor_hook=plan.merge if plan else None, convrot_int8=args.convrot_int8,
                                calc_device=device)
    from library.memory.block_swap import place_model

    place_model(dit, device, args.blocks_to_swap, supports_backward=False)  # --blocks_to_swap: the rest streams
    if plan:
        plan.finish()
    return dit


def load_dit_for_sampling(args: argparse.Namespace, device: Any, dtype: Any, num_shapes: int = 1) -> Any:
    """The DiT in eval mode, its main blocks wrapped by torch.compile with --compile (`num_shapes`: how many input
    shapes the run has, `pass_shapes`, for the dynamic-shape choice)."""
    dit = load_dit(args, device, dtype).eval()
    compile_for_sampling(args, dit, num_shapes)
    return dit


def compile_for_sampling(args: argparse.Namespace, dit: Any, num_shapes: int) -> None:
    """--compile: wrap the DiT's regions (`library.runtime.compile.compile_blocks`), with ConvRot INT8 q, k and v
    stacked first (one product for the three in the compiled blocks; `MossImage.stack_qkv_weights`); nothing
    without it."""
    from library.runtime.compile import compile_blocks

    if args.compile:
        dit.stack_qkv_weights()  # ConvRot INT8 blocks only (quantised at load or read from an int8 file)
        compile_blocks(args, dit, num_shapes=num_shapes)


# ------------------------------------------------------------------------------------------------- outputs
def _stem(settings: Any, index: int) -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}_{index:02d}_{settings.seed}"


def save_latents(latents: Any, settings: Any, path: Path) -> Path:
    import json
    from dataclasses import asdict

    from library.files.safetensors_io import save_file_atomic

    save_file_atomic({"latents": latents.float().cpu()}, path, {"moss_image_settings": json.dumps(asdict(settings))})
    return path


def load_latents(path: str) -> tuple[Any, Any]:
    import json

    from library.errors import UserError
    from library.sampling.generation import GenerationSettings
    from library.files.safetensors_io import load_safetensors, read_metadata

    sd = load_safetensors(path)
    if "latents" not in sd:
        raise UserError(f"'{path}' holds no 'latents' tensor: give a file saved with --output_type latent.")
    raw = read_metadata(path).get("moss_image_settings")
    settings = GenerationSettings(**json.loads(raw)) if raw else GenerationSettings(prompt="")
    settings.uncond_skip_layers = tuple(settings.uncond_skip_layers)
    return sd["latents"], settings


def load_vae_for(args: argparse.Namespace, device: Any) -> Any:
    from library.moss_image.vae import load_flux2_vae

    return load_flux2_vae(args.vae, device=device, disable_mmap=args.disable_mmap_load_safetensors)


def _png_path(args: argparse.Namespace, stem: str) -> Path:
    return Path(args.save_path) / f"{stem}.png"


def decode_and_save(args: argparse.Namespace, items: list[tuple[Any, Any, str]], vae: Any) -> list[Path]:
    """Decode each image and write its PNG (`generation.PngWriter`: the PNGs are written while the next image
    decodes)."""
    from library.sampling.generation import PngWriter

    with PngWriter(vae) as writer:
        for latents, settings, stem in items:
            writer.add(latents, _png_path(args, stem), settings)
        return writer.finish()


def save_latent_files(args: argparse.Namespace, items: list[tuple[Any, Any, str]]) -> list[Path]:
    paths = []
    for latents, s, stem in items:
        paths.append(save_latents(latents, s, Path(args.save_path) / f"{stem}{LATENT_SUFFIX}"))
        logger.info("saved latents %s", paths[-1])
    return paths


# Python's collector kept out of the sampling steps (`library.runtime.collector`); False: its automatic passes, as
# before (a bench's ratio)
COLLECT_BETWEEN_STEPS = True


def denoise_all(dit: Any, all_settings: list[Any], outputs: dict[str, Any], device: Any, first_index: int = 0,
                after_each: Callable[[tuple[Any, Any, str]], None] | None = None) -> list[tuple[Any, Any, str]]:
    """Each prompt's latents (on the CPU), with its settings and file stem, each handed to `after_each` once
    denoised; the collector's passes are made between the steps, while the queued GPU work runs
    (`COLLECT_BETWEEN_STEPS`)."""
    from library.runtime.collector import StepGarbageCollector
    from library.sampling.generation import denoise

    results = []
    with StepGarbageCollector() if COLLECT_BETWEEN_STEPS else contextlib.nullcontext() as collector:
        def between_steps(step: int, steps: int, x: Any) -> None:
            collector.step(step + 1)

        previous = None  # when the previous image was denoised
        for i, s in enumerate(all_settings, start=first_index):
            t0 = time.perf_counter()
            # the steps after the first repeat its calls: a compiled DiT checks only the guards between its graphs
            latents = denoise(dit, s, outputs[s.prompt], outputs[s.negative_prompt] if s.scale != 1.0 else None,
                              device, unguarded_repeats=True, callback=between_steps if collector else None)
            latents = latents.cpu()  # waits for the device: the time below is the real one
            done = time.perf_counter()
            # the interval between two images: the denoising and what ran between them (the previous image's decode)
            since = f"; {done - previous:.2f} s after the previous image" if previous is not None else ""
            logger.info("prompt %d denoised in %.2f s (seed %s)%s", i + 1, done - t0, s.seed, since)
            previous = done
            results.append((latents, s, _stem(s, i)))
            if after_each is not None:
                after_each(results[-1])
    return results


# ------------------------------------------------------------------------------------------------- main
def import_text_encoder_code() -> None:
    """Import the third-party code the text encoder is built from (transformers' Qwen3.5 model and tokenizer, and
    accelerate): seconds of pure-Python work, done with the collector paused (`library.runtime.startup`)."""
    with startup.imports_without_gc():
        import accelerate  # noqa: F401 - heavy (seconds): only a run that encodes prompts needs it
        from transformers import AutoTokenizer, Qwen3_5TextModel  # noqa: F401 - heavy (seconds), likewise


def _checkpoint_bytes(path: str, subfolder: str) -> int:
    """Bytes of the safetensors file(s) of a model option: a file with its shards, or a folder's files (those of its
    `subfolder` for a snapshot root)."""
    p = Path(path)
    if p.is_dir():
        folder = p / subfolder if (p / subfolder).is_dir() else p
        files = sorted(folder.glob("*.safetensors"))
    else:
        files = discover_shards(p) if p.exists() else []
    return sum(f.stat().st_size for f in files)


def _free_memory_bytes(device: Any) -> int:
    free = free_vram(device)
    if free is not None:
        return free
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _te_device_bytes(args: argparse.Namespace, device: Any) -> int:
    """The text encoder's weights on `device` (none where it runs on the CPU beside a GPU)."""
    if device.type == "cuda" and TextEncoderOptions.from_args(args).on_cpu:
        return 0
    return _checkpoint_bytes(args.text_encoder, "text_encoder")


def decode_fits_beside_dit(args: argparse.Namespace, device: Any, all_settings: list[Any]) -> bool:
    """Whether, loading together (`loads_overlap`), the largest image can be decoded while the DiT stays loaded: the
    room counted there for the text encoder (freed before the denoising) and `OVERLAP_HEADROOM_BYTES` hold the
    decode's working memory (`memory_model.vae_decode_bytes`)."""
    from library.planning.memory_model import vae_decode_bytes
    from library.planning.sizes import read_vae

    pixels = max(s.height * s.width for s in all_settings)
    return vae_decode_bytes(read_vae(args.vae), pixels) <= _te_device_bytes(args, device) + OVERLAP_HEADROOM_BYTES


def loads_overlap(args: argparse.Namespace, device: Any, dtype: Any) -> bool:
    """True when the DiT and the VAE may be read while the text encoder loads and encodes (seed 002's order is kept
    otherwise): no --blocks_to_swap nor --vram_budget (both plan for one model at a time), and the free memory of
    `device` holds the text encoder (unless it runs on the CPU beside a GPU), the DiT (at `dtype`), the VAE and
    `OVERLAP_HEADROOM_BYTES`. The images are the same either way (tested)."""
    import torch

    if args.blocks_to_swap or args.vram_budget is not None:
        return False
    dit = _checkpoint_bytes(args.dit, "transformer") * (2 if dtype == torch.float32 else 1)  # bf16 files
    need = _te_device_bytes(args, device) + dit + _checkpoint_bytes(args.vae, "vae") + OVERLAP_HEADROOM_BYTES
    free = _free_memory_bytes(device)
    logger.debug("loading together needs %.1f GiB, %.1f GiB free", need / 2**30, free / 2**30)
    return free >= need


def load_sampling_models(args: argparse.Namespace, device: Any, dtype: Any, with_vae: bool,
                         overlap: bool = False) -> tuple[Any, Any, dict[str, float]]:
    """The DiT in eval mode (not yet wrapped by --compile) and (`with_vae`) the VAE, with their load seconds
    (`dit_load`, `vae_load`). It imports nothing that is not imported yet (`_import_for_loading`), so that it can
    run beside the main thread's imports. `overlap`: `loads_overlap` found room for the float DiT beside the text
    encoder (`load_dit`'s `float_fits`)."""
    timer = phase_timer.PhaseTimer(device)
    with _MODEL_BUILD_LOCK, timer.phase("dit_load"):
        dit = load_dit(args, device, dtype, float_fits=overlap).eval()
    vae = None
    if with_vae:
        with timer.phase("vae_load"):
            with _MODEL_BUILD_LOCK:
                vae = load_vae_for(args, device)
            if overlap and vae.device.type == "cuda":
                vae.warm_up_decoder()  # off the first image's path, beside the text encoder's load and encode
    return dit, vae, timer.seconds


def _import_for_loading(args: argparse.Namespace) -> None:
    """What `load_sampling_models` imports on its way (the LoRA merge, the attention backend of --attn_mode), imported
    here first: two threads importing one package's modules in opposite orders could deadlock."""
    import library.lora.merge  # noqa: F401 - imported by _lora_plan
    from library.runtime.attention import Attention

    Attention(args.attn_mode, args.split_attn)  # imports the backend package (or says it is missing)


def pass_shapes(all_settings: list[Any], outputs: dict[str, Any]) -> int:
    """How many shapes of input the DiT's blocks get over these images: an image's size and the text lengths of its
    pass (the prompt's, and with CFG the negative prompt's, both in one pass: `library.moss_image.cfg_packing`).
    More than one compiles the blocks with dynamic shapes from the first image on (`compile_blocks`), rather than
    for the first image's shapes and then again for the next ones."""
    def tokens(text: str) -> int:
        return int(outputs[text][0].shape[-2])

    return len({(s.height, s.width, tokens(s.prompt), tokens(s.negative_prompt) if s.scale != 1.0 else None)
                for s in all_settings})


def generate(args: argparse.Namespace, all_settings: list[Any], device: Any, dtype: Any) -> list[Path]:
    """Encode every prompt, denoise them all, decode. When the memory holds all three models (`loads_overlap`) the
    DiT and the VAE are read by a second thread while the text encoder's code is imported and the prompts encoded
    (file reads and copies release the GIL; the builds take `_MODEL_BUILD_LOCK` in turn), and the DiT is freed where
    it is; otherwise seed 002's memory order: encode everything, free the encoder, read the DiT, denoise everything,
    move the DiT off the GPU, then read the VAE and decode (untiled). The phase timings go to the log and to
    `phase_timer.last_run_timings()`."""
    from library.sampling.generation import PngWriter

    started = startup.seconds_since_process_start()
    timer = phase_timer.PhaseTimer(device)
    texts = list(dict.fromkeys(t for s in all_settings for t in (s.prompt, s.negative_prompt)))
    images = args.output_type in ("images", "both")
    overlap = loads_overlap(args, device, dtype)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-load") as pool:
        if overlap:
            logger.info("reading the DiT%s while the text encoder encodes (the memory holds them together)",
                        " and the VAE" if images else "")
            _import_for_loading(args)
            background = pool.submit(load_sampling_models, args, device, dtype, images, True)
        with timer.phase("text_encoder_import"):
            import_text_encoder_code()
        with timer.phase("dit_wait"):
            _MODEL_BUILD_LOCK.acquire()  # the DiT's load, when it is still running
        try:
            with timer.phase("text_encoder_load"):
                te, tokenizer = load_text_encoder_for(args, device)
        finally:
            _MODEL_BUILD_LOCK.release()
        timer.seconds["text_encoder_load"] += timer.seconds["text_encoder_import"]
        with timer.phase("encode"):
            outputs = encode_texts(args, te, tokenizer, texts)
        del te  # freed before the DiT is read (or, loading together, before the denoising)
        _free(device)
        if overlap:
            with timer.phase("dit_wait"):
                dit, vae, loaded = background.result()
            del background  # the future holds the models too
        else:
            dit, vae, loaded = load_sampling_models(args, device, dtype, with_vae=False)
    with timer.phase("compile_setup"):
        # in this thread: it imports torch._dynamo / _inductor
        compile_for_sampling(args, dit, pass_shapes(all_settings, outputs))
    loaded["dit_load"] += timer.seconds.pop("compile_setup")
    # with the VAE beside the DiT (loading together) and room for a decode there, each image is decoded as soon as it
    # is denoised and its PNG written while the next one denoises; otherwise all after the DiT is freed
    beside = images and vae is not None and decode_fits_beside_dit(args, device, all_settings)
    with PngWriter(vae) if beside else contextlib.nullcontext() as early:
        def decode_early(item: tuple[Any, Any, str]) -> None:
            early.add(item[0], _png_path(args, item[2]), item[1])

        with timer.phase("denoise"):
            results = denoise_all(dit, all_settings, outputs, device, after_each=decode_early if early else None)
        with timer.phase("dit_free"):
            if not overlap:
                dit.to("cpu")  # the decode needs the room (seed 002: split decode)
            del dit
            _free(device)
        paths = save_latent_files(args, results) if args.output_type in ("latent", "both") else []
        if images:
            if vae is None:
                with timer.phase("vae_load"):
                    vae = load_vae_for(args, device)
            with timer.phase("decode"):
                paths += early.finish() if early else decode_and_save(args, results, vae)
            if early:  # the decodes ran inside the denoising phase: counted as decode
                timer.seconds["denoise"] -= early.decode_s
                timer.seconds["decode"] += early.decode_s
    if images:
        del vae
        _free(device)
    _record_timings({**timer.seconds, **loaded}, started, overlap)
    return paths


def _record_timings(seconds: dict[str, float], started: float, overlap: bool) -> None:
    """Record the run's timings (phases not run: 0.0) and log them on two lines: the phases, and where the seconds
    since the process started went."""
    timings = {k: seconds.get(k, 0.0) for k in TIMING_KEYS}
    timings["total"] = timings["encode"] + timings["denoise"] + timings["decode"]
    timings["startup"] = started
    timings["wall"] = startup.seconds_since_process_start()
    phase_timer.set_last_run_timings(timings)
    logger.info("timings (s): text encoder load %.2f, encode %.2f, DiT load %.2f, denoise %.2f, VAE load %.2f,"
                " decode %.2f; total after loading %.2f", *(timings[k] for k in TIMING_KEYS[:7]))
    models = (f"DiT + VAE load {timings['dit_load'] + timings['vae_load']:.2f} beside it, waited"
              f" {seconds.get('dit_wait', 0.0):.2f}" if overlap else
              f"DiT load {timings['dit_load']:.2f}, VAE load {timings['vae_load']:.2f}")
    logger.info("start-up (s): process start to run %.2f, text encoder import %.2f + load %.2f, encode %.2f, %s,"
                " denoise %.2f, DiT freed %.2f, decode and save %.2f; %.2f since the process started",
                timings["startup"], timings["text_encoder_import"],
                timings["text_encoder_load"] - timings["text_encoder_import"], timings["encode"], models,
                timings["denoise"], seconds.get("dit_free", 0.0), timings["decode"], timings["wall"])


def interactive(args: argparse.Namespace, device: Any, dtype: Any) -> list[Path]:
    """Prompts from the console. The models are loaded once, at the first prompt, and stay loaded (text encoder,
    DiT and VAE together: use --text_encoder_cpu, --te_quant or ConvRot INT8 when they do not fit)."""
    from library.sampling.sampler import parse_prompt_line, parse_uncond_skip_layers

    paths: list[Path] = []
    skip = parse_uncond_skip_layers(args.uncond_skip_layers)
    te = tokenizer = dit = vae = None
    print("Enter a prompt (with --w --h --s --l --fs --n --d options), an empty line or Ctrl-D to quit.", flush=True)
    for index, line in enumerate(sys.stdin):
        if not line.strip():
            break
        settings = _settings(args, parse_prompt_line(line.strip(), cli_defaults(args)), skip, index)
        if te is None:
            te, tokenizer = load_text_encoder_for(args, device)
            dit = load_dit_for_sampling(args, device, dtype)
        outputs = encode_texts(args, te, tokenizer, list(dict.fromkeys([settings.prompt, settings.negative_prompt])))
        results = denoise_all(dit, [settings], outputs, device, first_index=index)
        if args.output_type in ("latent", "both"):
            paths += save_latent_files(args, results)
        if args.output_type in ("images", "both"):
            vae = vae or load_vae_for(args, device)
            paths += decode_and_save(args, results, vae)
    return paths


def run(args: argparse.Namespace) -> list[Path]:
    from library.runtime.compile import (
        apply_cuda_backend_options,
        apply_cuda_optimizations,
        check_cpu_compiler,
        enable_expandable_segments,
    )

    if args.cuda_expandable_segments:
        enable_expandable_segments()

    phase_timer.set_last_run_timings({})
    resolve_args(args)
    _check_paths(args)
    _check_args(args)
    device, dtype = _device_and_dtype(args)
    check_cpu_compiler(args, device)
    apply_cuda_backend_options(args)
    if device.type == "cuda":
        apply_cuda_optimizations(args)  # TF32, as in training
    try:
        Path(args.save_path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        from library.errors import UserError
        from library.files.safetensors_io import describe_os_error

        raise UserError(describe_os_error(e, "the output folder", Path(args.save_path).parent)) from e
    if args.latent_path:
        items = []
        for p in args.latent_path:
            latents, settings = load_latents(p)
            items.append((latents, settings, Path(p).stem))
        return decode_and_save(args, items, load_vae_for(args, device))
    if args.interactive:
        return interactive(args, device, dtype)
    return generate(args, prompt_settings(args), device, dtype)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = setup_parser().parse_args(argv)
    try:
        with startup.frozen_imports():  # the imports live to the end of the run: its collections skip them
            if args.vram_budget is not None and not args.latent_path:  # the planned options, before any model is read
                apply_inference_vram_budget(args, setup_parser, planned_image_sizes(args), argv)
            paths = run(args)
    except UserError as e:
        logger.error("%s", e)
        return 2
    print(f"wrote {len(paths)} file(s) to {args.save_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
