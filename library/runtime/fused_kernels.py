"""Triton kernels for the element-wise code of a DiT block in eager CUDA runs: one kernel each way where the eager
forms launch several, each reading and writing whole activations (docs/benchmarks.md: half of an eager step's GPU
time is such memory-bound work). Every kernel computes in fp32 and rounds once, to the input's dtype.

**q/k head norm + RoPE** (`norm_rope_forward` / `norm_rope_backward`). The eager `apply_rope(q_norm(q), cos, sin)` is
four kernels per tensor: the RMSNorm (bf16 in, bf16 out), the fp32 upcast, the complex product with the RoPE table
and the downcast; its backward as many again. At 1024x1024 (4,352 tokens x 3,072) one q moves about 320 MB forward
where reading q and writing the result is 53 MB, and autograd keeps the fp32 complex input of the product (53 MB)
besides q. One program takes `TUNING["rope_rows"]` heads of `head_dim` values:

- forward: y = rotate(x * rstd * w), rstd = 1 / sqrt(mean(x^2) + eps); only x is kept (rstd is recomputed);
- backward: the rotation's transpose on the output gradient, then the RMSNorm input gradient
  rstd * u - x * rstd^3 * sum(u * x) / head_dim with u = w * (the rotated-back gradient). The norm weight gets no
  gradient (the DiT is frozen under a LoRA).

**RMSNorm + adaLN modulation** (`norm_modulate_forward` / `norm_modulate_backward`) of the block input:
rms_norm(x) * w * (1 + scale) + shift with shift/scale [B, W] per sample. The eager form is the norm, `1 + scale` and
an `addcmul`, and keeps the normed activation besides x; here one program normalises and modulates a token's row
(forward), and backward gives x's gradient from the output's, (1 + scale) and x (rstd recomputed). shift and scale
get no gradient (the modulation comes from the frozen timestep embedding under a LoRA).

**SwiGLU** (`swiglu_forward` / `swiglu_backward`) of the FFN's fused up/gate projection u = [value | gate]:
silu(gate) * value. The eager form is a silu and a product forward (and keeps silu(gate), 71 MB per block at
1024x1024, besides u); backward two products, the silu's backward and the concatenation of the two halves'
gradients. Here forward reads u once and writes the product; backward reads the gradient and u and writes the
gradient of u whole, both halves in place, so no concatenation follows.

**Gated residual** (`gated_residual_forward` / `gated_residual_backward`) of a block's two branches: x + gate * y with
gate [B, W] per sample. torch's `addcmul` broadcasts the gate over the tokens and so takes its unvectorised
element-wise kernel (about 1.9 TB/s on an H200 where copies reach 4), and its backward is a product of the same kind
for y's gradient. Here one program takes `TUNING["residual_rows"]` tokens x `TUNING["residual_block"]` columns, reads
x and y (forward) or the output's gradient (backward) with the gate's slice once, and writes the result, rounded to
nearest even as addcmul's (under Triton's interpreter too, which truncates a plain bf16 cast). x's gradient is the
output's, passed on; the gate gets none (the modulation comes from the frozen timestep embedding under a LoRA).

**RMSNorm + modulation + ConvRot INT8 quantisation** (`norm_modulate_quant_forward`) of a block input whose consumers
are ConvRot INT8 Linears (q, k and v; the FFN's up/gate projection): the norm + modulation above, and in the same
program the row's rotation and int8 codes as the activation quantiser makes them from the rounded result (its
"quarters" form: the row held as two parts of whole groups, each group as its four quarters; the same helpers, so
the codes and scales are those of quantising the output, bit for bit). The output is written as usual; the codes and
scales go to the int8 Linears through their activation cache, so they launch no quantiser of their own. The output's
row is summed for its norm in the quantiser's layout, so it can differ from `norm_modulate_forward`'s by rounding.
The backward is `norm_modulate_backward`'s.

**SwiGLU + ConvRot INT8 quantisation** (`swiglu_quant_forward`) of the FFN's up/gate output when `ffn_down` is a
ConvRot INT8 Linear: `swiglu_forward`'s product, and in the same program the codes and scales of its rows, as above.
The separate kernels read u (2F wide), write the product, then the quantiser reads the product again: at 1024x1024
(4,352 x 8,192) that second read is 71 MB per block and pass. The backward is `swiglu_backward`'s.

This module imports Triton; which calls take the kernels, and the autograd functions around them, are
`library.runtime.fused_ops`'s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from library.quant import convrot_quant_kernels as _qk
from library.quant.convrot_quant_kernels import _cast_rne
from library.quant.triton_launch import DirectLauncher

# launch parameters (`bench/fused_kernels.py --sweep` times the alternatives; `set_tuning` changes them)
TUNING: dict[str, int] = {
    "rope_rows": 16,  # heads per norm + RoPE program (16 x 128 values: 4 KiB of bf16 in, 4 KiB out)
    "rope_warps": 4,
    "swiglu_block": 1024,  # values of one row half per SwiGLU program
    "swiglu_warps": 4,
    "row_warps": 8,  # a norm + modulation program holds a whole row (3,072 values at full width)
    "residual_rows": 16,  # tokens per gated-residual program
    "residual_block": 256,  # columns per gated-residual program
    "residual_warps": 4,
    # the kernels that write ConvRot INT8 codes (norm + modulation, SwiGLU): rows a program and values a thread;
    # 0 keeps the activation quantiser's plan (`_qk._quarters_launch`: one row, about 64 values a thread)
    "codes_rows": 0,
    "codes_ept": 0,
}
_LAUNCHERS: dict[tuple, DirectLauncher] = {}  # (kernel name, constexprs, warps) -> its launcher


def set_tuning(**values: int) -> dict[str, int]:
    """Change launch parameters (names of TUNING); returns the previous ones. Launchers of other parameters are
    kept: each set compiles its own kernels once."""
    unknown = sorted(set(values) - set(TUNING))
    if unknown:
        raise ValueError(f"unknown launch parameters {unknown}: choose from {sorted(TUNING)}")
    previous = dict(TUNING)
    TUNING.update({k: int(v) for k, v in values.items()})
    return previous


def _launcher(kernel: object, constexprs: dict[str, int], warps: int) -> DirectLauncher:
    key = (kernel.__name__, tuple(sorted(constexprs.items())), warps)
    launcher = _LAUNCHERS.get(key)
    if launcher is None:
        launcher = _LAUNCHERS[key] = DirectLauncher(kernel, constexprs, {"num_warps": warps})
    return launcher


@triton.jit
def _rows(row0, n_rows, seq, heads, BR: tl.constexpr):
    """The rows (one head of one token each) of a program and their batch, token and head indices (64-bit: offsets
    of large batches pass 2^31)."""
    rows = row0 + tl.arange(0, BR)
    live = rows < n_rows
    h = rows % heads
    pos = rows // heads
    return rows, live, pos // seq, pos % seq, h


@triton.jit
def _norm_rope_fwd_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr, n_rows, seq, heads, xs_b, xs_s, xs_h, cs_b,
                          cs_s, eps, HALF: tl.constexpr, BR: tl.constexpr):
    rows, live, b, s, h = _rows(tl.program_id(0).to(tl.int64) * BR, n_rows, seq, heads, BR)
    d = tl.arange(0, 2 * HALF)
    x = tl.load(x_ptr + (b * xs_b + s * xs_s + h * xs_h)[:, None] + d[None, :], mask=live[:, None],
                other=0.0).to(tl.float32)
    w = tl.load(w_ptr + d).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / (2 * HALF) + eps)
    n0, n1 = tl.split(tl.reshape(x * rstd[:, None] * w[None, :], (BR, HALF, 2)))
    c_off = (b * cs_b + s * cs_s)[:, None] + tl.arange(0, HALF)[None, :]
    c = tl.load(cos_ptr + c_off, mask=live[:, None], other=0.0)
    sn = tl.load(sin_ptr + c_off, mask=live[:, None], other=0.0)
    y = tl.reshape(tl.join(n0 * c - n1 * sn, n0 * sn + n1 * c), (BR, 2 * HALF))
    tl.store(y_ptr + rows[:, None] * (2 * HALF) + d[None, :], y.to(y_ptr.dtype.element_ty), mask=live[:, None])


@triton.jit
def _norm_rope_bwd_kernel(g_ptr, x_ptr, w_ptr, cos_ptr, sin_ptr, dx_ptr, n_rows, seq, heads, gs_b, gs_s, gs_h,
                          xs_b, xs_s, xs_h, cs_b, cs_s, eps, HALF: tl.constexpr, BR: tl.constexpr):
    rows, live, b, s, h = _rows(tl.program_id(0).to(tl.int64) * BR, n_rows, seq, heads, BR)
    d = tl.arange(0, 2 * HALF)
    g = tl.load(g_ptr + (b * gs_b + s * gs_s + h * gs_h)[:, None] + d[None, :], mask=live[:, None],
                other=0.0).to(tl.float32)
    g0, g1 = tl.split(tl.reshape(g, (BR, HALF, 2)))
    c_off = (b * cs_b + s * cs_s)[:, None] + tl.arange(0, HALF)[None, :]
    c = tl.load(cos_ptr + c_off, mask=live[:, None], other=0.0)
    sn = tl.load(sin_ptr + c_off, mask=live[:, None], other=0.0)
    dn = tl.reshape(tl.join(g0 * c + g1 * sn, g1 * c - g0 * sn), (BR, 2 * HALF))  # the rotation's transpose
    x = tl.load(x_ptr + (b * xs_b + s * xs_s + h * xs_h)[:, None] + d[None, :], mask=live[:, None],
                other=0.0).to(tl.float32)
    w = tl.load(w_ptr + d).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / (2 * HALF) + eps)
    u = dn * w[None, :]
    proj = rstd * rstd * rstd * tl.sum(u * x, axis=1) / (2 * HALF)
    dx = rstd[:, None] * u - x * proj[:, None]
    tl.store(dx_ptr + rows[:, None] * (2 * HALF) + d[None, :], dx.to(dx_ptr.dtype.element_ty),
             mask=live[:, None])


def _norm_rope_launcher(backward: bool, half: int) -> DirectLauncher:
    """The launcher of one head size (a constexpr: each compiles its own kernel)."""
    kernel = _norm_rope_bwd_kernel if backward else _norm_rope_fwd_kernel
    return _launcher(kernel, {"HALF": half, "BR": TUNING["rope_rows"]}, TUNING["rope_warps"])


def _table_strides(cos: torch.Tensor, batch: int) -> tuple[int, int]:
    """Element strides of the cos/sin tables' batch (0 where one table serves every sample) and token dims."""
    return (0 if cos.shape[0] == 1 and batch != 1 else cos.stride(0)), cos.stride(1)


def _grid(n_rows: int) -> tuple[int, int, int]:
    return (triton.cdiv(n_rows, TUNING["rope_rows"]), 1, 1)


def norm_rope_forward(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      eps: float) -> torch.Tensor:
    """rotate(rms_norm(x) * weight) of x [B, S, H, D] by cos/sin [B or 1, S, D/2]: a new contiguous tensor."""
    bsz, seq, heads, dim = x.shape
    y = torch.empty((bsz, seq, heads, dim), dtype=x.dtype, device=x.device)
    n_rows = bsz * seq * heads
    if n_rows:
        cs_b, cs_s = _table_strides(cos, bsz)
        _norm_rope_launcher(False, dim // 2)(
            _grid(n_rows), (x, weight, cos, sin, y, n_rows, seq, heads, x.stride(0), x.stride(1), x.stride(2), cs_b,
                            cs_s, float(eps)))
    return y


def norm_rope_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, eps: float) -> torch.Tensor:
    """The gradient of `norm_rope_forward` with respect to x, from the output's gradient `grad`."""
    if grad.stride(-1) != 1:
        grad = grad.contiguous()
    bsz, seq, heads, dim = x.shape
    dx = torch.empty((bsz, seq, heads, dim), dtype=x.dtype, device=x.device)
    n_rows = bsz * seq * heads
    if n_rows:
        cs_b, cs_s = _table_strides(cos, bsz)
        _norm_rope_launcher(True, dim // 2)(
            _grid(n_rows), (grad, x, weight, cos, sin, dx, n_rows, seq, heads, grad.stride(0), grad.stride(1),
                            grad.stride(2), x.stride(0), x.stride(1), x.stride(2), cs_b, cs_s, float(eps)))
    return dx


# --------------------------------------------------------------------------------------------------------------------
# RMSNorm + adaLN modulation
# --------------------------------------------------------------------------------------------------------------------
@triton.jit
def _norm_modulate_fwd_kernel(x_ptr, w_ptr, shift_ptr, scale_ptr, y_ptr, seq, width, x_row, mod_b, eps,
                              BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b = row // seq
    cols = tl.arange(0, BLOCK)
    live = cols < width
    x = tl.load(x_ptr + row * x_row + cols, mask=live, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32)
    shift = tl.load(shift_ptr + b * mod_b + cols, mask=live, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + b * mod_b + cols, mask=live, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / width + eps)
    y = x * rstd * w * (1.0 + scale) + shift
    tl.store(y_ptr + row * width + cols, y.to(y_ptr.dtype.element_ty), mask=live)


@triton.jit
def _norm_modulate_bwd_kernel(g_ptr, x_ptr, w_ptr, scale_ptr, dx_ptr, seq, width, g_row, x_row, mod_b, eps,
                              BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b = row // seq
    cols = tl.arange(0, BLOCK)
    live = cols < width
    g = tl.load(g_ptr + row * g_row + cols, mask=live, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * x_row + cols, mask=live, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + b * mod_b + cols, mask=live, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / width + eps)
    u = g * (1.0 + scale) * w
    dx = rstd * u - x * (rstd * rstd * rstd * tl.sum(u * x, axis=0) / width)
    tl.store(dx_ptr + row * width + cols, dx.to(dx_ptr.dtype.element_ty), mask=live)


def _norm_modulate_launcher(backward: bool, width: int) -> DirectLauncher:
    kernel = _norm_modulate_bwd_kernel if backward else _norm_modulate_fwd_kernel
    return _launcher(kernel, {"BLOCK": triton.next_power_of_2(width)}, TUNING["row_warps"])


def norm_modulate_forward(x: torch.Tensor, weight: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                          eps: float) -> torch.Tensor:
    """rms_norm(x) * weight * (1 + scale) + shift of x [B, S, W] (rows evenly spaced, unit column stride) with
    shift/scale [B, W] of one layout and unit column stride: a new contiguous tensor."""
    bsz, seq, width = x.shape
    y = torch.empty((bsz, seq, width), dtype=x.dtype, device=x.device)
    if bsz * seq and width:
        _norm_modulate_launcher(False, width)(
            (bsz * seq, 1, 1), (x, weight, shift, scale, y, seq, width, row_stride(x), scale.stride(0), float(eps)))
    return y


def norm_modulate_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                           eps: float) -> torch.Tensor:
    """The gradient of `norm_modulate_forward` with respect to x, from the output's gradient `grad`."""
    if grad.stride(-1) != 1 or row_stride(grad) is None:
        grad = grad.contiguous()
    bsz, seq, width = x.shape
    dx = torch.empty((bsz, seq, width), dtype=x.dtype, device=x.device)
    if bsz * seq and width:
        _norm_modulate_launcher(True, width)(
            (bsz * seq, 1, 1), (grad, x, weight, scale, dx, seq, width, row_stride(grad), row_stride(x),
                                scale.stride(0), float(eps)))
    return dx


# --------------------------------------------------------------------------------------------------------------------
# SwiGLU
# --------------------------------------------------------------------------------------------------------------------
@triton.jit
def _swiglu_fwd_kernel(u_ptr, y_ptr, width, u_row, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < width
    value = tl.load(u_ptr + row * u_row + cols, mask=live, other=0.0).to(tl.float32)
    gate = tl.load(u_ptr + row * u_row + width + cols, mask=live, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * value
    tl.store(y_ptr + row * width + cols, y.to(y_ptr.dtype.element_ty), mask=live)


@triton.jit
def _swiglu_bwd_kernel(g_ptr, u_ptr, du_ptr, width, g_row, u_row, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < width
    g = tl.load(g_ptr + row * g_row + cols, mask=live, other=0.0).to(tl.float32)
    value = tl.load(u_ptr + row * u_row + cols, mask=live, other=0.0).to(tl.float32)
    gate = tl.load(u_ptr + row * u_row + width + cols, mask=live, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    d_value = g * gate * sig
    d_gate = g * value * sig * (1.0 + gate * (1.0 - sig))
    out = du_ptr + row * (2 * width) + cols
    tl.store(out, d_value.to(du_ptr.dtype.element_ty), mask=live)
    tl.store(out + width, d_gate.to(du_ptr.dtype.element_ty), mask=live)


def _swiglu_launcher(backward: bool) -> DirectLauncher:
    kernel = _swiglu_bwd_kernel if backward else _swiglu_fwd_kernel
    return _launcher(kernel, {"BLOCK": TUNING["swiglu_block"]}, TUNING["swiglu_warps"])


def _swiglu_grid(rows: int, width: int) -> tuple[int, int, int]:
    return (rows, triton.cdiv(width, TUNING["swiglu_block"]), 1)


def swiglu_forward(u: torch.Tensor) -> torch.Tensor:
    """silu(gate) * value of u [..., 2F] = [value | gate] with rows of unit column stride: a new [..., F] tensor."""
    width = u.shape[-1] // 2
    rows = u.numel() // u.shape[-1]
    y = torch.empty((*u.shape[:-1], width), dtype=u.dtype, device=u.device)
    if rows and width:
        _swiglu_launcher(False)(_swiglu_grid(rows, width), (u, y, width, row_stride(u)))
    return y


def swiglu_backward(grad: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The gradient of `swiglu_forward` with respect to u, both halves in one new contiguous tensor."""
    width = u.shape[-1] // 2
    rows = u.numel() // u.shape[-1]
    if grad.stride(-1) != 1 or row_stride(grad) is None:
        grad = grad.contiguous()
    du = torch.empty(u.shape, dtype=u.dtype, device=u.device)
    if rows and width:
        _swiglu_launcher(True)(_swiglu_grid(rows, width), (grad, u, du, width, row_stride(grad), row_stride(u)))
    return du


# --------------------------------------------------------------------------------------------------------------------
# RMSNorm + modulation + ConvRot INT8 quantisation
# --------------------------------------------------------------------------------------------------------------------
@triton.jit
def _quarter_cols(col0, i, NCH: tl.constexpr, G: tl.constexpr):
    """The columns of quarter i of NCH groups of G from column col0: [NCH, G / 4] (as `_qk._quarters_load` lays them)."""
    qw: tl.constexpr = G // 4
    return col0 + tl.arange(0, NCH)[:, None] * G + i * qw + tl.arange(0, qw)[None, :]


@triton.jit
def _modulated_quarter(z, rstd, w_ptr, shift_ptr, scale_ptr, mod_off, row_ok, col0, i, K, T_CODE: tl.constexpr,
                       NCH: tl.constexpr, G: tl.constexpr, EVEN: tl.constexpr, GATHER: tl.constexpr):
    """Quarter i of the rows' norm + modulation, rounded to T (fp32 values): x * rstd * w * (1 + scale) + shift."""
    cols = _quarter_cols(col0, i, NCH, G)
    if EVEN:
        w = tl.load(w_ptr + cols).to(tl.float32)
        shift = tl.load(shift_ptr + mod_off[:, None, None] + cols[None, :, :]).to(tl.float32)
        scale = tl.load(scale_ptr + mod_off[:, None, None] + cols[None, :, :]).to(tl.float32)
    else:
        live = cols < K
        mask = row_ok[:, None, None] & live[None, :, :]
        w = tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32)
        shift = tl.load(shift_ptr + mod_off[:, None, None] + cols[None, :, :], mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(scale_ptr + mod_off[:, None, None] + cols[None, :, :], mask=mask, other=0.0).to(tl.float32)
    y = z * rstd[:, None, None] * w[None, :, :] * (1.0 + scale) + shift
    return _qk._round_fast(y, T_CODE, GATHER)


@triton.jit
def _store_quarters(y_ptr, rows64, row_ok, col0, K, y0, y1, y2, y3, NCH: tl.constexpr, G: tl.constexpr,
                    EVEN: tl.constexpr):
    """The four quarters (already rounded to the output's dtype) into the contiguous output rows."""
    base = y_ptr + rows64[:, None, None] * K
    for_dtype = y_ptr.dtype.element_ty
    if EVEN:
        tl.store(base + _quarter_cols(col0, 0, NCH, G)[None, :, :], y0.to(for_dtype))
        tl.store(base + _quarter_cols(col0, 1, NCH, G)[None, :, :], y1.to(for_dtype))
        tl.store(base + _quarter_cols(col0, 2, NCH, G)[None, :, :], y2.to(for_dtype))
        tl.store(base + _quarter_cols(col0, 3, NCH, G)[None, :, :], y3.to(for_dtype))
    else:
        c0, c1 = _quarter_cols(col0, 0, NCH, G), _quarter_cols(col0, 1, NCH, G)
        c2, c3 = _quarter_cols(col0, 2, NCH, G), _quarter_cols(col0, 3, NCH, G)
        ok = row_ok[:, None, None]
        tl.store(base + c0[None, :, :], y0.to(for_dtype), mask=ok & (c0 < K)[None, :, :])
        tl.store(base + c1[None, :, :], y1.to(for_dtype), mask=ok & (c1 < K)[None, :, :])
        tl.store(base + c2[None, :, :], y2.to(for_dtype), mask=ok & (c2 < K)[None, :, :])
        tl.store(base + c3[None, :, :], y3.to(for_dtype), mask=ok & (c3 < K)[None, :, :])


@triton.jit
def _sum_squares(z0, z1, z2, z3):
    return tl.sum(tl.sum(z0 * z0 + z1 * z1 + z2 * z2 + z3 * z3, axis=2), axis=1)


@triton.jit
def _gated_quarter(z, r, gate_ptr, mod_off, row_ok, col0, i, K, T_CODE: tl.constexpr, NCH: tl.constexpr,
                   G: tl.constexpr, EVEN: tl.constexpr, GATHER: tl.constexpr):
    """Quarter i of the gated residual z + gate * r (fp32 values rounded to T), gate per sample like shift."""
    cols = _quarter_cols(col0, i, NCH, G)
    if EVEN:
        gate = tl.load(gate_ptr + mod_off[:, None, None] + cols[None, :, :]).to(tl.float32)
    else:
        mask = row_ok[:, None, None] & (cols < K)[None, :, :]
        gate = tl.load(gate_ptr + mod_off[:, None, None] + cols[None, :, :], mask=mask, other=0.0).to(tl.float32)
    return _qk._round_fast(z + gate * r, T_CODE, GATHER)


@triton.jit
def _gated_quarters(x_ptr, r_ptr, gate_ptr, xo_ptr, rows64, row_ok, mod_off, col0, x_row, r_row, K,
                    T_CODE: tl.constexpr, BM: tl.constexpr, NCH: tl.constexpr, G: tl.constexpr, EVEN: tl.constexpr,
                    GATHER: tl.constexpr):
    """NCH groups of the rows' gated residual x + gate * r from column col0, as `_qk._quarters_load` lays them out,
    rounded to T and written to the contiguous rows of xo."""
    z0, z1, z2, z3 = _qk._quarters_load(x_ptr, rows64, row_ok, col0, x_row, K, BM, NCH, G, EVEN)
    r0, r1, r2, r3 = _qk._quarters_load(r_ptr, rows64, row_ok, col0, r_row, K, BM, NCH, G, EVEN)
    z0 = _gated_quarter(z0, r0, gate_ptr, mod_off, row_ok, col0, 0, K, T_CODE, NCH, G, EVEN, GATHER)
    z1 = _gated_quarter(z1, r1, gate_ptr, mod_off, row_ok, col0, 1, K, T_CODE, NCH, G, EVEN, GATHER)
    z2 = _gated_quarter(z2, r2, gate_ptr, mod_off, row_ok, col0, 2, K, T_CODE, NCH, G, EVEN, GATHER)
    z3 = _gated_quarter(z3, r3, gate_ptr, mod_off, row_ok, col0, 3, K, T_CODE, NCH, G, EVEN, GATHER)
    _store_quarters(xo_ptr, rows64, row_ok, col0, K, z0, z1, z2, z3, NCH, G, EVEN)
    return z0, z1, z2, z3


@triton.jit
def _norm_modulate_quant_kernel(
    x_ptr, w_ptr, shift_ptr, scale_ptr, y_ptr, q_ptr, s_ptr, r_ptr, gate_ptr, xo_ptr, M, seq, K, x_row, r_row, mod_b,
    eps, T_CODE: tl.constexpr, TINY: tl.constexpr, LOG4G: tl.constexpr, BM: tl.constexpr, NCH_A: tl.constexpr,
    NCH_B: tl.constexpr, EVEN: tl.constexpr, FAST_DIV: tl.constexpr, GATHER: tl.constexpr, WRITE_Y: tl.constexpr,
    RESIDUAL: tl.constexpr,
):
    """The rows' norm + modulation (output y where WRITE_Y) and its ConvRot INT8 codes and scales; with RESIDUAL the
    rows normed are the gated residual x + gate * r, itself written to xo (gate [B, W] strided like shift)."""
    g: tl.constexpr = 1 << (2 * LOG4G)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    mod_off = (rows64 // seq) * mod_b
    if RESIDUAL:
        a0, a1, a2, a3 = _gated_quarters(x_ptr, r_ptr, gate_ptr, xo_ptr, rows64, row_ok, mod_off, 0, x_row, r_row, K,
                                         T_CODE, BM, NCH_A, g, EVEN, GATHER)
    else:
        a0, a1, a2, a3 = _qk._quarters_load(x_ptr, rows64, row_ok, 0, x_row, K, BM, NCH_A, g, EVEN)
    ss = _sum_squares(a0, a1, a2, a3)
    if NCH_B > 0:
        if RESIDUAL:
            b0, b1, b2, b3 = _gated_quarters(x_ptr, r_ptr, gate_ptr, xo_ptr, rows64, row_ok, mod_off, NCH_A * g, x_row,
                                             r_row, K, T_CODE, BM, NCH_B, g, EVEN, GATHER)
        else:
            b0, b1, b2, b3 = _qk._quarters_load(x_ptr, rows64, row_ok, NCH_A * g, x_row, K, BM, NCH_B, g, EVEN)
        ss += _sum_squares(b0, b1, b2, b3)
    rstd = tl.rsqrt(ss / K + eps)
    a0 = _modulated_quarter(a0, rstd, w_ptr, shift_ptr, scale_ptr, mod_off, row_ok, 0, 0, K, T_CODE, NCH_A, g, EVEN,
                            GATHER)
    a1 = _modulated_quarter(a1, rstd, w_ptr, shift_ptr, scale_ptr, mod_off, row_ok, 0, 1, K, T_CODE, NCH_A, g, EVEN,
                            GATHER)
    a2 = _modulated_quarter(a2, rstd, w_ptr, shift_ptr, scale_ptr, mod_off, row_ok, 0, 2, K, T_CODE, NCH_A, g, EVEN,
                            GATHER)
    a3 = _modulated_quarter(a3, rstd, w_ptr, shift_ptr, scale_ptr, mod_off, row_ok, 0, 3, K, T_CODE, NCH_A, g, EVEN,
                            GATHER)
    if WRITE_Y:
        _store_quarters(y_ptr, rows64, row_ok, 0, K, a0, a1, a2, a3, NCH_A, g, EVEN)
    a0, a1, a2, a3, amax = _qk._quarters_rotate(a0, a1, a2, a3, T_CODE, LOG4G, BM, NCH_A, g, GATHER)
    if NCH_B > 0:
        c0 = NCH_A * g
        b0 = _modulated_quarter(b0, rstd, w_ptr, shift_ptr, scale_ptr, mod_off, row_ok, c0, 0, K, T_CODE, NCH_B, g,
                                EVEN, GATHER)
        b1 = _modulated_quarter(b1, rstd, w_ptr, shift_ptr, scale_ptr, mod_off, row_ok, c0, 1, K, T_CODE, NCH_B, g,
                                EVEN, GATHER)
        b2 = _modulated_quarter(b2, rstd, w_ptr, shift_ptr, scale_ptr, mod_off, row_ok, c0, 2, K, T_CODE, NCH_B, g,
                                EVEN, GATHER)
        b3 = _modulated_quarter(b3, rstd, w_ptr, shift_ptr, scale_ptr, mod_off, row_ok, c0, 3, K, T_CODE, NCH_B, g,
                                EVEN, GATHER)
        if WRITE_Y:
            _store_quarters(y_ptr, rows64, row_ok, c0, K, b0, b1, b2, b3, NCH_B, g, EVEN)
        b0, b1, b2, b3, amax_b = _qk._quarters_rotate(b0, b1, b2, b3, T_CODE, LOG4G, BM, NCH_B, g, GATHER)
        amax = tl.maximum(amax, amax_b)
    # the activation quantiser's scale and codes (`_qk._rot_quant_quarters_kernel`), from the rounded output
    r, s_t = _qk._quarters_scales(s_ptr, rows, row_ok, amax, T_CODE, TINY, BM, EVEN, GATHER)
    _qk._quarters_store(q_ptr, rows64, row_ok, 0, K, K, a0, a1, a2, a3, r, s_t, T_CODE, NCH_A, g, EVEN, FAST_DIV,
                        GATHER)
    if NCH_B > 0:
        _qk._quarters_store(q_ptr, rows64, row_ok, NCH_A * g, K, K, b0, b1, b2, b3, r, s_t, T_CODE, NCH_B, g, EVEN,
                            FAST_DIV, GATHER)


def fused_quant_plan(width: int, group_size: int) -> tuple[int, int, int, int, bool] | None:
    """The "quarters" quantiser's launch shape for rows of `width` with `group_size` (None where it does not apply):
    the row widths `norm_modulate_quant_forward` and `swiglu_quant_forward` take."""
    return _qk._quarters_launch(width, group_size)


def norm_modulate_quant_forward(x: torch.Tensor, weight: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                                eps: float, group_size: int, one_buffer: bool = True, write_y: bool = True
                                ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """`norm_modulate_forward` of x [B, S, W] (as there), and the ConvRot INT8 codes [B * S, W] and fp32 scales
    [B * S] of its rows, as the activation quantiser gives them (`one_buffer`: in one allocation, as it lays them out
    for the activation cache; else two). `write_y=False`: the codes and scales only (the output is None), for
    consumers that read nothing else. Only for shapes with a `fused_quant_plan`."""
    bsz, seq, width = x.shape
    m = bsz * seq
    q, s = _codes_out(m, width, x.device, one_buffer)
    y = torch.empty((bsz, seq, width), dtype=x.dtype, device=x.device) if write_y else None
    if m:
        launcher, bm = _codes_launcher(_norm_modulate_quant_kernel, width, group_size, x.dtype, m, write_y)
        launcher(((m + bm - 1) // bm, 1, 1), (x, weight, shift, scale, y if write_y else x, q, s, x, x, x, m, seq,
                                              width, row_stride(x), 0, scale.stride(0), float(eps)))
    return y, q, s


def residual_norm_modulate_quant_forward(x: torch.Tensor, gate: torch.Tensor, r: torch.Tensor, weight: torch.Tensor,
                                         shift: torch.Tensor, scale: torch.Tensor, eps: float, group_size: int,
                                         write_y: bool = False
                                         ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The gated residual h = x + gate * r of x, r [B, S, W] (rows evenly spaced) and gate [B, W] (strided like
    shift and scale), then `norm_modulate_quant_forward` of h, in one pass: (h, the norm's output or None without
    `write_y`, the codes [B * S, W] and the fp32 scales [B * S], two allocations). Only for shapes with a
    `fused_quant_plan`."""
    bsz, seq, width = x.shape
    m = bsz * seq
    q, s = _codes_out(m, width, x.device, one_buffer=False)
    h = torch.empty((bsz, seq, width), dtype=x.dtype, device=x.device)
    y = torch.empty((bsz, seq, width), dtype=x.dtype, device=x.device) if write_y else None
    if m:
        launcher, bm = _codes_launcher(_norm_modulate_quant_kernel, width, group_size, x.dtype, m, write_y,
                                       residual=True)
        launcher(((m + bm - 1) // bm, 1, 1), (x, weight, shift, scale, y if write_y else x, q, s, r, gate, h, m, seq,
                                              width, row_stride(x), row_stride(r), scale.stride(0), float(eps)))
    return h, y, q, s


# --------------------------------------------------------------------------------------------------------------------
# SwiGLU + ConvRot INT8 quantisation
# --------------------------------------------------------------------------------------------------------------------
@triton.jit
def _silu_product(gate, value, T_CODE: tl.constexpr, GATHER: tl.constexpr):
    """silu(gate) * value in fp32 (as `_swiglu_fwd_kernel`), rounded to T."""
    return _qk._round_fast(gate * tl.sigmoid(gate) * value, T_CODE, GATHER)


@triton.jit
def _swiglu_quarters(u_ptr, rows64, row_ok, col0, u_row, F, T_CODE: tl.constexpr, BM: tl.constexpr,
                     NCH: tl.constexpr, G: tl.constexpr, EVEN: tl.constexpr, GATHER: tl.constexpr):
    """NCH groups of the SwiGLU output from column col0, as the quantiser's four quarters (rounded to T, fp32): the
    value half's columns and the gate half's (F columns further on) of the same rows."""
    v0, v1, v2, v3 = _qk._quarters_load(u_ptr, rows64, row_ok, col0, u_row, F, BM, NCH, G, EVEN)
    g0, g1, g2, g3 = _qk._quarters_load(u_ptr + F, rows64, row_ok, col0, u_row, F, BM, NCH, G, EVEN)
    return (_silu_product(g0, v0, T_CODE, GATHER), _silu_product(g1, v1, T_CODE, GATHER),
            _silu_product(g2, v2, T_CODE, GATHER), _silu_product(g3, v3, T_CODE, GATHER))


@triton.jit
def _swiglu_quant_kernel(
    u_ptr, y_ptr, q_ptr, s_ptr, M, F, u_row,
    T_CODE: tl.constexpr, TINY: tl.constexpr, LOG4G: tl.constexpr, BM: tl.constexpr, NCH_A: tl.constexpr,
    NCH_B: tl.constexpr, EVEN: tl.constexpr, FAST_DIV: tl.constexpr, GATHER: tl.constexpr, WRITE_Y: tl.constexpr,
):
    g: tl.constexpr = 1 << (2 * LOG4G)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    a0, a1, a2, a3 = _swiglu_quarters(u_ptr, rows64, row_ok, 0, u_row, F, T_CODE, BM, NCH_A, g, EVEN, GATHER)
    if WRITE_Y:
        _store_quarters(y_ptr, rows64, row_ok, 0, F, a0, a1, a2, a3, NCH_A, g, EVEN)
    a0, a1, a2, a3, amax = _qk._quarters_rotate(a0, a1, a2, a3, T_CODE, LOG4G, BM, NCH_A, g, GATHER)
    if NCH_B > 0:
        c0 = NCH_A * g
        b0, b1, b2, b3 = _swiglu_quarters(u_ptr, rows64, row_ok, c0, u_row, F, T_CODE, BM, NCH_B, g, EVEN, GATHER)
        if WRITE_Y:
            _store_quarters(y_ptr, rows64, row_ok, c0, F, b0, b1, b2, b3, NCH_B, g, EVEN)
        b0, b1, b2, b3, amax_b = _qk._quarters_rotate(b0, b1, b2, b3, T_CODE, LOG4G, BM, NCH_B, g, GATHER)
        amax = tl.maximum(amax, amax_b)
    r, s_t = _qk._quarters_scales(s_ptr, rows, row_ok, amax, T_CODE, TINY, BM, EVEN, GATHER)
    _qk._quarters_store(q_ptr, rows64, row_ok, 0, F, F, a0, a1, a2, a3, r, s_t, T_CODE, NCH_A, g, EVEN, FAST_DIV,
                        GATHER)
    if NCH_B > 0:
        _qk._quarters_store(q_ptr, rows64, row_ok, NCH_A * g, F, F, b0, b1, b2, b3, r, s_t, T_CODE, NCH_B, g, EVEN,
                            FAST_DIV, GATHER)


def swiglu_quant_forward(u: torch.Tensor, group_size: int, one_buffer: bool = True, write_y: bool = True
                         ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """`swiglu_forward` of u [..., 2F] (rows of unit column stride, as there), and the ConvRot INT8 codes [rows, F]
    and fp32 scales [rows] of its output's rows, as the activation quantiser gives them; `one_buffer`: codes and
    scales in one allocation, as the quantiser lays them out for the activation cache (else two, as the registered
    ops return them); `write_y=False`: the codes and scales only (the output is None). Only for widths with a
    `fused_quant_plan`."""
    width = u.shape[-1] // 2
    m = u.numel() // u.shape[-1]
    q, s = _codes_out(m, width, u.device, one_buffer)
    y = torch.empty((*u.shape[:-1], width), dtype=u.dtype, device=u.device) if write_y else None
    if m:
        launcher, bm = _codes_launcher(_swiglu_quant_kernel, width, group_size, u.dtype, m, write_y)
        launcher(((m + bm - 1) // bm, 1, 1), (u, y if write_y else u, q, s, m, width, row_stride(u)))
    return y, q, s


# (kernel, width, group, dtype, even, write_y) -> launch
_CODES_LAUNCHERS: dict[tuple, tuple[DirectLauncher, int]] = {}


def _codes_launcher(kernel: object, width: int, group_size: int, dtype: torch.dtype, m: int, write_y: bool = True,
                    residual: bool = False) -> tuple[DirectLauncher, int]:
    """The launcher and rows per program of a kernel that writes codes (`norm_modulate_quant_forward`,
    `swiglu_quant_forward`) for m rows of `width` in groups of `group_size`, with or without its output (`write_y`):
    kept per shape, since the compiled blocks call these once per block and pass, where the host time of building the
    plan again would show."""
    # m & 63: whether m is a multiple of BM (<= 64)
    rows, ept = TUNING["codes_rows"], TUNING["codes_ept"]
    if rows and (rows & (rows - 1) or rows > 64):
        raise ValueError(f"codes_rows must be 0 (the plan's) or a power of two up to 64, got {rows}")
    key = (kernel.__name__, width, group_size, dtype, m & 63, write_y, residual, rows, ept)
    hit = _CODES_LAUNCHERS.get(key)
    if hit is None:
        plan = fused_quant_plan(width, group_size)
        if plan is None:
            raise ValueError(f"no fused quantisation for rows of {width} in groups of {group_size}")
        bm, nch_a, nch_b, warps, fills = plan
        bm = rows or bm
        if ept:
            warps = max(1, min(16, _qk._pow2_floor(max(1, bm * width // (32 * ept)))))
        const = {**_quant_constexprs(dtype, group_size, bm, nch_a, nch_b), "EVEN": fills and m % bm == 0,
                 "WRITE_Y": write_y}
        if kernel is _norm_modulate_quant_kernel:
            const["RESIDUAL"] = residual
        hit = _CODES_LAUNCHERS[key] = (_launcher(kernel, const, warps), bm)
    return hit


def _codes_out(m: int, width: int, device: torch.device, one_buffer: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """New int8 codes [m, width] and fp32 scales [m]: in one allocation (`one_buffer`) or two."""
    if one_buffer:
        return _qk._codes_and_scales(m, width, device)
    return (torch.empty((m, width), dtype=torch.int8, device=device),
            torch.empty((m,), dtype=torch.float32, device=device))


def _quant_constexprs(dtype: torch.dtype, group_size: int, bm: int, nch_a: int, nch_b: int) -> dict[str, int]:
    """The quarters quantiser's constexprs (all but EVEN) for rows of `dtype` in groups of `group_size`."""
    return {"T_CODE": _qk._T_CODE[dtype], "TINY": _qk._TINY[dtype], "LOG4G": _qk.log4(group_size), "BM": bm,
            "NCH_A": nch_a, "NCH_B": nch_b, "FAST_DIV": dtype == torch.bfloat16, "GATHER": _qk._INTERPRET}


# --------------------------------------------------------------------------------------------------------------------
# gated residual
# --------------------------------------------------------------------------------------------------------------------
@triton.jit
def _residual_tile(row0, seq, width, BR: tl.constexpr, BLOCK: tl.constexpr):
    """The tokens (inside their sample: a program's tile never spans two), columns, live columns and mask of one
    program's tile."""
    s = row0 + tl.arange(0, BR)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live_cols = cols < width
    return s, cols, live_cols, (s < seq)[:, None] & live_cols[None, :]


@triton.jit
def _gated_residual_fwd_kernel(x_ptr, gate_ptr, y_ptr, out_ptr, seq, width, n_tiles, x_row, y_row, gate_b,
                               BR: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0) // n_tiles
    s, cols, live_cols, live = _residual_tile((tl.program_id(0) % n_tiles) * BR, seq, width, BR, BLOCK)
    rows = (b * seq + s).to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * x_row + cols[None, :], mask=live, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + rows[:, None] * y_row + cols[None, :], mask=live, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + b * gate_b + cols, mask=live_cols, other=0.0).to(tl.float32)
    out = x + gate[None, :] * y
    tl.store(out_ptr + rows[:, None] * width + cols[None, :], _cast_rne(out, out_ptr.dtype.element_ty), mask=live)


@triton.jit
def _gated_residual_bwd_kernel(g_ptr, gate_ptr, dy_ptr, seq, width, n_tiles, g_row, gate_b,
                               BR: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0) // n_tiles
    s, cols, live_cols, live = _residual_tile((tl.program_id(0) % n_tiles) * BR, seq, width, BR, BLOCK)
    rows = (b * seq + s).to(tl.int64)
    g = tl.load(g_ptr + rows[:, None] * g_row + cols[None, :], mask=live, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + b * gate_b + cols, mask=live_cols, other=0.0).to(tl.float32)
    tl.store(dy_ptr + rows[:, None] * width + cols[None, :], _cast_rne(g * gate[None, :], dy_ptr.dtype.element_ty),
             mask=live)


def _residual_launch(backward: bool, shape: tuple[int, int, int], tensors: tuple, strides: tuple) -> None:
    """Launch one gated-residual kernel over `shape` [B, S, W]: its tensors, then the shape's arguments, then the
    strides."""
    bsz, seq, width = shape
    rows, block = TUNING["residual_rows"], TUNING["residual_block"]
    kernel = _gated_residual_bwd_kernel if backward else _gated_residual_fwd_kernel
    n_tiles = triton.cdiv(seq, rows)
    launcher = _launcher(kernel, {"BR": rows, "BLOCK": block}, TUNING["residual_warps"])
    launcher((bsz * n_tiles, triton.cdiv(width, block), 1), (*tensors, seq, width, n_tiles, *strides))


def gated_residual_forward(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + gate * y of x, y [B, S, W] (rows evenly spaced, unit column stride) and gate [B, W] (unit column stride),
    all of one dtype: a new contiguous tensor."""
    bsz, seq, width = x.shape
    out = torch.empty((bsz, seq, width), dtype=x.dtype, device=x.device)
    if bsz * seq and width:
        _residual_launch(False, x.shape, (x, gate, y, out), (row_stride(x), row_stride(y), gate.stride(0)))
    return out


def gated_residual_backward(grad: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The gradient of `gated_residual_forward` with respect to y (gate * grad), from the output's gradient."""
    if grad.stride(-1) != 1 or row_stride(grad) is None:
        grad = grad.contiguous()
    bsz, seq, width = grad.shape
    dy = torch.empty((bsz, seq, width), dtype=grad.dtype, device=grad.device)
    if bsz * seq and width:
        _residual_launch(True, grad.shape, (grad, gate, dy), (row_stride(grad), gate.stride(0)))
    return dy


def row_stride(t: torch.Tensor) -> int | None:
    """The element stride between consecutive rows of t seen as [rows, last dim], None where the rows are not evenly
    spaced (dims of size 1 have no say)."""
    stride = expected = None
    for dim in range(t.dim() - 2, -1, -1):
        if t.shape[dim] == 1:
            continue
        if stride is None:
            stride = t.stride(dim)
            expected = stride * t.shape[dim]
        elif t.stride(dim) != expected:
            return None
        else:
            expected *= t.shape[dim]
    return t.shape[-1] if stride is None else stride
