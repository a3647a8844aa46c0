"""ConvRot INT8 benchmark: the int8 Linear (rotation + quantisation + GEMM + epilogue) against bf16 F.linear, and a
DiT-like block (hidden 3072, 24x128 heads, SwiGLU 8192 through one 3072 -> 16384 up_gate Linear) forward and
forward + backward with a rank-16 LoRA, bf16 against int8. GPU correctness (Triton against eager) is checked in the
same run. Prints a table and writes JSON.

    python -m bench.convrot_int8 --out results.json            # on a CUDA GPU (H200 in docs/benchmarks.md)
    python -m bench.convrot_int8 --smoke                       # tiny shapes, CPU or GPU: checks the script runs
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


from library.quant import convrot_kernels as K
from library.quant import convrot as U

G = 256


# ----------------------------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------------------------
def bench(fn, device: str, rep_ms: int = 200) -> float:
    """Median milliseconds of fn() (device events through triton's do_bench on CUDA)."""
    if device == "cuda":
        import triton.testing

        fn()
        torch.cuda.synchronize()
        return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[1]


def host_time(fn, calls: int = 40) -> float:
    """Host microseconds per call (launch cost only: the GPU queue does not fill in `calls` calls)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t) / calls * 1e6
    torch.cuda.synchronize()
    return us


def cycler(items):
    state = {"i": 0}

    def nxt():
        state["i"] = (state["i"] + 1) % len(items)
        return items[state["i"]]

    return nxt


def relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


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
    K._ACT_CACHE.clear()
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
        "grad_x_bwd_bf16_relerr": relerr(K.int8_linear_grad_input(gy, q, s, G, "bf16"), gx_ref),
        "grad_x_bwd_int8_relerr": relerr(K.int8_linear_grad_input(gy, q, s, G, "int8"), gx_ref),
        "grad_x_bwd_int8_triton_vs_eager_relerr": relerr(
            K.int8_linear_grad_input(gy, q, s, G, "int8"),
            K.int8_linear_grad_input(gy, q, s, G, "int8", backend="eager"),
        ),
    }
    # weight quantisation on the GPU equals the CPU (fp32 recipe: exact sums, identical on both)
    q_cpu, s_cpu = K.quantize_convrot_weight(w.cpu(), G)
    res["weight_q_gpu_vs_cpu_mismatch"] = int((q.cpu() != q_cpu).sum())
    res["weight_s_gpu_vs_cpu_mismatch"] = int((s.cpu() != s_cpu).sum())
    return res


# ----------------------------------------------------------------------------------------------------------------
# Linear
# ----------------------------------------------------------------------------------------------------------------
def bench_linear(m: int, k: int, n: int, device: str, variants: str) -> dict:
    """variants: "none" (bf16 vs int8 only), "final" (+ components and backward), "all" (+ alternatives)."""
    torch.manual_seed(0)
    w = (torch.randn(n, k, device=device) * 0.02).to(torch.bfloat16)
    bias = (torch.randn(n, device=device) * 0.1).to(torch.bfloat16)
    q, s = K.quantize_convrot_weight(w, G)
    xs = [torch.randn(m, k, device=device, dtype=torch.bfloat16) for _ in range(4)]
    gys = [torch.randn(m, n, device=device, dtype=torch.bfloat16) for _ in range(2)]
    nx, ngy = cycler(xs), cycler(gys)
    flops = 2.0 * m * k * n
    r: dict = {"M": m, "K": k, "N": n}
    gemm_default = K._TUNING["gemm"]

    def int8_full():
        K._ACT_CACHE.clear()
        return K.int8_linear(nx(), q, s, bias, G)

    r["bf16_ms"] = bench(lambda: F.linear(nx(), w, bias), device)
    r["int8_ms"] = bench(int8_full, device)
    if variants != "none" and device == "cuda":
        q_x, s_x = K._quantize_rows_triton(xs[0], G)
        s_w = s.reshape(-1)
        r["quant_ms"] = bench(lambda: K._quantize_rows_triton(nx(), G), device)
        r["gemm_ms"] = bench(lambda: K._int8_gemm_triton(q_x, s_x, q, (k, 1), s_w, bias, torch.bfloat16, n), device)
    if variants != "none" and device == "cuda":
        r["host_us_per_call_bf16"] = host_time(lambda: F.linear(nx(), w, bias))
        r["host_us_per_call_int8"] = host_time(int8_full)
        try:
            K._TUNING["gemm"] = "tma"
            r["gemm_tma_ms"] = bench(lambda: K._int8_gemm_triton(q_x, s_x, q, (k, 1), s_w, bias, torch.bfloat16, n),
                                     device)
            r["int8_tma_ms"] = bench(int8_full, device)
            r["host_us_per_call_int8_tma"] = host_time(int8_full)
        except Exception as e:  # noqa: BLE001 - report, keep benchmarking
            r["tma_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        finally:
            K._TUNING["gemm"] = gemm_default
    if variants == "final" and device == "cuda":
        r["bwd_bf16_ref_ms"] = bench(lambda: ngy() @ w, device)
        r["bwd_int8mode_bf16_ms"] = bench(lambda: K.int8_linear_grad_input(ngy(), q, s, G, "bf16"), device)
        r["dequant_ms"] = bench(lambda: K.dequantize_weight(q, s, G, torch.bfloat16), device)
    if variants == "all" and device == "cuda":
        r["cublas_int_mm_ms"] = bench(lambda: torch._int_mm(q_x, q.t()), device)
        r["torch_rotation_ms"] = bench(lambda: K.rotate_activation(nx(), G), device)
        r["eager_int8_ms"] = bench(lambda: K.int8_linear(nx(), q, s, bias, G, backend="eager"), device)
        try:
            K._TUNING["gemm"] = "tma"
            r["gemm_tma_ms"] = bench(lambda: K._int8_gemm_triton(q_x, s_x, q, (k, 1), s_w, bias, torch.bfloat16, n),
                                     device)
            r["int8_tma_ms"] = bench(int8_full, device)
            y_tma = K._int8_gemm_triton(q_x, s_x, q, (k, 1), s_w, bias, torch.bfloat16, n)
            K._TUNING["gemm"] = "ptr"
            y_ptr = K._int8_gemm_triton(q_x, s_x, q, (k, 1), s_w, bias, torch.bfloat16, n)
            r["tma_vs_ptr_mismatch"] = int((y_tma != y_ptr).sum())
        except Exception as e:  # noqa: BLE001 - report, keep benchmarking
            r["tma_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        finally:
            K._TUNING["gemm"] = gemm_default
        r["bwd_bf16_ref_ms"] = bench(lambda: ngy() @ w, device)
        r["bwd_int8mode_bf16_ms"] = bench(lambda: K.int8_linear_grad_input(ngy(), q, s, G, "bf16"), device)
        r["bwd_int8mode_int8_ms"] = bench(lambda: K.int8_linear_grad_input(ngy(), q, s, G, "int8"), device)
        r["dequant_ms"] = bench(lambda: K.dequantize_weight(q, s, G, torch.bfloat16), device)
    for key in [key for key in r if key.endswith("_ms") and key not in ("quant_ms", "torch_rotation_ms", "dequant_ms")]:
        r[key.replace("_ms", "_tflops")] = flops / (r[key] * 1e-3) / 1e12
    r["speedup"] = r["bf16_ms"] / r["int8_ms"]
    if "quant_ms" in r:
        r["quant_GBps"] = (m * k * 3 + m * 4) / (r["quant_ms"] * 1e-3) / 1e9
    return r


def sweep_quant(m: int, k: int, device: str) -> list[dict]:
    """Launch shapes of the fused rotate+quantise kernel: (elements per program, per thread)."""
    xs = [torch.randn(m, k, device=device, dtype=torch.bfloat16) for _ in range(4)]
    nx = cycler(xs)
    out = []
    saved = dict(K._TUNING)
    for row_elems, ept in [(4096, 8), (4096, 16), (8192, 16), (8192, 32), (16384, 16), (16384, 32)]:
        K._TUNING.update(row_elems=row_elems, elems_per_thread=ept)
        try:
            ms = bench(lambda: K._quantize_rows_triton(nx(), G), device, rep_ms=100)
            out.append({"K": k, "row_elems": row_elems, "elems_per_thread": ept, "ms": ms,
                        "GBps": (m * k * 3 + m * 4) / (ms * 1e-3) / 1e9})
        except Exception as e:  # noqa: BLE001
            out.append({"K": k, "row_elems": row_elems, "elems_per_thread": ept, "error": str(e)[:200]})
    K._TUNING.update(saved)
    return out


# ----------------------------------------------------------------------------------------------------------------
# DiT-like block
# ----------------------------------------------------------------------------------------------------------------
class LoRA(nn.Module):
    def __init__(self, org: nn.Module, k: int, n: int, rank: int = 16):
        super().__init__()
        self.org = org
        self.down = nn.Linear(k, rank, bias=False)
        self.up = nn.Linear(rank, n, bias=False)
        nn.init.normal_(self.up.weight, std=0.01)

    def forward(self, x):
        return self.org(x) + self.up(self.down(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int, ffn: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.norm1 = nn.RMSNorm(dim, eps=1e-6)
        self.norm2 = nn.RMSNorm(dim, eps=1e-6)
        self.q_norm = nn.RMSNorm(head_dim, eps=1e-6)
        self.k_norm = nn.RMSNorm(head_dim, eps=1e-6)
        self.proj = nn.ModuleDict({
            "q": nn.Linear(dim, dim), "k": nn.Linear(dim, dim), "v": nn.Linear(dim, dim), "o": nn.Linear(dim, dim),
            "ffn_up_gate": nn.Linear(dim, 2 * ffn), "ffn_down": nn.Linear(ffn, dim),
        })

    def forward(self, x, mod):
        b, seq, dim = x.shape
        shift1, scale1, gate1, shift2, scale2, gate2 = mod.unbind(0)
        h = (self.norm1(x) * (1 + scale1) + shift1).to(self.norm1.weight.dtype)

        def heads(t):
            return t.view(b, seq, self.heads, self.head_dim)

        q = self.q_norm(heads(self.proj["q"](h))).transpose(1, 2)
        k = self.k_norm(heads(self.proj["k"](h))).transpose(1, 2)
        v = heads(self.proj["v"](h)).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, seq, dim)
        x = x + gate1 * self.proj["o"](a)
        h = self.norm2(x) * (1 + scale2) + shift2
        value, gate = self.proj["ffn_up_gate"](h).chunk(2, dim=-1)
        return x + gate2 * self.proj["ffn_down"](F.silu(gate) * value)


def add_lora(block: Block) -> list[nn.Parameter]:
    params = []
    for name, lin in list(block.proj.items()):
        lora = LoRA(lin, lin.in_features, lin.out_features).to(device=lin.bias.device, dtype=torch.bfloat16)
        block.proj[name] = lora
        params += [lora.down.weight, lora.up.weight]
    return params


def bench_block(m: int, dim: int, heads: int, ffn: int, device: str) -> dict:
    torch.manual_seed(0)
    ref = Block(dim, heads, dim // heads, ffn).to(device=device, dtype=torch.bfloat16).requires_grad_(False)
    with torch.no_grad():
        for lin in ref.proj.values():
            lin.weight.normal_(0, 1 / math.sqrt(lin.in_features))
    qb = Block(dim, heads, dim // heads, ffn).to(device=device, dtype=torch.bfloat16).requires_grad_(False)
    qb.load_state_dict(ref.state_dict())
    U.convert_model_to_convrot_int8(qb, lambda name: name.startswith("proj."), group_size=G)
    xs = [torch.randn(1, m, dim, device=device, dtype=torch.bfloat16) for _ in range(3)]
    mod = torch.randn(6, dim, device=device, dtype=torch.bfloat16) * 0.1
    nx = cycler(xs)
    r: dict = {"M": m, "dim": dim, "heads": heads, "ffn": ffn}
    with torch.no_grad():
        y_ref, y_q = ref(xs[0], mod), qb(xs[0], mod)
        r["fwd_out_relerr_int8_vs_bf16"] = relerr(y_q - xs[0], y_ref - xs[0])
        r["fwd_bf16_ms"] = bench(lambda: ref(nx(), mod), device)
        hits = K._ACT_CACHE.hits
        r["fwd_int8_ms"] = bench(lambda: qb(nx(), mod), device)
        r["act_cache_hits"] = K._ACT_CACHE.hits - hits
    lora_ref, lora_q = add_lora(ref), add_lora(qb)
    for p_ref, p_q in zip(lora_ref, lora_q):
        p_q.data.copy_(p_ref.data)
        p_ref.requires_grad_(True)
        p_q.requires_grad_(True)
    gy = torch.randn(1, m, dim, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        r["fwd_lora_bf16_ms"] = bench(lambda: ref(nx(), mod), device)
        r["fwd_lora_int8_ms"] = bench(lambda: qb(nx(), mod), device)

    xs_train = [x.detach().clone().requires_grad_(True) for x in xs]
    nxt = cycler(xs_train)

    def step(model):
        def run():
            x = nxt()
            model(x, mod).backward(gy)
            x.grad = None
            for p in model.parameters():
                p.grad = None
        return run

    grads = {}
    for name, model, params in (("bf16", ref, lora_ref), ("int8", qb, lora_q)):
        x = xs[0].detach().clone().requires_grad_(True)
        model(x, mod).backward(gy)
        grads[name] = ([p.grad.clone() for p in params], x.grad.clone())
        for p in params:
            p.grad = None
    r["lora_grad_relerr_int8_vs_bf16"] = max(relerr(a, b) for a, b in zip(grads["int8"][0], grads["bf16"][0]))
    r["grad_x_relerr_int8_vs_bf16"] = relerr(grads["int8"][1], grads["bf16"][1])
    r["train_bf16_ms"] = bench(step(ref), device)
    r["train_int8_ms"] = bench(step(qb), device)
    for lin in qb.modules():
        if isinstance(lin, U.ConvRotInt8Linear):
            lin.bwd = "int8"
    r["train_int8_bwd_int8_ms"] = bench(step(qb), device)
    r["fwd_speedup"] = r["fwd_bf16_ms"] / r["fwd_int8_ms"]
    r["fwd_lora_speedup"] = r["fwd_lora_bf16_ms"] / r["fwd_lora_int8_ms"]
    r["train_speedup"] = r["train_bf16_ms"] / r["train_int8_ms"]
    r["train_bwd_int8_speedup"] = r["train_bf16_ms"] / r["train_int8_bwd_int8_ms"]
    return r


# ----------------------------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.convrot_int8", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the JSON results here")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU or GPU): only checks that the script runs")
    ap.add_argument("--variants", choices=["none", "final", "all"], default="final",
                    help="component timings: none, final (quantisation, GEMM, backward) or all (+ alternatives)")
    ap.add_argument("--sweep", action="store_true", help="also sweep the launch shapes of the quantisation kernel")
    ap.add_argument("--gemm", choices=["ptr", "tma"], default=None, help="forward GEMM kernel (default: tma on Hopper)")
    ap.add_argument("--row_elems", type=int, default=None)
    ap.add_argument("--elems_per_thread", type=int, default=None)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.gemm:
        K.set_gemm_kernel(args.gemm)
    if args.row_elems:
        K._TUNING["row_elems"] = args.row_elems
    if args.elems_per_thread:
        K._TUNING["elems_per_thread"] = args.elems_per_thread
    if args.smoke:
        m, shapes, block = 96, [(256, 256), (256, 1024), (512, 256)], (256, 2, 512)
    else:
        m, shapes, block = 4352, [(3072, 3072), (3072, 16384), (8192, 3072)], (3072, 24, 8192)
    import triton

    res: dict = {
        "command": " ".join(["python", "-m", "bench.convrot_int8", *sys.argv[1:]]),
        "env": {
            "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "has_triton": K.HAS_TRITON,
        },
    }
    t0 = time.time()
    if device == "cuda":
        res["checks"] = [check_linear(m, k, n, device, torch.bfloat16) for (k, n) in shapes[:1]]
        print("checks done %.0fs" % (time.time() - t0), flush=True)
    res["linear"] = [bench_linear(m, k, n, device, args.variants) for k, n in shapes]
    print("linear done %.0fs" % (time.time() - t0), flush=True)
    if device == "cuda" and args.sweep:
        res["quant_sweep"] = sweep_quant(m, shapes[0][0], device) + sweep_quant(m, shapes[2][0], device)
        print("sweep done %.0fs" % (time.time() - t0), flush=True)
    res["tuning"] = dict(K._TUNING)
    res["block"] = bench_block(m, *block, device)
    res["gemm_autotune"] = {
        name: {str(key): str(cfg) for key, cfg in getattr(getattr(K, name, None), "cache", {}).items()}
        for name in ("_int8_gemm_tuned", "_int8_gemm_tma_tuned")
    }
    res["seconds"] = time.time() - t0
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res.get("checks", []), indent=None))
    for r in res["linear"]:
        extra = {k: round(v, 4) for k, v in r.items() if k.endswith(("_ms", "per_call_bf16", "per_call_int8", "_tma"))
                 and k not in ("bf16_ms", "int8_ms")}
        print(f"Linear M={r['M']} K={r['K']} N={r['N']}: bf16 {r['bf16_ms']:.4f} ms ({r['bf16_tflops']:.0f} TF/s)"
              f"  int8 {r['int8_ms']:.4f} ms ({r['int8_tflops']:.0f} TOPS)  speedup {r['speedup']:.3f}x  {extra}")
    for r in res.get("quant_sweep", []):
        print("quant", r)
    print("block", json.dumps(res["block"]))
    print("autotune", json.dumps(res["gemm_autotune"]))


if __name__ == "__main__":
    main()
