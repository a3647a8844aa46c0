#!/usr/bin/env python
"""Would one product for q, k and v pay? The three projections of a block's input as three GEMMs (as the DiT runs them
today) against one GEMM over their weights stacked [3W, W], bf16 and ConvRot INT8, forward and the input gradient, at
the shapes of a 1024x1024 step (4,352 tokens, width 3,072). Stacked weights need no more memory: q, k and v can stay
views of one buffer, and the file format is untouched.

    python -m bench.qkv_packing --out qkv_packing.json                   # on a CUDA GPU
    python -m bench.qkv_packing --device cpu --tokens 64 --width 256 --iters 3 --out smoke.json   # a CPU smoke run

Each form is timed with CUDA events around `--reps` calls back to back (L2 flushed before each timed call), median
over `--iters` calls, divided by `--reps`. The INT8 forms quantise the input once (as the activation cache does for
q, k and v) and time the GEMMs alone. Every pair is checked to give the same values (the stacked GEMM computes the
same dot products, so bf16 and int8 outputs are equal; the input gradient's three sums are added in another order,
so there the relative difference is reported).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.convrot_int8 import relerr, time_ms
from bench.fused_kernels import _repeated
from library.files.safetensors_io import write_atomic


def _pair(name: str, three: Callable[[], Any], one: Callable[[], Any], device: str, iters: int, reps: int,
          flops: float) -> dict[str, Any]:
    a, b = three(), one()
    row: dict[str, Any] = {"case": name, "rel_diff": relerr(torch.cat([t.float().flatten() for t in b]),
                                                            torch.cat([t.float().flatten() for t in a]))}
    row["three_ms"] = time_ms(_repeated(three, reps), device, iters, warmup=2)["median_ms"] / reps
    row["one_ms"] = time_ms(_repeated(one, reps), device, iters, warmup=2)["median_ms"] / reps
    row["speedup"] = row["three_ms"] / row["one_ms"]
    row["one_tflops"] = flops / (row["one_ms"] * 1e9)
    row["three_tflops"] = flops / (row["three_ms"] * 1e9)
    return row


def bf16_cases(m: int, w: int, device: str, iters: int, reps: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = torch.randn(m, w, generator=g).to(device, dtype)
    stacked = (torch.randn(3 * w, w, generator=g) / w**0.5).to(device, dtype)
    wq, wk, wv = stacked.split(w)  # views: what q, k and v would hold
    grad = torch.randn(m, 3 * w, generator=g).to(device, dtype)
    gq, gk, gv = grad.split(w, dim=1)
    flops = 2.0 * m * w * 3 * w
    return [
        _pair("bf16 forward", lambda: (F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)),
              lambda: F.linear(x, stacked).split(w, dim=1), device, iters, reps, flops),
        # the input gradient: three products summed (autograd's accumulation) against one product over 3W
        _pair("bf16 input gradient", lambda: ((gq @ wq).add_(gk @ wk).add_(gv @ wv),),
              lambda: (grad @ stacked,), device, iters, reps, flops),
    ]


def int8_cases(m: int, w: int, device: str, iters: int, reps: int) -> list[dict[str, Any]]:
    from library.quant import convrot_kernels as K

    g = torch.Generator().manual_seed(1)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    weights = [torch.randn(w, w, generator=g) / w**0.5 for _ in range(3)]
    codes = [K.quantize_convrot_weight(wt.to(device), 256) for wt in weights]
    stacked_q = torch.cat([q for q, _ in codes]).contiguous()
    stacked_s = torch.cat([s.reshape(-1) for _, s in codes]).contiguous()
    parts = [(stacked_q[i * w:(i + 1) * w], stacked_s[i * w:(i + 1) * w]) for i in range(3)]
    x = torch.randn(m, w, generator=g).to(device, dtype)
    x_q, x_s = K.quantize_activation(x, 256)
    flops = 2.0 * m * w * 3 * w
    return [_pair("int8 forward (GEMMs)", lambda: tuple(K.int8_gemm(x_q, x_s, q, s, None, dtype) for q, s in parts),
                  lambda: K.int8_gemm(x_q, x_s, stacked_q, stacked_s, None, dtype).split(w, dim=1),
                  device, iters, reps, flops)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.qkv_packing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=4352)
    p.add_argument("--width", type=int, default=3072)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", type=Path, required=True)
    ns = p.parse_args(argv)
    if ns.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu for a smoke run", file=sys.stderr)
        return 2
    rows = bf16_cases(ns.tokens, ns.width, ns.device, ns.iters, ns.reps)
    rows += int8_cases(ns.tokens, ns.width, ns.device, ns.iters, ns.reps)
    payload = {"command": " ".join(["python", "-m", "bench.qkv_packing", *(argv if argv is not None else sys.argv[1:])]),
               "device": torch.cuda.get_device_name() if ns.device == "cuda" else "cpu", "torch": torch.__version__,
               "results": rows}
    write_atomic(ns.out, lambda tmp: Path(tmp).write_text(json.dumps(payload, indent=1)))
    for r in rows:
        print(f"{r['case']:<22} three {r['three_ms']:.4f} ms ({r['three_tflops']:.0f} T/s), one {r['one_ms']:.4f} ms "
              f"({r['one_tflops']:.0f} T/s): {r['speedup']:.3f}x, rel diff {r['rel_diff']:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
