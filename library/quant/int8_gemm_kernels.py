"""The int8 GEMMs of the ConvRot INT8 Linear (Triton): forward variants (pointer / TMA loads, one tile per program or
persistent) with the dequantisation epilogue, their autotuners, launch plans and the pinned per-shape table.

- `_int8_gemm_triton`: ``T_out(fp32(A @ B) * (s_a[m] * s_b[n]))`` then ``+ bias`` in T_out, for int8 A [M, K] and a
  weight read in place through its strides; int32 accumulation (exact, so every variant and configuration gives
  identical outputs). Variants (`GEMM_VARIANTS`): "ptr" (pointer loads pipelined with cp.async), "tma"
  (tensor-descriptor loads, Hopper+), "ptr_persistent" / "tma_persistent" (a grid of at most one program per SM
  looping over the tiles in grouped order, the tile loop flattened so that one tile's epilogue overlaps the next
  tile's loads, optionally the epilogue in two column halves), "tma_persistent_ws" (Triton's warp
  specialisation of that loop) and "tma_split_tail" (persistent, with the tiles of the last partial wave split
  along K over the whole grid: exact int32 partial sums added with atomics, so that e.g. 408 tiles on 132 SMs take
  about 3.1 tile times instead of 4). The persistent ones need a Triton whose ``tl.range`` takes ``flatten`` and
  ``warp_specialize``; `available_gemm_variants` says what this one builds.
- which variant and configuration a shape gets: `set_gemm_kernel` (or the env var ``MOSS_INT8_GEMM``) forces a
  variant; "auto" (default) looks the GPU (its name, then its compute capability) and the shape (N, K, B layout,
  nearest M bucket) up in the pinned table (``int8_gemm_table.json`` next to this module, or the file named by
  ``MOSS_INT8_GEMM_TABLE``; written from ``python -m bench.int8_gemm_sweep``), so that a pinned shape never
  autotunes in a training step; a GPU or shape without an entry gets "ptr", autotuned on its first call.
- the upcast grad-input GEMM of the backward (`set_backward_kernel("upcast")`) lives in
  `library.quant.int8_grad_kernels`; its launches go through `_launch_tuned` here.

The choice, configuration, grid and launch keywords are kept per shape (`_GEMM_PLANS`) after the first call, and
the pointer kernels launch through `library.quant.triton_launch.DirectLauncher`. `launch_gemm_variant` launches one
variant with an explicit configuration (the sweep, tests). `library.quant.convrot_kernels` re-exports the names
used elsewhere.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from library.errors import UserError
from library.quant import convrot_quant_kernels as _qk

# triton is optional: the quantiser module's import of it decides for both (None and False without it)
from library.quant.convrot_quant_kernels import _INTERPRET, _TRITON_IMPORTED, _TUNING, tl, triton
from library.quant.int8_gemm_configs import (  # noqa: F401 - re-exported (benchmarks and tests read them here)
    _M_BUCKET_MAX,
    DEFAULT_GEMM_TABLE,
    GEMM_KERNEL_ENV,
    GEMM_KERNELS,
    GEMM_TABLE_ENV,
    GEMM_VARIANTS,
    GemmConfig,
    GemmVariant,
    gemm_m_bucket,
)
from library.quant.triton_launch import (
    DirectLauncher,
    TmaLauncher,
    _launch_hooks_idle,
    constexpr_tail,
    invalidate_plans,
    raw_launch_enabled,
)

logger = logging.getLogger(__name__)

# how the "bf16" backward runs on CUDA (`set_backward_kernel`)
BACKWARD_KERNELS: tuple[str, ...] = ("dequant", "upcast")

if _TRITON_IMPORTED:
    _cast_rne = _qk._cast_rne  # the jit helper the GEMM kernels call

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
    def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
        """(row tile, column tile) of output tile `tile_id` in the grouped ordering (GROUP_M row tiles share their
        B columns in L2)."""
        num_pid_in_group = GROUP_M * num_pid_n
        group_id = tile_id // num_pid_in_group
        first_pid_m = group_id * GROUP_M
        group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
        pid_m = first_pid_m + ((tile_id % num_pid_in_group) % group_size_m)
        pid_n = (tile_id % num_pid_in_group) // group_size_m
        return pid_m, pid_n

    @triton.jit
    def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """The output tile of this program (one tile per program)."""
        return _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    @triton.jit
    def _gemm_epilogue_tile(acc, c_ptr, sa_ptr, sb_ptr, bias_ptr, off_m, off_n, M, N, stride_cm, stride_cn,
                            HAS_SB: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, EPI_SUBTILE: tl.constexpr):
        """`_gemm_epilogue` of the tile at (off_m, off_n); EPI_SUBTILE: as two [BLOCK_M, BLOCK_N / 2] halves (fewer
        live fp32 registers; element-wise, so the same values)."""
        offs_m = off_m + tl.arange(0, BLOCK_M)
        if EPI_SUBTILE:
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            acc0, acc1 = tl.split(halves)
            offs_n = off_n + tl.arange(0, BLOCK_N // 2)
            _gemm_epilogue(acc0, c_ptr, sa_ptr, sb_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn,
                           HAS_SB, HAS_BIAS)
            _gemm_epilogue(acc1, c_ptr, sa_ptr, sb_ptr, bias_ptr, offs_m, offs_n + BLOCK_N // 2, M, N, stride_cm,
                           stride_cn, HAS_SB, HAS_BIAS)
        else:
            offs_n = off_n + tl.arange(0, BLOCK_N)
            _gemm_epilogue(acc, c_ptr, sa_ptr, sb_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn,
                           HAS_SB, HAS_BIAS)

    @triton.jit
    def _tma_tile_acc(a_desc, b_desc, off_m, off_n, k_lo, k_hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
        """int32 sum over the K tiles [k_lo, k_hi) of the output tile at (off_m, off_n), by TMA loads of A [M, K] and
        W [N, K] (K-major, out-of-range tiles zero-filled)."""
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for kk in range(k_lo, k_hi):
            a = a_desc.load([off_m, kk * BLOCK_K])
            b = b_desc.load([off_n, kk * BLOCK_K])
            acc = tl.dot(a, b.T, acc, out_dtype=tl.int32)
        return acc

    @triton.jit
    def _ptr_tile_acc(a_ptr, b_ptr, pid_m, pid_n, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                      EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """int32 sum over K of the output tile (pid_m, pid_n), by pointer loads of A [M, K] and B [K, N] (any
        strides); rows and columns past M and N wrap around so that the loads stay in bounds (the store is
        masked)."""
        offs_am = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
        offs_bn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
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
        return acc

    @triton.jit
    def _int8_gemm_tma_kernel(
        a_desc, b_desc, c_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K, M_BUCKET, stride_cm, stride_cn,
        HAS_SB: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        """The forward GEMM with tensor-memory-accelerator loads (Hopper+): A [M, K] and W [N, K], both K-major,
        out-of-range tiles zero-filled by the copy engine."""
        pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = _tma_tile_acc(a_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, 0, tl.cdiv(K, BLOCK_K), BLOCK_M,
                            BLOCK_N, BLOCK_K)
        _gemm_epilogue_tile(acc, c_ptr, sa_ptr, sb_ptr, bias_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, stride_cm,
                            stride_cn, HAS_SB, HAS_BIAS, BLOCK_M, BLOCK_N, False)

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
        acc = _ptr_tile_acc(a_ptr, b_ptr, pid_m, pid_n, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, EVEN_K,
                            BLOCK_M, BLOCK_N, BLOCK_K)
        _gemm_epilogue_tile(acc, c_ptr, sa_ptr, sb_ptr, bias_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, stride_cm,
                            stride_cn, HAS_SB, HAS_BIAS, BLOCK_M, BLOCK_N, False)

    @triton.jit
    def _int8_gemm_persistent_kernel(
        a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K, M_BUCKET,
        stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
        HAS_SB: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        EPI_SUBTILE: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPEC: tl.constexpr,
    ):
        """`_int8_gemm_kernel` as a persistent kernel: a fixed grid of programs (at most one per SM), each looping
        over the output tiles tile_id = program, program + grid, ... in the grouped ordering. FLATTEN lets the
        software pipeliner overlap one tile's epilogue with the next tile's loads."""
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0), flatten=FLATTEN,
                                warp_specialize=WARP_SPEC):
            pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
            acc = _ptr_tile_acc(a_ptr, b_ptr, pid_m, pid_n, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                                EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K)
            _gemm_epilogue_tile(acc, c_ptr, sa_ptr, sb_ptr, bias_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N,
                                stride_cm, stride_cn, HAS_SB, HAS_BIAS, BLOCK_M, BLOCK_N, EPI_SUBTILE)

    @triton.jit
    def _int8_gemm_tma_persistent_kernel(
        a_desc, b_desc, c_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K, M_BUCKET, stride_cm, stride_cn,
        HAS_SB: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        EPI_SUBTILE: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPEC: tl.constexpr,
    ):
        """`_int8_gemm_tma_kernel` as a persistent kernel (see `_int8_gemm_persistent_kernel`); WARP_SPEC asks
        Triton to split the loop into producer (TMA) and consumer (MMA) warps where it supports that."""
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0), flatten=FLATTEN,
                                warp_specialize=WARP_SPEC):
            pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
            acc = _tma_tile_acc(a_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, 0, tl.cdiv(K, BLOCK_K), BLOCK_M,
                                BLOCK_N, BLOCK_K)
            _gemm_epilogue_tile(acc, c_ptr, sa_ptr, sb_ptr, bias_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N,
                                stride_cm, stride_cn, HAS_SB, HAS_BIAS, BLOCK_M, BLOCK_N, EPI_SUBTILE)

    @triton.jit
    def _int8_gemm_tma_split_tail_kernel(
        a_desc, b_desc, c_ptr, sa_ptr, sb_ptr, bias_ptr, ws_ptr, cnt_ptr, M, N, K, M_BUCKET, stride_cm, stride_cn,
        HAS_SB: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        EPI_SUBTILE: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPEC: tl.constexpr,
    ):
        """`_int8_gemm_tma_persistent_kernel` without the last, partial wave: when the tiles leave a remainder of
        `tail` tiles (at most half the grid) after whole waves, those tiles are split along K over all programs
        (grid // tail splits each). Each split adds its int32 partial sums into a workspace tile with atomics
        (integer sums: exact in any order) and bumps the tile's counter; the split that arrives last reads the sums
        back (resetting workspace and counter to zero for the next launch) and runs the epilogue. `ws_ptr` (int32,
        tail x BLOCK_M x BLOCK_N) and `cnt_ptr` (int32, tail) must be zero before the launch; launches sharing them
        must not run concurrently (one stream)."""
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        num_tiles = num_pid_m * num_pid_n
        programs = tl.num_programs(0)
        pid = tl.program_id(0)
        k_tiles = tl.cdiv(K, BLOCK_K)
        tail = num_tiles % programs
        splits = tl.minimum(programs // tl.maximum(tail, 1), k_tiles)
        split_tail = (tail > 0) & (splits >= 2)
        whole = tl.where(split_tail, num_tiles - tail, num_tiles)
        for tile_id in tl.range(pid, whole, programs, flatten=FLATTEN, warp_specialize=WARP_SPEC):
            pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
            acc = _tma_tile_acc(a_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, 0, k_tiles, BLOCK_M, BLOCK_N,
                                BLOCK_K)
            _gemm_epilogue_tile(acc, c_ptr, sa_ptr, sb_ptr, bias_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N,
                                stride_cm, stride_cn, HAS_SB, HAS_BIAS, BLOCK_M, BLOCK_N, EPI_SUBTILE)
        if split_tail & (pid < tail * splits):
            t = pid // splits
            j = pid % splits
            pid_m, pid_n = _tile_coords(whole + t, num_pid_m, num_pid_n, GROUP_M)
            acc = _tma_tile_acc(a_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, j * k_tiles // splits,
                                (j + 1) * k_tiles // splits, BLOCK_M, BLOCK_N, BLOCK_K)
            offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            ws_ptrs = ws_ptr + t.to(tl.int64) * (BLOCK_M * BLOCK_N) + offs
            tl.atomic_add(ws_ptrs, acc, sem="relaxed")
            tl.debug_barrier()  # every thread's partial sums are issued before the counter's release
            arrived = tl.atomic_add(cnt_ptr + t, 1, sem="acq_rel")
            if arrived == splits - 1:  # the last split: all partial sums are in the workspace
                total = tl.atomic_xchg(ws_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32), sem="relaxed")
                tl.atomic_xchg(cnt_ptr + t, 0, sem="relaxed")
                _gemm_epilogue_tile(total, c_ptr, sa_ptr, sb_ptr, bias_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N,
                                    M, N, stride_cm, stride_cn, HAS_SB, HAS_BIAS, BLOCK_M, BLOCK_N, EPI_SUBTILE)

    # the autotuners' choices persist across processes where this Triton can store them (not under the interpreter)
    _AUTOTUNE_CACHE = (
        {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
    )

    def _autotuned(kernel: Any, configs: list[tuple[int, ...]], key: list[str], disk_cache: bool = False,
                   pre_hook: Any = None, extra: dict | None = None) -> Any:
        """`kernel` autotuned over (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps) configurations (GROUP_M 8), with the
        constexprs `extra` fixed."""
        return triton.autotune(
            configs=[triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, **(extra or {})},
                                   num_stages=st, num_warps=wp, pre_hook=pre_hook) for bm, bn, bk, st, wp in configs],
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

    # the persistent kernels need a Triton whose tl.range takes `flatten` and `warp_specialize` (3.4+)
    _PERSISTENT_OK = {"flatten", "warp_specialize"} <= set(inspect.signature(tl.range).parameters)
    # the short in-step tuning list of the persistent kernels (pinned table entries come from a broader sweep)
    _PERSISTENT_CONFIGS = [
        (128, 256, 128, 3, 8),
        (128, 256, 128, 4, 8),
        (256, 128, 128, 3, 8),
        (128, 128, 128, 4, 8),
        (64, 256, 128, 4, 4),
    ]
    _GEMM_KEY = ["M_BUCKET", "N", "K", "HAS_SB", "HAS_BIAS"]
    _RAW_GEMMS = {"ptr": _int8_gemm_kernel, "tma": _int8_gemm_tma_kernel, "ptr_persistent": _int8_gemm_persistent_kernel,
                  "tma_persistent": _int8_gemm_tma_persistent_kernel,
                  "tma_persistent_ws": _int8_gemm_tma_persistent_kernel,
                  "tma_split_tail": _int8_gemm_tma_split_tail_kernel}
    _TUNED_GEMMS = {"ptr": _int8_gemm_tuned, "tma": _int8_gemm_tma_tuned}
    if _PERSISTENT_OK:
        _TUNED_GEMMS["ptr_persistent"] = _autotuned(
            _int8_gemm_persistent_kernel, _PERSISTENT_CONFIGS, _GEMM_KEY,
            extra={"EPI_SUBTILE": False, "FLATTEN": True, "WARP_SPEC": False})
        _TUNED_GEMMS["tma_persistent"] = _autotuned(
            _int8_gemm_tma_persistent_kernel, _PERSISTENT_CONFIGS, _GEMM_KEY, pre_hook=_set_tma_blocks,
            extra={"EPI_SUBTILE": False, "FLATTEN": True, "WARP_SPEC": False})
        _TUNED_GEMMS["tma_split_tail"] = _autotuned(
            _int8_gemm_tma_split_tail_kernel, _PERSISTENT_CONFIGS, _GEMM_KEY, pre_hook=_set_tma_blocks,
            extra={"EPI_SUBTILE": False, "FLATTEN": True, "WARP_SPEC": False})
        _TUNED_GEMMS["tma_persistent_ws"] = _autotuned(
            _int8_gemm_tma_persistent_kernel, _PERSISTENT_CONFIGS, _GEMM_KEY, pre_hook=_set_tma_blocks,
            extra={"EPI_SUBTILE": False, "FLATTEN": False, "WARP_SPEC": True})

else:
    _TensorDescriptor = None
    _PERSISTENT_OK = False



# --------------------------------------------------------------------------------------------------------------------
# Variants, configurations and the pinned per-shape table
# --------------------------------------------------------------------------------------------------------------------
def available_gemm_variants() -> tuple[str, ...]:
    """The variants this Triton can build (TMA needs tensor descriptors, persistent a tl.range with flatten and
    warp_specialize); whether the GPU runs them (Hopper for TMA) is checked per call."""
    if not _TRITON_IMPORTED:
        return ()
    return tuple(v.name for v in GEMM_VARIANTS.values()
                 if (not v.tma or _TensorDescriptor is not None) and (not v.persistent or _PERSISTENT_OK))


# (gpu, N, K, B K-major) -> [(M bucket, variant, config)] sorted by bucket; None until first read
_TABLE: dict[str, Any] = {"rows": None, "path": None}
# (kernel setting, M, N, K, B K-major, device) -> (variant, pinned config or None, its (constexprs, launch options),
# persistent grid size or None): decided on a shape's first call
_CHOICES: dict[tuple, tuple] = {}


def parse_gemm_table(data: dict[str, Any], source: str) -> dict[tuple, list[tuple[int, str, GemmConfig]]]:
    """The table's rows by (gpu, N, K, B K-major); `data` is the JSON document ``{"entries": [{"gpu", "n", "k",
    "m_bucket", "variant", "config", optional "b_kmajor" (default true)}, ...]}``. `gpu` is a device name as
    torch reports it ("NVIDIA H200") or a compute capability ("sm90"). Entries naming a variant this Triton cannot
    build are skipped (those shapes fall back to the autotuner)."""
    rows: dict[tuple, list[tuple[int, str, GemmConfig]]] = {}
    usable = set(available_gemm_variants())
    try:
        for e in data.get("entries", []):
            if e["variant"] not in GEMM_VARIANTS:
                raise ValueError(f"unknown variant {e['variant']!r}")
            if e["variant"] not in usable:
                continue
            key = (str(e["gpu"]), int(e["n"]), int(e["k"]), bool(e.get("b_kmajor", True)))
            rows.setdefault(key, []).append((int(e["m_bucket"]), e["variant"], GemmConfig.from_json(e["config"])))
    except (KeyError, TypeError, ValueError) as err:
        raise UserError(f"the int8 GEMM table {source} has a malformed entry ({err}); fix it or regenerate it with"
                        " python -m bench.int8_gemm_sweep") from err
    for r in rows.values():
        r.sort(key=lambda t: t[0])
    return rows


def set_gemm_table(path: str | Path | None) -> None:
    """Read the pinned per-shape table from `path` (None: the env var ``MOSS_INT8_GEMM_TABLE`` or the shipped
    `DEFAULT_GEMM_TABLE`; "none": no table, every shape autotuned); shapes already launched keep their plans until
    `clear_gemm_plans`."""
    path = Path(path) if path is not None else Path(os.environ.get(GEMM_TABLE_ENV) or DEFAULT_GEMM_TABLE)
    if str(path) == "none":
        _TABLE["rows"], _TABLE["path"] = {}, None
        _CHOICES.clear()
        invalidate_plans()
        return
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise UserError(f"cannot read the int8 GEMM table {path} ({err}); fix the file or unset"
                        f" {GEMM_TABLE_ENV}") from err
    _TABLE["rows"], _TABLE["path"] = parse_gemm_table(data, str(path)), path
    _CHOICES.clear()
    invalidate_plans()


def pinned_gemm(gpu_names: Sequence[str], n: int, k: int, m: int, b_kmajor: bool = True
                ) -> tuple[str, GemmConfig] | None:
    """The table's (variant, config) for a GEMM of M x N x K on a GPU known by `gpu_names` (its name, then its
    capability, e.g. ("NVIDIA H200", "sm90")): the entry of the nearest M bucket (log2 distance; ties to the larger)
    of the first name with entries for (N, K). None where the table has nothing for it."""
    if _TABLE["rows"] is None:
        set_gemm_table(None)
    want = gemm_m_bucket(m).bit_length()
    for gpu in gpu_names:
        rows = _TABLE["rows"].get((gpu, int(n), int(k), bool(b_kmajor)))
        if rows:
            _, variant, config = min(rows, key=lambda r: (abs(r[0].bit_length() - want), -r[0]))
            return variant, config
    return None


def _gpu_names(device: torch.device) -> tuple[str, ...]:
    if device.type != "cuda":
        return ()
    major, minor = torch.cuda.get_device_capability(device)
    return (torch.cuda.get_device_name(device), f"sm{major}{minor}")


def _choose(device: torch.device, m: int, n: int, k: int, b_kmajor: bool) -> tuple[GemmVariant, GemmConfig | None]:
    """The variant and (pinned) configuration of a shape: the forced variant (`set_gemm_kernel`) with the table's
    configuration where the table chose that variant too, else the table's choice ("auto"), else "ptr"; no pinned
    configuration means the variant's autotuner runs on the first call."""
    setting = _TUNING["gemm"]
    pinned = pinned_gemm(_gpu_names(device), n, k, m, b_kmajor)
    if setting == "auto":
        return (GEMM_VARIANTS[pinned[0]], pinned[1]) if pinned else (GEMM_VARIANTS["ptr"], None)
    return GEMM_VARIANTS[setting], (pinned[1] if pinned and pinned[0] == setting else None)


def tma_encodes() -> int:
    """Tensor descriptors encoded so far by the raw TMA launches of the forward GEMMs (each a cache miss)."""
    return sum(t.encodes for plan in _GEMM_PLANS.values() for t in plan[5].values() if t is not None)


def clear_gemm_plans() -> None:
    """Forget the per-shape choices and launch plans (the next call of each shape decides again)."""
    _CHOICES.clear()
    _GEMM_PLANS.clear()
    invalidate_plans()


def set_gemm_kernel(name: str) -> None:
    """Choose the forward int8 GEMM on CUDA: "auto" (default: the pinned table's variant and configuration for this
    GPU and shape, else "ptr" autotuned), or force one of `GEMM_VARIANTS` (autotuned on a shape's first call unless
    the table pinned that variant for it): "ptr" (pointer loads pipelined with cp.async, lowest host cost), "tma"
    (tensor-descriptor loads on Hopper+; launched raw with its descriptors encoded once per operand where Triton is
    3.5-3.6, about the host time of "ptr", else 55-70 us of host time per call against about 15 for "ptr"),
    "ptr_persistent", "tma_persistent", "tma_persistent_ws" and "tma_split_tail" (persistent grids; with Triton's
    warp specialisation; with the last partial wave split along K). TMA variants fall back to their pointer
    counterparts where descriptors cannot be used; the env var ``MOSS_INT8_GEMM`` sets the same."""
    if name not in GEMM_KERNELS:
        raise ValueError(f"unknown ConvRot GEMM kernel {name!r}; choose one of {GEMM_KERNELS}")
    if name != "auto" and name not in available_gemm_variants():
        raise ValueError(f"the ConvRot GEMM kernel {name!r} needs a newer Triton; available here:"
                         f" {available_gemm_variants()}")
    _TUNING["gemm"] = name
    invalidate_plans()
    _CHOICES.clear()


def set_backward_kernel(name: str) -> None:
    """Choose how the "bf16" backward (grad_x = grad_y @ W) runs on CUDA: "dequant" (default; W dequantised into a
    transient bf16 tensor by one kernel, then cuBLAS) or "upcast" (one Triton GEMM that upcasts the int8 codes inside
    the kernel and rotates its output tile: no dequantised weight; bf16/fp16 gradients and groups up to 256)."""
    if name not in BACKWARD_KERNELS:
        raise ValueError(f"unknown ConvRot backward kernel {name!r}; choose one of {BACKWARD_KERNELS}")
    _TUNING["backward"] = name
    invalidate_plans()


@contextlib.contextmanager
def backward_kernel(name: str) -> Iterator[None]:
    """`set_backward_kernel` for a block of code (the benchmark compares both)."""
    saved = _TUNING["backward"]
    set_backward_kernel(name)
    try:
        yield
    finally:
        _TUNING["backward"] = saved
        invalidate_plans()


@contextlib.contextmanager
def first_configs(enabled: bool = True) -> Iterator[None]:
    """Within the block, a shape that the table does not pin takes its autotuner's first configuration instead of
    timing all of them (each a compile of its own): for correctness checks over many small shapes, where the
    timing would cost minutes and decide nothing. Plans made inside stay after the block; `clear_gemm_plans`
    forgets them. ``first_configs(False)`` restores the tuning within a block."""
    saved = _TUNING["first_config"]
    _TUNING["first_config"] = enabled
    try:
        yield
    finally:
        _TUNING["first_config"] = saved


_HOPPER: dict[int, bool] = {}


def _is_hopper_or_newer(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _HOPPER:
        _HOPPER[index] = torch.cuda.get_device_capability(index) >= (9, 0)
    return _HOPPER[index]


def _tma_ok(a: torch.Tensor, b: torch.Tensor, stride_bn: int, stride_bk: int, k: int) -> bool:
    """TMA descriptors need K-major operands with 16-byte aligned bases and row strides (and a Hopper GPU)."""
    return (
        _TensorDescriptor is not None and not _INTERPRET and a.is_cuda and _is_hopper_or_newer(a.device)
        and stride_bk == 1 and a.stride(1) == 1 and k % 16 == 0 and a.stride(0) % 16 == 0 and stride_bn % 16 == 0
        and a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
    )


_NUM_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    """Programs of a persistent grid: the GPU's SM count (4 under the interpreter, so that programs loop)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _NUM_SMS:
        _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _NUM_SMS[index]


# (kernel kind, M, N, K, flags, out dtype, device) -> (plain kernel, grid, launch keywords) once the autotuner chose
_GEMM_PLANS: dict[tuple, tuple] = {}
# the block shape of every variant under the interpreter (small: the interpreter runs each program in Python)
_INTERPRET_CONFIG = GemmConfig(32, 32, 32, group_m=4, num_stages=2, num_warps=4)


def _gemm_args(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, b_strides_nk: Sequence[int],
               sb: torch.Tensor | None, bias: torch.Tensor | None, c: torch.Tensor, n: int) -> tuple:
    """The pointer kernels' runtime arguments (the TMA kernels take descriptors for the first two and no A/B
    strides: `_tma_args`)."""
    m, k = a.shape
    stride_bn, stride_bk = int(b_strides_nk[0]), int(b_strides_nk[1])
    return (a, b, c, sa, sb if sb is not None else sa, bias if bias is not None else sa, m, n, k, gemm_m_bucket(m),
            a.stride(0), a.stride(1), stride_bk, stride_bn, c.stride(0), c.stride(1))


def _tma_args(args: tuple, a: torch.Tensor, b: torch.Tensor, stride_bn: int, n: int,
              workspace: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[tuple, tuple]:
    """The TMA kernels' runtime arguments from the pointer kernels' (`workspace`: the split-tail kernel's)."""
    m, k = a.shape
    descs = (_TensorDescriptor(a, [m, k], [a.stride(0), 1], [1, 16]),
             _TensorDescriptor(b, [n, k], [stride_bn, 1], [1, 16]))
    ws = () if workspace is None else workspace
    return (*descs, *args[2:6], *ws, *args[6:10], args[14], args[15]), descs


# device -> (int32 partial-sum workspace, int32 tile counters) of the split-tail kernel, zero between launches (the
# kernel leaves them zeroed); grown on demand
_WORKSPACES: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}


def _split_tail_workspace(device: torch.device, tiles: int, programs: int, block_m: int, block_n: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The zeroed workspace for a split-tail launch of `tiles` tiles on `programs` programs (the tail is at most
    half the grid, so programs // 2 tiles of partial sums at most)."""
    need = max(1, programs // 2) * block_m * block_n
    ws = _WORKSPACES.get(device)
    if ws is None or ws[0].numel() < need or ws[1].numel() < programs:
        ws = (torch.zeros(need, dtype=torch.int32, device=device), torch.zeros(max(programs, 1), dtype=torch.int32,
                                                                               device=device))
        _WORKSPACES[device] = ws
    return ws


def launch_gemm_variant(
    variant: str, config: GemmConfig, a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor,
    b_strides_nk: Sequence[int], sb: torch.Tensor | None, bias: torch.Tensor | None, out: torch.Tensor,
    programs: int | None = None,
) -> torch.Tensor:
    """One launch of `variant` with `config` through Triton's normal launch path (no tuner, no plan): `out` [M, N]
    = epilogue(a @ B) as in `_int8_gemm_triton`. For benchmarks and tests; `programs` caps a persistent grid
    (default: the SM count). TMA variants need K-major operands (b_strides_nk[1] == 1) with 16-byte aligned rows."""
    v = GEMM_VARIANTS[variant]
    m, k = a.shape
    n = out.shape[1]
    args = _gemm_args(a, sa, b, b_strides_nk, sb, bias, out, n)
    flags: dict[str, Any] = {"HAS_SB": sb is not None, "HAS_BIAS": bias is not None}
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    grid = (min(tiles, programs or _num_sms(a.device)) if v.persistent else tiles,)
    if v.tma:
        if int(b_strides_nk[1]) != 1 or a.stride(1) != 1:
            raise ValueError(f"the {variant} GEMM needs K-major operands")
        ws = (_split_tail_workspace(a.device, tiles, grid[0], config.block_m, config.block_n) if v.split_tail
              else None)
        args, descs = _tma_args(args, a, b, int(b_strides_nk[0]), n, ws)
        descs[0].block_shape = [config.block_m, config.block_k]
        descs[1].block_shape = [config.block_n, config.block_k]
    else:
        flags["EVEN_K"] = k % config.block_k == 0
    _RAW_GEMMS[variant][grid](*args, **flags, **config.meta(v), **config.options())
    return out


def _align(t: torch.Tensor | None) -> int:
    """The address of `t` modulo 16 (0 for a missing operand): Triton specialises a pointer on its 16-byte alignment."""
    return 0 if t is None else t.data_ptr() & 15


def _plan_key(name: str, m: int, n: int, k: int, sb: torch.Tensor | None, bias: torch.Tensor | None,
              out_dtype: torch.dtype, device: int) -> tuple:
    """The key of a variant's launch plan (`_GEMM_PLANS`): the sizes, the optional operands, the output dtype."""
    return (name, m, n, k, sb is not None, bias is not None, out_dtype, device)


def _tma_key(sa: torch.Tensor, sb: torch.Tensor | None, bias: torch.Tensor | None) -> tuple[int, int, int]:
    """A TMA plan's key beyond `_plan_key` (its sizes and dtypes are fixed and c is new): the alignments of the
    scales and the bias."""
    return _align(sa), _align(sb), _align(bias)


def _direct_key(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor | None,
                bias: torch.Tensor | None, stride_am: int, stride_ak: int, stride_bk: int, stride_bn: int,
                stride_cm: int) -> tuple:
    """A pointer plan's direct-launch key beyond `_plan_key` (c is new): the operands' alignments and strides."""
    return (_align(a), _align(b), *_tma_key(sa, sb, bias), stride_am, stride_ak, stride_bk, stride_bn, stride_cm)


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
    if _INTERPRET:
        return _interpreted_gemm(a, sa, b, b_strides_nk, sb, bias, c)
    args = _gemm_args(a, sa, b, b_strides_nk, sb, bias, c, n)
    has_sb, has_bias = sb is not None, bias is not None
    device = a.get_device()
    choice_key = (_TUNING["gemm"], m, n, k, stride_bk == 1, device)
    choice = _CHOICES.get(choice_key)
    if choice is None:
        variant, config = _choose(a.device, m, n, k, stride_bk == 1)
        choice = _CHOICES[choice_key] = (variant, config, None if config is None else (
            config.meta(variant), config.options()), _num_sms(a.device) if variant.persistent else None)
    variant, config, pinned, programs = choice
    if variant.tma and _tma_ok(a, b, stride_bn, stride_bk, k):
        # the split-tail workspace is sized for any configuration's tiles (programs // 2 tiles of 256 x 256)
        ws = _split_tail_workspace(a.device, 0, programs, 256, 256) if variant.split_tail else None
        key = _plan_key(variant.name, m, n, k, sb, bias, out_dtype, device)
        tma_key = _tma_key(sa, sb, bias)
        plan = _GEMM_PLANS.get(key)
        tma = plan[5].get(tma_key) if plan is not None else None
        if tma is not None and raw_launch_enabled() and _launch_hooks_idle():
            try:
                tma(plan[4], ((a, (m, k), (a.stride(0), 1)), (b, (n, k), (stride_bn, 1))),
                    (*args[2:6], *(ws or ()), *args[6:10], args[14], args[15]))
                return c
            except TypeError as e:  # this Triton's C launch wants other arguments: Triton's own launch from now on
                plan[5][tma_key] = None
                invalidate_plans()
                logger.info("raw TMA launches are not usable with this Triton (%s); launching through Triton", e)
        tma_args, descs = _tma_args(args, a, b, stride_bn, n, ws)
        _launch_tuned(_TUNED_GEMMS[variant.name], _RAW_GEMMS[variant.name], key, m, n, tma_args,
                      {"HAS_SB": has_sb, "HAS_BIAS": has_bias}, descs, pinned=pinned, programs=programs,
                      tma_key=tma_key)
        return c
    name = "ptr_persistent" if variant.persistent else "ptr"
    if variant.warp_specialize and pinned is not None:  # the pointer kernel without the warp specialisation
        pinned = (config.meta(GEMM_VARIANTS[name]), pinned[1])
    key = _plan_key(name, m, n, k, sb, bias, out_dtype, device)
    direct_key = _direct_key(a, b, sa, sb, bias, args[10], args[11], stride_bk, stride_bn, args[14])
    block_k = config.block_k if config is not None else 128  # the tuned lists' BLOCK_K divide 128
    _launch_tuned(_TUNED_GEMMS[name], _RAW_GEMMS[name], key, m, n, args,
                  {"HAS_SB": has_sb, "HAS_BIAS": has_bias, "EVEN_K": k % block_k == 0}, None, direct_key,
                  pinned=pinned, programs=programs)
    return c


def _interpreted_gemm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, b_strides_nk: Sequence[int],
                      sb: torch.Tensor | None, bias: torch.Tensor | None, c: torch.Tensor) -> torch.Tensor:
    """Under the interpreter: the chosen variant's pointer form (TMA needs a GPU) with small blocks."""
    persistent = _TUNING["gemm"] != "auto" and GEMM_VARIANTS[_TUNING["gemm"]].persistent
    return launch_gemm_variant("ptr_persistent" if persistent else "ptr", _INTERPRET_CONFIG, a, sa, b, b_strides_nk,
                               sb, bias, c)


def bound_gemm(
    a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor | None, bias: torch.Tensor | None,
    c: torch.Tensor,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor],
              None] | None:
    """``gemm(a, sa, b, sb, bias, c)``: the launch that `_int8_gemm_triton` made for these operands (a [M, K] and c
    [M, N] contiguous, the weight b [N, K] read through its strides, bias already in c's dtype), for later operands
    of the same shapes, dtypes, strides and alignments (b, sb and bias at the same addresses where the GEMM reads
    them through a TMA descriptor); the same kernel, configuration, grid and arguments. None where that call has not
    run yet or no cheaper launch exists. Valid while `library.quant.triton_launch.plan_epoch()` is unchanged."""
    m, k = a.shape
    n = c.shape[1]
    if m == 0 or a.stride() != (k, 1) or c.stride() != (n, 1):
        return None
    b_strides = b.stride()
    if _INTERPRET:
        def gemm_interpreted(a_, sa_, b_, sb_, bias_, c_):
            _interpreted_gemm(a_, sa_, b_, b_strides, sb_, bias_, c_)

        return gemm_interpreted
    stride_bn, stride_bk = b_strides
    device = a.get_device()
    choice = _CHOICES.get((_TUNING["gemm"], m, n, k, stride_bk == 1, device))
    if choice is None:
        return None
    variant, _config, _pinned, programs = choice
    has_sb, has_bias = sb is not None, bias is not None
    bucket = gemm_m_bucket(m)
    if variant.tma and _tma_ok(a, b, stride_bn, stride_bk, k):
        plan = _GEMM_PLANS.get(_plan_key(variant.name, m, n, k, sb, bias, c.dtype, device))
        tma = plan[5].get(_tma_key(sa, sb, bias)) if plan is not None else None
        if tma is None or not raw_launch_enabled():
            return None
        ws = _split_tail_workspace(a.device, 0, programs, 256, 256) if variant.split_tail else ()
        launch_tma = tma.bound_a(plan[4], b, (n, k), (stride_bn, 1), device)

        def gemm_tma(a_, sa_, b_, sb_, bias_, c_):  # b_ is the bound descriptor's tensor
            launch_tma(a_, (m, k), (k, 1), (c_, sa_, sb_ if has_sb else sa_, bias_ if has_bias else sa_, *ws, m, n,
                                            k, bucket, n, 1))

        return gemm_tma
    name = "ptr_persistent" if variant.persistent else "ptr"
    plan = _GEMM_PLANS.get(_plan_key(name, m, n, k, sb, bias, c.dtype, device))
    if plan is None or plan[3] is None:
        return None
    launch = plan[3].bound(plan[4], _direct_key(a, b, sa, sb, bias, k, 1, stride_bk, stride_bn, n), device)
    if launch is None:
        return None

    def gemm_ptr(a_, sa_, b_, sb_, bias_, c_):
        launch((a_, b_, c_, sa_, sb_ if has_sb else sa_, bias_ if has_bias else sa_, m, n, k, bucket, k, 1,
                stride_bk, stride_bn, n, 1))

    return gemm_ptr


def _launch_tuned(
    tuned: Any, raw: Any, key: tuple, m: int, n: int, args: tuple, flags: dict, descs: tuple | None,
    direct_key: tuple | None = None, pinned: tuple[dict, dict] | None = None, programs: int | None = None,
    tma_key: tuple | None = None,
) -> None:
    """Autotune on the first call of a shape (or take the `pinned` (constexprs, launch options) of the table), then
    launch the plain kernel with the chosen config, its grid and keywords kept per shape (the autotuner's per-call
    bookkeeping is a noticeable share of the host time): directly (`DirectLauncher`, with `direct_key` as its
    specialisation key when given) unless TMA descriptors are used; a TMA kernel's first launch of a `tma_key`
    through Triton also yields its `TmaLauncher` (plan[5]), which the caller uses from then on. `programs` caps the
    grid of a persistent kernel."""
    plan = _GEMM_PLANS.get(key)
    if plan is None:
        def grid(meta: dict) -> tuple[int]:
            tiles = triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"])
            return (min(tiles, programs) if programs else tiles,)

        if pinned is None and _TUNING["first_config"]:  # `first_configs`: no timing
            cfg = tuned.configs[0]
            pinned = dict(cfg.kwargs), {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        if pinned is None:
            tuned[grid](*args, **flags)
            cfg = tuned.best_config
            meta = dict(cfg.kwargs)
            options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        else:
            meta, options = pinned
        # the pointer kernels launch directly from now on; the TMA kernel's descriptors change per call
        direct = DirectLauncher(raw, {**flags, **meta}, options) if descs is None else None
        plan = _GEMM_PLANS[key] = (raw[grid(meta)], meta, {**flags, **meta, **options}, direct, (*grid(meta), 1, 1),
                                   {})
        if pinned is None:  # the tuner ran this call already
            return
    launch, meta, keywords, direct, grid3, tma_launchers = plan
    if direct is not None:
        direct(grid3, args, direct_key)
        return
    blocks = ([meta["BLOCK_M"], meta["BLOCK_K"]], [meta["BLOCK_N"], meta["BLOCK_K"]])
    descs[0].block_shape, descs[1].block_shape = blocks
    kernel = launch(*args, **keywords)
    if tma_key is not None and tma_key not in tma_launchers:
        constexprs = {k: v for k, v in keywords.items() if k not in ("num_warps", "num_stages")}
        tma_launchers[tma_key] = (TmaLauncher.of(kernel, constexpr_tail(raw, constexprs), blocks)
                                  if kernel is not None and hasattr(type(kernel), "__getitem__") else None)


if os.environ.get(GEMM_KERNEL_ENV):
    set_gemm_kernel(os.environ[GEMM_KERNEL_ENV])
