#!/usr/bin/env python
"""Where a compiled inference pass of the DiT spends its GPU time: the product's loading and compile path
(`moss_image_minimal_inference.load_dit_for_sampling`, with the script's own options), one CFG step's two passes at
an image size (the conditional one over every block, the unconditional one skipping `--uncond_skip_layers` as the
sampler does), timed over `--steps` steps after warm-up, and with `--profile` the GPU time per kernel category
(`bench.gpu_profile`). Random prompt embeddings stand in for the text encoder (only their length matters here).
One JSON.

    python -m bench.infer_profile --snapshot /tmp/full --out OUT/infer_profile.json --profile [--extra=--convrot_int8]
        [--settings inference_codes=False]

`--settings` changes `library.runtime.fused_compiled.set_compiled_kernels` before the DiT compiles (the same
switches as `bench.infer_oneshot`'s runs), so two invocations give a ratio; `--no_compile` times the eager forms.
The steps after the first run as the sampler runs them, inside `MossImage.repeated_calls()` (dynamo checks only the
guards between its graphs); `--guarded` checks every guard on every step. A step is one pass over both texts packed
side by side, as the sampler runs it (`library.moss_image.cfg_packing`); `--unpacked` runs the two passes.
Every timed step records its host time (until the last launch returns) and Python's collector passes in it.
`--sampler_images N` then denoises N images of `--sampler_steps` steps through the inference script's own loop
(`moss_image_minimal_inference.denoise_all`: the sampler between the passes, the collector's passes between the
steps, `--auto_gc` leaving them to Python as before) at the same text lengths, so that the loop's cost per step
beside the passes is measured in the same process.
"""

from __future__ import annotations

import argparse
import gc
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import moss_image_minimal_inference as script
from bench.report import write_report
from library.sampling.sampler import DEFAULT_UNCOND_SKIP_LAYERS, initial_noise, repeated_velocity


def _settings(text: str) -> dict[str, bool]:
    """"a=False,b=True" -> {"a": False, "b": True}."""
    out: dict[str, bool] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, _, value = item.partition("=")
        if value not in ("True", "False"):
            raise SystemExit(f"--settings: {item!r} is not name=True or name=False")
        out[name.strip()] = value == "True"
    return out


def _tuning(text: str) -> dict[str, int]:
    """"a=1,b=2" -> {"a": 1, "b": 2} (launch parameters of `library.runtime.fused_kernels.TUNING`)."""
    out: dict[str, int] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, _, value = item.partition("=")
        if not value.strip().isdigit():
            raise SystemExit(f"--tuning: {item!r} is not name=integer")
        out[name.strip()] = int(value)
    return out


def _load(args: argparse.Namespace) -> tuple[Any, Any, torch.device]:
    argv = ["--snapshot", str(args.snapshot), "--prompt", "profile", "--image_size", *map(str, args.image_size)]
    argv += ([] if args.no_compile else ["--compile"]) + shlex.split(args.extra)
    sargs = script.setup_parser().parse_args(argv)
    script.resolve_args(sargs)
    device, dtype = script._device_and_dtype(sargs)
    return script.load_dit_for_sampling(sargs, device, dtype), sargs, device


class _GcPasses:
    """Python's collector passes while the block runs, through `gc.callbacks`: per mark, the passes and their
    milliseconds by generation (`since_mark`)."""

    def __enter__(self) -> _GcPasses:
        self._began = 0.0
        self._passes: list[tuple[int, float]] = []
        gc.callbacks.append(self._callback)
        return self

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self._passes.append((int(info["generation"]), (time.perf_counter() - self._began) * 1e3))

    def mark(self) -> None:
        self._passes = []

    def since_mark(self) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for generation, ms in self._passes:
            out.setdefault(f"gen{generation}", []).append(round(ms, 2))
        return out

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


def _sampler_images(args: argparse.Namespace, dit: Any, cond: torch.Tensor, uncond: torch.Tensor,
                    device: torch.device) -> dict[str, Any]:
    """`--sampler_images` images of `--sampler_steps` steps through the inference script's own loop
    (`moss_image_minimal_inference.denoise_all`: the sampler, the prompt's preparation, the latents read back),
    the collector's passes between the steps or, with `--auto_gc`, automatic as before."""
    from library.sampling import generation
    from library.sampling.generation import GenerationSettings

    height, width = args.image_size
    settings = [GenerationSettings(prompt="cond", negative_prompt="uncond", height=height, width=width,
                                   sample_steps=args.sampler_steps, seed=i) for i in range(args.sampler_images)]
    outputs = {"cond": (cond[0], torch.ones(cond.shape[1], dtype=torch.bool)),
               "uncond": (uncond[0], torch.ones(uncond.shape[1], dtype=torch.bool))}
    seconds: list[float] = []
    passes_per_image: list[dict[str, list[float]]] = []
    plain = generation.denoise

    def timed(*a: Any, **k: Any) -> torch.Tensor:  # one image, read back as the script does
        passes.mark()
        t0 = time.perf_counter()
        latents = plain(*a, **k).cpu()
        seconds.append(round(time.perf_counter() - t0, 3))
        passes_per_image.append({g: [len(v), round(sum(v), 2)] for g, v in passes.since_mark().items()})
        return latents

    previous = script.COLLECT_BETWEEN_STEPS
    script.COLLECT_BETWEEN_STEPS = not args.auto_gc
    generation.denoise = timed  # the script imports it from the module at each call
    try:
        with _GcPasses() as passes:
            script.denoise_all(dit, settings, outputs, device)  # once for all images, as the script runs them
    finally:
        script.COLLECT_BETWEEN_STEPS = previous
        generation.denoise = plain
    return {"images": args.sampler_images, "steps": args.sampler_steps, "collector": "automatic" if args.auto_gc
            else "between steps", "image_s": seconds, "ms_per_step": [round(v * 1e3 / args.sampler_steps, 2)
                                                                      for v in seconds],
            "gc_passes_per_image": passes_per_image}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from library.runtime import fused_kernels
    from library.runtime.fused_compiled import set_compiled_kernels

    previous = set_compiled_kernels(**_settings(args.settings))
    previous_tuning = fused_kernels.set_tuning(**_tuning(args.tuning))
    try:
        began = time.perf_counter()
        dit, sargs, device = _load(args)
        load_s = time.perf_counter() - began
        height, width = args.image_size
        g = torch.Generator().manual_seed(0)
        cond = torch.randn(1, args.text_tokens, dit.config.text_dim, generator=g)
        uncond = torch.randn(1, args.uncond_tokens, dit.config.text_dim, generator=g)
        x = initial_noise(height, width, 0, device=device)
        t = torch.full((1,), 500.0, device=device)
        skip = list(DEFAULT_UNCOND_SKIP_LAYERS)
        with torch.no_grad():
            grid = (x.shape[-2], x.shape[-1])
            prepared = [dit.prepare_text(e.to(device), torch.ones(e.shape[:2], dtype=torch.bool), grid)
                        for e in (cond, uncond)]

            # as the sampler runs a CFG step: one packed pass over both texts (`MossImage.pack_texts`), unless
            # --unpacked, then the two passes
            packed = None if args.unpacked else dit.pack_texts(prepared)

            def velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
                if packed is not None:
                    v_cond, v_uncond = dit.forward_packed(x, t, packed, ((), skip))
                    return v_cond.float() + v_uncond.float()
                v = dit.forward_with_text(x, t, prepared[0]).float()
                return v + dit.forward_with_text(x, t, prepared[1], skip_layers=skip).float()

            repeated: list[Any] = [None if args.guarded else dit.repeated_calls]

            def step(repeat: bool = True) -> torch.Tensor:
                # as the sampler runs its steps after the first (`MossImage.repeated_calls`), unless --guarded
                if not repeat or repeated[0] is None:
                    return velocity(x, t)
                v, repeated[0] = repeated_velocity(velocity, x, t, repeated[0])
                return v

            warm = time.perf_counter()
            for i in range(args.warmup):
                step(repeat=i > 0)
            if device.type == "cuda":
                torch.cuda.synchronize()
            warmup_s = time.perf_counter() - warm
            times, host, collections = [], [], []
            with _GcPasses() as passes:
                for _ in range(args.steps):
                    passes.mark()
                    t0 = time.perf_counter()
                    step()
                    host.append((time.perf_counter() - t0) * 1e3)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    times.append((time.perf_counter() - t0) * 1e3)
                    collections.append(passes.since_mark())
            out: dict[str, Any] = {
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
                "torch": torch.__version__, "args": vars(args),
                "compiled_settings": _settings(args.settings), "tuning": _tuning(args.tuning),
                "guarded": args.guarded, "packed": packed is not None, "load_s": round(load_s, 2),
                "warmup_s": round(warmup_s, 2), "step_ms_median": round(statistics.median(times), 2),
                "step_ms": [round(v, 2) for v in times], "step_mean_ms": round(statistics.fmean(times), 2),
                "host_ms": [round(v, 2) for v in host], "gc_passes": collections,
                "tokens": {"image": grid[0] * grid[1], "cond_text": args.text_tokens,
                           "uncond_text": args.uncond_tokens}}
            if args.sampler_images:
                out["sampler"] = _sampler_images(args, dit, cond, uncond, device)
            if args.profile and device.type == "cuda":
                from bench.gpu_profile import kernel_profile

                out["profile"] = kernel_profile(step, steps=3)
    finally:
        set_compiled_kernels(**previous)
        fused_kernels.set_tuning(**previous_tuning)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--snapshot", type=Path, required=True, help="snapshot folder (python -m bench.make_full_snapshot)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON here")
    p.add_argument("--image_size", type=int, nargs=2, default=[1024, 1024], metavar=("HEIGHT", "WIDTH"))
    p.add_argument("--text_tokens", type=int, default=32, help="tokens of the conditional prompt")
    p.add_argument("--uncond_tokens", type=int, default=8, help="tokens of the negative prompt")
    p.add_argument("--steps", type=int, default=20, help="timed CFG steps (two passes each)")
    p.add_argument("--warmup", type=int, default=3, help="CFG steps before timing (the first compiles)")
    p.add_argument("--profile", action="store_true", help="GPU time per kernel category of three steps")
    p.add_argument("--no_compile", action="store_true", help="the eager forms")
    p.add_argument("--settings", default="", help="set_compiled_kernels switches, e.g. inference_codes=False")
    p.add_argument("--extra", default="", help="more options of the inference script, e.g. --convrot_int8")
    p.add_argument("--tuning", default="", help="fused_kernels launch parameters, e.g. codes_rows=2,codes_ept=16"
                   " (what python -m bench.codes_kernels prints last)")
    p.add_argument("--unpacked", action="store_true",
                   help="run a CFG step as two passes, not one pass over both texts packed (library.moss_image."
                        "cfg_packing)")
    p.add_argument("--guarded", action="store_true",
                   help="every guard checked on every step (not only those between the graphs, as the sampler has it)")
    p.add_argument("--sampler_images", type=int, default=0,
                   help="after the timed steps, this many images through the inference script's denoising loop")
    p.add_argument("--sampler_steps", type=int, default=50, help="steps of each --sampler_images image")
    p.add_argument("--auto_gc", action="store_true",
                   help="--sampler_images with Python's collector passing on its own, not between the steps")
    args = p.parse_args(argv)
    write_report(run(args), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
