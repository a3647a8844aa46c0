#!/usr/bin/env python
"""The int8 GEMM with its block's next step in the epilogue (`library.quant.int8_epilogue_kernels`) against the plain
GEMM followed by that step's own kernel, at the DiT's shapes (M = 4,352: a 1024x1024 image and 256 text tokens), one
JSON. What compiled ConvRot INT8 inference blocks run (`library.runtime.fused_compiled`):

- ``q_norm_rope``: q or k (3,072 x 3,072) with the head RMSNorm + RoPE; separate: the GEMM, then
  `fused_kernels.norm_rope_forward`;
- ``o_residual`` / ``ffn_down_residual`` (3,072 x 3,072 / 3,072 x 8,192) with the gated residual; separate: the GEMM,
  then `fused_kernels.gated_residual_forward` (one pass, as inductor's fused kernel).

Per case: GPU time per call (`--inner` calls captured in a CUDA graph, replayed `--reps` times, median; L2 not flushed),
and host time per call (`--host_calls` calls queued without a sync, then one; the registered op's call as a compiled
graph makes it, and the kernel module's function alone), and the two outputs' relative difference.

    python -m bench.epilogue_gemm --out OUT/epilogue_gemm.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.report import write_report

M = 4352
CASES = {"q_norm_rope": (3072, 3072), "o_residual": (3072, 3072), "ffn_down_residual": (3072, 8192)}
HEAD = 128


def _inputs(n: int, k: int, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    angles = torch.rand(1, M, HEAD // 2, generator=g) * 6
    return {
        "x_q": torch.randint(-128, 128, (M, k), generator=g, dtype=torch.int8).to(device),
        "x_scale": (torch.rand(M, generator=g) * 1e-3).to(device),
        "weight": torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8).to(device),
        "weight_scale": (torch.rand(n, generator=g) * 1e-3).to(device),
        "residual": torch.randn(1, M, n, generator=g).to(device, torch.bfloat16),
        "gate": torch.randn(1, n, generator=g).to(device, torch.bfloat16),
        "norm_weight": (1 + 0.1 * torch.randn(HEAD, generator=g)).to(device, torch.bfloat16),
        "cos": angles.cos().to(device), "sin": angles.sin().to(device),
    }


def _calls(case: str, t: dict[str, torch.Tensor]) -> dict[str, Callable[[], torch.Tensor]]:
    """separate (GEMM, then the step's kernel), the kernel module's fused function, and the registered op."""
    from library.quant import convrot_kernels as K
    from library.quant import int8_epilogue_kernels as E
    from library.runtime import fused_compiled  # noqa: F401 - registers the ops
    from library.runtime import fused_kernels as FK

    ops = torch.ops.moss_image
    x_q, sa, w, sw = t["x_q"], t["x_scale"], t["weight"], t["weight_scale"]
    n = w.shape[0]

    def product() -> torch.Tensor:
        return K.int8_gemm(x_q, sa, w, sw, None, torch.bfloat16, "auto")

    if case == "q_norm_rope":
        args = (t["norm_weight"], t["cos"], t["sin"])
        return {
            "separate": lambda: FK.norm_rope_forward(product().view(1, M, n // HEAD, HEAD), *args, 1e-6),
            "fused": lambda: E.gemm_norm_rope(x_q, sa, w, sw, *args, 1e-6, M, torch.bfloat16),
            "fused_op": lambda: ops.convrot_int8_linear_norm_rope(x_q, sa, w, sw, *args, 1e-6, M, torch.bfloat16),
        }
    res, gate = t["residual"], t["gate"]
    return {
        "separate": lambda: FK.gated_residual_forward(res, gate, product().view(1, M, n)),
        "fused": lambda: E.gemm_gated_residual(x_q, sa, w, sw, res, gate),
        "fused_op": lambda: ops.convrot_int8_linear_gated_residual(x_q, sa, w, sw, res, gate),
    }


def _host_us(fn: Callable[[], Any], calls: int) -> float:
    """Host microseconds per call, `calls` queued back to back (the GPU may lag: nothing waits for it)."""
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - began
    torch.cuda.synchronize()
    return round(host / calls * 1e6, 2)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from bench.int8_gemm_sweep import time_gpu
    from library.quant import int8_epilogue_kernels as E

    out: dict[str, Any] = {"env": {"torch": torch.__version__, "python": platform.python_version(),
                                   "gpu": torch.cuda.get_device_name(), "kernels": E.describe()},
                           "args": vars(args), "cases": {}}
    for case, (n, k) in CASES.items():
        t = _inputs(n, k, "cuda")
        calls = _calls(case, t)
        usable = E.epilogue_gemm_usable(t["x_q"], t["weight"], torch.bfloat16, HEAD if case == "q_norm_rope" else None)
        row: dict[str, Any] = {"m": M, "n": n, "k": k, "usable": usable}
        ref, got = calls["separate"](), calls["fused"]()
        row["rel_diff"] = float((got.float().view(-1) - ref.float().view(-1)).norm() / ref.float().norm())
        for name, fn in calls.items():
            row[f"{name}_gpu_us"] = round(time_gpu(fn, args.reps, args.inner)["ms"] * 1e3, 2)
            row[f"{name}_host_us"] = statistics.median(_host_us(fn, args.host_calls) for _ in range(3))
        row["gpu_speedup"] = round(row["separate_gpu_us"] / row["fused_gpu_us"], 3)
        out["cases"][case] = row
        print(case, json.dumps(row), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="write the JSON here")
    p.add_argument("--reps", type=int, default=20, help="graph replays per timing (>= 20)")
    p.add_argument("--inner", type=int, default=10, help="calls per captured graph")
    p.add_argument("--host_calls", type=int, default=200, help="calls per host timing")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.epilogue_gemm needs a CUDA GPU", file=sys.stderr)
        return 2
    write_report(run(args), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
