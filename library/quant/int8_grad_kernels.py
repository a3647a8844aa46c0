"""The upcast grad-input GEMM of the ConvRot INT8 Linear's backward (Triton), `set_backward_kernel("upcast")`:
grad_x = grad_y @ W with the int8 codes upcast inside the GEMM, the weight scale applied to the gradient tile and the
inverse rotation applied to the output tile, so that no dequantised weight is written. It shares the forward GEMMs'
tile order, autotuner and launch plans (`library.quant.int8_gemm_kernels`); `library.quant.convrot_kernels` calls it.
"""

from __future__ import annotations

import torch

from library.quant.convrot_quant_kernels import _INTERPRET, _TRITON_IMPORTED, tl, triton
from library.quant.convrot_quant_kernels import log4 as _log4
from library.quant.int8_gemm_configs import gemm_m_bucket
from library.quant.int8_gemm_kernels import _launch_tuned

if _TRITON_IMPORTED:
    from library.quant.convrot_quant_kernels import _cast_rne, _fwht_rows
    from library.quant.int8_gemm_kernels import _autotuned, _tile_ids

    @triton.jit
    def _grad_input_upcast_kernel(
        g_ptr, w_ptr, sw_ptr, o_ptr, M, N, K, M_BUCKET,
        stride_gm, stride_gk, stride_wk, stride_wn, stride_om, stride_on,
        DTYPE: tl.constexpr, LOG4G: tl.constexpr, EVEN_K: tl.constexpr, GATHER: tl.constexpr,
        INTERPRET: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        """grad_x = rotate(sum_k DTYPE(grad[m, k] * s_w[k]) * q_w[k, n]) without a dequantised weight: the int8
        codes are upcast to DTYPE (exact) inside the GEMM, the weight scale is applied to the gradient tile (rounded
        once to DTYPE), fp32 accumulation, and the blockwise inverse rotation runs on the fp32 accumulator tile in the
        epilogue (BLOCK_N is a multiple of the group). Here K is the weight's output width (the reduction) and N its
        input width; the weight is read in place through its strides."""
        pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # wrap-around rows/columns keep the loads in bounds; wrapped columns form whole groups (N % g == 0), so the
        # rotation never mixes them with real ones, and the store is masked
        offs_gm = offs_m % M
        offs_wn = offs_n % N
        offs_k = tl.arange(0, BLOCK_K)
        g_ptrs = g_ptr + offs_gm[:, None].to(tl.int64) * stride_gm + offs_k[None, :] * stride_gk
        w_ptrs = w_ptr + offs_k[:, None].to(tl.int64) * stride_wk + offs_wn[None, :] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(tl.cdiv(K, BLOCK_K)):
            k_idx = kk * BLOCK_K + offs_k
            if EVEN_K:
                a = tl.load(g_ptrs)
                b = tl.load(w_ptrs)
                sw = tl.load(sw_ptr + k_idx)
            else:
                k_ok = k_idx < K
                a = tl.load(g_ptrs, mask=k_ok[None, :], other=0.0)
                b = tl.load(w_ptrs, mask=k_ok[:, None], other=0)
                sw = tl.load(sw_ptr + k_idx, mask=k_ok, other=0.0)
            a = _cast_rne(a.to(tl.float32) * sw[None, :], DTYPE)
            if INTERPRET:  # the interpreter multiplies bf16 bit patterns: the same product in fp32 (exact inputs)
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee", out_dtype=tl.float32)
            else:
                acc = tl.dot(a, b.to(DTYPE), acc, out_dtype=tl.float32)
            g_ptrs += BLOCK_K * stride_gk
            w_ptrs += BLOCK_K * stride_wk
        if LOG4G > 0:
            acc = _fwht_rows(acc, BLOCK_M, BLOCK_N, LOG4G, GATHER)
        o_ptrs = o_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
        tl.store(o_ptrs, _cast_rne(acc, o_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))

    # (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps): BLOCK_N = 256 holds whole 256-groups for the epilogue rotation
    _UPCAST_CONFIGS = [
        (128, 256, 64, 3, 8),
        (128, 256, 32, 4, 8),
        (64, 256, 64, 3, 4),
        (64, 256, 128, 3, 8),
        (128, 256, 128, 2, 8),
        (256, 256, 32, 3, 8),
    ]
    # no disk cache: Triton 3.6 cannot write the DTYPE constexpr (a Triton dtype) into its JSON cache key (a
    # TypeError on the H200, 2026-12-01)
    _grad_input_upcast_tuned = _autotuned(_grad_input_upcast_kernel, _UPCAST_CONFIGS,
                                          ["M_BUCKET", "N", "K", "DTYPE", "LOG4G"])


def _grad_input_upcast_triton(
    g2: torch.Tensor, weight: torch.Tensor, s_w: torch.Tensor, group_size: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """grad_x [M, K_w] = g2 [M, N_w] @ W for W = rotate(s_w * q_w), by `_grad_input_upcast_kernel`."""
    m, n_red = g2.shape
    k_out = weight.shape[1]
    out = torch.empty((m, k_out), dtype=out_dtype, device=g2.device)
    if m == 0:
        return out
    flags = {"DTYPE": tl.bfloat16 if g2.dtype == torch.bfloat16 else tl.float16,
             "LOG4G": _log4(group_size) if group_size else 0, "GATHER": _INTERPRET, "INTERPRET": _INTERPRET}
    args = (g2, weight, s_w, out, m, k_out, n_red, gemm_m_bucket(m), g2.stride(0), g2.stride(1),
            weight.stride(0), weight.stride(1), out.stride(0), out.stride(1))
    if _INTERPRET:
        bm, bn, bk = 16, max(32, group_size), 32
        _grad_input_upcast_kernel[(triton.cdiv(m, bm) * triton.cdiv(k_out, bn),)](
            *args, **flags, EVEN_K=n_red % bk == 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=4)
        return out
    flags["EVEN_K"] = n_red % 128 == 0
    key = ("upcast", m, k_out, n_red, g2.dtype, out_dtype, group_size, g2.get_device())
    _launch_tuned(_grad_input_upcast_tuned, _grad_input_upcast_kernel, key, m, k_out, args, flags, None)
    return out
