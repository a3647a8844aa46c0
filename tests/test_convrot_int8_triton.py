"""The Triton ConvRot kernels against the eager reference.

On a CPU machine they run under Triton's interpreter (TRITON_INTERPRET=1, which can execute the int8 tl.dot) in a
subprocess, because the interpreter is chosen when the kernels are defined. With a CUDA GPU the same checks also run
compiled, in-process. Running this file as a script prints the check results as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# (M, K, N, group size): K over several column tiles of the streaming kernels (and not a power of two), a tile
# wider than K, a group wider than the default tile, no rotation
CASES = [(5, 512, 48, 256), (17, 1280, 24, 256), (33, 192, 40, 64), (3, 64, 24, 16), (6, 2048, 16, 1024),
         (7, 96, 8, 0), (4, 512, 32, 256),  # rows and K fill the one-pass quantisers' tiles (no masks)
         (3, 112, 8, 16)]  # 7 groups: the "quarters" kernel's second part rounded up to 4 groups (masked)


def run_checks(device: str) -> dict:
    """Compare the Triton path with the eager path on small shapes; returns counts (all exact ones must be 0)."""
    from library.quant import convrot_kernels as K

    torch.manual_seed(0)
    out: dict = {"has_triton": K.HAS_TRITON, "cases": []}
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        for m, k, n, g in CASES:
            w = torch.randn(n, k, device=device)
            q, s = K.quantize_convrot_weight(w, g)
            x = (torch.randn(2, m, k, device=device) * 2).to(dt)
            x[0, 0, 3] = 40.0
            bias = torch.randn(n, device=device).to(dt)
            q_t, s_t = K._quantize_rows_triton(x.reshape(-1, k), g)  # the default one-pass "quarters" kernel
            q_st, s_st = K._quantize_rows_triton(x.reshape(-1, k), g, kernel="stream")
            # the one-pass "rows" kernel (bf16 only: the interpreter's time), else the streaming one in its place,
            # so that "default_vs_rows" repeats "default_vs_stream" for fp16 and fp32
            q_r, s_r = ((q_st, s_st) if dt != torch.bfloat16 else
                        K._quantize_rows_triton(x.reshape(-1, k), g, kernel="rows"))
            q_mm, s_mm = K._quantize_rows_triton(x.reshape(-1, k), g, kernel="rows_mma")  # tensor-core rotation
            q_tm, s_tm = K._quantize_rows_triton(x.reshape(-1, k), g, kernel="tiles_mma")  # two passes, 64-blocks
            rows = x.reshape(-1, k)  # two packed sequences' rows, each's codes written in place in one buffer
            q_sg, s_sg = K.quantize_segments([rows[:m // 2 + 1], rows[m // 2 + 1:]], g)
            q_e, s_e = K.quantize_rowwise(K.rotate_activation(x, g).reshape(-1, k) if g else x.reshape(-1, k))
            y_t = K.int8_linear(x, q, s, bias, g, backend="triton")
            y_e = K.int8_linear(x, q, s, bias, g, backend="eager")
            case = {
                "dtype": str(dt), "shape": [m, k, n, g],
                "q_mismatch": int((q_t != q_e).sum()), "s_mismatch": int((s_t != s_e.reshape(-1)).sum()),
                "default_vs_stream_q_mismatch": int((q_t != q_st).sum()),
                "default_vs_stream_s_mismatch": int((s_t != s_st).sum()),
                "default_vs_rows_q_mismatch": int((q_t != q_r).sum()),
                "default_vs_rows_s_mismatch": int((s_t != s_r).sum()),
                "mma_q_mismatch": int((q_mm != q_e).sum()), "mma_s_mismatch": int((s_mm != s_e.reshape(-1)).sum()),
                "tiles_mma_q_mismatch": int((q_tm != q_e).sum()),
                "tiles_mma_s_mismatch": int((s_tm != s_e.reshape(-1)).sum()),
                "segments_q_mismatch": int((q_sg != q_t).sum()), "segments_s_mismatch": int((s_sg != s_t).sum()),
                "y_mismatch": int((y_t != y_e).sum()), "y_dtype_ok": y_t.dtype == dt and y_t.shape == (2, m, n),
                "y_relerr": float((y_t.float() - y_e.float()).norm() / y_e.float().norm()),
            }
            if g == 256 and k % 256 == 0 and dt != torch.float32:  # the one-kernel forward of few rows
                K.set_fused_linear(64)
                try:
                    y_f = K.linear_forward(x, q, s, bias, g)
                finally:
                    K.set_fused_linear(0)
                case["fused_y_mismatch"] = int((y_f != y_e).sum())
                case["fused_y_relerr"] = float((y_f.float() - y_e.float()).norm() / y_e.float().norm())
                case["fused_y_ok"] = y_f.dtype == dt and y_f.shape == (2, m, n)
            if g:
                d_t = K.dequantize_weight(q, s, g, dt, backend="triton")
                d_e = K.dequantize_weight(q, s, g, dt, backend="eager")
                case["deq_mismatch_frac"] = float((d_t != d_e).float().mean())
                rel = (d_t.float() - d_e.float()).abs() / d_e.float().abs().clamp(min=1e-3)
                case["deq_maxrel"] = float(rel.max())
                gy = torch.randn(2, m, n, device=device).to(dt)
                g_t = K.int8_linear_grad_input(gy, q, s, g, mode="int8", backend="triton")
                g_e = K.int8_linear_grad_input(gy, q, s, g, mode="int8", backend="eager")
                case["bwd_int8_relerr"] = float((g_t.float() - g_e.float()).norm() / g_e.float().norm())
            if dt != torch.float32 and g <= 256:  # the upcast backward GEMM (no dequantised weight)
                gy = torch.randn(2, m, n, device=device).to(dt)
                with K.backward_kernel("upcast"):
                    g_u = K.int8_linear_grad_input(gy, q, s, g, mode="bf16", backend="triton")
                g_d = K.int8_linear_grad_input(gy, q, s, g, mode="bf16", backend="eager")
                # its numerics in torch: DTYPE(grad * s_w) @ q in fp32, rotated back in fp32, rounded once
                acc = (gy.reshape(-1, n).float() * s.reshape(1, n)).to(dt).float() @ q.float()
                model = (K.rotate_weight(acc, g) if g else acc).to(dt).reshape(2, m, k)
                case["bwd_upcast_dtype_ok"] = g_u.dtype == dt and g_u.shape == (2, m, k)
                case["bwd_upcast_vs_model_relerr"] = float((g_u.float() - model.float()).norm() / model.float().norm())
                case["bwd_upcast_vs_dequant_relerr"] = float((g_u.float() - g_d.float()).norm() / g_d.float().norm())
            out["cases"].append(case)
    # the activation cache of the module's eager path: the same tensor object is quantised once; an in-place change
    # invalidates it
    w = torch.randn(32, 256, device=device)
    q, s = K.quantize_convrot_weight(w, 256)
    x = torch.randn(4, 256, device=device, dtype=torch.bfloat16)
    K._ACT_CACHE.clear()
    hits = K._ACT_CACHE.hits
    y1 = K.linear_forward(x, q, s, None, 256)
    y2 = K.linear_forward(x, q, s, None, 256)
    x.mul_(2)
    y3 = K.linear_forward(x, q, s, None, 256)
    out["launch_tuned"] = _check_launch_tuned(device)
    # the eager path's codes and scales share one allocation: the same values as two, the scales 16-byte aligned
    xo = torch.randn(9, 512, device=device, dtype=torch.bfloat16)
    q1, s1 = K._quantize_rows_triton(xo, 256, one_buffer=True)
    q2, s2 = K._quantize_rows_triton(xo, 256)
    out["one_buffer"] = {
        "same": bool(torch.equal(q1, q2) and torch.equal(s1, s2)),
        "layout_ok": q1.shape == (9, 512) and s1.shape == (9,) and q1.is_contiguous() and s1.is_contiguous()
        and s1.dtype == torch.float32 and s1.data_ptr() % 16 == 0 and q1.data_ptr() + 9 * 512 <= s1.data_ptr(),
    }
    out["cache"] = {
        "hits": K._ACT_CACHE.hits - hits, "same": bool(torch.equal(y1, y2)),
        "after_inplace_ok": bool(torch.equal(y3, K.int8_linear(x, q, s, None, 256, backend="eager"))),
    }
    out["plans"] = _check_plans(device)
    out["lora_node"] = _check_lora_node(device)
    out["lora_group"] = _check_lora_group(device)
    return out


def _check_lora_group(device: str) -> dict:
    """Three LoRA-wrapped int8 Linears of one input as one node (`library.lora.eager_node.LoRAGroup`: the launch
    plans inside it, the bases' input gradients added in place into the LoRA's, the second run replaying the bound
    backward) against a node each: the same values to bf16 rounding."""
    from library.lora import eager_node
    from library.quant import convrot as U
    from networks import lora_generic

    torch.manual_seed(3)
    linears = []
    for i, rank in enumerate((4, 8, 4)):
        mod = U.ConvRotInt8Linear.from_linear(torch.nn.Linear(512, 40 + 8 * i, bias=False).to(device,
                                                                                              torch.bfloat16), 256)
        lora = lora_generic.LoRAModule(f"lora_x{i}", f"x{i}", mod, lora_dim=rank, alpha=4.0)
        lora.to(device)
        with torch.no_grad():
            lora.lora_up.weight.normal_(0, 0.1)
        lora.apply_to()
        linears.append((mod, lora))
    x0 = torch.randn(2, 9, 512, device=device, dtype=torch.bfloat16)
    runs = []
    for group in (False, True, True):
        x = x0.clone().requires_grad_(True)
        with torch.autocast(device, dtype=torch.bfloat16):
            parts = eager_node.lora_group_parts([m for m, _ in linears], x) if group else None
            ys = eager_node.lora_group(x, parts) if parts is not None else [m(x) for m, _ in linears]
        sum((y.float() * (i + 1)).sum() for i, y in enumerate(ys)).backward()
        runs.append((parts is not None, [y.detach() for y in ys], x.grad,
                     [t.grad.clone() for _, lora in linears for t in (lora.lora_down.weight, lora.lora_up.weight)]))
        for _, lora in linears:
            lora.zero_grad(set_to_none=True)
    ref = runs[0]
    rel = [max(_relerr(a, b) for a, b in zip([*run[1], run[2], *run[3]], [*ref[1], ref[2], *ref[3]]))
           for run in runs[1:]]
    return {"grouped": [run[0] for run in runs], "relerr": rel}


def _check_lora_node(device: str) -> dict:
    """A LoRA around the int8 Linear as one autograd node (`library.lora.eager_node.LoRALinear`, the module's
    launch plans inside it, the LoRA's input gradient as the addend of the replayed backward product) against the
    module's own node plus the LoRA operators: the same values to bf16 rounding; the sums in place (the default) and
    into new tensors (`set_lora_in_place(False)`) bit for bit."""
    from library.lora import eager_node
    from library.quant import convrot as U
    from networks import lora_generic

    torch.manual_seed(2)
    lin = torch.nn.Linear(512, 40, bias=True).to(device=device, dtype=torch.bfloat16)
    mod = U.ConvRotInt8Linear.from_linear(lin, 256)
    lora = lora_generic.LoRAModule("lora_x", "x", mod, lora_dim=4, alpha=4.0)
    lora.to(device)
    with torch.no_grad():
        lora.lora_up.weight.normal_(0, 0.1)
    lora.apply_to()
    x0 = torch.randn(2, 9, 512, device=device, dtype=torch.bfloat16)
    gy = torch.randn(2, 9, 40, device=device, dtype=torch.bfloat16)
    runs = {}
    # the second node run replays the bound backward (with its addend), in place; the third into new tensors
    for one_node, in_place in ((False, True), (True, True), (True, True), (True, False)):
        previous = eager_node.set_lora_one_node(one_node)
        previous_in_place = eager_node.set_lora_in_place(in_place)
        try:
            x = x0.clone().requires_grad_(True)
            with torch.autocast(device, dtype=torch.bfloat16):  # the trainer's case: fp32 LoRA tensors
                y = mod(x)
            node = type(y.grad_fn).__name__
            y.backward(gy)
        finally:
            eager_node.set_lora_one_node(previous)
            eager_node.set_lora_in_place(previous_in_place)
        runs.setdefault(one_node, []).append((node, y.detach(), x.grad, lora.lora_down.weight.grad.clone(),
                                              lora.lora_up.weight.grad.clone()))
        lora.zero_grad(set_to_none=True)
    ref = runs[False][0]
    rel = [max(_relerr(a, b) for a, b in zip(run[1:], ref[1:])) for run in runs[True]]
    bwd_plans = sum(len(key) == 3 for key in mod._eager_plans.plans)  # the backward's bound dequantisation
    in_place_equal = all(torch.equal(a, b) for a, b in zip(runs[True][1][1:], runs[True][2][1:]))
    return {"nodes": [run[0] for run in runs[True]], "relerr": rel, "bwd_plans": bwd_plans,
            "in_place_equal": in_place_equal}


def _relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _check_plans(device: str) -> dict:
    """The int8 Linear module's launch plans (`library.quant.linear_plan`): replayed calls give the regular path's
    outputs and gradients bit for bit; a moved weight and a switch of kernels bind again."""
    from library.quant import convrot as U
    from library.quant import convrot_kernels as K

    torch.manual_seed(1)
    res: dict = {}
    for tag, bias, g, shape in (("bias_3d", True, 256, (2, 5, 512)), ("plain_2d", False, 0, (7, 96))):
        lin = torch.nn.Linear(shape[-1], 40, bias=bias).to(device=device, dtype=torch.bfloat16)
        mod = U.ConvRotInt8Linear.from_linear(lin, g)
        b = mod.bias

        def regular(x, mod=mod, b=b, g=g):
            return K.linear_forward(x, mod.weight, mod.weight_scale, b, g)

        xs = [torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in range(4)]
        with torch.no_grad():
            ys = [mod(x) for x in xs] + [mod(xs[3])]  # the last one finds its codes in the activation cache
            same = all(torch.equal(y, regular(x)) for y, x in zip(ys, [*xs, xs[3]]))
            replays, plans = mod._eager_plans.replays, len(mod._eager_plans)
            mod.weight.data = mod.weight.data.clone()  # a new address (block swap, .to()): bound again
            moved = torch.equal(mod(xs[1]), ys[1]) and torch.equal(mod(xs[2]), ys[2])
            K.set_quantiser(K._TUNING["quantiser"])  # any switch makes the bound launches stale
            after_switch = torch.equal(mod(xs[3]), ys[3]) and torch.equal(mod(xs[1]), ys[1])
        xg = xs[2].clone().requires_grad_(True)
        xr = xs[2].clone().requires_grad_(True)
        gy = torch.randn(*shape[:-1], 40, device=device, dtype=torch.bfloat16)
        mod(xr).backward(gy)  # binds the backward's dequantisation (replays the forward)
        mod(xg).backward(gy)  # replays both
        bwd_plans = sum(len(key) == 3 for key in mod._eager_plans.plans)
        xr.grad = None
        mod._eager_plans.clear()
        mod(xr).backward(gy)  # the regular paths (no plans)
        res[tag] = {"same": same, "replays": replays, "plans": plans, "moved": moved, "after_switch": after_switch,
                    "replays_total": mod._eager_plans.replays, "grad_same": bool(torch.equal(xg.grad, xr.grad)),
                    "bwd_plans": bwd_plans}
    return res


def _check_launch_tuned(device: str) -> bool:
    """The first call of a shape goes through the autotuner, later calls launch the plain kernel with its choice."""
    import triton

    from library.quant import convrot_kernels as K

    calls = []

    class FakeTuner:  # stands in for triton.autotune (whose timing needs a GPU): picks one config
        best_config = triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}, num_warps=4,
                                    num_stages=2)
        configs = (best_config,)  # what `first_configs` takes without timing

        def __getitem__(self, grid):
            def run(*args, **flags):
                calls.append("tuned")
                meta = dict(self.best_config.kwargs)
                K._int8_gemm_kernel[grid(meta)](*args, **flags, **meta)
            return run

    a = torch.randint(-128, 128, (40, 96), dtype=torch.int8, device=device)
    b = torch.randint(-128, 128, (24, 96), dtype=torch.int8, device=device)
    sa, sb = torch.rand(40, device=device), torch.rand(24, device=device)
    ref = K._epilogue_eager(K.int8_mm(a, b), sa, sb, torch.bfloat16)
    outs = []
    key = ("test", 40, 24, 96)
    from library.quant.int8_gemm_kernels import first_configs

    def two_calls() -> None:  # a new plan, then its reuse
        K._GEMM_PLANS.pop(key, None)
        for _ in range(2):
            c = torch.empty(40, 24, dtype=torch.bfloat16, device=device)
            args = (a, b, c, sa, sb, sa, 40, 24, 96, 64, a.stride(0), 1, 1, b.stride(0), c.stride(0), 1)
            K._launch_tuned(FakeTuner(), K._int8_gemm_kernel, key, 40, 24, args,
                            {"HAS_SB": True, "HAS_BIAS": False, "EVEN_K": True}, None)
            outs.append(c)
        K._GEMM_PLANS.pop(key, None)

    with first_configs(False):  # the CUDA checks run under first_configs(): the tuner's own path here
        two_calls()
    tuned_once = calls == ["tuned"]
    with first_configs():  # the first configuration, no tuner call
        two_calls()
    return tuned_once and calls == ["tuned"] and len(outs) == 4 and all(torch.equal(c, ref) for c in outs)


def _few_rows(c: dict) -> float:
    """A tenth of a case's rows (x is [2, M, K]), at least 2: the scales that the GPU's non-IEEE fp32 division may
    round one bit away."""
    return max(2, 0.1 * 2 * c["shape"][0])


def _assert_checks(res: dict, on_cuda: bool = False) -> None:
    assert res["has_triton"]
    for c in res["cases"]:
        # bf16/fp16 rows are exact up to g = 256 (a group's fp32 sum stays exact unless its exponents span many
        # binades, which 1024 fp16 terms can); without rotation every dtype is exact
        exact = (c["dtype"] != "torch.float32" and c["shape"][3] <= 256) or c["shape"][3] == 0
        assert c["y_dtype_ok"], c
        assert c["segments_q_mismatch"] == 0 and c["segments_s_mismatch"] == 0, c  # the same launches, in place
        # the one-pass and the streaming quantiser run the same arithmetic per group: identical codes and scales
        # (compiled, inexact fp32 sums may be reduced in another order: then within the tolerance against eager)
        # ("quarters", the default, holds a row in another layout: the same sums per group, the same codes)
        if exact or not on_cuda:
            assert c["default_vs_stream_q_mismatch"] == 0 and c["default_vs_stream_s_mismatch"] == 0, c
            assert c["default_vs_rows_q_mismatch"] == 0 and c["default_vs_rows_s_mismatch"] == 0, c
        else:
            assert c["default_vs_stream_q_mismatch"] <= 0.01 * 2 * c["shape"][0] * c["shape"][1], c
            assert c["default_vs_rows_q_mismatch"] <= 0.01 * 2 * c["shape"][0] * c["shape"][1], c
        if exact:  # the tensor-core rotation ("rows_mma"; other shapes and dtypes run "rows") equals eager as well
            assert c["mma_q_mismatch"] == 0 and c["mma_s_mismatch"] <= (_few_rows(c) if on_cuda else 0), c
            # the same for the two-pass tensor-core quantiser ("tiles_mma"; other groups and dtypes run "rows")
            assert c["tiles_mma_q_mismatch"] == 0, c
            assert c["tiles_mma_s_mismatch"] <= (_few_rows(c) if on_cuda else 0), c
        if "fused_y_mismatch" in c:  # the one-kernel forward: the codes and sums of the two-kernel path
            assert c["fused_y_ok"], c
            assert c["fused_y_relerr"] < 1e-3 if on_cuda else c["fused_y_mismatch"] == 0, c
        if exact and on_cuda:  # Triton's fp32 division on the GPU is not IEEE: a scale may differ in its last bit
            # (a few rows), the int8 codes may not; the outputs then follow those scales
            assert c["q_mismatch"] == 0 and c["s_mismatch"] <= _few_rows(c), c
            assert c["y_relerr"] < 1e-3, c
        elif exact:  # bf16/fp16 rows: the fp32 transform rounded once to T equals the eager T matmul on these data
            assert c["q_mismatch"] == 0 and c["s_mismatch"] == 0 and c["y_mismatch"] == 0, c
        else:  # fp32 activations (and 1024-groups): the rotation sums round differently from a BLAS matmul
            assert c["q_mismatch"] <= 0.01 * 2 * c["shape"][0] * c["shape"][1] and c["y_relerr"] < 1e-2, c
        if "deq_mismatch_frac" in c:  # dequantisation: summation order differs; at most 1 ulp (bf16 2^-8, fp16
            # 2^-11 relative) on a few elements; fp32 outputs keep the last bits of the different fp32 sums
            if c["dtype"] == "torch.float32":
                assert c["deq_maxrel"] < 1e-3, c
            else:
                assert c["deq_mismatch_frac"] < 0.01 and c["deq_maxrel"] <= 2**-7, c
            assert c["bwd_int8_relerr"] < 1e-2, c
        if "bwd_upcast_vs_model_relerr" in c:  # fp32 sums in another order, then one rounding: a few 1-ulp steps
            assert c["bwd_upcast_dtype_ok"], c
            assert c["bwd_upcast_vs_model_relerr"] < 1e-3 and c["bwd_upcast_vs_dequant_relerr"] < 2e-2, c
    assert res["cache"] == {"hits": 1, "same": True, "after_inplace_ok": True}
    assert res["launch_tuned"]
    for tag, p in res["plans"].items():  # the first call binds, the four after it replay (one from the cache)
        rotated = tag != "plain_2d"  # without rotation the backward dequantises in torch: nothing to bind
        assert p == {"same": True, "replays": 4, "plans": 1, "moved": True, "after_switch": True,
                     "replays_total": 9 if rotated else 8, "grad_same": True, "bwd_plans": int(rotated)}, (tag, p)
    assert res["one_buffer"] == {"same": True, "layout_ok": True}
    assert res["lora_node"]["nodes"] == ["LoRALinearBackward"] * 3, res["lora_node"]
    assert max(res["lora_node"]["relerr"]) < 1e-2 and res["lora_node"]["bwd_plans"] == 1, res["lora_node"]
    assert res["lora_node"]["in_place_equal"], res["lora_node"]
    assert res["lora_group"]["grouped"] == [False, True, True], res["lora_group"]
    assert max(res["lora_group"]["relerr"]) < 1e-2, res["lora_group"]


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


def _interpreter_runs_int8_dots() -> bool:
    """Triton's CPU interpreter runs these kernels from 3.9 on (3.6 fails inside its loop-bound handling)."""
    try:
        import triton

        return tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 9)
    except Exception:  # noqa: BLE001
        return False


def test_bf16_codes_by_reciprocal_equal_the_division():
    """The "quarters" quantiser's bf16 codes multiply by the row's fp32 reciprocal instead of dividing: for every
    positive finite bf16 value y and a spread of bf16 scales s, bf16(y * fp32(1 / s)) is bf16(fp32(y / s)), the
    eager ``bf16 / bf16`` (quotients kept inside fp32's normal range)."""
    y = torch.arange(1, 0x7F80, dtype=torch.int16).view(torch.bfloat16).float()  # every positive finite bf16
    g = torch.Generator().manual_seed(0)
    s = torch.cat([torch.tensor([1.0, 1.5, 3.0, 127.0, 1e-30, 3e36]),
                   torch.exp2(torch.rand(250, generator=g) * 200 - 100)]).bfloat16().float()
    for si in s:
        by_division = y / si
        ok = (by_division.abs() > 2.0**-120) & (by_division.abs() < 2.0**120)
        by_reciprocal = (y * (1.0 / si)).bfloat16()
        assert torch.equal(by_reciprocal[ok], by_division.bfloat16()[ok]), float(si)


@pytest.mark.skipif(not _interpreter_runs_int8_dots(), reason="needs triton >= 3.9 for the CPU interpreter")
def test_triton_kernels_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.test_convrot_int8_triton"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_checks(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.mark.skipif(not torch.cuda.is_available() or not _triton_importable(), reason="needs a CUDA GPU and triton")
def test_triton_kernels_on_cuda():
    from library.quant.int8_gemm_kernels import clear_gemm_plans, first_configs

    try:
        with first_configs():  # correctness over many small shapes: no autotuning of each (minutes of compiles)
            res = run_checks("cuda")
    finally:
        clear_gemm_plans()
    _assert_checks(res, on_cuda=True)


if __name__ == "__main__":  # python -m tests.test_convrot_int8_triton, from the repository root
    from library.quant.int8_gemm_kernels import first_configs

    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    with first_configs(device == "cuda"):  # no autotuning of each small shape on the GPU
        print(json.dumps(run_checks(device)))
