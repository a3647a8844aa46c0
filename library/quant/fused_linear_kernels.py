"""The ConvRot INT8 Linear's forward of a few rows in one Triton kernel: rotation, quantisation, int8 GEMM and
epilogue in one launch (`fused_linear_triton`), the same output as the quantiser + GEMM pair of
`library.quant.convrot_quant_kernels` and `library.quant.int8_gemm_kernels`. Off unless `set_fused_linear` allows it;
`library.quant.convrot_kernels.linear_forward` then takes it for inputs it accepts. Timed on the H200
(docs/benchmarks.md, fifth run): 50.9 us against the pair's 94.0 us at 64 x 3072 -> 3072, but 15x slower at 4,352 rows
and 6.6-15x bf16's time on the text encoder's shapes (every N tile quantises its rows again), so it stays off.
"""

from __future__ import annotations

import torch

from library.quant import convrot_quant_kernels as _qk
from library.quant.convrot_quant_kernels import _INTERPRET, _TRITON_IMPORTED, tl, triton
from library.quant.triton_launch import DirectLauncher, invalidate_plans

if _TRITON_IMPORTED:

    @triton.jit
    def _fused_quant_gemm_kernel(
        x_ptr, w_ptr, c_ptr, sb_ptr, bias_ptr, h_ptr, M, N, K, stride_xm, stride_wn, stride_cm,
        T_CODE: tl.constexpr, TINY: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, GATHER: tl.constexpr,
    ):
        """The whole ConvRot INT8 Linear forward in one kernel, for few rows (256-groups of bf16/fp16 rows, K a
        multiple of 256, W [N, K] K-major): each program rotates and quantises its BLOCK_M rows itself, as the
        "tiles_mma" quantiser does (pass 1 the absmax of each rotated row, pass 2 the codes), and feeds the codes of
        each 64-column block straight to the int8 tensor-core product with W's matching [64, BLOCK_N] tile. Every
        column tile redoes its rows' rotation (reads that hit L2), which pays only where the rows are few and a
        second launch costs more than that (short captions, the text refiner). The codes, the int32 sums and the
        epilogue are those of the two-kernel path, so the output is identical to it."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        rows64 = rows.to(tl.int64)
        d = tl.arange(0, 64)
        h = tl.load(h_ptr + d[:, None] * 64 + d[None, :])
        s, s_t = _qk._rotated_row_scales(x_ptr, rows64, row_ok, K, stride_xm, h, T_CODE, TINY, BLOCK_M, GATHER)
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N  # wrapped: the loads stay in bounds, the store masks
        w_base = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + d[:, None]  # W^T's [64, BLOCK_N] tile at k = 0
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for k0 in range(0, K, 256):
            y0, y1, y2, y3 = _qk._rotate256_tile(x_ptr, rows64, row_ok, k0, stride_xm, h, BLOCK_M, GATHER)
            acc = tl.dot(_qk._quantize_block(_qk._round_to_dtype(y0, T_CODE), s_t, T_CODE), tl.load(w_base + k0),
                         acc, out_dtype=tl.int32)
            acc = tl.dot(_qk._quantize_block(_qk._round_to_dtype(y1, T_CODE), s_t, T_CODE),
                         tl.load(w_base + (k0 + 64)), acc, out_dtype=tl.int32)
            acc = tl.dot(_qk._quantize_block(_qk._round_to_dtype(y2, T_CODE), s_t, T_CODE),
                         tl.load(w_base + (k0 + 128)), acc, out_dtype=tl.int32)
            acc = tl.dot(_qk._quantize_block(_qk._round_to_dtype(y3, T_CODE), s_t, T_CODE),
                         tl.load(w_base + (k0 + 192)), acc, out_dtype=tl.int32)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        sb = tl.load(sb_ptr + offs_n, mask=offs_n < N, other=0.0)
        out = _qk._cast_rne(acc.to(tl.float32) * (s[:, None] * sb[None, :]), c_ptr.dtype.element_ty)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
            out = _qk._cast_rne(out.to(tl.float32) + bias[None, :], c_ptr.dtype.element_ty)
        c_ptrs = c_ptr + rows64[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, out, mask=row_ok[:, None] & (offs_n[None, :] < N))


# the fused one-kernel forward (`fused_linear_triton`): used for M up to "max_m" rows (0: never, the default: it loses
# on every layer of the hot paths, see the module docstring; `set_fused_linear` and the benchmark's overhead part set it)
_FUSED: dict[str, int] = {"max_m": 0, "block_m": 16, "block_n": 64, "warps": 4}
_FUSED_LAUNCHERS: dict[tuple, DirectLauncher] = {}


def set_fused_linear(max_m: int, block_m: int | None = None, block_n: int | None = None,
                     warps: int | None = None) -> None:
    """Let the ConvRot INT8 Linear's forward run as one kernel (`fused_linear_triton`) for inputs of up to `max_m`
    rows (0 turns it off), with its tile shape."""
    for name, value in (("max_m", max_m), ("block_m", block_m), ("block_n", block_n), ("warps", warps)):
        if value is not None:
            _FUSED[name] = int(value)
    invalidate_plans()
    _FUSED_LAUNCHERS.clear()


def fused_linear_ok(x2: torch.Tensor, weight: torch.Tensor, group_size: int) -> bool:
    """Whether `fused_linear_triton` takes this input (the caller has checked the shapes against each other)."""
    m, k = x2.shape
    return (0 < m <= _FUSED["max_m"] and group_size == 256 and k % 256 == 0 and x2.stride(1) == 1
            and x2.dtype in (torch.bfloat16, torch.float16) and weight.stride(1) == 1)


def fused_linear_triton(x2: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        bias: torch.Tensor | None, h64: torch.Tensor) -> torch.Tensor:
    """``int8_linear`` of x2 [M, K] (bf16/fp16, 256-groups; `fused_linear_ok`) in one launch: rotation, quantisation,
    int8 GEMM and epilogue by `_fused_quant_gemm_kernel`; the same output as the two kernels."""
    m, k = x2.shape
    n = weight.shape[0]
    c = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    bm, bn = max(16, _FUSED["block_m"]), max(16, _FUSED["block_n"])
    has_bias = bias is not None
    key = (x2.dtype, has_bias)
    launcher = _FUSED_LAUNCHERS.get(key)
    if launcher is None:
        launcher = _FUSED_LAUNCHERS[key] = DirectLauncher(
            _fused_quant_gemm_kernel, {"T_CODE": _qk._T_CODE[x2.dtype], "TINY": _qk._TINY[x2.dtype],
                                       "HAS_BIAS": has_bias, "BLOCK_M": bm, "BLOCK_N": bn, "GATHER": _INTERPRET},
            {"num_warps": _FUSED["warps"]})
    if has_bias and (bias.dtype != x2.dtype or not bias.is_contiguous()):
        bias = bias.to(x2.dtype).contiguous()
    args = (x2, weight, c, weight_scale, bias if has_bias else c, h64, m, n, k, x2.stride(0), weight.stride(0), n)
    # what the specialisation depends on beyond the launcher's constants (c and h64 are aligned): the operands'
    # alignments, M's divisibility, and the widths and strides, which are few per model
    key = (x2.data_ptr() & 15, weight.data_ptr() & 15, weight_scale.data_ptr() & 15,
           bias.data_ptr() & 15 if has_bias else 0, m == 1, m & 15, n, k, x2.stride(0), weight.stride(0))
    launcher(((m + bm - 1) // bm, (n + bn - 1) // bn, 1), args, key)
    return c
