#!/usr/bin/env python
"""Full-size end to end on the GPU machine: the product's own commands (cache tools, trainer, inference script) on a
full-size random-weight snapshot, each run in its own process under `bench.measure`, figures written as JSON. Run it
from the repository root:

    python -m bench.full_e2e snapshot --root /tmp/e2e                 # bench.make_full_snapshot (skipped if there)
    python -m bench.full_e2e data     --root /tmp/e2e                 # 1024x1024 images + captions, two copies
    python -m bench.full_e2e cache    --root /tmp/e2e --out $OUT      # latents, TE outputs (bf16 and INT8 TE)
    python -m bench.full_e2e train    --root /tmp/e2e --out $OUT [--configs a,b] [--steps 16 --skip 6]
    python -m bench.full_e2e infer    --root /tmp/e2e --out $OUT [--runs a,b]
    python -m bench.full_e2e quality  --root /tmp/e2e --out $OUT      # INT8 vs bf16 (latents, PSNR, TE outputs)
    python -m bench.full_e2e ddp      --root /tmp/e2e --out $OUT      # needs 2 GPUs: throughput, equivalence, swap
    python -m bench.full_e2e report   --out $OUT                      # one summary JSON of everything in --out

`--scale small` runs every phase on the CPU with the small snapshot at 64x64 (tests/test_full_e2e.py), so the
commands are known to work before device time is spent. Each phase writes `e2e_<phase>.json` into --out; the runs
write their `bench.measure` JSON under --out/runs/ (one file per run and rank).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent  # the working directory of every run: `-m bench.*` and the entries

logger = logging.getLogger("bench.full_e2e")

TRAIN_STEP = "library.training.network_trainer:NetworkTrainer.add_step_hook"  # the trainer's step seam
INFER_TIMINGS = "library.runtime.phase_timer:last_run_timings"
DENOISE = "library.sampling.generation:denoise"


# ------------------------------------------------------------------------------------------------------ settings
@dataclass(frozen=True)
class Scale:
    name: str
    resolution: int
    images: int
    steps: int
    skip: int
    infer_steps: int
    device: str
    snapshot_args: tuple[str, ...]

    @property
    def small(self) -> bool:
        return self.name == "small"


SCALES = {
    "full": Scale("full", 1024, 16, 16, 6, 50, "cuda", ()),
    "small": Scale("small", 64, 4, 4, 1, 3, "cpu", ("--scale", "small")),
}


@dataclass
class Paths:
    root: Path

    @property
    def snap(self) -> Path:
        return self.root / "snapshot"

    @property
    def dit(self) -> Path:
        return self.snap / "transformer" / "diffusion_pytorch_model-00001-of-00003.safetensors"

    @property
    def dit_int8(self) -> Path:
        return self.snap / "moss_image_base_int8_convrot.safetensors"

    @property
    def te(self) -> Path:
        return self.snap / "text_encoder" / "model-00001-of-00004.safetensors"

    @property
    def te_int8(self) -> Path:
        return self.snap / "text_encoder_int8" / "qwen3.5_9b_int8_convrot.safetensors"

    @property
    def vae(self) -> Path:
        return self.snap / "flux2-vae.safetensors"

    @property
    def tokenizer(self) -> Path:
        return self.snap / "tokenizer"

    def data(self, te: str) -> Path:
        """Image folders (kohya DreamBooth layout) whose TE caches come from the bf16 or the INT8 encoder."""
        return self.root / f"data_{te}te"


# --------------------------------------------------------------------------------------------------- running
def run_measured(out: Path, label: str, entry: str, argv: list[str], *, phase: str | None = None,
                 time_specs: tuple[str, ...] = (), skip: int = 0, profile_call: int = 0, nproc: int = 1,
                 extra_measure: tuple[str, ...] = (), timeout: int = 900, env: dict[str, str] | None = None,
                 gpu: int | None = None) -> dict[str, Any]:
    """One product command in its own process(es) under bench.measure; returns rank 0's figures (all ranks' under
    'ranks')."""
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    js = runs / f"{label}.json"
    m = ["-m", "bench.measure", "--json", str(js), "--label", label, "--skip", str(skip), *extra_measure]
    if phase:
        m += ["--phase", phase]
    if profile_call:
        m += ["--profile_call", str(profile_call)]
    for t in time_specs:
        m += ["--time", t]
    if nproc > 1 and cuda_available():  # as users launch it
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nproc),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", *m]
    elif nproc > 1:  # accelerate launch --cpu starts one process: torchrun runs the CPU (gloo) DDP
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *m]
    else:
        cmd = [sys.executable, *m]
    cmd += ["--", entry, *argv]
    t0 = time.perf_counter()
    proc_env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    if gpu is not None:  # one GPU of several: the run sees it as cuda:0, the driver poller reads its real index
        proc_env.update(CUDA_VISIBLE_DEVICES=str(gpu), MEASURE_GPU_INDEX=str(gpu))
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=proc_env)
    wall = round(time.perf_counter() - t0, 2)
    log = runs / f"{label}.log"
    log.write_text(proc.stdout + "\n---- stderr ----\n" + proc.stderr)
    files = [js] if nproc == 1 else [js.with_name(f"{js.stem}.rank{r}{js.suffix}") for r in range(nproc)]
    ranks = [json.loads(f.read_text()) for f in files if f.exists()]
    result: dict[str, Any] = dict(ranks[0]) if ranks else {"label": label}
    result.update(process_wall_s=wall, returncode=proc.returncode)
    if nproc > 1:
        result["ranks"] = ranks
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        result["error_tail"] = tail
        logger.error("%s failed (exit %d):\n%s", label, proc.returncode, tail)
    else:
        logger.info("%s: %.1f s", label, wall)
    return result


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


_WRITE_LOCK = threading.Lock()


def write_json(path: Path, data: Any) -> None:
    with _WRITE_LOCK:  # runs on several GPUs report from their own threads
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------------ phases
def phase_snapshot(args: argparse.Namespace, scale: Scale, paths: Paths) -> dict[str, Any]:
    marker = paths.snap / "e2e_done.json"
    if marker.exists():
        return json.loads(marker.read_text())
    cmd = [sys.executable, "-m", "bench.make_full_snapshot", str(paths.snap), *scale.snapshot_args, "--what", args.what]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"make_full_snapshot failed:\n{proc.stderr[-3000:]}")
    summary = json.loads(proc.stdout[proc.stdout.index("{"):])
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    write_json(marker, summary)
    return summary


def _caption(i: int, scale: Scale) -> str:
    colours = ("red", "green", "blue", "yellow", "purple", "orange", "white", "black")
    shapes = ("square", "circle", "triangle", "ring")
    if scale.small:  # the CPU check: a few tokens keep its steps cheap (CPUs without bf16 units are slow in bf16)
        return f"a {colours[i % 8]} {shapes[i % 4]}, number {i:02d}"
    return (f"A studio photograph of a {colours[i % 8]} {shapes[i % 4]} on a grey background, soft daylight from the"
            f" left, a small shadow under the object, sharp focus, number {i:02d}.")


def phase_data(args: argparse.Namespace, scale: Scale, paths: Paths) -> dict[str, Any]:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    r = scale.resolution
    first = paths.data("bf16") / "1_e2e"
    first.mkdir(parents=True, exist_ok=True)
    yy, xx = np.mgrid[0:r, 0:r]
    for i in range(scale.images):
        img = np.full((r, r, 3), 110, np.uint8)
        img[:, :, i % 3] += (yy * 40 // r).astype(np.uint8)  # a gradient background per image
        cy, cx, rad = rng.integers(r // 4, 3 * r // 4, 2).tolist() + [int(rng.integers(r // 10, r // 4))]
        disk = (yy - cy) ** 2 + (xx - cx) ** 2 < rad**2
        img[disk] = rng.integers(0, 255, 3, dtype=np.uint8)
        Image.fromarray(img).save(first / f"img{i:02d}.png")
        (first / f"img{i:02d}.txt").write_text(_caption(i, scale), encoding="utf-8")
    second = paths.data("int8") / "1_e2e"
    if second.parent.exists():
        shutil.rmtree(second.parent)
    shutil.copytree(first.parent, second.parent)
    return {"images": scale.images, "resolution": r, "folders": [str(first), str(second)]}


def _dataset_args(scale: Scale, data: Path) -> list[str]:
    return ["--train_data_dir", str(data), "--resolution", str(scale.resolution), "--caption_extension", ".txt"]


def phase_cache(args: argparse.Namespace, scale: Scale, paths: Paths) -> dict[str, Any]:
    out = Path(args.out)
    res: dict[str, Any] = {"images": scale.images, "resolution": scale.resolution}
    dev = ["--device", scale.device]
    te_src = {"te_bf16": (paths.te, "bf16"), "te_int8_prequantised": (paths.te_int8, "int8")}

    def one(name: str, gpu: int | None) -> None:
        if name == "latents":
            res[name] = run_measured(
                out, "cache_latents", "tools.cache_latents:main",
                ["--moss_image", "--vae", str(paths.vae), *_dataset_args(scale, paths.data("bf16")),
                 "--cache_latents_to_disk", "--skip_cache_check", *dev],
                time_specs=("library.caching.strategies:cache_latents",), gpu=gpu)
            return
        te_path, data = te_src[name]
        res[name] = run_measured(
            out, f"cache_{name}", "tools.cache_text_encoder_outputs:main",
            ["--moss_image", "--text_encoder", str(te_path), "--tokenizer_cache_dir", str(paths.tokenizer),
             *_dataset_args(scale, paths.data(data)), "--cache_text_encoder_outputs_to_disk", *dev],
            time_specs=("library.caching.strategies:cache_text_encoder_outputs",), gpu=gpu)

    on_gpus(["latents", *te_src], one, args.gpus)
    for f in (paths.data("bf16") / "1_e2e").glob("*_moss.npz"):  # the same images: share the latent caches
        shutil.copy2(f, paths.data("int8") / "1_e2e" / f.name)
    for k, v in res.items():
        if isinstance(v, dict) and v.get("calls"):
            loop = next(iter(v["calls"].values()))["total_s"]
            v["loop_s"] = loop
            v["images_per_s"] = round(scale.images / loop, 2) if loop else None
    return res


# name -> (DiT, TE, options); seed 001's memory table rows first, then the speed rows
TRAIN_CONFIGS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "bf16_gc": ("bf16", "bf16", ("--gradient_checkpointing",)),
    "int8_gc": ("int8", "int8", ("--gradient_checkpointing",)),
    "int8_swap20": ("int8", "int8", ("--gradient_checkpointing", "--blocks_to_swap", "20", "--block_swap_h2d_only")),
    "int8_swap36": ("int8", "int8", ("--gradient_checkpointing", "--blocks_to_swap", "36", "--block_swap_h2d_only")),
    "int8_unsloth": ("int8", "int8", ("--unsloth_offload_checkpointing",)),
    "bf16_swap20_int8te": ("bf16", "int8", ("--gradient_checkpointing", "--blocks_to_swap", "20",
                                            "--block_swap_h2d_only")),
    "int8_te_lora": ("int8", "int8", ("--gradient_checkpointing", "te_lora")),
    "bf16_te_lora": ("bf16", "bf16", ("--gradient_checkpointing", "te_lora")),
    "bf16_nockpt_compile": ("bf16", "bf16", ("--compile",)),
    "bf16_gc_compile": ("bf16", "bf16", ("--gradient_checkpointing", "--compile")),
    "int8_gc_compile": ("int8", "int8", ("--gradient_checkpointing", "--compile")),
    "bf16_swap20_compile": ("bf16", "bf16", ("--gradient_checkpointing", "--blocks_to_swap", "20",
                                             "--block_swap_h2d_only", "--compile")),
}
INT8_DIT_SOURCE = {"file": False}  # --int8_dit file: INT8 rows read the pre-quantised file instead of quantising
GPU_ONLY = ("--blocks_to_swap", "--block_swap_h2d_only", "--unsloth_offload_checkpointing", "--compile")


def train_argv(scale: Scale, paths: Paths, name: str, out_dir: Path, steps: int, extra: tuple[str, ...] = ()
               ) -> list[str]:
    dit, te, opts = TRAIN_CONFIGS[name]
    te_lora = "te_lora" in opts
    opts = tuple(o for o in opts if o != "te_lora")
    if scale.small:  # the CPU run checks the command lines, not the GPU features
        keep: list[str] = []
        skip_next = False
        for o in opts:
            if skip_next:
                skip_next = False
                continue
            if o in GPU_ONLY:
                skip_next = o == "--blocks_to_swap"
                continue
            keep.append(o)
        opts = tuple(keep) + (("--gradient_checkpointing",) if "--blocks_to_swap" in opts else ())
    argv = [
        "--pretrained_model_name_or_path", str(paths.dit), "--text_encoder", str(paths.te_int8 if te == "int8" else paths.te),
        "--vae", str(paths.vae), "--tokenizer_cache_dir", str(paths.tokenizer),
        *_dataset_args(scale, paths.data(te)), "--output_dir", str(out_dir), "--output_name", name,
        "--network_module", "networks.lora_generic", "--network_dim", "16", "--network_alpha", "16",
        "--optimizer_type", "AdamW", "--learning_rate", "1e-4", "--max_train_steps", str(steps), "--seed", "1",
        "--mixed_precision", "bf16", "--cache_latents", "--cache_latents_to_disk",
        "--max_data_loader_n_workers", "2", "--persistent_data_loader_workers",
        "--timestep_sampling", "sigma", "--weighting_scheme", "logit_normal", "--logit_mean", "-1.09",
        "--logit_std", "0.95", "--save_model_as", "safetensors", *opts, *extra,
    ]
    if dit == "int8" and INT8_DIT_SOURCE["file"]:  # the pre-quantised ComfyUI file (detected by the loader)
        argv[argv.index("--pretrained_model_name_or_path") + 1] = str(paths.dit_int8)
    elif dit == "int8":
        argv.append("--convrot_int8")
    if not te_lora:
        argv += ["--network_train_unet_only", "--cache_text_encoder_outputs", "--cache_text_encoder_outputs_to_disk"]
    if scale.small and "--gradient_checkpointing" in argv and argv.count("--gradient_checkpointing") > 1:
        argv.remove("--gradient_checkpointing")
    return argv


def _step_summary(r: dict[str, Any]) -> dict[str, Any]:
    step = r.get("calls", {}).get(TRAIN_STEP, {})
    return {k: r.get(k) for k in ("startup_s", "wall_s", "host_peak_rss_gib", "torch_gpu", "driver_gpu_used_peak_gib",
                                  "returncode", "error_tail", "profile") if r.get(k) is not None} | {
        "step_median_s": step.get("median_s"), "step_first_s": step.get("first_s"), "steps": step.get("n"),
        "gap_median_s": step.get("median_gap_s")}


def phase_train(args: argparse.Namespace, scale: Scale, paths: Paths) -> dict[str, Any]:
    out = Path(args.out)
    names = args.configs.split(",") if args.configs else list(TRAIN_CONFIGS)
    for name in names:
        if name not in TRAIN_CONFIGS:
            raise SystemExit(f"unknown training configuration {name!r}: choose from {', '.join(TRAIN_CONFIGS)}")
    res: dict[str, Any] = {}

    def one(name: str, gpu: int | None) -> None:
        r = run_measured(out, f"train_{name}", "moss_image_train_network:main",
                         train_argv(scale, paths, name, paths.root / "out" / name, args.steps,
                                    tuple(args.train_extra.split())),
                         phase=TRAIN_STEP, skip=args.skip, gpu=gpu,
                         profile_call=args.profile_call if name in (args.profile or "").split(",") else 0)
        res[name] = _step_summary(r) | {"gpu": gpu}
        write_json(out / "e2e_train_partial.json", res)

    on_gpus(names, one, args.gpus)
    return {n: res[n] for n in names}


def on_gpus(names: list[str], fn: Any, gpus: str) -> None:
    """Run `fn(name, gpu)` for every name, one run per GPU at a time (`--gpus 0,1`: two at once), in order."""
    import queue
    from concurrent.futures import ThreadPoolExecutor

    ids = [int(g) for g in gpus.split(",")] if gpus else [None]
    free: queue.Queue = queue.Queue()
    for g in ids:
        free.put(g)

    def task(name: str) -> None:
        g = free.get()
        try:
            fn(name, g)
        finally:
            free.put(g)

    with ThreadPoolExecutor(max_workers=len(ids)) as pool:
        for f in [pool.submit(task, n) for n in names]:
            f.result()


INFER_RUNS: dict[str, tuple[str, tuple[str, ...]]] = {  # name -> (DiT, options)
    "bf16": ("bf16", ()),
    "bf16_lora": ("bf16", ("lora",)),
    "int8": ("int8_file", ()),
    "bf16_compile": ("bf16", ("--compile",)),
    "int8_compile": ("int8_file", ("--compile",)),
}


def infer_argv(scale: Scale, paths: Paths, name: str, save: Path) -> list[str]:
    dit, opts = INFER_RUNS[name]
    lora = paths.root / "out" / "bf16_gc" / "bf16_gc.safetensors"
    argv = ["--dit", str(paths.dit_int8 if dit == "int8_file" else paths.dit), "--text_encoder", str(paths.te),
            "--vae", str(paths.vae), "--tokenizer_cache_dir", str(paths.tokenizer),
            "--image_size", str(scale.resolution), str(scale.resolution),
            "--infer_steps", str(scale.infer_steps), "--seed", "7", "--save_path", str(save), "--output_type", "both",
            "--device", scale.device]
    if "--compile" in opts:  # a second image: its denoise is the compiled steady state (the first one compiles)
        prompts = save.parent / f"{name}_prompts.txt"
        prompts.parent.mkdir(parents=True, exist_ok=True)
        prompts.write_text(f"{_caption(3, scale)} --d 7\n{_caption(3, scale)} --d 8\n", encoding="utf-8")
        argv += ["--from_file", str(prompts)]
    else:
        argv += ["--prompt", _caption(3, scale)]
    for o in opts:
        if o == "lora":
            argv += ["--lora_weight", str(lora), "--lora_multiplier", "1.0"]
        elif scale.small and o == "--compile":
            argv += ["--compile", "--compile_backend", "eager"]
        else:
            argv.append(o)
    return argv


def phase_infer(args: argparse.Namespace, scale: Scale, paths: Paths) -> dict[str, Any]:
    out = Path(args.out)
    names = args.runs.split(",") if args.runs else list(INFER_RUNS)
    res: dict[str, Any] = {}

    def one(name: str, gpu: int | None) -> None:
        save = paths.root / "infer" / name
        if save.exists():
            shutil.rmtree(save)
        r = run_measured(out, f"infer_{name}", "moss_image_minimal_inference:main",
                         infer_argv(scale, paths, name, save), extra_measure=("--record", INFER_TIMINGS),
                         time_specs=(DENOISE,), gpu=gpu)
        timings = r.get("recorded", {}).get(INFER_TIMINGS, {})
        per_image = r.get("durations_s", {}).get(DENOISE, [])
        n = max(len(per_image), 1)
        steady = per_image[-1] if per_image else None  # compiled runs: the second image
        e2e = None if steady is None or not timings else timings["encode"] / n + steady + timings["decode"] / n
        res[name] = {"timings_s": timings, "denoise_per_image_s": per_image,
                     "per_image_encode_denoise_decode_s": None if e2e is None else round(e2e, 3),
                     **{k: r.get(k) for k in ("wall_s", "host_peak_rss_gib", "torch_gpu", "driver_gpu_used_peak_gib",
                                              "returncode", "error_tail") if r.get(k) is not None}}
        write_json(out / "e2e_infer_partial.json", res)

    on_gpus(names, one, args.gpus)
    return {n: res[n] for n in names}


def _one(folder: Path, pattern: str) -> Path | None:
    files = sorted(folder.glob(pattern))
    return files[0] if files else None


def psnr(a: Any, b: Any) -> float:
    import numpy as np

    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * math.log10(255.0**2 / mse)


def rel_err(a: Any, b: Any) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def phase_quality(args: argparse.Namespace, scale: Scale, paths: Paths) -> dict[str, Any]:
    import numpy as np
    from PIL import Image

    from library.files.safetensors_io import load_safetensors

    res: dict[str, Any] = {}
    base = paths.root / "infer" / "bf16"
    for other in [n for n in INFER_RUNS if n != "bf16"]:
        folder = paths.root / "infer" / other
        la, lb = _one(folder, "*.safetensors"), _one(base, "*.safetensors")
        ia, ib = _one(folder, "*.png"), _one(base, "*.png")
        if not (la and lb and ia and ib):
            continue
        ref = "bf16_lora" if other == "int8_lora" and (paths.root / "infer" / "bf16_lora").exists() else "bf16"
        if ref != "bf16":
            lb, ib = _one(paths.root / "infer" / ref, "*.safetensors"), _one(paths.root / "infer" / ref, "*.png")
        res[f"{other}_vs_{ref}"] = {
            "latent_rel_err": round(rel_err(load_safetensors(str(la))["latents"], load_safetensors(str(lb))["latents"]), 5),
            "image_psnr_db": round(psnr(np.asarray(Image.open(ia).convert("RGB")), np.asarray(Image.open(ib).convert("RGB"))), 2),
        }
    res["te_outputs_int8_vs_bf16"] = _te_cache_error(paths)
    return res


def _te_cache_error(paths: Paths) -> dict[str, Any]:
    import numpy as np
    import torch

    errs = []
    for f in sorted((paths.data("bf16") / "1_e2e").glob("*_moss_te.npz")):
        g = paths.data("int8") / "1_e2e" / f.name
        if not g.exists():
            continue
        a, b = np.load(f), np.load(g)
        key = "prompt_embeds_0" if "prompt_embeds_0" in a.files else "prompt_embeds"
        errs.append(rel_err(torch.from_numpy(b[key].astype(np.float32)), torch.from_numpy(a[key].astype(np.float32))))
    return {"files": len(errs), "mean_rel_err": round(float(np.mean(errs)), 5) if errs else None,
            "max_rel_err": round(float(np.max(errs)), 5) if errs else None}


# --------------------------------------------------------------------------------------------------------- DDP
PER_IMAGE_NOISE = "bench.ddp_noise:install"


def phase_ddp(args: argparse.Namespace, scale: Scale, paths: Paths) -> dict[str, Any]:
    """Throughput of 2 processes against 1 (batch 1 per GPU), the LoRA after one SGD step with the same global
    batch (1 process x batch 2 against 2 x batch 1, noise and timesteps drawn per image so that both see the same
    samples), and block swap under DDP (losses against the same run without swap)."""
    out = Path(args.out)
    nproc = 2  # gloo on the CPU at --scale small
    res: dict[str, Any] = {}
    base = ("bf16_gc_compile" if not scale.small else "bf16_gc")
    for n in sorted({1, nproc}):
        r = run_measured(out, f"ddp_{base}_{n}proc", "moss_image_train_network:main",
                         train_argv(scale, paths, base, paths.root / "ddp" / f"{base}_{n}", args.steps),
                         phase=TRAIN_STEP, skip=args.skip, nproc=n)
        res[f"throughput_{n}proc"] = _step_summary(r) | {"ranks": len(r.get("ranks", [])) or 1}
    one, two = res.get("throughput_1proc", {}), res.get(f"throughput_{nproc}proc", {})
    if one.get("step_median_s") and two.get("step_median_s"):
        res["speedup"] = round(nproc * one["step_median_s"] / two["step_median_s"], 3)
    # equivalence: one SGD step, same global batch of 2
    two = _two_image_copy(paths)  # the global batch of the step is then the same two images in both layouts
    for precision in ("no", "bf16"):  # fp32: the averaging must be exact; bf16: autocast noise on top
        eq = []
        for n, bs in ((1, 2), (nproc, 2 // nproc)):
            tag = f"eq_{precision}_{n}proc_bs{bs}"
            argv = set_options(train_argv(scale, paths, "bf16_gc", paths.root / "ddp" / tag, 1),
                               {"--train_batch_size": str(bs), "--optimizer_type": "SGD", "--learning_rate": "1.0",
                                "--max_grad_norm": "0", "--train_data_dir": str(two), "--mixed_precision": precision})
            r = run_measured(out, f"ddp_{tag}", "moss_image_train_network:main", argv, phase=TRAIN_STEP, nproc=n,
                             extra_measure=("--setup", PER_IMAGE_NOISE))
            eq.append(paths.root / "ddp" / tag / "bf16_gc.safetensors")
            res[tag] = {k: r.get(k) for k in ("returncode", "error_tail", "world_size") if r.get(k) is not None}
        if all(f.exists() for f in eq):
            res[f"equivalence_{'fp32' if precision == 'no' else precision}"] = compare_loras(eq[0], eq[1])
    if not scale.small:  # block swap under DDP: the losses of the same seeded run with and without swap
        r = run_measured(out, "ddp_swap20_2proc", "moss_image_train_network:main",
                         train_argv(scale, paths, "bf16_swap20_compile", paths.root / "ddp" / "swap20", args.steps),
                         phase=TRAIN_STEP, skip=args.skip, nproc=nproc)
        res["swap20_2proc"] = _step_summary(r)
    return res


def _two_image_copy(paths: Paths) -> Path:
    """The first two images of the bf16-TE data with their caches, in a folder of their own."""
    src = paths.data("bf16") / "1_e2e"
    dst = paths.root / "data_two" / "1_e2e"
    if dst.parent.exists():
        shutil.rmtree(dst.parent)
    dst.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        if f.name.startswith(("img00", "img01")):
            shutil.copy2(f, dst / f.name)
    return dst.parent


def set_options(argv: list[str], values: dict[str, str]) -> list[str]:
    """Replace the value of each option in `values` (or append the option when it is not there)."""
    argv = list(argv)
    for opt, value in values.items():
        if opt in argv:
            argv[argv.index(opt) + 1] = value
        else:
            argv += [opt, value]
    return argv


def compare_loras(a: Path, b: Path) -> dict[str, Any]:
    from library.files.safetensors_io import load_safetensors

    sa, sb = load_safetensors(str(a)), load_safetensors(str(b))
    worst, num, den = 0.0, 0.0, 0.0
    for k in sa:  # the up weights: the only ones one step from the zero-initialised up changes
        if not k.endswith("lora_up.weight"):
            continue
        x, y = sa[k].float(), sb[k].float()
        num += float((x - y).pow(2).sum())
        den += float(y.pow(2).sum())
        worst = max(worst, float((x - y).abs().max()))
    return {"tensors": len(sa), "rel_err": round(math.sqrt(num / max(den, 1e-30)), 6), "max_abs_diff": worst}


# ------------------------------------------------------------------------------------------------------- report
def phase_report(args: argparse.Namespace, scale: Scale, paths: Paths) -> dict[str, Any]:
    out = Path(args.out)
    return {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("e2e_*.json")) if p.stem != "e2e_report"}


PHASES = {"snapshot": phase_snapshot, "data": phase_data, "cache": phase_cache, "train": phase_train,
          "infer": phase_infer, "quality": phase_quality, "ddp": phase_ddp, "report": phase_report}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.full_e2e", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("phases", help=f"comma-separated phases: {','.join(PHASES)}")
    p.add_argument("--root", default="/tmp/e2e", help="work folder (snapshot, data, outputs)")
    p.add_argument("--out", default="e2e_out", help="where the JSON figures go")
    p.add_argument("--scale", choices=sorted(SCALES), default="full")
    p.add_argument("--what", default="dit,te,vae,comfy_int8", help="snapshot parts (make_full_snapshot --what)")
    p.add_argument("--configs", default="", help="training configurations (default: all)")
    p.add_argument("--runs", default="", help="inference runs (default: all)")
    p.add_argument("--steps", type=int, default=None, help="training steps per configuration")
    p.add_argument("--skip", type=int, default=None, help="steps left out of the medians")
    p.add_argument("--profile", default="", help="training configurations whose --profile_call step is profiled")
    p.add_argument("--profile_call", type=int, default=0)
    p.add_argument("--train_extra", default="", help="options added to every training row (e.g. --cuda_expandable_segments)")
    p.add_argument("--int8_dit", choices=("quantise", "file"), default="quantise",
                   help="INT8 training rows: --convrot_int8 on the bf16 shards, or the pre-quantised ComfyUI file")
    p.add_argument("--gpus", default="", help="GPU indices for single-GPU runs side by side (e.g. 0,1; default: as is)")
    args = p.parse_args(argv)
    scale = SCALES[args.scale]
    args.steps = args.steps or scale.steps
    args.skip = scale.skip if args.skip is None else args.skip
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse_args(argv)
    scale, paths = SCALES[args.scale], Paths(Path(args.root))
    INT8_DIT_SOURCE["file"] = args.int8_dit == "file"
    failed = False
    for name in args.phases.split(","):
        if name not in PHASES:
            raise SystemExit(f"unknown phase {name!r}: choose from {', '.join(PHASES)}")
        t0 = time.perf_counter()
        result = PHASES[name](args, scale, paths)
        logger.info("phase %s done in %.1f s", name, time.perf_counter() - t0)
        write_json(Path(args.out) / f"e2e_{name}.json", result)
        failed |= any_failed(result)
    return 1 if failed else 0


def any_failed(result: Any) -> bool:
    """True when a run anywhere in a phase's result ended with a non-zero exit status."""
    if isinstance(result, dict):
        if result.get("returncode") not in (None, 0):
            return True
        return any(any_failed(v) for v in result.values())
    if isinstance(result, list):
        return any(any_failed(v) for v in result)
    return False


if __name__ == "__main__":
    sys.exit(main())
