"""The fused element-wise kernels of a DiT block against the eager forms they replace, one chain at a time, at the
shapes of a 1024x1024 step (4,352 tokens, width 3,072 in 24 heads of 128, FFN 8,192, bf16, batch 1).

    python -m bench.fused_kernels --out fused_kernels.json             # on a CUDA GPU
    python -m bench.fused_kernels --sweep --out fused_kernels.json     # also each launch parameter's alternatives
    TRITON_INTERPRET=1 python -m bench.fused_kernels --device cpu --tokens 32 --width 256 --ffn 512 --iters 1 \\
        --reps 1 --out smoke.json                                      # a smoke run of the same code on a CPU

Each chain runs as the block calls it (`library.moss_image.dit`: `norm_modulate`, `norm_rope`, `swiglu`,
`gated_residual`), with the
fused kernels on and off (`library.runtime.fused_ops.set_fused_kernels`): the forward (with autograd recording, as in
training) and the forward + backward. A timed call makes `--reps` calls back to back; on CUDA a sleep kernel holds the
GPU while the host queues it (`held_gpu_ms`), so the GPU time is measured with the host out of it (as in a step where
the GPU leads: one chain's kernels take less time than autograd's call around them). The median over `--iters` timed
calls is divided by `--reps`. ``gbps`` is the kernels' traffic (the bytes their arguments and results take) over
their time.
`--sweep` times the kernels form for each value of each launch parameter (`fused_kernels.TUNING`), one at a time.
``codes``: the norm + modulation and SwiGLU kernels that also write ConvRot INT8 codes, against the plain kernel
followed by the activation quantiser.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.convrot_int8 import relerr, time_ms
from library.moss_image import dit
from library.runtime import fused_ops

SWEEP = {"rope_rows": (8, 16, 32), "rope_warps": (2, 4, 8), "swiglu_block": (512, 1024, 2048, 4096),
         "swiglu_warps": (2, 4, 8), "row_warps": (4, 8, 16), "residual_rows": (4, 8, 16, 32),
         "residual_block": (128, 256, 512, 1024), "residual_warps": (2, 4, 8)}
TUNED_BY = {"norm_modulate": ("row_warps",), "norm_rope": ("rope_rows", "rope_warps"),
            "swiglu": ("swiglu_block", "swiglu_warps"),
            "gated_residual": ("residual_rows", "residual_block", "residual_warps")}


class Chain:
    """One chain's inputs and its call as the block makes it."""

    def __init__(self, name: str, tokens: int, width: int, ffn: int, head: int, device: str):
        g = torch.Generator().manual_seed(0)
        bf16 = torch.bfloat16

        def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * scale).to(device, bf16)

        self.name = name
        if name == "norm_modulate":
            self.norm = dit.RMSNorm(width).to(device, bf16).requires_grad_(False)
            self.x = rand(1, tokens, width)
            self.shift, self.scale = rand(1, 6, width, scale=0.3).unbind(1)[:2]
            self.call = lambda x: dit.norm_modulate(self.norm, x, self.shift, self.scale)
            moved = 2 * self.x.nbytes  # read x, write the result; backward: read the gradient and x, write x's
            self.bytes = {"forward": moved, "backward": 3 * self.x.nbytes}
        elif name == "norm_rope":
            heads = width // head
            self.norm = dit.RMSNorm(head).to(device, bf16).requires_grad_(False)
            self.x = rand(1, tokens, width).view(1, tokens, heads, head)
            ang = torch.rand(1, tokens, head // 2, generator=g) * 100
            cos, sin = ang.cos().to(device), ang.sin().to(device)
            self.call = lambda x: dit.norm_rope(self.norm, x, cos, sin)
            tables = cos.nbytes + sin.nbytes
            self.bytes = {"forward": 2 * self.x.nbytes + tables, "backward": 3 * self.x.nbytes + tables}
        elif name == "swiglu":
            self.x = rand(1, tokens, 2 * ffn)
            self.call = dit.swiglu
            self.bytes = {"forward": self.x.nbytes * 3 // 2, "backward": self.x.nbytes * 5 // 2}
        elif name == "gated_residual":  # x here is the branch's output y, the residual stream another tensor
            self.x = rand(1, tokens, width)
            residual = rand(1, tokens, width)
            gate = rand(1, 6, width, scale=0.3).unbind(1)[2]
            self.call = lambda y: dit.gated_residual(residual, gate, y)
            self.bytes = {"forward": 3 * self.x.nbytes, "backward": 2 * self.x.nbytes}  # read x, y; the gradient
        else:
            raise ValueError(name)
        self.grad = torch.randn(self.call(self.x).shape, generator=g).to(device, bf16)

    def forward(self) -> torch.Tensor:
        return self.call(self.x.detach().requires_grad_(True))

    def train(self) -> torch.Tensor:
        x = self.x.detach().requires_grad_(True)
        self.call(x).backward(self.grad)
        return x.grad


def _repeated(fn: Callable[[], Any], reps: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(reps):
            fn()

    return run


def held_gpu_ms(fn: Callable[[], Any], iters: int, warmup: int = 2) -> dict[str, Any]:
    """GPU time of `fn` on CUDA with the host out of it: before each timed call a sleep kernel holds the GPU for twice
    the host time of one call, so the whole call is queued before its first kernel starts. `held` is the share of
    calls whose start event had not run when the host had queued the call's end (the queue was full throughout)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    host_s = time.perf_counter() - t
    torch.cuda.synchronize()
    clock_hz = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "clock_rate", 0) * 1e3 or 2e9
    cycles = int(max(2 * host_s, 5e-4) * clock_hz)
    times, held = [], 0
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        start.record()
        fn()
        end.record()
        held += not start.query()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return {"median_ms": statistics.median(times), "held": held / iters, "host_ms": host_s * 1e3}


def _time(fn: Callable[[], Any], device: str, iters: int, reps: int, held: list[float] | None = None) -> float:
    """Milliseconds per call of `fn`; on CUDA, `held` collects the share of timed calls queued whole in advance."""
    if device == "cuda":
        r = held_gpu_ms(_repeated(fn, reps), iters)
        if held is not None:
            held.append(r["held"])
        return r["median_ms"] / reps
    return time_ms(_repeated(fn, reps), device, iters, warmup=2)["median_ms"] / reps


def measure(chain: Chain, device: str, iters: int, reps: int) -> dict[str, Any]:
    """Both forms of one chain: times, the kernels' bandwidth, and their difference (rounding only)."""
    row: dict[str, Any] = {"chain": chain.name}
    outputs, held = {}, []
    for form, on in (("eager", False), ("kernels", True)):
        previous = fused_ops.set_fused_kernels(on)
        try:
            fwd = _time(chain.forward, device, iters, reps, held)
            step = _time(chain.train, device, iters, reps, held)
            outputs[form] = (chain.forward().detach(), chain.train())
        finally:
            fused_ops.set_fused_kernels(previous)
        row[f"{form}_forward_ms"], row[f"{form}_train_ms"] = fwd, step
    row["forward_speedup"] = row["eager_forward_ms"] / row["kernels_forward_ms"]
    row["train_speedup"] = row["eager_train_ms"] / row["kernels_train_ms"]
    backward_ms = max(row["kernels_train_ms"] - row["kernels_forward_ms"], 1e-9)
    row["kernels_forward_gbps"] = chain.bytes["forward"] / (row["kernels_forward_ms"] * 1e6)
    row["kernels_backward_gbps"] = chain.bytes["backward"] / (backward_ms * 1e6)
    (y_e, g_e), (y_k, g_k) = outputs["eager"], outputs["kernels"]
    row["out_rel_diff"], row["grad_rel_diff"] = relerr(y_k, y_e), relerr(g_k, g_e)
    if held:
        row["held_min"] = min(held)  # 1.0: every timed call was queued whole before the GPU started it
    return row


def codes(tokens: int, width: int, ffn: int, device: str, iters: int, reps: int) -> list[dict[str, Any]]:
    """The two kernels that also write ConvRot INT8 codes (groups of 256), forward as the int8 block runs them,
    against their plain kernel followed by the activation quantiser ("quarters") on its output: time, traffic, and
    whether the codes and scales are the quantiser's on the fused kernel's own output, bit for bit (the norm's output
    may differ from the plain kernel's by rounding: it sums the row in another order)."""
    from library.quant.convrot_quant_kernels import _quantize_rows_triton
    from library.runtime import fused_kernels as kernels

    g = torch.Generator().manual_seed(1)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(device, torch.bfloat16)

    x, u = rand(1, tokens, width), rand(1, tokens, 2 * ffn)
    w, (shift, scale) = 1 + rand(width, scale=0.1), rand(1, 2, width, scale=0.3).unbind(1)
    pairs = {
        "norm_modulate": (lambda: kernels.norm_modulate_forward(x, w, shift, scale, 1e-6),
                          lambda: kernels.norm_modulate_quant_forward(x, w, shift, scale, 1e-6, 256),
                          x.nbytes, width),
        "swiglu": (lambda: kernels.swiglu_forward(u), lambda: kernels.swiglu_quant_forward(u, 256), u.nbytes, ffn),
    }
    rows = []
    for name, (plain, fused, read, k) in pairs.items():
        def separate(plain=plain, k=k):
            y = plain()
            return (y, *_quantize_rows_triton(y.reshape(-1, k), 256))

        y_s = separate()[0]
        y_f, q_f, s_f = fused()
        q_r, s_r = _quantize_rows_triton(y_f.reshape(-1, k), 256)  # the quantiser on the fused kernel's own output
        written = y_f.nbytes + q_f.nbytes + s_f.nbytes
        row = {"chain": name, "separate_ms": _time(separate, device, iters, reps),
               "fused_ms": _time(fused, device, iters, reps),
               "codes_equal": bool(torch.equal(q_r, q_f)), "scales_equal": bool(torch.equal(s_r, s_f)),
               "out_rel_diff": relerr(y_f, y_s)}
        row["speedup"] = row["separate_ms"] / row["fused_ms"]
        row["fused_gbps"] = (read + written) / (row["fused_ms"] * 1e6)
        rows.append(row)
    return rows


def sweep(chain: Chain, device: str, iters: int, reps: int) -> list[dict[str, Any]]:
    """The kernels form's forward + backward for each value of the chain's launch parameters, one at a time."""
    from library.runtime import fused_kernels

    rows = []
    for param in TUNED_BY[chain.name]:
        for value in SWEEP[param]:
            previous = fused_kernels.set_tuning(**{param: value})
            try:
                rows.append({"chain": chain.name, param: value, "train_ms": _time(chain.train, device, iters, reps)})
            except Exception as e:  # noqa: BLE001 - a value that does not build or launch is a result
                rows.append({"chain": chain.name, param: value, "error": f"{type(e).__name__}: {e}"[:500]})
            finally:
                fused_kernels.set_tuning(**previous)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fused_kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=4352)
    p.add_argument("--width", type=int, default=3072)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--head", type=int, default=128)
    p.add_argument("--iters", type=int, default=30, help="timed calls per measurement (median)")
    p.add_argument("--reps", type=int, default=20, help="chain calls per timed call")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--out", type=Path, required=True)
    ns = p.parse_args(argv)
    if not fused_ops.prepare(ns.device):
        print(f"the fused kernels do not run on {ns.device} (a CUDA GPU with Triton, or TRITON_INTERPRET=1 for a CPU"
              " smoke run)", file=sys.stderr)
        return 2
    chains = [Chain(name, ns.tokens, ns.width, ns.ffn, ns.head, ns.device) for name in TUNED_BY]
    results = [measure(c, ns.device, ns.iters, ns.reps) for c in chains]
    payload: dict[str, Any] = {
        "command": " ".join(["python", "-m", "bench.fused_kernels", *(argv if argv is not None else sys.argv[1:])]),
        "device": torch.cuda.get_device_name() if ns.device == "cuda" else "cpu", "torch": torch.__version__,
        "results": results}
    if fused_ops.prepare_fused_quant(ns.device):
        payload["codes"] = codes(ns.tokens, ns.width, ns.ffn, ns.device, ns.iters, ns.reps)
    if ns.sweep:
        payload["sweep"] = [row for c in chains for row in sweep(c, ns.device, ns.iters, ns.reps)]
    tmp = ns.out.with_name(f".{ns.out.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(ns.out)
    for r in results:
        print(f"{r['chain']:<14} forward {r['eager_forward_ms']:.3f} -> {r['kernels_forward_ms']:.3f} ms "
              f"({r['forward_speedup']:.2f}x), forward + backward {r['eager_train_ms']:.3f} -> "
              f"{r['kernels_train_ms']:.3f} ms ({r['train_speedup']:.2f}x), kernels {r['kernels_forward_gbps']:.0f} / "
              f"{r['kernels_backward_gbps']:.0f} GB/s")
    for r in payload.get("codes", []):
        print(f"{r['chain']:<14} + int8 codes: kernel + quantiser {r['separate_ms']:.3f} -> one kernel "
              f"{r['fused_ms']:.3f} ms ({r['speedup']:.2f}x, {r['fused_gbps']:.0f} GB/s), codes equal "
              f"{r['codes_equal'] and r['scales_equal']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
