"""ConvRot INT8 Triton kernels of the rotation and the row-wise quantisation (the GEMMs are in
`library.quant.convrot_kernels`, which re-exports the entry points used elsewhere).

- `_quantize_rows_triton`: rotate (blockwise regular Hadamard) and quantise the rows of an activation to int8 codes
  + fp32 scales, with comfy-kitchen's eager numerics. Five kernels; `set_quantiser` chooses, `set_row_tuning`
  overrides their launch shapes (benchmark sweeps):
  - "quarters" (default): one pass over whole rows held in registers, as two parts of a power-of-two count of groups
    (K = 3072 is 8 + 4 groups of 256: nothing padded) and each group as its four quarters, so that the top digit of
    the rotation is element-wise and only the digits inside a quarter move data between threads; bf16 codes divide
    by multiplying with the row's reciprocal (`FAST_DIV`, exact: see below). About half the instructions a value of
    "rows" (counted in the sm_90 code);
  - "rows": one pass, each row held as chunks of whole groups padded to a power of two (K = 3072 as 4096), rotated
    by `_fwht_rows` across the row's threads;
  - "stream": rows wider than the one-pass kernels hold, and the column-scaled quantisation of the int8 backward;
    two passes over column tiles;
  - "rows_mma" and "tiles_mma": 256-groups of bf16/fp16 rows rotated on the tensor cores (both measured slower than
    "rows").

  Why `FAST_DIV` gives the codes of the IEEE division for bf16: the code is ``round(bf16(y / s))`` with y and s bf16
  values (8-bit significands). A quotient of two 8-bit significands either terminates, and then it has at most 8
  significant bits (a bf16 value, never a midpoint between two), or it lies at least 2^-17 (relative) from every
  midpoint between bf16 values. ``y * fp32(1 / s)`` is within 2^-23 of the quotient, so it rounds to the same bf16
  value as the correctly rounded quotient does (and as the eager ``bf16 / bf16`` does). fp16 (11-bit significands)
  leaves no such margin, so fp16 and fp32 rows keep the division.
- `_scale_rotate_triton`: rotate(fp32(x) * row scale) per row (dequantisation, the int8 backward's output).
- the shared @triton.jit helpers: `_fwht_rows` (the radix-4 transform), `_round_to_dtype`, `_cast_rne`.

Launches go through `library.quant.triton_launch.DirectLauncher` (the compiled kernel's launcher once a
specialisation is known).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from library.quant.triton_launch import DirectLauncher, invalidate_plans, spec_key

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

try:  # triton is optional: without it nothing here is defined beyond the host-side helpers
    import triton
    import triton.language as tl

    _TRITON_IMPORTED = True
except Exception:  # noqa: BLE001 - any import failure (missing package, broken install) means "no triton"
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    _TRITON_IMPORTED = False


def log4(group_size: int) -> int:
    """log4 of a ConvRot group size (a power of 4)."""
    return (int(group_size).bit_length() - 1) // 2


def _next_pow2(v: int) -> int:
    return 1 << max(0, (int(v) - 1).bit_length())


if _TRITON_IMPORTED:

    @triton.jit
    def _fwht_rows(x, BM: tl.constexpr, KP: tl.constexpr, LOG4G: tl.constexpr, GATHER: tl.constexpr):
        """Blockwise regular-Hadamard transform of each row of x [BM, KP] (fp32): LOG4G radix-4 stages, one per
        base-4 digit of the index inside a block of 4**LOG4G elements (H_g is the Kronecker power of H4 / 2).

        With H4[a, b] = -1 exactly where a + b == 3, a stage is out[a] = 0.5 * sum_b x[b] - x[3 - a]: a sum and a
        flip along the digit axis. Both are reductions that stay in registers or warp shuffles (the row layout puts
        a 256-block inside one warp), so no shared memory or barrier is needed. GATHER does the (exact) flip with
        tl.gather instead: identical values, used under the interpreter where tl.flip is very slow."""
        for s in tl.static_range(LOG4G):
            y = tl.reshape(x, (BM, KP // (4 << (2 * s)), 4, 1 << (2 * s)))
            if GATHER:
                d = tl.arange(0, 4)
                flipped = tl.gather(y, tl.broadcast_to((3 - d)[None, None, :, None], y.shape), 2)
            else:
                flipped = tl.flip(y, 2)
            y = 0.5 * tl.sum(y, axis=2, keep_dims=True) - flipped
            x = tl.reshape(y, (BM, KP))
        return x

    @triton.jit
    def _round_to_dtype(x, T_CODE: tl.constexpr):
        """Round fp32 values to the activation dtype (0 fp32, 1 fp16, 2 bf16) and back, nearest-even."""
        if T_CODE == 1:
            x = x.to(tl.float16).to(tl.float32)
        elif T_CODE == 2:
            # explicit bit-level round-to-nearest-even to bf16 (finite inputs), identical on GPU and interpreter
            u = x.to(tl.uint32, bitcast=True)
            u = (u + (((u >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
            x = u.to(tl.float32, bitcast=True)
        return x

    @triton.jit
    def _cast_rne(x, DTYPE: tl.constexpr):
        """fp32 -> DTYPE with round-to-nearest-even (bf16 rounded bit-exactly first: the interpreter truncates)."""
        if DTYPE == tl.bfloat16:
            x = _round_to_dtype(x, 2)
        return x.to(DTYPE)

    @triton.jit
    def _load_rotated_tile(
        x_ptr, cs_ptr, rows64, cols, mask, stride_xm, K,
        HAS_CS: tl.constexpr, LOG4G: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, GATHER: tl.constexpr,
    ):
        """One [BM, BK] tile of the rows, in fp32: (x * column scale), rotated per group (not yet rounded to T)."""
        x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_CS:
            x = x * tl.load(cs_ptr + cols, mask=cols < K, other=0.0)[None, :]
        if LOG4G > 0:
            x = _fwht_rows(x, BM, BK, LOG4G, GATHER)
        return x

    @triton.jit
    def _rot_quant_kernel(
        x_ptr, q_ptr, s_ptr, cs_ptr, M, K, stride_xm, stride_qm,
        T_CODE: tl.constexpr, TINY: tl.constexpr, HAS_CS: tl.constexpr,
        LOG4G: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, GATHER: tl.constexpr,
    ):
        """Rotate and quantise BM rows to int8 with fp32 scales (eager numerics), streaming over K in tiles of BK
        columns (a multiple of the group): pass 1 takes each row's absmax, pass 2 recomputes the tile (its reads
        mostly hit L2) and writes the codes. Nothing wider than one tile lives in registers and K is not padded
        beyond the tile (K = 3072 is 12 tiles of 256)."""
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        row_ok = rows < M
        rows64 = rows.to(tl.int64)
        offs = tl.arange(0, BK)
        amax = tl.zeros((BM,), dtype=tl.float32)
        for k0 in range(0, K, BK):
            cols = k0 + offs
            mask = row_ok[:, None] & (cols[None, :] < K)
            x = _load_rotated_tile(x_ptr, cs_ptr, rows64, cols, mask, stride_xm, K, HAS_CS, LOG4G, BM, BK, GATHER)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        # rounding to T is monotonic and odd, so the absmax of the rounded row is the rounded absmax
        amax = _round_to_dtype(amax, T_CODE)
        s = tl.maximum(tl.math.div_rn(amax, tl.full((BM,), 127.0, tl.float32)), 1e-30)
        tl.store(s_ptr + rows, s, mask=row_ok)
        s_t = _round_to_dtype(s, T_CODE)
        s_t = tl.broadcast_to(tl.where(s_t == 0.0, TINY, s_t)[:, None], (BM, BK))
        for k0 in range(0, K, BK):
            cols = k0 + offs
            mask = row_ok[:, None] & (cols[None, :] < K)
            x = _load_rotated_tile(x_ptr, cs_ptr, rows64, cols, mask, stride_xm, K, HAS_CS, LOG4G, BM, BK, GATHER)
            v = _round_to_dtype(tl.math.div_rn(_round_to_dtype(x, T_CODE), s_t), T_CODE)
            v = (v + 12582912.0) - 12582912.0  # round half to even (|v| <= 2^22)
            v = tl.minimum(tl.maximum(v, -128.0), 127.0)
            tl.store(q_ptr + rows64[:, None] * stride_qm + cols[None, :], v.to(tl.int8), mask=mask)

    @triton.jit
    def _rot_quant_rows_kernel(
        x_ptr, q_ptr, s_ptr, h_ptr, M, K, stride_xm, stride_qm,
        T_CODE: tl.constexpr, TINY: tl.constexpr, LOG4G: tl.constexpr, BM: tl.constexpr, NCH: tl.constexpr,
        CH: tl.constexpr, EVEN: tl.constexpr, MMA: tl.constexpr, GATHER: tl.constexpr,
    ):
        """Rotate and quantise BM whole rows in one pass (eager numerics): each row is held in registers as NCH
        chunks of CH columns (CH a multiple of the group, so a chunk is whole groups and K needs no padding to a
        power of two beyond NCH chunks), loaded once, rotated once, reduced to its absmax and written as int8 codes
        + an fp32 scale. EVEN: K == NCH * CH and M % BM == 0 (no masks).

        MMA (256-groups of bf16/fp16 rows, BM * NCH >= 4): the rotation as H_256 = H_4 (x) H_64 on the tensor cores:
        the three low base-4 digits by one product with H_64 (`h_ptr`, exact in T; the products are exact, the sums
        fp32), the high digit by one radix-4 stage in registers. GATHER also marks the interpreter (fp32 product)."""
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        rows64 = rows.to(tl.int64)
        cols = tl.arange(0, NCH)[:, None] * CH + tl.arange(0, CH)[None, :]
        offs_x = rows64[:, None, None] * stride_xm + cols[None, :, :]
        if EVEN:
            x = tl.load(x_ptr + offs_x)
        else:
            mask = (rows[:, None, None] < M) & (cols[None, :, :] < K)
            x = tl.load(x_ptr + offs_x, mask=mask, other=0.0)
        if MMA:
            d64 = tl.arange(0, 64)
            h = tl.load(h_ptr + d64[:, None] * 64 + d64[None, :])
            xr = tl.reshape(x, (BM * NCH * 4, 64))
            if GATHER:
                y = tl.dot(xr.to(tl.float32), h.to(tl.float32), input_precision="ieee", out_dtype=tl.float32)
            else:
                y = tl.dot(xr, h, out_dtype=tl.float32)
            y = tl.reshape(y, (BM * NCH, 4, 64))
            if GATHER:
                d = tl.arange(0, 4)
                flipped = tl.gather(y, tl.broadcast_to((3 - d)[None, :, None], y.shape), 1)
            else:
                flipped = tl.flip(y, 1)
            x = tl.reshape(0.5 * tl.sum(y, axis=1, keep_dims=True) - flipped, (BM, NCH, CH))
        else:
            x = x.to(tl.float32)
            if LOG4G > 0:
                x = tl.reshape(_fwht_rows(tl.reshape(x, (BM * NCH, CH)), BM * NCH, CH, LOG4G, GATHER),
                               (BM, NCH, CH))
        x = _round_to_dtype(x, T_CODE)
        amax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)
        s = tl.maximum(tl.math.div_rn(amax, tl.full((BM,), 127.0, tl.float32)), 1e-30)
        s_t = _round_to_dtype(s, T_CODE)
        s_t = tl.broadcast_to(tl.where(s_t == 0.0, TINY, s_t)[:, None, None], (BM, NCH, CH))
        v = _round_to_dtype(tl.math.div_rn(x, s_t), T_CODE)
        v = (v + 12582912.0) - 12582912.0  # round half to even (|v| <= 2^22)
        v = tl.minimum(tl.maximum(v, -128.0), 127.0).to(tl.int8)
        offs_q = rows64[:, None, None] * stride_qm + cols[None, :, :]
        if EVEN:
            tl.store(s_ptr + rows, s)
            tl.store(q_ptr + offs_q, v)
        else:
            tl.store(s_ptr + rows, s, mask=rows < M)
            tl.store(q_ptr + offs_q, v, mask=mask)

    @triton.jit
    def _round_fast(x, T_CODE: tl.constexpr, GATHER: tl.constexpr):
        """`_round_to_dtype` by the hardware conversion (round to nearest even) on the GPU; the interpreter, whose
        bf16 conversion truncates, keeps the bit-level rounding. The same values either way."""
        if GATHER or T_CODE == 0:
            x = _round_to_dtype(x, T_CODE)
        elif T_CODE == 1:
            x = x.to(tl.float16).to(tl.float32)
        else:
            x = x.to(tl.bfloat16).to(tl.float32)
        return x

    @triton.jit
    def _quarters_load(x_ptr, rows64, row_ok, col0, stride_xm, K,
                       BM: tl.constexpr, NCH: tl.constexpr, G: tl.constexpr, EVEN: tl.constexpr):
        """NCH groups of G columns from column col0 of BM rows, as four fp32 tensors [BM, NCH, G / 4]: the four
        quarters of each group (the top base-4 digit of the index inside the group)."""
        qw: tl.constexpr = G // 4
        cols = col0 + tl.arange(0, NCH)[:, None] * G + tl.arange(0, qw)[None, :]
        base = x_ptr + rows64[:, None, None] * stride_xm + cols[None, :, :]
        if EVEN:
            z0 = tl.load(base).to(tl.float32)
            z1 = tl.load(base + qw).to(tl.float32)
            z2 = tl.load(base + 2 * qw).to(tl.float32)
            z3 = tl.load(base + 3 * qw).to(tl.float32)
        else:
            mask = row_ok[:, None, None] & (cols[None, :, :] < K)
            z0 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
            z1 = tl.load(base + qw, mask=mask, other=0.0).to(tl.float32)
            z2 = tl.load(base + 2 * qw, mask=mask, other=0.0).to(tl.float32)
            z3 = tl.load(base + 3 * qw, mask=mask, other=0.0).to(tl.float32)
        return z0, z1, z2, z3

    @triton.jit
    def _quarters_rotate(z0, z1, z2, z3, T_CODE: tl.constexpr, LOG4G: tl.constexpr, BM: tl.constexpr,
                         NCH: tl.constexpr, G: tl.constexpr, GATHER: tl.constexpr):
        """Rotate groups held as four quarter tensors: the low LOG4G - 1 digits inside each quarter
        (`_fwht_rows`), then the top digit across the quarters, element-wise (out_j = 0.5 * sum_i z_i - z_(3-j),
        the sum in the order of the radix-4 stage); rounded to T. Returns the four rotated quarters and their
        per-row absmax."""
        qw: tl.constexpr = G // 4
        if LOG4G > 1:
            z0 = tl.reshape(_fwht_rows(tl.reshape(z0, (BM * NCH, qw)), BM * NCH, qw, LOG4G - 1, GATHER),
                            (BM, NCH, qw))
            z1 = tl.reshape(_fwht_rows(tl.reshape(z1, (BM * NCH, qw)), BM * NCH, qw, LOG4G - 1, GATHER),
                            (BM, NCH, qw))
            z2 = tl.reshape(_fwht_rows(tl.reshape(z2, (BM * NCH, qw)), BM * NCH, qw, LOG4G - 1, GATHER),
                            (BM, NCH, qw))
            z3 = tl.reshape(_fwht_rows(tl.reshape(z3, (BM * NCH, qw)), BM * NCH, qw, LOG4G - 1, GATHER),
                            (BM, NCH, qw))
        half = 0.5 * (((z0 + z1) + z2) + z3)
        y0 = _round_fast(half - z3, T_CODE, GATHER)
        y1 = _round_fast(half - z2, T_CODE, GATHER)
        y2 = _round_fast(half - z1, T_CODE, GATHER)
        y3 = _round_fast(half - z0, T_CODE, GATHER)
        m = tl.maximum(tl.maximum(tl.abs(y0), tl.abs(y1)), tl.maximum(tl.abs(y2), tl.abs(y3)))
        return y0, y1, y2, y3, tl.max(tl.max(m, axis=2), axis=1)

    @triton.jit
    def _quarters_codes(y, r, s_t, T_CODE: tl.constexpr, FAST_DIV: tl.constexpr, GATHER: tl.constexpr):
        """int8 codes of rotated values y (rounded to T) [BM, NCH, G / 4]: T(y / s_t) rounded half to even and
        clamped. FAST_DIV (bf16): y times the row's reciprocal r, which rounds to the same bf16 value as the
        correctly rounded quotient (the module's docstring says why); otherwise the IEEE division."""
        if FAST_DIV:
            v = y * r[:, None, None]
        else:
            v = tl.math.div_rn(y, tl.broadcast_to(s_t[:, None, None], y.shape))
        v = _round_fast(v, T_CODE, GATHER)
        v = (v + 12582912.0) - 12582912.0  # round half to even (|v| <= 2^22)
        return tl.minimum(tl.maximum(v, -128.0), 127.0).to(tl.int8)

    @triton.jit
    def _quarters_store(q_ptr, rows64, row_ok, col0, stride_qm, K, y0, y1, y2, y3, r, s_t,
                        T_CODE: tl.constexpr, NCH: tl.constexpr, G: tl.constexpr, EVEN: tl.constexpr,
                        FAST_DIV: tl.constexpr, GATHER: tl.constexpr):
        qw: tl.constexpr = G // 4
        cols = col0 + tl.arange(0, NCH)[:, None] * G + tl.arange(0, qw)[None, :]
        base = q_ptr + rows64[:, None, None] * stride_qm + cols[None, :, :]
        c0 = _quarters_codes(y0, r, s_t, T_CODE, FAST_DIV, GATHER)
        c1 = _quarters_codes(y1, r, s_t, T_CODE, FAST_DIV, GATHER)
        c2 = _quarters_codes(y2, r, s_t, T_CODE, FAST_DIV, GATHER)
        c3 = _quarters_codes(y3, r, s_t, T_CODE, FAST_DIV, GATHER)
        if EVEN:
            tl.store(base, c0)
            tl.store(base + qw, c1)
            tl.store(base + 2 * qw, c2)
            tl.store(base + 3 * qw, c3)
        else:
            mask = row_ok[:, None, None] & (cols[None, :, :] < K)
            tl.store(base, c0, mask=mask)
            tl.store(base + qw, c1, mask=mask)
            tl.store(base + 2 * qw, c2, mask=mask)
            tl.store(base + 3 * qw, c3, mask=mask)

    @triton.jit
    def _quarters_scales(s_ptr, rows, row_ok, amax, T_CODE: tl.constexpr, TINY: tl.constexpr, BM: tl.constexpr,
                         EVEN: tl.constexpr, GATHER: tl.constexpr):
        """Each row's scale from the absmax of its rotated values (stored, fp32: absmax / 127), and what its codes
        divide by: (the reciprocal r, the scale in T s_t) for `_quarters_store`."""
        s = tl.maximum(tl.math.div_rn(amax, tl.full((BM,), 127.0, tl.float32)), 1e-30)
        s_t = _round_fast(s, T_CODE, GATHER)
        s_t = tl.where(s_t == 0.0, TINY, s_t)
        if EVEN:
            tl.store(s_ptr + rows, s)
        else:
            tl.store(s_ptr + rows, s, mask=row_ok)
        return tl.math.div_rn(tl.full((BM,), 1.0, tl.float32), s_t), s_t

    @triton.jit
    def _rot_quant_quarters_kernel(
        x_ptr, q_ptr, s_ptr, h_ptr, M, K, stride_xm, stride_qm,
        T_CODE: tl.constexpr, TINY: tl.constexpr, LOG4G: tl.constexpr, BM: tl.constexpr, NCH_A: tl.constexpr,
        NCH_B: tl.constexpr, EVEN: tl.constexpr, FAST_DIV: tl.constexpr, GATHER: tl.constexpr,
    ):
        """Rotate and quantise BM whole rows in one pass (eager numerics), the row held in registers as two parts
        of whole groups (NCH_A groups, then NCH_B more; both powers of two or NCH_B = 0, so K = 3072 is 8 + 4 groups
        of 256 and nothing is padded) and each part as the four quarters of its groups, so that the top digit of the
        rotation is element-wise and only the digits inside a quarter move data between threads. EVEN: the parts
        fill K and M % BM == 0 (no masks). h_ptr is unused (the launch signature of the other quantisers)."""
        g: tl.constexpr = 1 << (2 * LOG4G)
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        row_ok = rows < M
        rows64 = rows.to(tl.int64)
        a0, a1, a2, a3 = _quarters_load(x_ptr, rows64, row_ok, 0, stride_xm, K, BM, NCH_A, g, EVEN)
        a0, a1, a2, a3, amax = _quarters_rotate(a0, a1, a2, a3, T_CODE, LOG4G, BM, NCH_A, g, GATHER)
        if NCH_B > 0:
            b0, b1, b2, b3 = _quarters_load(x_ptr, rows64, row_ok, NCH_A * g, stride_xm, K, BM, NCH_B, g, EVEN)
            b0, b1, b2, b3, amax_b = _quarters_rotate(b0, b1, b2, b3, T_CODE, LOG4G, BM, NCH_B, g, GATHER)
            amax = tl.maximum(amax, amax_b)
        r, s_t = _quarters_scales(s_ptr, rows, row_ok, amax, T_CODE, TINY, BM, EVEN, GATHER)
        _quarters_store(q_ptr, rows64, row_ok, 0, stride_qm, K, a0, a1, a2, a3, r, s_t, T_CODE, NCH_A, g, EVEN,
                        FAST_DIV, GATHER)
        if NCH_B > 0:
            _quarters_store(q_ptr, rows64, row_ok, NCH_A * g, stride_qm, K, b0, b1, b2, b3, r, s_t, T_CODE, NCH_B,
                            g, EVEN, FAST_DIV, GATHER)

    @triton.jit
    def _rotate256_tile(x_ptr, rows64, row_ok, k0, stride_xm, h, BM: tl.constexpr, GATHER: tl.constexpr):
        """One 256-group of BM rows, rotated (H_256 = H_4 (x) H_64), in fp32, as its four 64-column blocks: each
        block times H_64 on the tensor cores (products exact, fp32 sums), then the radix-4 stage of the high
        digit across the four blocks in registers (out_j = 0.5 * sum_i z_i - z_(3-j)): no reshape, no shuffle."""
        d = tl.arange(0, 64)
        base = x_ptr + rows64[:, None] * stride_xm + (k0 + d)[None, :]
        mask = row_ok[:, None]
        if GATHER:  # the interpreter: fp32 products, IEEE
            z0 = tl.dot(tl.load(base, mask=mask, other=0.0).to(tl.float32), h.to(tl.float32), input_precision="ieee")
            z1 = tl.dot(tl.load(base + 64, mask=mask, other=0.0).to(tl.float32), h.to(tl.float32),
                        input_precision="ieee")
            z2 = tl.dot(tl.load(base + 128, mask=mask, other=0.0).to(tl.float32), h.to(tl.float32),
                        input_precision="ieee")
            z3 = tl.dot(tl.load(base + 192, mask=mask, other=0.0).to(tl.float32), h.to(tl.float32),
                        input_precision="ieee")
        else:
            z0 = tl.dot(tl.load(base, mask=mask, other=0.0), h, out_dtype=tl.float32)
            z1 = tl.dot(tl.load(base + 64, mask=mask, other=0.0), h, out_dtype=tl.float32)
            z2 = tl.dot(tl.load(base + 128, mask=mask, other=0.0), h, out_dtype=tl.float32)
            z3 = tl.dot(tl.load(base + 192, mask=mask, other=0.0), h, out_dtype=tl.float32)
        half = 0.5 * (((z0 + z1) + z2) + z3)
        return half - z3, half - z2, half - z1, half - z0

    @triton.jit
    def _quantize_block(y, s_t, T_CODE: tl.constexpr):
        """int8 codes of rotated values y (rounded to T) with the per-row scale s_t (in T): the eager numerics."""
        v = _round_to_dtype(tl.math.div_rn(y, s_t), T_CODE)
        v = (v + 12582912.0) - 12582912.0  # round half to even (|v| <= 2^22)
        return tl.minimum(tl.maximum(v, -128.0), 127.0).to(tl.int8)

    @triton.jit
    def _rotated_row_scales(x_ptr, rows64, row_ok, K, stride_xm, h, T_CODE: tl.constexpr, TINY: tl.constexpr,
                            BM: tl.constexpr, GATHER: tl.constexpr):
        """The first pass of the tensor-core quantisers over 256-groups: each row's scale (fp32, as stored: the
        rounded absmax of the rotated row / 127) and the divisor of its codes (the scale in T, broadcast to one
        64-column block)."""
        amax = tl.zeros((BM,), dtype=tl.float32)
        for k0 in range(0, K, 256):
            y0, y1, y2, y3 = _rotate256_tile(x_ptr, rows64, row_ok, k0, stride_xm, h, BM, GATHER)
            m01 = tl.maximum(tl.max(tl.abs(_round_to_dtype(y0, T_CODE)), axis=1),
                             tl.max(tl.abs(_round_to_dtype(y1, T_CODE)), axis=1))
            m23 = tl.maximum(tl.max(tl.abs(_round_to_dtype(y2, T_CODE)), axis=1),
                             tl.max(tl.abs(_round_to_dtype(y3, T_CODE)), axis=1))
            amax = tl.maximum(amax, tl.maximum(m01, m23))
        s = tl.maximum(tl.math.div_rn(amax, tl.full((BM,), 127.0, tl.float32)), 1e-30)
        s_t = _round_to_dtype(s, T_CODE)
        return s, tl.broadcast_to(tl.where(s_t == 0.0, TINY, s_t)[:, None], (BM, 64))

    @triton.jit
    def _rot_quant_tiles_mma_kernel(
        x_ptr, q_ptr, s_ptr, h_ptr, M, K, stride_xm, stride_qm,
        T_CODE: tl.constexpr, TINY: tl.constexpr, BM: tl.constexpr, GATHER: tl.constexpr,
    ):
        """Rotate (256-groups) and quantise BM rows of bf16/fp16 activations in two passes over the groups: the
        first takes each row's absmax, the second rotates again (its reads hit L2) and writes the codes. The
        rotation is `_rotate256_tile` on the tensor cores, so neither pass is bound by the transform's arithmetic;
        K is a multiple of 256 (no column masks, no padding)."""
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        row_ok = rows < M
        rows64 = rows.to(tl.int64)
        d = tl.arange(0, 64)
        h = tl.load(h_ptr + d[:, None] * 64 + d[None, :])
        s, s_t = _rotated_row_scales(x_ptr, rows64, row_ok, K, stride_xm, h, T_CODE, TINY, BM, GATHER)
        tl.store(s_ptr + rows, s, mask=row_ok)
        q_base = q_ptr + rows64[:, None] * stride_qm + d[None, :]
        mask = row_ok[:, None]
        for k0 in range(0, K, 256):
            y0, y1, y2, y3 = _rotate256_tile(x_ptr, rows64, row_ok, k0, stride_xm, h, BM, GATHER)
            tl.store(q_base + k0, _quantize_block(_round_to_dtype(y0, T_CODE), s_t, T_CODE), mask=mask)
            tl.store(q_base + k0 + 64, _quantize_block(_round_to_dtype(y1, T_CODE), s_t, T_CODE), mask=mask)
            tl.store(q_base + k0 + 128, _quantize_block(_round_to_dtype(y2, T_CODE), s_t, T_CODE), mask=mask)
            tl.store(q_base + k0 + 192, _quantize_block(_round_to_dtype(y3, T_CODE), s_t, T_CODE), mask=mask)

    @triton.jit
    def _scale_rotate_kernel(
        x_ptr, y_ptr, rs_ptr, M, K, stride_xm, stride_ym,
        HAS_RS: tl.constexpr, LOG4G: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, GATHER: tl.constexpr,
    ):
        """y = rotate(fp32(x) * row_scale) for one [BM, BK] tile (BK a multiple of the group), stored in y's dtype
        (dequantisation / int8-backward output)."""
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BK + tl.arange(0, BK)
        row_ok = rows < M
        mask = row_ok[:, None] & (cols[None, :] < K)
        rows64 = rows.to(tl.int64)
        x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0).to(tl.float32)
        if HAS_RS:
            x = x * tl.load(rs_ptr + rows, mask=row_ok, other=0.0)[:, None]
        x = _fwht_rows(x, BM, BK, LOG4G, GATHER)
        tl.store(y_ptr + rows64[:, None] * stride_ym + cols[None, :], _cast_rne(x, y_ptr.dtype.element_ty), mask=mask)


_T_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_TINY = {dt: float(torch.finfo(dt).tiny) for dt in _FLOAT_DTYPES}


# Launch parameters (the benchmark can override them): elements per program and per thread of the row kernels (a
# tile is BM rows x BK columns), the column tile of the streaming kernels, the activation quantiser ("quarters" and
# "rows": one pass over whole rows held in registers, up to "rows_max" elements a row; "rows_elems" elements and
# "rows_ept" elements a thread per program of "rows", about "quarters_ept" elements a thread of "quarters"; "stream":
# two passes over column tiles), and, for `library.quant.convrot_kernels`, the forward GEMM kernel ("auto", or a
# variant of `library.quant.int8_gemm_kernels.GEMM_VARIANTS`) and the backward.
_TUNING: dict = {"row_elems": 4096, "elems_per_thread": 16, "tile_k": 256, "quantiser": "quarters",
                 "rows_max": 16384, "rows_elems": 2048, "rows_ept": 16, "quarters_ept": 64, "tiles_bm": 32,
                 "tiles_warps": 4, "gemm": "auto", "backward": "dequant", "first_config": False}
QUANTISERS: tuple[str, ...] = ("rows", "stream", "rows_mma", "tiles_mma", "quarters")
# (device, dtype) -> H_64 (normalised, exact in bf16/fp16) for the "rows_mma" quantiser
_H64: dict[tuple, torch.Tensor] = {}
# (kernel, K, group size, dtype, has column scale, device) -> launch plan of the rotate + quantise kernel
_QUANT_PLANS: dict[tuple, tuple] = {}


def set_quantiser(name: str) -> None:
    """Choose the activation quantiser kernel: "rows" (one pass, whole rows in registers, rows wider than
    ``_TUNING["rows_max"]`` fall back to "stream"), "stream" (two passes over column tiles), "rows_mma" ("rows"
    with the 256-group rotation of bf16/fp16 rows on the tensor cores; other rows as "rows") or "tiles_mma" (two
    passes over 256-groups of bf16/fp16 rows, each group rotated as four 64-column blocks on the tensor cores and
    one radix-4 stage in registers; other rows as "rows") or "quarters" (default; one pass, whole rows as two parts of a
    power-of-two count of groups, each group as four quarter tensors: the top digit of the rotation element-wise,
    no padding; rows without rotation or wider than ``_TUNING["rows_max"]`` as "rows")."""
    if name not in QUANTISERS:
        raise ValueError(f"unknown ConvRot quantiser {name!r}; choose one of {QUANTISERS}")
    _TUNING["quantiser"] = name
    invalidate_plans()

def set_row_tuning(row_elems: int | None = None, elems_per_thread: int | None = None, tile_k: int | None = None,
                   rows_elems: int | None = None, rows_ept: int | None = None, rows_max: int | None = None,
                   tiles_bm: int | None = None, tiles_warps: int | None = None,
                   quarters_ept: int | None = None) -> None:
    """Override the tile shapes of the row kernels (benchmark sweeps): the streaming rotate + quantise and scale +
    rotate kernels (`row_elems`, `elems_per_thread`, `tile_k`), the one-pass quantiser (`rows_*`), the
    "tiles_mma" quantiser (`tiles_bm` rows a program, at least 16; `tiles_warps`) and the "quarters" quantiser
    (`quarters_ept`: about that many elements a thread)."""
    for name, value in (("row_elems", row_elems), ("elems_per_thread", elems_per_thread), ("tile_k", tile_k),
                        ("rows_elems", rows_elems), ("rows_ept", rows_ept), ("rows_max", rows_max),
                        ("tiles_bm", tiles_bm), ("tiles_warps", tiles_warps), ("quarters_ept", quarters_ept)):
        if value is not None:
            _TUNING[name] = int(value)
    _QUANT_PLANS.clear()
    invalidate_plans()


def _pow2_floor(v: int) -> int:
    return 1 << (max(1, int(v)).bit_length() - 1)


def _tile_launch(k: int, group_size: int) -> tuple[int, int, int]:
    """(BM rows, BK columns, warps) of a row-kernel tile: BK a power of two, a multiple of the group (K % g == 0, so
    masked tail columns are whole groups of zeros), no wider than K needs."""
    bk = max(16, group_size, min(_TUNING["tile_k"], _next_pow2(k)))
    bm = _next_pow2(max(1, min(64, _TUNING["row_elems"] // bk)))
    warps = max(1, min(16, bm * bk // (32 * _TUNING["elems_per_thread"])))
    return bm, bk, _pow2_floor(warps)


def _rows_launch(k: int, group_size: int) -> tuple[int, int, int, int] | None:
    """(BM rows, NCH chunks, CH columns a chunk, warps) of the one-pass quantiser, or None for rows too wide for it.
    A chunk is a power of two of whole groups; only the chunk count is rounded up to a power of two (K = 3072 is 12
    chunks of 256 held as 16, the last 4 masked)."""
    ch = max(group_size, min(256, _next_pow2(k)))
    nch = _next_pow2(-(-k // ch))
    width = nch * ch
    if width > _TUNING["rows_max"]:
        return None
    bm = _next_pow2(max(1, min(64, _TUNING["rows_elems"] // width)))
    warps = max(1, min(16, bm * width // (32 * _TUNING["rows_ept"])))
    return bm, nch, ch, _pow2_floor(warps)


def _quarters_launch(k: int, group_size: int) -> tuple[int, int, int, int, bool] | None:
    """(BM rows, NCH_A groups, NCH_B groups, warps, whether the parts fill K) of the "quarters" quantiser, or None
    where it does not apply (no rotation, K not whole groups, rows wider than ``_TUNING["rows_max"]``). The groups
    of a row are split into two power-of-two parts (12 = 8 + 4, 48 = 32 + 16); a count of more than two bits rounds
    its second part up (masked). At least two warps a program: at K = 3072 they moved 1.71 TB/s against one warp's
    1.60 (`python -m bench.convrot_int8 --parts quantiser`, the sweep of ``quarters_ept``)."""
    if group_size < 4 or k % group_size or k > _TUNING["rows_max"]:
        return None
    groups = k // group_size
    nch_a = _pow2_floor(groups)
    rest = groups - nch_a
    nch_b = _next_pow2(rest) if rest else 0
    ept = max(8, _TUNING["quarters_ept"])
    bm = _next_pow2(max(1, -(-32 * ept // k)))
    if bm > 64:
        return None
    warps = max(2, min(16, _pow2_floor(max(1, bm * k // (32 * ept)))))
    return bm, nch_a, nch_b, warps, nch_a + nch_b == groups


def _h64(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """H_64 = H_4 (x) H_4 (x) H_4 / 8 with H_4's -1 where row + column == 3 (the ConvRot regular Hadamard)."""
    h = _H64.get((device, dtype))
    if h is None:
        h4 = torch.ones(4, 4, dtype=torch.float64)
        for a in range(4):
            h4[a, 3 - a] = -1.0
        h = torch.kron(torch.kron(h4, h4), h4) / 8.0
        h = _H64[(device, dtype)] = h.to(device=device, dtype=dtype).contiguous()
    return h


def _quant_plan(k: int, group_size: int, dtype: torch.dtype, has_cs: bool, device: int, kernel: str) -> tuple:
    """(kernel name: "quarters", "rows", "rows_mma", "tiles_mma" or "stream"; rows a program; its DirectLaunchers
    (masked, and for whole tiles); whether K fills the row tile) for a shape."""
    key = (kernel, k, group_size, dtype, has_cs, device)
    plan = _QUANT_PLANS.get(key)
    if plan is not None:
        return plan
    log4g = log4(group_size) if group_size else 0
    if (kernel == "tiles_mma" and group_size == 256 and k % 256 == 0 and not has_cs
            and dtype in (torch.bfloat16, torch.float16)):
        bm = max(16, _next_pow2(_TUNING["tiles_bm"]))
        launcher = DirectLauncher(_rot_quant_tiles_mma_kernel,
                                  {"T_CODE": _T_CODE[dtype], "TINY": _TINY[dtype], "BM": bm, "GATHER": _INTERPRET},
                                  {"num_warps": _TUNING["tiles_warps"]})
        plan = _QUANT_PLANS[key] = ("tiles_mma", bm, (launcher, launcher), False)
        return plan
    quarters = _quarters_launch(k, group_size) if kernel == "quarters" and not has_cs else None
    if quarters is not None:
        bm, nch_a, nch_b, warps, fills = quarters
        const = {"T_CODE": _T_CODE[dtype], "TINY": _TINY[dtype], "LOG4G": log4g, "BM": bm, "NCH_A": nch_a,
                 "NCH_B": nch_b, "FAST_DIV": dtype == torch.bfloat16, "GATHER": _INTERPRET}
        launchers = tuple(DirectLauncher(_rot_quant_quarters_kernel, {**const, "EVEN": even}, {"num_warps": warps})
                          for even in (False, True))
        plan = _QUANT_PLANS[key] = ("quarters", bm, launchers, fills)
        return plan
    rows = (_rows_launch(k, group_size) if kernel in ("rows", "rows_mma", "tiles_mma", "quarters") and not has_cs
            else None)
    if rows is not None:
        bm, nch, ch, warps = rows
        mma = (kernel == "rows_mma" and group_size == 256 and ch == 256 and bm * nch >= 4
               and dtype in (torch.bfloat16, torch.float16))
        const = {"T_CODE": _T_CODE[dtype], "TINY": _TINY[dtype], "LOG4G": log4g, "BM": bm, "NCH": nch, "CH": ch,
                 "MMA": mma, "GATHER": _INTERPRET}
        launchers = tuple(DirectLauncher(_rot_quant_rows_kernel, {**const, "EVEN": even}, {"num_warps": warps})
                          for even in (False, True))
        plan = ("rows_mma" if mma else "rows", bm, launchers, k == nch * ch)
    else:
        bm, bk, warps = _tile_launch(k, group_size)
        const = {"T_CODE": _T_CODE[dtype], "TINY": _TINY[dtype], "HAS_CS": has_cs, "LOG4G": log4g, "BK": bk,
                 "BM": bm, "GATHER": _INTERPRET}
        plan = ("stream", bm, (DirectLauncher(_rot_quant_kernel, const, {"num_warps": warps}),), False)
    _QUANT_PLANS[key] = plan
    return plan


def scales_offset(m: int, k: int) -> int:
    """Where `_codes_and_scales` puts the scales in its buffer: the next 16-byte boundary after m x k codes."""
    return (m * k + 15) & ~15


def _codes_and_scales(m: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes [m, k] and fp32 scales [m] in one allocation: the codes first, the scales after them at the next
    16-byte boundary (one allocator call instead of two)."""
    off = scales_offset(m, k)
    buf = torch.empty((off + 4 * m,), dtype=torch.int8, device=device)
    return buf.as_strided((m, k), (k, 1)), buf[off:].view(torch.float32)


def _quantize_rows_triton(
    x2: torch.Tensor, group_size: int, col_scale: torch.Tensor | None = None, kernel: str | None = None,
    one_buffer: bool = False, out_codes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused rotate (group_size > 0) + per-row int8 quantisation of x2 [M, K]; with col_scale the rows are scaled
    per column first and quantised in fp32. `kernel` overrides `set_quantiser`'s choice (the benchmark compares).
    `one_buffer`: codes and scales share one allocation (`_codes_and_scales`; eager callers only: the registered
    ops return them as two outputs, which must not share storage). `out_codes`: where the codes go (contiguous
    [M, K], 16-byte aligned: rows of a larger buffer, `quantize_segments`), the scales being new."""
    m, k = x2.shape
    stride_xm, stride_xk = x2.stride()
    if stride_xk != 1:
        x2 = x2.contiguous()
        stride_xm = k
    dtype = torch.float32 if col_scale is not None else x2.dtype
    if out_codes is not None:
        if out_codes.shape != (m, k) or not out_codes.is_contiguous() or out_codes.data_ptr() % 16:
            raise ValueError("out_codes must be contiguous int8 [M, K] at a 16-byte boundary")
        q, s = out_codes, torch.empty((m,), dtype=torch.float32, device=x2.device)
    elif one_buffer:
        q, s = _codes_and_scales(m, k, x2.device)
    else:
        q = torch.empty((m, k), dtype=torch.int8, device=x2.device)
        s = torch.empty((m,), dtype=torch.float32, device=x2.device)
    if m == 0:
        return q, s
    name, bm, launchers, even_k = _quant_plan(k, group_size, dtype, col_scale is not None, x2.get_device(),
                                              kernel or _TUNING["quantiser"])
    grid = ((m + bm - 1) // bm, 1, 1)
    if name != "stream":
        # the plan fixes K and the dtypes, q and s are new (aligned): x2's alignment and stride and M's value decide
        key = (x2.data_ptr() & 15, stride_xm, m == 1, m & 15)
        h = _h64(x2.device, dtype) if name in ("rows_mma", "tiles_mma") else s
        launchers[even_k and m % bm == 0](grid, (x2, q, s, h, m, k, stride_xm, k), key)
    else:
        cs = col_scale.to(torch.float32).contiguous() if col_scale is not None else s
        launchers[0](grid, (x2, q, s, cs, m, k, stride_xm, k))
    return q, s


def bound_quantiser(x2: torch.Tensor, group_size: int
                    ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None:
    """``quantise(x2, q, s)``: the launch that `_quantize_rows_triton(x2, group_size)` made for x2's shape, dtype,
    alignment and row stride (same kernel, grid and arguments), for inputs of that same layout and new outputs q
    [M, K] and s [M] (16-byte aligned); None where that call has not run yet, its rows are not contiguous or no
    cheaper launch exists. Valid while `library.quant.triton_launch.plan_epoch()` is unchanged."""
    m, k = x2.shape
    stride_xm, stride_xk = x2.stride()
    plan = _QUANT_PLANS.get((_TUNING["quantiser"], k, group_size, x2.dtype, False, x2.get_device()))
    if plan is None or stride_xk != 1 or m == 0:
        return None
    name, bm, launchers, even_k = plan
    grid = ((m + bm - 1) // bm, 1, 1)
    device = x2.get_device()
    if name == "stream":
        aligned = (torch.int8, True), (torch.float32, True), (torch.float32, True)  # q, s and s again (no cs)
        launch = launchers[0].bound(grid, ((x2.dtype, x2.data_ptr() % 16 == 0), *aligned,
                                           *spec_key((m, k, stride_xm, k))), device)
        if launch is None:
            return None
        return lambda x, q, s: launch((x, q, s, s, m, k, stride_xm, k))
    launch = launchers[even_k and m % bm == 0].bound(grid, (x2.data_ptr() & 15, stride_xm, m == 1, m & 15), device)
    if launch is None:
        return None
    if name in ("rows_mma", "tiles_mma"):
        h = _h64(x2.device, x2.dtype)
        return lambda x, q, s: launch((x, q, s, h, m, k, stride_xm, k))
    return lambda x, q, s: launch((x, q, s, s, m, k, stride_xm, k))


def _scale_rotate_triton(
    x2: torch.Tensor, row_scale: torch.Tensor | None, group_size: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """rotate(fp32(x2) * row_scale) per row -> out_dtype [M, K]."""
    m, k = x2.shape
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    y = torch.empty((m, k), dtype=out_dtype, device=x2.device)
    if m == 0:
        return y
    bm, bk, launcher = _scale_rotate_plan(k, group_size, row_scale is not None)
    rs = row_scale.to(device=x2.device, dtype=torch.float32).contiguous() if row_scale is not None else y
    launcher(((m + bm - 1) // bm, (k + bk - 1) // bk, 1), (x2, y, rs, m, k, x2.stride(0), y.stride(0)))
    return y


def bound_dequantiser(weight: torch.Tensor, row_scale: torch.Tensor, group_size: int, dtype: torch.dtype
                      ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None:
    """``dequantise(weight, y, row_scale)``: the launch that `_scale_rotate_triton(weight, row_scale, group_size,
    dtype)` made for this weight's shape, layout and alignment (fp32 contiguous row scales), into a new y [M, K] of
    `dtype`; None where that call has not run yet. Valid while `library.quant.triton_launch.plan_epoch()` is
    unchanged."""
    m, k = weight.shape
    plan = _QUANT_PLANS.get(("scale_rotate", k, group_size, True))
    if (plan is None or m == 0 or weight.stride(1) != 1 or row_scale.dtype != torch.float32
            or not row_scale.is_contiguous()):
        return None
    bm, bk, launcher = plan
    stride = weight.stride(0)
    key = ((weight.dtype, weight.data_ptr() % 16 == 0), (dtype, True), (torch.float32, row_scale.data_ptr() % 16 == 0),
           *spec_key((m, k, stride, k)))
    launch = launcher.bound(((m + bm - 1) // bm, (k + bk - 1) // bk, 1), key, weight.get_device())
    if launch is None:
        return None
    return lambda w, y, rs: launch((w, y, rs, m, k, stride, k))


def _scale_rotate_plan(k: int, group_size: int, has_rs: bool) -> tuple[int, int, DirectLauncher]:
    """(BM, BK, its DirectLauncher) of `_scale_rotate_kernel` for a shape (the weight dequantisation runs once per
    int8 Linear in every eager backward: a launch without Triton's per-call bookkeeping)."""
    key = ("scale_rotate", k, group_size, has_rs)
    plan = _QUANT_PLANS.get(key)
    if plan is None:
        bm, bk, warps = _tile_launch(k, group_size)
        const = {"HAS_RS": has_rs, "LOG4G": log4(group_size), "BK": bk, "BM": bm, "GATHER": _INTERPRET}
        plan = _QUANT_PLANS[key] = (bm, bk, DirectLauncher(_scale_rotate_kernel, const, {"num_warps": warps}))
    return plan
