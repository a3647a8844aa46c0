"""The int8 GEMMs of the ConvRot INT8 Linear (Triton): the forward GEMM with its dequantisation epilogue and the
"upcast" grad-input GEMM of the bf16 backward, with their configurations, autotuners and launch plans.

- `_int8_gemm_triton`: ``T_out(fp32(A @ B) * (s_a[m] * s_b[n]))`` then ``+ bias`` in T_out, for int8 A [M, K] and a
  weight read in place through its strides; int32 accumulation (exact). Two kernels: "ptr" (pointer loads,
  pipelined with cp.async; default) and "tma" (tensor-descriptor loads on Hopper+), chosen by `set_gemm_kernel`.
- `_grad_input_upcast_triton`: grad_x = grad_y @ W with the int8 codes upcast inside the GEMM and the inverse
  rotation applied to the output tile (`set_backward_kernel("upcast")`).

Each shape is autotuned on its first call; the chosen configuration, grid and launch keywords are then kept per
shape (`_GEMM_PLANS`) and the pointer kernels launch through `library.quant.triton_launch.DirectLauncher`.
`library.quant.convrot_kernels` re-exports the names used elsewhere.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from library.quant import convrot_quant_kernels as _qk
from library.quant.convrot_quant_kernels import _TUNING, _next_pow2
from library.quant.convrot_quant_kernels import log4 as _log4
from library.quant.triton_launch import DirectLauncher

# how the "bf16" backward runs on CUDA (`set_backward_kernel`)
BACKWARD_KERNELS: tuple[str, ...] = ("dequant", "upcast")

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

try:  # triton is optional: without it nothing here is defined beyond the host-side helpers
    import triton
    import triton.language as tl

    _TRITON_IMPORTED = True
except Exception:  # noqa: BLE001 - any import failure (missing package, broken install) means "no triton"
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    _TRITON_IMPORTED = False

if _TRITON_IMPORTED:
    _cast_rne = _qk._cast_rne  # the jit helpers the GEMM kernels call
    _fwht_rows = _qk._fwht_rows

    @triton.jit
    def _gemm_epilogue(acc, c_ptr, sa_ptr, sb_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn,
                       HAS_SB: tl.constexpr, HAS_BIAS: tl.constexpr):
        """c = T_out(fp32(acc) * (sa[m] * sb[n])), then T_out(c + bias[n]) (bias already in T_out); masked store."""
        sa = tl.load(sa_ptr + offs_m, mask=offs_m < M, other=0.0)
        if HAS_SB:
            sb = tl.load(sb_ptr + offs_n, mask=offs_n < N, other=0.0)
            c = acc.to(tl.float32) * (sa[:, None] * sb[None, :])
        else:
            c = acc.to(tl.float32) * sa[:, None]
        out = _cast_rne(c, c_ptr.dtype.element_ty)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
            out = _cast_rne(out.to(tl.float32) + bias[None, :], c_ptr.dtype.element_ty)
        c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, out, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))

    @triton.jit
    def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """Grouped ordering of the output tiles (GROUP_M row tiles share their B columns in L2)."""
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        num_pid_in_group = GROUP_M * num_pid_n
        group_id = pid // num_pid_in_group
        first_pid_m = group_id * GROUP_M
        group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
        pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
        pid_n = (pid % num_pid_in_group) // group_size_m
        return pid_m, pid_n

    @triton.jit
    def _int8_gemm_tma_kernel(
        a_desc, b_desc, c_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K, M_BUCKET, stride_cm, stride_cn,
        HAS_SB: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        """The forward GEMM with tensor-memory-accelerator loads (Hopper+): A [M, K] and W [N, K], both K-major,
        out-of-range tiles zero-filled by the copy engine."""
        pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for kk in range(tl.cdiv(K, BLOCK_K)):
            a = a_desc.load([off_m, kk * BLOCK_K])
            b = b_desc.load([off_n, kk * BLOCK_K])
            acc = tl.dot(a, b.T, acc, out_dtype=tl.int32)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        _gemm_epilogue(
            acc, c_ptr, sa_ptr, sb_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, HAS_SB, HAS_BIAS
        )

    @triton.jit
    def _int8_gemm_kernel(
        a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K, M_BUCKET,
        stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
        HAS_SB: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        """C = epilogue(A @ B) with int8 A [M, K], B [K, N] (any strides), int32 accumulation.

        Epilogue: c = T_out(fp32(acc) * (sa[m] * sb[n])), then T_out(c + bias[n]) (bias already in T_out)."""
        pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_am = offs_m % M  # wrap-around rows/columns: loads stay in bounds, the store is masked
        offs_bn = offs_n % N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + offs_am[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_bn[None, :].to(tl.int64) * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for kk in range(tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_left = K - kk * BLOCK_K
                a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0)
                b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0)
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk

        _gemm_epilogue(
            acc, c_ptr, sa_ptr, sb_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, HAS_SB, HAS_BIAS
        )

    # the autotuners' choices persist across processes where this Triton can store them (not under the interpreter)
    _AUTOTUNE_CACHE = (
        {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
    )

    def _autotuned(kernel: Any, configs: list[tuple[int, ...]], key: list[str], disk_cache: bool = False,
                   pre_hook: Any = None) -> Any:
        """`kernel` autotuned over (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps) configurations (GROUP_M 8)."""
        return triton.autotune(
            configs=[triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_stages=st,
                                   num_warps=wp, pre_hook=pre_hook) for bm, bn, bk, st, wp in configs],
            key=key, **(_AUTOTUNE_CACHE if disk_cache else {}),
        )(kernel)

    # (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps). BLOCK_K = 128 keeps 128-byte int8 rows for the K-major operands.
    _GEMM_CONFIGS = [
        (128, 256, 128, 3, 8),
        (128, 256, 128, 4, 8),
        (256, 128, 128, 3, 8),
        (256, 128, 128, 4, 8),
        (128, 128, 128, 4, 8),
        (128, 256, 64, 4, 8),
        (64, 256, 128, 4, 4),
        (64, 128, 128, 4, 4),
    ]
    _int8_gemm_tuned = _autotuned(_int8_gemm_kernel, _GEMM_CONFIGS, ["M_BUCKET", "N", "K", "HAS_SB", "HAS_BIAS"],
                                  disk_cache=True)

    try:
        from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
    except ImportError:  # older triton: pointer kernel only
        _TensorDescriptor = None

    def _set_tma_blocks(nargs: dict) -> None:
        nargs["a_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
        nargs["b_desc"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]

    # no disk cache: its configurations carry a pre-hook, which Triton does not store
    _int8_gemm_tma_tuned = _autotuned(_int8_gemm_tma_kernel, _GEMM_CONFIGS,
                                      ["M_BUCKET", "N", "K", "HAS_SB", "HAS_BIAS"], pre_hook=_set_tma_blocks)

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



def set_gemm_kernel(name: str) -> None:
    """Choose the forward int8 GEMM on CUDA: "ptr" (default; pointer loads pipelined with cp.async, lowest host cost)
    or "tma" (tensor-descriptor loads on Hopper+: 4-8 % faster on the GPU at M = 4352, about 30 us more host time per
    call; falls back to "ptr" where descriptors cannot be used)."""
    if name not in ("ptr", "tma"):
        raise ValueError(f"unknown ConvRot GEMM kernel {name!r}; choose 'ptr' or 'tma'")
    _TUNING["gemm"] = name



def set_backward_kernel(name: str) -> None:
    """Choose how the "bf16" backward (grad_x = grad_y @ W) runs on CUDA: "dequant" (default; W dequantised into a
    transient bf16 tensor by one kernel, then cuBLAS) or "upcast" (one Triton GEMM that upcasts the int8 codes inside
    the kernel and rotates its output tile: no dequantised weight; bf16/fp16 gradients and groups up to 256)."""
    if name not in BACKWARD_KERNELS:
        raise ValueError(f"unknown ConvRot backward kernel {name!r}; choose one of {BACKWARD_KERNELS}")
    _TUNING["backward"] = name


@contextlib.contextmanager
def backward_kernel(name: str) -> Iterator[None]:
    """`set_backward_kernel` for a block of code (the benchmark compares both)."""
    saved = _TUNING["backward"]
    set_backward_kernel(name)
    try:
        yield
    finally:
        _TUNING["backward"] = saved



def _tma_ok(a: torch.Tensor, b: torch.Tensor, stride_bn: int, stride_bk: int, k: int) -> bool:
    """TMA descriptors need K-major operands with 16-byte aligned bases and row strides (and a Hopper GPU)."""
    return (
        _TensorDescriptor is not None and not _INTERPRET and a.is_cuda
        and torch.cuda.get_device_capability(a.device) >= (9, 0)
        and stride_bk == 1 and a.stride(1) == 1 and k % 16 == 0 and a.stride(0) % 16 == 0 and stride_bn % 16 == 0
        and a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
    )


# (kernel kind, M, N, K, flags, out dtype, device) -> (plain kernel, grid, launch keywords) once the autotuner chose
_GEMM_PLANS: dict[tuple, tuple] = {}


def _int8_gemm_triton(
    a: torch.Tensor,
    sa: torch.Tensor,
    b: torch.Tensor,
    b_strides_nk: Sequence[int],
    sb: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    n: int,
) -> torch.Tensor:
    """epilogue(a @ B) where B[k, n] = b[n * b_strides_nk[0] + k * b_strides_nk[1]] (no copy of b)."""
    m, k = a.shape
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return c
    stride_bn, stride_bk = int(b_strides_nk[0]), int(b_strides_nk[1])
    m_bucket = min(_next_pow2(m), 8192)
    stride_am, stride_ak = a.stride()
    stride_cm, stride_cn = max(n, 1), 1  # c is new and contiguous
    args = (
        a, b, c, sa, sb if sb is not None else sa, bias if bias is not None else sa, m, n, k,
        m_bucket, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    )
    has_sb, has_bias = sb is not None, bias is not None
    if _INTERPRET:
        bm, bn, bk = 32, 32, 32
        grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
        _int8_gemm_kernel[grid](
            *args, HAS_SB=has_sb, HAS_BIAS=has_bias, EVEN_K=k % bk == 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=4,
        )
        return c
    if _TUNING["gemm"] == "tma" and _tma_ok(a, b, stride_bn, stride_bk, k):
        descs = (_TensorDescriptor(a, [m, k], [a.stride(0), 1], [1, 16]),
                 _TensorDescriptor(b, [n, k], [stride_bn, 1], [1, 16]))
        tma_args = (*descs, *args[2:10], c.stride(0), c.stride(1))
        key = ("tma", m, n, k, has_sb, has_bias, out_dtype, a.get_device())
        _launch_tuned(_int8_gemm_tma_tuned, _int8_gemm_tma_kernel, key, m, n, tma_args,
                      {"HAS_SB": has_sb, "HAS_BIAS": has_bias}, descs)
        return c
    key = ("ptr", m, n, k, has_sb, has_bias, out_dtype, a.get_device())
    # the plan fixes the sizes and dtypes and c is new: the operands' alignments and strides decide the rest
    direct_key = (a.data_ptr() & 15, b.data_ptr() & 15, sa.data_ptr() & 15, 0 if sb is None else sb.data_ptr() & 15,
                  0 if bias is None else bias.data_ptr() & 15, stride_am, stride_ak, stride_bk, stride_bn, stride_cm)
    _launch_tuned(_int8_gemm_tuned, _int8_gemm_kernel, key, m, n, args,
                  {"HAS_SB": has_sb, "HAS_BIAS": has_bias, "EVEN_K": k % 128 == 0}, None, direct_key)
    return c


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
    args = (g2, weight, s_w, out, m, k_out, n_red, min(_next_pow2(m), 8192), g2.stride(0), g2.stride(1),
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


def _launch_tuned(
    tuned: Any, raw: Any, key: tuple, m: int, n: int, args: tuple, flags: dict, descs: tuple | None,
    direct_key: tuple | None = None,
) -> None:
    """Autotune on the first call of a shape, then launch the plain kernel with the chosen config, its grid and
    keywords kept per shape (the autotuner's per-call bookkeeping is a noticeable share of the host time): directly
    (`DirectLauncher`, with `direct_key` as its specialisation key when given) unless TMA descriptors are used."""
    plan = _GEMM_PLANS.get(key)
    if plan is None:
        def grid(meta: dict) -> tuple[int]:
            return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

        tuned[grid](*args, **flags)
        cfg = tuned.best_config
        meta = dict(cfg.kwargs)
        options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        # the pointer kernels launch directly from now on; the TMA kernel's descriptors change per call
        direct = DirectLauncher(raw, {**flags, **meta}, options) if descs is None else None
        _GEMM_PLANS[key] = (raw[grid(meta)], meta, {**flags, **meta, **options}, direct, (*grid(meta), 1, 1))
        return
    launch, meta, keywords, direct, grid3 = plan
    if direct is not None:
        direct(grid3, args, direct_key)
        return
    descs[0].block_shape = [meta["BLOCK_M"], meta["BLOCK_K"]]
    descs[1].block_shape = [meta["BLOCK_N"], meta["BLOCK_K"]]
    launch(*args, **keywords)
