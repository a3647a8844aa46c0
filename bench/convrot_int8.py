"""ConvRot INT8 benchmark: bf16 and INT8 side by side, one JSON.

Parts (`--parts`, comma-separated; default: all the device supports):

- ``host`` (CPU and GPU): host cost per call at tiny shapes, where the kernels take no time: calls/s, microseconds
  per call and aten ops per call of F.linear against the int8 Linear module (eager without and with autograd, a
  q/k/v trio reading one input, which shares its quantisation), and the registered op called eagerly (the
  dispatcher's share).
- ``checks`` (GPU): Triton against the eager reference at one full-size shape (codes, scales, outputs, gradients).
- ``linear`` (GPU): the int8 Linear module against bf16 ``nn.Linear`` at M = 4352 for 3072x3072, 3072x16384 and
  8192x3072, forward and forward + backward (grad of the input, the base is frozen), quantisation included; plus
  the components (quantiser with its GB/s, GEMM, each backward kernel, dequantisation). Medians over `--iters`
  (>= 20) timed iterations after warm-up, each measured with CUDA events after an L2 flush.
- ``quantiser`` (GPU): the activation quantiser at M = 4352 and K = 3072 / 8192 / 16384 in TB/s, the one-pass
  "quarters" kernel (default) against the one-pass "rows" kernel (the previous default), the two-pass "stream"
  kernel, the tensor-core rotations "rows_mma" and "tiles_mma" and the copy rate, their codes against each other
  and the eager reference, and sweeps of the one-pass kernels' launch shapes.
- ``overhead`` (GPU): microseconds per int8 Linear call against F.linear at M = 64 and 4352 (3072 x 3072, 1000
  calls, one sync at the end), with the raw launches (default), the compiled kernels' launchers and every launch
  through ``JITFunction.run``, the quantiser and GEMM alone, and a cProfile of the module call at M = 64.
- ``te`` (GPU): the Linears of the Qwen3.5-9B text model (32 layers) at M = 20 / 77 / 300 tokens, bf16 against
  ConvRot INT8, ms per caption (the whole encoder per caption is ``bench.te_throughput``'s).
- ``blocks`` (GPU): 4 full-width MossImageBlocks (the product's modules, rank-16 LoRA from networks.lora_generic,
  fp32 LoRA weights under bf16 autocast as in the trainer), each block ``torch.compile(fullgraph=True)`` by
  ``library.runtime.compile.compile_blocks``: bf16 against INT8 (quantised by ``library.moss_image.loaders.quantize_dit``),
  compiled training step (forward + backward) and compiled inference forward, eager for reference, the graph count,
  and the output / LoRA-gradient error of INT8 against bf16. ``--profile`` adds the GPU time of one compiled step
  split by kernel category.

    python -m bench.convrot_int8 --out convrot_int8.json          # on a CUDA GPU (H200 in docs/benchmarks.md)
    python -m bench.convrot_int8 --parts host --out host.json     # the CPU part
    python -m bench.convrot_int8 --smoke                          # tiny shapes, CPU or GPU: the script runs
    python -m bench.convrot_int8 --parts quantiser,overhead,te,checks,linear --out convrot.json   # issue 13 figures
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from bench.gpu_profile import kernel_profile
from bench.host_profile import host_profile
from library.moss_image.dit import MossImage, MossImageConfig
from library.moss_image.rope import rope_cos_sin
from library.moss_image.loaders import quantize_dit
from library.quant import convrot as U
from library.quant import convrot_kernels as K
from library.quant import convrot_ops, int8_gemm_kernels, int8_grad_kernels, linear_plan, triton_launch
from library.runtime.compile import compile_blocks
from networks import lora_generic

G = 256
FULL_M = 4352  # 1024x1024 image (4096 tokens) + 256 text tokens
FULL_SHAPES = [(3072, 3072), (3072, 16384), (8192, 3072)]  # (K, N): q/k/v/o, ffn_up_gate, ffn_down


# ----------------------------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------------------------
class _L2Flush:
    """Writes a buffer larger than the L2 cache before each timed iteration (weights and activations come from HBM,
    as in a real step)."""

    def __init__(self, device: str):
        self.buf = torch.empty(256 << 20, dtype=torch.int8, device=device) if device == "cuda" else None

    def __call__(self) -> None:
        if self.buf is not None:
            self.buf.zero_()


def time_ms(fn: Callable[[], Any], device: str, iters: int, warmup: int = 5) -> dict:
    """Median (and spread) of `iters` timed calls after `warmup` calls: CUDA events around each call on the GPU,
    the host clock on the CPU."""
    flush = _L2Flush(device)
    for _ in range(warmup):
        fn()
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        for _ in range(iters):
            flush()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    return {"median_ms": statistics.median(times), "p10_ms": times[len(times) // 10],
            "p90_ms": times[(len(times) * 9) // 10], "iters": iters}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def calls_per_second(fn: Callable[[], Any], device: str, calls: int, repeats: int = 5) -> float:
    """Best of `repeats` batches of `calls` calls (synchronised around each batch): calls per second."""
    for _ in range(min(calls, 50)):
        fn()
    best = math.inf
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return calls / best


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.names: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        self.names[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def aten_ops_per_call(fn: Callable[[], Any]) -> tuple[int, dict]:
    fn()
    with _CountOps() as counter:
        fn()
    return counter.count, dict(counter.names)


def cycler(items: list) -> Callable[[], Any]:
    state = {"i": 0}

    def nxt() -> Any:
        state["i"] = (state["i"] + 1) % len(items)
        return items[state["i"]]

    return nxt


def relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


# ----------------------------------------------------------------------------------------------------------------
# host cost per call
# ----------------------------------------------------------------------------------------------------------------
def bench_host(m: int, k: int, n: int, device: str, calls: int) -> dict:
    """Host cost of one Linear call at a shape whose kernels take (almost) no time. bf16 on the GPU; fp32 on the
    CPU, where bf16 matmuls are emulated and would be measured instead of the host code, with one thread."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
    lin = nn.Linear(k, n, bias=False).to(device=device, dtype=dtype).requires_grad_(False)
    qlins = [U.ConvRotInt8Linear.from_linear(lin, G) for _ in range(3)]
    qlin = qlins[0]
    xs = [torch.randn(m, k, device=device, dtype=dtype) for _ in range(2)]
    xgs = [x.clone().requires_grad_(True) for x in xs]
    nx, nxg = cycler(xs), cycler(xgs)  # alternating inputs: every int8 call misses the activation cache

    def qkv() -> None:
        x = nx()
        for q in qlins:
            q(x)

    variants: dict[str, tuple[Callable[[], Any], bool, int]] = {
        # name: (fn, grad enabled, Linear calls per fn call)
        "F_linear": (lambda: F.linear(nx(), lin.weight), False, 1),
        "int8_module": (lambda: qlin(nx()), False, 1),
        "int8_module_qkv_shared_input": (qkv, False, 3),
        "int8_registered_op_eager": (
            lambda: convrot_ops.linear(nx(), qlin.weight, qlin.weight_scale, None, G, "bf16"), False, 1),
        "F_linear_autograd": (lambda: F.linear(nxg(), lin.weight), True, 1),
        "int8_module_autograd": (lambda: qlin(nxg()), True, 1),
    }
    r: dict = {"M": m, "K": k, "N": n, "group_size": G, "dtype": str(dtype), "calls": calls, "variants": {}}
    for name, (fn, grad, per) in variants.items():
        with torch.set_grad_enabled(grad):
            rate = calls_per_second(fn, device, max(1, calls // per)) * per
            ops_count, names = aten_ops_per_call(fn)
        r["variants"][name] = {"calls_per_s": rate, "us_per_call": 1e6 / rate, "aten_ops_per_call": ops_count / per,
                               "aten_ops": names}
    v = r["variants"]
    for name in list(v):
        ref = "F_linear_autograd" if name.endswith("autograd") else "F_linear"
        v[name]["x_of_F_linear"] = v[name]["us_per_call"] / v[ref]["us_per_call"]
    r["op_dispatch"] = bench_op_dispatch(qlin, xs[0], device, calls)
    torch.set_num_threads(threads)
    return r


def bench_op_dispatch(qlin: U.ConvRotInt8Linear, x: torch.Tensor, device: str, calls: int) -> dict:
    """What one call of the registered ops costs on the host with the kernels replaced by no-ops: the dispatcher,
    the ops' Python and (for `linear_grad`) the autograd node. This is the part a compiled graph pays per call on
    top of the launches, and it is the same on the CPU as on a GPU host."""
    x_q, x_s = K.quantize_activation(x, G)
    y = torch.empty(x.shape[0], qlin.out_features, device=x.device, dtype=x.dtype)
    stubs = {"quantize_activation": lambda *a, **k: (x_q, x_s), "int8_gemm": lambda *a, **k: y,
             "int8_linear_grad_input": lambda *a, **k: x}
    saved = {name: getattr(K, name) for name in stubs}
    args = (qlin.weight, qlin.weight_scale, None, G, "bf16")
    xg = x.clone().requires_grad_(True)
    variants = {
        "linear_op": lambda: convrot_ops.LINEAR(x, x_q, x_s, *args),
        "quantize_op": lambda: convrot_ops.QUANTIZE(x, G),
        "linear_no_grad": lambda: convrot_ops.linear(x, *args),
        "linear_grad": lambda: convrot_ops.linear(xg, *args),
    }
    out: dict = {}
    try:
        for name, value in stubs.items():
            setattr(K, name, value)
        for name, fn in variants.items():
            with torch.set_grad_enabled(name == "linear_grad"):
                out[name] = {"us_per_call": 1e6 / calls_per_second(fn, device, calls)}
    finally:
        for name, value in saved.items():
            setattr(K, name, value)
    return out


# ----------------------------------------------------------------------------------------------------------------
# correctness on the device
# ----------------------------------------------------------------------------------------------------------------
def check_linear(m: int, k: int, n: int, device: str, dtype: torch.dtype) -> dict:
    torch.manual_seed(1)
    w = torch.randn(n, k, device=device) * 0.02
    w[:, 7] *= 20  # an outlier input channel
    w = w.to(torch.bfloat16)
    q, s = K.quantize_convrot_weight(w, G)
    x = torch.randn(m, k, device=device).to(dtype)
    x[:, 11] *= 30
    bias = (torch.randn(n, device=device) * 0.1).to(dtype)
    q_t, s_t = K._quantize_rows_triton(x, G)
    q_e, s_e = K.quantize_rowwise(K.rotate_activation(x, G))
    y_t = K.int8_linear(x, q, s, bias, G, backend="triton")
    y_e = K.int8_linear(x, q, s, bias, G, backend="eager")
    y_ref = F.linear(x, w.to(dtype), bias)
    gy = torch.randn(m, n, device=device).to(dtype)
    gx_ref = gy @ w.to(dtype)
    deq_t = K.dequantize_weight(q, s, G, dtype, backend="triton")
    deq_e = K.dequantize_weight(q, s, G, dtype, backend="eager")
    res = {
        "shape": [m, k, n], "dtype": str(dtype).replace("torch.", ""),
        "q_act_mismatch": int((q_t != q_e).sum()), "s_act_mismatch": int((s_t != s_e.reshape(-1)).sum()),
        "y_triton_vs_eager_mismatch": int((y_t != y_e).sum()), "y_numel": y_t.numel(),
        "y_triton_vs_eager_relerr": relerr(y_t, y_e),
        "y_int8_vs_bf16_relerr": relerr(y_t, y_ref),
        "dequant_triton_vs_eager_mismatch": int((deq_t != deq_e).sum()),
    }
    for kernel in K.BACKWARD_KERNELS:
        with K.backward_kernel(kernel):
            res[f"grad_x_bf16_{kernel}_relerr"] = relerr(K.int8_linear_grad_input(gy, q, s, G, "bf16"), gx_ref)
    res["grad_x_int8_relerr"] = relerr(K.int8_linear_grad_input(gy, q, s, G, "int8"), gx_ref)
    res["grad_x_int8_triton_vs_eager_relerr"] = relerr(
        K.int8_linear_grad_input(gy, q, s, G, "int8"), K.int8_linear_grad_input(gy, q, s, G, "int8", backend="eager"))
    # weight quantisation on the GPU equals the CPU (fp32 recipe: exact sums, identical on both)
    q_cpu, s_cpu = K.quantize_convrot_weight(w.cpu(), G)
    res["weight_q_gpu_vs_cpu_mismatch"] = int((q.cpu() != q_cpu).sum())
    res["weight_s_gpu_vs_cpu_mismatch"] = int((s.cpu() != s_cpu).sum())
    return res


# ----------------------------------------------------------------------------------------------------------------
# Linear at the product's shapes
# ----------------------------------------------------------------------------------------------------------------
def bench_linear(m: int, k: int, n: int, device: str, iters: int, components: bool) -> dict:
    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=False).to(device=device, dtype=torch.bfloat16).requires_grad_(False)
    nn.init.normal_(lin.weight, std=0.02)
    qlin = U.ConvRotInt8Linear.from_linear(lin, G)
    xs = [torch.randn(m, k, device=device, dtype=torch.bfloat16) for _ in range(3)]
    xgs = [x.clone().requires_grad_(True) for x in xs]
    gys = [torch.randn(m, n, device=device, dtype=torch.bfloat16) for _ in range(2)]
    nx, nxg, ngy = cycler(xs), cycler(xgs), cycler(gys)
    flops = 2.0 * m * k * n
    r: dict = {"M": m, "K": k, "N": n}

    def step(mod: nn.Module) -> Callable[[], None]:
        def run() -> None:
            x = nxg()
            mod(x).backward(ngy())
            x.grad = None
        return run

    with torch.no_grad():
        r["fwd_bf16"] = time_ms(lambda: lin(nx()), device, iters)
        r["fwd_int8"] = time_ms(lambda: qlin(nx()), device, iters)
    r["fwd_bwd_bf16"] = time_ms(step(lin), device, iters)
    for kernel in K.BACKWARD_KERNELS:
        with K.backward_kernel(kernel):
            r[f"fwd_bwd_int8_bwd_bf16_{kernel}"] = time_ms(step(qlin), device, iters)
    qlin.bwd = "int8"
    r["fwd_bwd_int8_bwd_int8"] = time_ms(step(qlin), device, iters)
    qlin.bwd = "bf16"
    if components:
        q_x, s_x = K._quantize_rows_triton(xs[0], G)
        s_w = qlin.weight_scale
        q, gy = qlin.weight, gys[0]
        r["quantise"] = time_ms(lambda: K._quantize_rows_triton(nx(), G), device, iters)
        r["quantise"]["GBps"] = (m * k * 3 + m * 4) / (r["quantise"]["median_ms"] * 1e-3) / 1e9
        r["gemm"] = time_ms(lambda: K.int8_gemm(q_x, s_x, q, s_w, None, torch.bfloat16), device, iters)
        r["bwd_bf16_reference"] = time_ms(lambda: gy @ lin.weight, device, iters)
        for kernel in K.BACKWARD_KERNELS:
            with K.backward_kernel(kernel):
                r[f"bwd_bf16_{kernel}"] = time_ms(lambda: K.int8_linear_grad_input(gy, q, s_w, G, "bf16"), device,
                                                  iters)
        r["bwd_int8"] = time_ms(lambda: K.int8_linear_grad_input(gy, q, s_w, G, "int8"), device, iters)
        r["dequantise"] = time_ms(lambda: K.dequantize_weight(q, s_w, G, torch.bfloat16), device, iters)
    for key, value in list(r.items()):
        if isinstance(value, dict) and key not in ("quantise", "dequantise"):
            gemms = 2 if key.startswith("fwd_bwd") else 1  # forward + grad of the input (the base is frozen)
            value["tflops"] = tflops(gemms * flops, value["median_ms"])
    r["speedup_fwd"] = r["fwd_bf16"]["median_ms"] / r["fwd_int8"]["median_ms"]
    r["speedup_fwd_bwd"] = {key[len("fwd_bwd_int8_"):]: r["fwd_bwd_bf16"]["median_ms"] / v["median_ms"]
                            for key, v in r.items() if key.startswith("fwd_bwd_int8_")}
    return r


def sweep_quant(m: int, k: int, device: str, iters: int) -> list[dict]:
    """Tile shapes of the streaming rotate + quantise kernel: (elements per program, per thread, column tile)."""
    xs = [torch.randn(m, k, device=device, dtype=torch.bfloat16) for _ in range(3)]
    nx = cycler(xs)
    saved = dict(K._TUNING)
    out = []
    for row_elems in (2048, 4096, 8192, 16384):
        for ept in (8, 16, 32):
            for tile_k in (256, 512, 1024):
                K.set_row_tuning(row_elems, ept, tile_k)
                entry = {"K": k, "row_elems": row_elems, "elems_per_thread": ept, "tile_k": tile_k}
                try:
                    t = time_ms(lambda: K._quantize_rows_triton(nx(), G), device, iters)
                    entry.update(ms=t["median_ms"], GBps=(m * k * 3 + m * 4) / (t["median_ms"] * 1e-3) / 1e9)
                except Exception as e:  # noqa: BLE001 - a tile that does not compile is a result too
                    entry["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                out.append(entry)
    K.set_row_tuning(saved["row_elems"], saved["elems_per_thread"], saved["tile_k"])
    return out


# ----------------------------------------------------------------------------------------------------------------
# issue 13: quantiser bandwidth, host overhead per call, a text-encoder Linear stack
# ----------------------------------------------------------------------------------------------------------------
QUANT_KS = (3072, 8192, 16384)
# one 4-layer unit of the Qwen3.5-9B text model's Linears: (in, out, input group); Linears of one group read one
# tensor (q/k/v of the full-attention layer, gate/up of each MLP), as in the model
TE_UNIT = ([(4096, 8192, "a"), (4096, 1024, "a"), (4096, 1024, "a"), (4096, 4096, "o")]
           + [(4096, 12288, "qkvz"), (4096, 4096, "out")] * 3
           + [(4096, 12288, "mlp"), (4096, 12288, "mlp"), (12288, 4096, "down")] * 4)


def _quant_bytes(m: int, k: int) -> int:
    return m * k * 3 + m * 4  # bf16 in, int8 codes + fp32 scales out


def _tuning_sweep(kernel: str, settings: list[dict], nx: Callable[[], torch.Tensor], nbytes: int, device: str,
                  iters: int, describe: Callable[[], dict] | None = None) -> list[dict]:
    """The quantiser `kernel` timed under each `set_row_tuning` setting (`describe`: more fields once it is set);
    a launch shape that does not compile is recorded with its error."""
    rows = []
    for setting in settings:
        K.set_row_tuning(**setting)
        entry = {**setting, **(describe() if describe else {})}
        try:
            t = time_ms(lambda: K._quantize_rows_triton(nx(), G, kernel=kernel), device, iters)
            entry.update(ms=t["median_ms"], TBps=nbytes / (t["median_ms"] * 1e-3) / 1e12)
        except Exception as e:  # noqa: BLE001 - a launch shape that does not compile is a result too
            entry["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(entry)
    return rows


def bench_quantiser(m: int, device: str, iters: int, ks: tuple = QUANT_KS, sweep: bool = True) -> list[dict]:
    """The activation quantiser at M x K (bf16 -> int8 + scale, rotation included): every kernel of
    `K.QUANTISERS` ("quarters" the default) and the copy rate of x; codes and scales against each other and against
    the eager reference; small sweeps of the one-pass kernels' launch shapes."""
    out = []
    for k in ks:
        torch.manual_seed(0)
        xs = [torch.randn(m, k, device=device, dtype=torch.bfloat16) for _ in range(3)]
        xs[0][:, 5] *= 30
        nx = cycler(xs)
        nbytes = _quant_bytes(m, k)
        r: dict = {"M": m, "K": k, "bytes": nbytes}
        q_r, s_r = K._quantize_rows_triton(xs[0], G, kernel="rows")
        q_s, s_s = K._quantize_rows_triton(xs[0], G, kernel="stream")
        q_e, s_e = K.quantize_rowwise(K.rotate_activation(xs[0], G))
        r["rows_vs_stream_q_mismatch"] = int((q_r != q_s).sum())
        r["rows_vs_stream_s_mismatch"] = int((s_r != s_s).sum())
        r["rows_vs_eager_q_mismatch"] = int((q_r != q_e).sum())
        r["rows_vs_eager_s_mismatch"] = int((s_r != s_e.view(-1)).sum())
        r["rows_plan"] = str(K._rows_launch(k, G))
        q_m, s_m = K._quantize_rows_triton(xs[0], G, kernel="rows_mma")
        r["rows_mma_vs_eager_q_mismatch"] = int((q_m != q_e).sum())
        r["rows_mma_vs_eager_s_mismatch"] = int((s_m != s_e.view(-1)).sum())
        r["rows_mma_vs_rows_q_mismatch"] = int((q_m != q_r).sum())
        q_t, s_t = K._quantize_rows_triton(xs[0], G, kernel="tiles_mma")
        r["tiles_mma_vs_eager_q_mismatch"] = int((q_t != q_e).sum())
        r["tiles_mma_vs_eager_s_mismatch"] = int((s_t != s_e.view(-1)).sum())
        r["tiles_mma_vs_rows_q_mismatch"] = int((q_t != q_r).sum())
        r["tiles_mma_vs_rows_s_mismatch"] = int((s_t != s_r).sum())
        q_4, s_4 = K._quantize_rows_triton(xs[0], G, kernel="quarters")
        r["quarters_plan"] = str(K._quarters_launch(k, G))
        r["quarters_vs_eager_q_mismatch"] = int((q_4 != q_e).sum())
        r["quarters_vs_eager_s_mismatch"] = int((s_4 != s_e.view(-1)).sum())
        r["quarters_vs_rows_q_mismatch"] = int((q_4 != q_r).sum())
        r["quarters_vs_rows_s_mismatch"] = int((s_4 != s_r).sum())
        for kernel in K.QUANTISERS:
            t = time_ms(lambda kernel=kernel, nx=nx: K._quantize_rows_triton(nx(), G, kernel=kernel), device, iters)
            r[kernel] = {**t, "TBps": nbytes / (t["median_ms"] * 1e-3) / 1e12}
        t = time_ms(lambda nx=nx: nx().clone(), device, iters)
        r["copy"] = {**t, "TBps": 2 * m * k * 2 / (t["median_ms"] * 1e-3) / 1e12}
        r["rows_over_stream"] = r["stream"]["median_ms"] / r["rows"]["median_ms"]
        r["rows_mma_over_rows"] = r["rows"]["median_ms"] / r["rows_mma"]["median_ms"]
        r["tiles_mma_over_rows"] = r["rows"]["median_ms"] / r["tiles_mma"]["median_ms"]
        r["quarters_over_rows"] = r["rows"]["median_ms"] / r["quarters"]["median_ms"]
        if sweep:
            saved = dict(K._TUNING)
            r["rows_sweep"] = _tuning_sweep(
                "rows", [{"rows_elems": e, "rows_ept": t} for e in (1024, 8192) for t in (8, 16, 32)], nx, nbytes,
                device, iters, lambda k=k: {"plan": str(K._rows_launch(k, G))})
            r["tiles_sweep"] = _tuning_sweep(
                "tiles_mma", [{"tiles_bm": bm, "tiles_warps": w} for bm in (16, 32, 64) for w in (4, 8)], nx, nbytes,
                device, iters)
            r["quarters_sweep"] = _tuning_sweep(
                "quarters", [{"quarters_ept": e} for e in (32, 64, 96, 128)], nx, nbytes, device, iters,
                lambda k=k: {"plan": str(K._quarters_launch(k, G))})
            K.set_row_tuning(**{name: saved[name] for name in ("rows_elems", "rows_ept", "tiles_bm", "tiles_warps",
                                                               "quarters_ept")})
        out.append(r)
    return out


def _per_call_us(fn: Callable[[], Any], device: str, calls: int) -> float:
    """Microseconds per call over `calls` back-to-back calls, CUDA synchronised once at the end (best of 3)."""
    for _ in range(min(calls, 20)):
        fn()
    best = math.inf
    for _ in range(3):
        _sync(device)
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return best / calls * 1e6


def _host_profile(fn: Callable[[], Any], calls: int = 300, top: int = 18) -> list[str]:
    """The functions with the most own time over `calls` calls (`bench.host_profile`), one line each."""
    rows = host_profile(fn, steps=calls, top=top)["by_own_time"]
    return [f"{r['own_ms'] * 1e3:7.2f} us own {r['total_ms'] * 1e3:7.2f} us cum {r['calls']:4.1f}x {r['where']}"
            for r in rows]


def bench_overhead(m: int, k: int, n: int, device: str, calls: int) -> dict:
    """Time per call of the int8 Linear module against F.linear at M x K -> N (1000 calls, one CUDA sync at the
    end): with the raw Triton launches (default), the compiled kernels' launchers and ``JITFunction.run``, without
    the module's launch plans, the quantiser and the GEMM alone, and where the host time goes (cProfile of the
    module call)."""
    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=True).to(device=device, dtype=torch.bfloat16).requires_grad_(False)
    qlin = U.ConvRotInt8Linear.from_linear(lin, G)
    xs = [torch.randn(m, k, device=device, dtype=torch.bfloat16) for _ in range(2)]
    nx = cycler(xs)  # alternating inputs: every int8 call misses the activation cache
    q_x, s_x = K._quantize_rows_triton(xs[0], G)
    r: dict = {"M": m, "K": k, "N": n, "calls": calls}
    # (tag, direct launches, raw launches): raw = the C launch function called directly (default), direct = the
    # compiled kernel's own launcher, jit_run = every launch through JITFunction.run
    modes = (("raw", True, True), ("direct", True, False), ("jit_run", False, False))
    with torch.no_grad():
        r["F_linear_us"] = _per_call_us(lambda: F.linear(nx(), lin.weight, lin.bias), device, calls)
        outs = {}
        for tag, direct, raw in modes:
            triton_launch.set_direct_launch(direct)
            triton_launch.set_raw_launch(raw)
            r[f"int8_module_us_{tag}"] = _per_call_us(lambda: qlin(nx()), device, calls)
            r[f"quantise_us_{tag}"] = _per_call_us(lambda: K._quantize_rows_triton(nx(), G), device, calls)
            r[f"gemm_us_{tag}"] = _per_call_us(
                lambda: K.int8_gemm(q_x, s_x, qlin.weight, qlin.weight_scale, qlin.bias, torch.bfloat16), device,
                calls)
            outs[tag] = qlin(xs[0].clone())  # a new tensor: the quantiser runs too
        r["F_linear_us_again"] = _per_call_us(lambda: F.linear(nx(), lin.weight, lin.bias), device, calls)
        triton_launch.set_direct_launch(True)
        triton_launch.set_raw_launch(True)
        # the module without its launch plans (`library.quant.linear_plan`): the regular path on every call
        plans, qlin._eager_plans = qlin._eager_plans, None
        try:
            r["int8_module_us_unplanned"] = _per_call_us(lambda: qlin(nx()), device, calls)
            unplanned = qlin(xs[0].clone())
        finally:
            qlin._eager_plans = plans
        planned = qlin(xs[0].clone())
        r["planned_vs_unplanned_mismatch"] = int((planned != unplanned).sum())
        r["plan_replays"] = plans.replays
        r["int8_unplanned_over_F_linear"] = r["int8_module_us_unplanned"] / r["F_linear_us"]
        r["direct_vs_jit_run_mismatch"] = int((outs["direct"] != outs["jit_run"]).sum())
        r["raw_vs_jit_run_mismatch"] = int((outs["raw"] != outs["jit_run"]).sum())
        r["direct_launch_usable"] = triton_launch.direct_launch_enabled()
        r["raw_launch_usable"] = triton_launch.raw_launch_enabled()
        r["raw_launch_layouts"] = sorted({str(v) for v in triton_launch._LAYOUT.values()})
        r["int8_over_F_linear"] = r["int8_module_us_raw"] / r["F_linear_us"]
        r["int8_over_F_linear_direct"] = r["int8_module_us_direct"] / r["F_linear_us"]
        # the one-kernel forward (rotation, quantisation, GEMM and epilogue in one launch), which is off by default
        K.set_fused_linear(m)
        try:
            r["int8_module_us_fused"] = _per_call_us(lambda: qlin(nx()), device, calls)
            r["fused_vs_two_kernels_mismatch"] = int((qlin(xs[0].clone()) != outs["raw"]).sum())
        finally:
            K.set_fused_linear(0)
        r["int8_fused_over_F_linear"] = r["int8_module_us_fused"] / r["F_linear_us"]
        if m <= 256:
            r["host_profile_int8_module"] = _host_profile(lambda: qlin(nx()), calls=min(calls, 300))
    return r


def bench_te_linears(ms: tuple, device: str, iters: int, layers: int = 32, shrink: int = 1) -> dict:
    """The Linear layers of the Qwen3.5-9B text model (`TE_UNIT` repeated to `layers` layers, random weights) at
    M tokens, eager: bf16 nn.Linear against the ConvRot INT8 module, ms per caption. Only the Linears: the whole
    encoder (attention, DeltaNet, norms) per caption is bench.te_throughput's (it needs a full snapshot). INT8 with
    and without the raw Triton launches and the modules' launch plans."""
    torch.manual_seed(0)
    unit = [(i // shrink, o // shrink, g) for i, o, g in TE_UNIT]  # `shrink`: smaller widths for a smoke run
    bf16 = [nn.Linear(i, o, bias=False).to(device=device, dtype=torch.bfloat16).requires_grad_(False)
            for i, o, _ in unit]
    int8 = [U.ConvRotInt8Linear.from_linear(lin, G) for lin in bf16]
    units = layers // 4
    r: dict = {"layers": layers, "linears_per_caption": len(unit) * units, "shrink": shrink, "rows": [],
               # a registered Triton launch hook (a profiler) sends every launch through Triton's own path
               "launch_hooks_idle": triton_launch._launch_hooks_idle(),
               "raw_launch_usable": triton_launch.raw_launch_enabled()}
    for m in ms:
        groups = {g: torch.randn(m, i, device=device, dtype=torch.bfloat16) for i, _, g in unit}

        def run(mods: list, groups: dict = groups) -> None:
            fresh = {g: x.clone() for g, x in groups.items()}  # new tensors per unit: no activation-cache carry-over
            for _ in range(units):
                for mod, (_, _, g) in zip(mods, unit):
                    mod(fresh[g])

        with torch.no_grad():
            tb = time_ms(lambda: run(bf16), device, iters, warmup=3)
            tq = time_ms(lambda: run(int8), device, iters, warmup=3)
            triton_launch.set_raw_launch(False)  # the compiled kernels' own launchers, for comparison
            try:
                tqd = time_ms(lambda: run(int8), device, iters, warmup=3)
            finally:
                triton_launch.set_raw_launch(True)
            linear_plan.set_linear_plans(False)  # every call through the regular path (no launch plans)
            try:
                tqu = time_ms(lambda: run(int8), device, iters, warmup=3)
            finally:
                linear_plan.set_linear_plans(True)
            K.set_fused_linear(m)  # the one-kernel forward for these rows (off by default)
            try:
                tqf = time_ms(lambda: run(int8), device, iters, warmup=3)
            finally:
                K.set_fused_linear(0)
        r["rows"].append({"M": m, "bf16_ms_per_caption": tb["median_ms"], "int8_ms_per_caption": tq["median_ms"],
                          "int8_over_bf16": tq["median_ms"] / tb["median_ms"],
                          "int8_unplanned_ms_per_caption": tqu["median_ms"],
                          "int8_unplanned_over_bf16": tqu["median_ms"] / tb["median_ms"],
                          "int8_no_raw_launch_ms_per_caption": tqd["median_ms"],
                          "int8_no_raw_launch_over_bf16": tqd["median_ms"] / tb["median_ms"],
                          "int8_fused_ms_per_caption": tqf["median_ms"],
                          "int8_fused_over_bf16": tqf["median_ms"] / tb["median_ms"]})
    return r


# ----------------------------------------------------------------------------------------------------------------
# 4 compiled full-width blocks through the product's modules
# ----------------------------------------------------------------------------------------------------------------
STATE = {"graphs": 0}


def _counting(backend: str) -> Callable[..., Any]:
    """A torch.compile backend that counts the graphs dynamo captures and compiles them with `backend`."""
    from torch._dynamo.backends.registry import lookup_backend

    inner = lookup_backend(backend)

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        STATE["graphs"] += 1
        return inner(gm, example_inputs)

    return compile_graph


class _Blocks:
    """The main blocks of a MossImage built at full width with `layers` blocks, a LoRA on every block Linear, and the
    inputs of a 1024x1024 step."""

    def __init__(self, cfg: MossImageConfig, seq: int, device: str, int8: bool = False):
        torch.manual_seed(0)  # the same weights for bf16 and INT8
        with torch.device(device):
            dit = MossImage(cfg)
        dit.to(torch.bfloat16)
        with torch.no_grad():
            for lin in (m for m in dit.layers.modules() if isinstance(m, nn.Linear)):
                lin.weight.normal_(0, 1 / math.sqrt(lin.in_features))
            for blk in dit.layers:
                blk.scale_shift_table.normal_(0, 0.1)
        if int8:
            quantize_dit(dit)
        dit.requires_grad_(False)
        self.dit = dit
        self.net = lora_generic.create_network(1.0, 16, 16.0, None, [], dit)
        self.net.apply_to(None, dit, apply_text_encoder=False, apply_unet=True)
        self.net.to(device=device, dtype=torch.float32)
        g = torch.Generator(device="cpu").manual_seed(1)
        with torch.no_grad():
            for name, p in self.net.named_parameters():
                if "lora_up" in name:  # as if trained a little: a non-zero LoRA path
                    p.copy_(torch.randn(p.shape, generator=g) * 0.01)
        self.net.requires_grad_(True)
        side = math.isqrt(max(seq - 256, 1))
        text = seq - side * side
        pos = torch.zeros(1, seq, 3, dtype=torch.long)
        pos[0, text:, 1] = torch.arange(side).repeat_interleave(side)
        pos[0, text:, 2] = torch.arange(side).repeat(side)
        pos[0, :text, 0] = torch.arange(text)
        self.cos, self.sin = (t.to(device) for t in rope_cos_sin(pos, cfg.rope_axes_dims, cfg.rope_theta))
        self.x = (torch.randn(1, seq, cfg.hidden_size, generator=g) * 0.5).to(device, torch.bfloat16)
        self.mod = (torch.randn(1, 6, cfg.hidden_size, generator=g) * 0.1).to(device, torch.bfloat16)
        self.gy = torch.randn(1, seq, cfg.hidden_size, generator=g).to(device, torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            for blk in self.dit.layers:
                x = blk(x, self.cos, self.sin, None, self.mod)
        return x

    def train_step(self) -> torch.Tensor:
        x = self.x.detach().requires_grad_(True)  # as under checkpointing: the block input requires grad
        y = self.forward(x)
        y.backward(self.gy)
        return y

    def lora_grads(self) -> list[torch.Tensor]:
        grads = [p.grad.detach().clone() for p in self.net.parameters()]
        self.net.zero_grad(set_to_none=True)
        return grads

    def compile(self, backend: str) -> None:
        args = argparse.Namespace(compile_backend=_counting(backend), compile_mode="default", compile_dynamic="false",
                                  compile_fullgraph=True, compile_cache_size_limit=None)
        compile_blocks(args, self.dit)


def _profile_categories(fn: Callable[[], Any], steps: int = 3) -> dict:
    """GPU time per kernel category of `steps` calls (torch.profiler), milliseconds per call."""
    return kernel_profile(fn, steps)["categories_ms"]


def bench_blocks(layers: int, seq: int, device: str, iters: int, profile: bool, cfg: MossImageConfig,
                 backend: str) -> dict:
    cfg = dataclasses.replace(cfg, num_layers=layers, num_refiner_layers=0)
    bf16 = _Blocks(cfg, seq, device)
    int8 = _Blocks(cfg, seq, device, int8=True)
    r: dict = {"layers": layers, "seq": seq, "hidden": cfg.hidden_size, "ffn": cfg.ffn_hidden, "lora_rank": 16,
               "backend": backend}
    # quality of INT8 against bf16, eager (one step each)
    y_b = bf16.train_step()
    g_b = bf16.lora_grads()
    y_q = int8.train_step()
    g_q = int8.lora_grads()
    r["out_relerr_int8_vs_bf16"] = relerr(y_q - bf16.x, y_b - bf16.x)
    r["lora_grad_relerr_int8_vs_bf16_max"] = max(relerr(a, b) for a, b in zip(g_q, g_b))
    for name, blocks in (("bf16", bf16), ("int8", int8)):
        r[f"eager_train_{name}"] = time_ms(blocks.train_step, device, iters)
        with torch.no_grad():
            r[f"eager_infer_{name}"] = time_ms(lambda b=blocks: b.forward(b.x), device, iters)
    for name, blocks in (("bf16", bf16), ("int8", int8)):
        torch._dynamo.reset()
        STATE["graphs"] = 0
        blocks.compile(backend)
        t0 = time.perf_counter()
        blocks.train_step()
        blocks.lora_grads()
        with torch.no_grad():
            blocks.forward(blocks.x)
        _sync(device)
        r[f"compile_s_{name}"] = time.perf_counter() - t0
        r[f"compiled_train_{name}"] = time_ms(blocks.train_step, device, iters)
        with torch.no_grad():
            r[f"compiled_infer_{name}"] = time_ms(lambda b=blocks: b.forward(b.x), device, iters)
        r[f"graphs_{name}"] = STATE["graphs"]  # one training + one inference graph shared by all blocks
        if profile:
            r[f"profile_compiled_train_{name}_ms"] = _profile_categories(blocks.train_step)
            with torch.no_grad():
                r[f"profile_compiled_infer_{name}_ms"] = _profile_categories(lambda b=blocks: b.forward(b.x))
    for mode in ("eager_train", "eager_infer", "compiled_train", "compiled_infer"):
        r[f"speedup_{mode}"] = r[f"{mode}_bf16"]["median_ms"] / r[f"{mode}_int8"]["median_ms"]
        r[f"{mode}_int8_ms_per_block"] = r[f"{mode}_int8"]["median_ms"] / layers
        r[f"{mode}_bf16_ms_per_block"] = r[f"{mode}_bf16"]["median_ms"] / layers
    return r


# ----------------------------------------------------------------------------------------------------------------
def _env(device: str) -> dict:
    env = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "has_triton": K.HAS_TRITON, "python": platform.python_version()}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.convrot_int8", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the JSON results here")
    ap.add_argument("--parts", default=None, help="comma-separated: host, checks, linear, blocks (default: all"
                    " that the device supports; the CPU runs host only)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU or GPU): only checks that the script runs")
    ap.add_argument("--iters", type=int, default=30, help="timed iterations per measurement (>= 20 for results)")
    ap.add_argument("--host_calls", type=int, default=2000, help="calls per batch in the host part")
    ap.add_argument("--no_components", action="store_true", help="linear: skip the per-kernel timings")
    ap.add_argument("--sweep", action="store_true", help="linear: also sweep the quantiser's tile shapes")
    ap.add_argument("--profile", action="store_true", help="blocks: GPU time per kernel category")
    ap.add_argument("--gemm", choices=K.GEMM_KERNELS, default=None,
                    help="forward GEMM kernel (default: auto, the pinned table else ptr)")
    ap.add_argument("--layers", type=int, default=4, help="blocks: number of full-width blocks")
    ap.add_argument("--blocks_backend", default=None, help="blocks: torch.compile backend (default inductor on the"
                    " GPU, aot_eager for a CPU smoke run)")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    every = {"host", "checks", "linear", "blocks", "quantiser", "overhead", "te"}
    parts = set(args.parts.split(",")) if args.parts else (every if device == "cuda" else {"host"})
    unknown = parts - every
    if unknown:
        ap.error(f"unknown --parts {sorted(unknown)}")
    if device != "cuda" and parts - {"host"} and not args.smoke:
        ap.error("the checks, linear and blocks parts need a CUDA GPU (use --smoke for a CPU dry run)")
    if args.gemm:
        K.set_gemm_kernel(args.gemm)
    torch.backends.cuda.matmul.allow_tf32 = True  # as the trainer (apply_cuda_optimizations)
    if args.smoke:
        m, shapes, iters = 64, [(256, 256), (256, 1024), (512, 256)], 3
        block_cfg, seq, host_shapes = MossImageConfig(hidden_size=256, num_heads=2, head_dim=128, ffn_hidden=512,
                                                      text_dim=256, num_refiner_layers=0), 64, [(4, 256, 256)]
    else:
        m, shapes, iters = FULL_M, FULL_SHAPES, max(20, args.iters)
        block_cfg, seq = MossImageConfig(), FULL_M
        host_shapes = [(4, 256, 256)] + ([(256, 4096, 4096)] if device == "cuda" else [])
    res: dict = {"command": " ".join(["python", "-m", "bench.convrot_int8", *(argv if argv is not None
                                                                              else sys.argv[1:])]),
                 "env": _env(device), "tuning": dict(K._TUNING), "backward_kernel": K._TUNING["backward"]}
    t0 = time.time()
    def linear_part() -> list:
        out = [bench_linear(m, k, n, device, iters, not args.no_components and device == "cuda") for k, n in shapes]
        if args.sweep and device == "cuda":
            res["quant_sweep"] = sweep_quant(m, shapes[0][0], device, iters) + sweep_quant(m, shapes[2][0], device,
                                                                                           iters)
        return out

    backend = args.blocks_backend or ("inductor" if device == "cuda" else "aot_eager")
    on_device = device == "cuda" or args.smoke
    jobs: list[tuple[str, str, bool, Callable[[], Any]]] = [  # (part, result key, runs here, what)
        ("host", "host", True, lambda: [bench_host(hm, hk, hn, device, 100 if args.smoke else args.host_calls)
                                        for hm, hk, hn in host_shapes]),
        ("quantiser", "quantiser", on_device,
         lambda: bench_quantiser(m, device, iters, ks=(256, 512) if args.smoke else QUANT_KS, sweep=device == "cuda")),
        ("overhead", "overhead", on_device,
         lambda: [bench_overhead(om, shapes[0][0], shapes[0][0], device, 5 if args.smoke else 1000)
                  for om in ((8, m) if args.smoke else (64, FULL_M))]),
        ("te", "te_linears", on_device,
         lambda: bench_te_linears((20,) if args.smoke else (20, 77, 300), device, 3 if args.smoke else 20,
                                  layers=4 if args.smoke else 32, shrink=16 if args.smoke else 1)),
        ("checks", "checks", device == "cuda",
         lambda: [check_linear(m, k, n, device, torch.bfloat16) for (k, n) in shapes[:1]]),
        ("linear", "linear", on_device, linear_part),
        ("blocks", "blocks", on_device,
         lambda: bench_blocks(2 if args.smoke else args.layers, seq, device, iters, args.profile and device == "cuda",
                              block_cfg, backend)),
    ]
    for part, key, runs, what in jobs:
        if part not in parts or not runs:
            continue
        try:  # a part that fails is recorded and the others still run
            res[key] = what()
        except Exception as e:  # noqa: BLE001
            import traceback

            res.setdefault("errors", {})[part] = traceback.format_exc()[-4000:]
            print(f"{part} FAILED: {type(e).__name__}: {e}", flush=True)
        print(f"{part} done {time.time() - t0:.0f}s", flush=True)
        if args.out:  # partial results survive a time limit
            Path(args.out).write_text(json.dumps(res, indent=1))
    res["gemm_autotune"] = {
        name: {str(key): str(cfg) for key, cfg in getattr(getattr(module, name, None), "cache", {}).items()}
        for module, name in ((int8_gemm_kernels, "_int8_gemm_tuned"), (int8_gemm_kernels, "_int8_gemm_tma_tuned"),
                             (int8_grad_kernels, "_grad_input_upcast_tuned"))
    }
    res["seconds"] = time.time() - t0
    text = json.dumps(res, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return res


if __name__ == "__main__":
    main()
