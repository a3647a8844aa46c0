#!/usr/bin/env python
"""The kernels that write ConvRot INT8 codes, as compiled INT8 inference blocks launch them (codes only, no output):
the norm + modulation (q/k/v's input), the gated residual with the norm + modulation (the FFN's input) and SwiGLU
(ffn_down's input), at the shapes of a 1024x1024 pass (4,352 tokens, width 3,072, FFN 8,192, bf16, group 256), for
each launch plan of `fused_kernels.TUNING` ``codes_rows`` (rows a program) x ``codes_ept`` (values a thread), the
default plan first. One JSON; the last line printed is the fastest plan for the three together, as
``codes_rows=R,codes_ept=E`` (what `bench.infer_profile --tuning` takes).

    python -m bench.codes_kernels --out OUT/codes_kernels.json
    TRITON_INTERPRET=1 python -m bench.codes_kernels --device cpu --tokens 16 --width 768 --ffn 1024 --iters 1 \\
        --reps 1 --rows 1 --ept 0,32 --out smoke.json                         # a smoke run on a CPU

Each plan is timed as `bench.fused_kernels` times its kernels: CUDA events around `--reps` launches back to back,
queued whole behind a sleep kernel (the host out of the GPU time), median of `--iters`, divided by `--reps`;
``tbps`` is the bytes read and written over that time. Every plan's codes and scales are checked against the
default plan's (the same bits).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from bench.fused_kernels import _time
from bench.report import write_report
from library.runtime import fused_kernels as FK

GROUP = 256


def _inputs(tokens: int, width: int, ffn: int, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int, s: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * s).to(device, torch.bfloat16)

    mod = randn(1, 6, width, s=0.3)
    return {"x": randn(1, tokens, width), "r": randn(1, tokens, width), "w": randn(width, s=0.1) + 1,
            "shift": mod[:, 0], "scale": mod[:, 1], "gate": mod[:, 2], "u": randn(1, tokens, 2 * ffn)}


def _launches(t: dict[str, torch.Tensor]) -> dict[str, tuple[Any, int]]:
    """name -> (launch returning (codes, scales), bytes read and written)."""
    m, width = t["x"].shape[1], t["x"].shape[2]
    ffn = t["u"].shape[-1] // 2
    codes = m * width + 4 * m
    return {
        "norm_modulate": (lambda: FK.norm_modulate_quant_forward(t["x"], t["w"], t["shift"], t["scale"], 1e-6, GROUP,
                                                                 one_buffer=False, write_y=False)[1:],
                          2 * m * width + codes),
        "residual_norm_modulate": (lambda: FK.residual_norm_modulate_quant_forward(
            t["x"], t["gate"], t["r"], t["w"], t["shift"], t["scale"], 1e-6, GROUP)[2:], 6 * m * width + codes),
        "swiglu": (lambda: FK.swiglu_quant_forward(t["u"], GROUP, one_buffer=False, write_y=False)[1:],
                   4 * m * ffn + m * ffn + 4 * m),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    t = _inputs(args.tokens, args.width, args.ffn, args.device)
    launches = _launches(t)
    plans = [(0, 0)] + [(r, e) for r in args.rows for e in args.ept if (r, e) != (0, 0)]
    reference = {name: launch() for name, (launch, _) in launches.items()}
    rows: list[dict[str, Any]] = []
    for r, e in plans:
        previous = FK.set_tuning(codes_rows=r, codes_ept=e)
        try:
            row: dict[str, Any] = {"codes_rows": r, "codes_ept": e, "kernels": {}}
            for name, (launch, nbytes) in launches.items():
                try:
                    q, s = launch()
                    same = bool(torch.equal(q, reference[name][0]) and torch.equal(s, reference[name][1]))
                    us = 1e3 * _time(launch, args.device, args.iters, args.reps)
                    row["kernels"][name] = {"us": round(us, 2), "tbps": round(nbytes / us / 1e6, 3), "same": same}
                except Exception as exc:  # noqa: BLE001 - a plan that fails to compile or launch is recorded
                    row["kernels"][name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            ok = [k for k in row["kernels"].values() if "us" in k and k["same"]]
            row["total_us"] = round(sum(k["us"] for k in ok), 2) if len(ok) == len(launches) else None
            rows.append(row)
            print(row, flush=True)
        finally:
            FK.set_tuning(**previous)
    timed = [r for r in rows if r["total_us"] is not None]
    best = min(timed, key=lambda r: r["total_us"]) if timed else None
    return {"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
            "torch": torch.__version__, "args": vars(args), "plans": rows,
            "best": best, "default_total_us": rows[0]["total_us"]}


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=4352)
    p.add_argument("--width", type=int, default=3072)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--iters", type=int, default=20, help="timed calls per plan and kernel (median)")
    p.add_argument("--reps", type=int, default=20, help="launches per timed call")
    p.add_argument("--rows", type=_ints, default=[1, 2, 4], help="codes_rows values (comma-separated)")
    p.add_argument("--ept", type=_ints, default=[0, 8, 16, 32, 64], help="codes_ept values (0: the plan's warps)")
    args = p.parse_args(argv)
    result = run(args)
    write_report(result, args.out)
    best = result["best"]
    print(f"codes_rows={best['codes_rows']},codes_ept={best['codes_ept']}" if best else "codes_rows=0,codes_ept=0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
