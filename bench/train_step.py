#!/usr/bin/env python
"""One LoRA training step of the full-size MOSS-Image DiT on the GPU: time per step and peak reserved memory.

    python -m bench.make_full_dit /tmp/full
    python -m bench.train_step --dit /tmp/full/transformer/diffusion_pytorch_model-00001-of-00003.safetensors \\
        --out train_step.json [--configs gc,swap36_h2d] [--steps 5] [--warmup 2] [--budget_s 420]

The DiT is loaded through the real loader (`load_moss_image_model`), bf16; LoRA rank 16 (alpha 16) from
`networks.lora_generic` on the 252 block Linears, fp32 LoRA weights under bf16 autocast, AdamW; one 1024x1024 image
(64x64 latent patches = 4096 image tokens) and 256 text tokens, batch 1; the trainer's inputs (noisy latents that
require grad under checkpointing, flow-matching target noise - x0, MSE loss). Each configuration runs in its own
process (clean memory statistics); the time of a step is the median over `--steps` steps after `--warmup` steps,
host clock around a synchronised step (forward, backward, optimizer step), as the trainer sees it.
`max_memory_reserved` is read over the measured steps (`peak_reserved_gib`) and over the whole process including the
load (`peak_reserved_with_load_gib`). The losses of all steps are recorded: every configuration sees the same inputs
and initial LoRA, so the swap and offload variants must reproduce the plain one (`max_rel_loss_diff_vs_gc`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("bench.train_step")
REPO = Path(__file__).resolve().parent.parent  # the children run as `python -m bench.train_step` from here

# name -> checkpointing (none | plain | unsloth), blocks_to_swap, h2d_only, per-block compile
CONFIGS: dict[str, dict[str, Any]] = {
    "gc": dict(ckpt="plain"),
    "no_ckpt": dict(ckpt="none"),
    "gc_unsloth": dict(ckpt="unsloth"),
    "swap20": dict(ckpt="plain", swap=20),
    "swap20_h2d": dict(ckpt="plain", swap=20, h2d=True),
    "swap36": dict(ckpt="plain", swap=36),
    "swap36_h2d": dict(ckpt="plain", swap=36, h2d=True),
    "gc_compile": dict(ckpt="plain", compile=True),
    "no_ckpt_compile": dict(ckpt="none", compile=True),
    "swap20_h2d_compile": dict(ckpt="plain", swap=20, h2d=True, compile=True),
}
IMAGE = 1024
TEXT_TOKENS = 256
RANK = 16


# ------------------------------------------------------------------------------------------------ one configuration
def _load(dit: str, spec: dict[str, Any], dev: torch.device) -> Any:
    from library.moss_image.loaders import load_moss_image_model
    from library.memory.block_swap import BlockSwapConfig

    swap = spec.get("swap")
    model = load_moss_image_model(dev, dit, "torch", False, loading_device="cpu" if swap else dev,
                                  dtype=torch.bfloat16)
    if swap:  # the trainer's order: freeze, enable, place the rest, arm
        model.requires_grad_(False)
        model.enable_block_swap(swap, BlockSwapConfig(dev, h2d_only=bool(spec.get("h2d")),
                                                      allow_cpu_for_tests=dev.type == "cpu"))  # CPU: smoke runs
        model.move_to_device_except_swap_blocks(dev)
        model.prepare_block_swap_before_forward()
    else:
        model.to(dev)
    if spec["ckpt"] != "none":
        model.enable_gradient_checkpointing(unsloth_offload=spec["ckpt"] == "unsloth")
    return model


def _h2d_bandwidth(off: Any) -> float:
    """GB/s of one block copied from the (pinned) host arena into a spare device buffer, on the side stream."""
    size = off.layout.nbytes
    dst = torch.empty(size, dtype=torch.uint8, device=off.device)
    src = off.host[:size]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * size / (time.perf_counter() - t0) / 1e9


def run_single(name: str, dit: str, steps: int, warmup: int, image: int = IMAGE, device: str = "cuda"
               ) -> dict[str, Any]:
    from library.runtime.compile import apply_cuda_optimizations, compile_blocks
    from networks.lora_generic import create_network

    spec = CONFIGS[name]
    dev = torch.device(device)
    args = argparse.Namespace(compile_backend="inductor", compile_mode="default", compile_dynamic="false",
                              compile_fullgraph=False, compile_cache_size_limit=None)
    apply_cuda_optimizations(args)
    t0 = time.perf_counter()
    model = _load(dit, spec, dev)
    load_s = time.perf_counter() - t0
    torch.manual_seed(0)
    network = create_network(1.0, RANK, float(RANK), None, None, model)
    network.apply_to(None, model, False, True)
    network.to(dev)
    network.train()
    params = [p for p in network.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    if spec.get("compile"):
        compile_blocks(args, model, num_shapes=1)
    gen = torch.Generator(device=dev).manual_seed(1)
    h = w = image // 16
    latents = torch.randn(1, 128, h, w, generator=gen, device=dev)
    noise = torch.randn(1, 128, h, w, generator=gen, device=dev)
    embeds = (torch.randn(1, TEXT_TOKENS, model.config.text_dim, generator=gen, device=dev) * 0.5).to(torch.bfloat16)
    mask = torch.ones(1, TEXT_TOKENS, dtype=torch.bool, device=dev)
    sigma = torch.tensor([0.6], device=dev)
    off = model.block_offloader

    def step() -> tuple[float, float, float]:
        noisy = (1 - sigma) * latents + sigma * noise
        if spec["ckpt"] != "none":
            noisy.requires_grad_(True)
        start, mid = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(noisy, sigma * 1000, embeds, mask)
        loss = torch.nn.functional.mse_loss(pred.float(), noise - latents)
        mid.record()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        end.record()
        value = float(loss.item())  # the trainer reads the loss every step too
        return value, start.elapsed_time(mid), mid.elapsed_time(end)

    losses, times, fwd, bwd = [], [], [], []
    loads0 = off.loads if off is not None else 0
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            loads0 = off.loads if off is not None else 0
        torch.cuda.synchronize()
        t = time.perf_counter()
        loss, f_ms, b_ms = step()
        torch.cuda.synchronize()
        losses.append(loss)
        if i >= warmup:
            times.append((time.perf_counter() - t) * 1000)
            fwd.append(f_ms)
            bwd.append(b_ms)
    gib = 2**30
    result: dict[str, Any] = {
        "config": name, **spec, "ok": True,
        "step_ms_median": round(statistics.median(times), 1), "step_ms": [round(x, 1) for x in times],
        "forward_ms_median": round(statistics.median(fwd), 1),
        "backward_opt_ms_median": round(statistics.median(bwd), 1),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / gib, 2),
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / gib, 2),
        "losses": losses, "load_s": round(load_s, 1),
        "host_peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    }
    if spec.get("compile"):  # recompilations would show here (e.g. from the swapped weights' changing storage)
        from torch._dynamo.utils import counters

        result["dynamo_stats"] = {k: int(v) for k, v in counters["stats"].items()}
    if off is not None:
        result.update(loads_per_step=(off.loads - loads0) / steps, host_arena_gib=round(off.host.numel() / gib, 2),
                      pinned=bool(off.host.is_pinned()), block_mib=round(off.layout.nbytes / 2**20, 1),
                      ring=off.ring, streamed=len(off.streamed), h2d_gbps=round(_h2d_bandwidth(off), 1))
    return result


# ---------------------------------------------------------------------------------------------------------- driver
def _child(name: str, ns: argparse.Namespace, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.train_step", "--dit", ns.dit, "--single", name, "--steps", str(ns.steps),
           "--image", str(ns.image),
           "--warmup", str(ns.warmup + (1 if CONFIGS[name].get("compile") else 0))]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"config": name, "ok": False, "error": f"timeout after {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"config": name, "ok": False, "error": proc.stderr[-1500:]}
    result = json.loads(lines[-1][len("RESULT "):])
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    return result


def _write(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, path)


def _compare(results: list[dict[str, Any]]) -> None:
    ref = next((r for r in results if r.get("config") == "gc" and r.get("ok")), None)
    for r in results:
        if ref is not None and r.get("ok") and r is not ref:
            r["max_rel_loss_diff_vs_gc"] = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"]))


def _table(results: list[dict[str, Any]]) -> str:
    rows = ["config               step_ms  fwd_ms  bwd_ms  reserved_GiB  alloc_GiB  loads/step  h2d_GB/s  dloss"]
    for r in results:
        if not r.get("ok"):
            rows.append(f"{r['config']:<20} FAILED: {r.get('error', '')[-200:]!r}")
            continue
        rows.append(f"{r['config']:<20} {r['step_ms_median']:>7} {r['forward_ms_median']:>7} "
                    f"{r['backward_opt_ms_median']:>7} {r['peak_reserved_gib']:>13} {r['peak_allocated_gib']:>10} "
                    f"{r.get('loads_per_step', '-'):>11} {r.get('h2d_gbps', '-'):>9} "
                    f"{r.get('max_rel_loss_diff_vs_gc', 0):.1e}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(prog="python -m bench.train_step",
                                description="MOSS-Image LoRA training step benchmark (GPU)")
    p.add_argument("--dit", required=True, help="first shard of the full-size DiT (python -m bench.make_full_dit)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--steps", type=int, default=5, help="measured steps per configuration")
    p.add_argument("--warmup", type=int, default=2, help="steps before measuring (one more with compile)")
    p.add_argument("--out", type=Path, default=Path("train_step.json"), help="JSON results")
    p.add_argument("--image", type=int, default=IMAGE, help="square image size (multiple of 16)")
    p.add_argument("--budget_s", type=float, default=600, help="stop starting configurations after this many seconds")
    p.add_argument("--single", default=None, help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.train_step needs a CUDA GPU", file=sys.stderr)
        return 2
    if ns.single:
        print("RESULT " + json.dumps(run_single(ns.single, ns.dit, ns.steps, ns.warmup, ns.image)), flush=True)
        return 0
    names = [n.strip() for n in ns.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        print(f"unknown configurations {unknown}: choose from {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    payload: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "image": ns.image, "text_tokens": TEXT_TOKENS, "lora_rank": RANK, "batch": 1, "results": [],
    }
    t_start = time.perf_counter()
    for name in names:
        left = ns.budget_s - (time.perf_counter() - t_start)
        need = 120 if CONFIGS[name].get("compile") else 45
        if left < need:
            payload["results"].append({"config": name, "ok": False, "error": "skipped: time budget"})
            continue
        result = _child(name, ns, timeout=min(left, 400))
        payload["results"].append(result)
        _compare(payload["results"])
        _write(ns.out, payload)
        print(_table([result]).splitlines()[-1], flush=True)
    _compare(payload["results"])
    _write(ns.out, payload)
    print(_table(payload["results"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
