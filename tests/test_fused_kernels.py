"""The fused element-wise kernels of a DiT block (`library.runtime.fused_ops`, `library.runtime.fused_kernels`).

The kernels run under Triton's interpreter in a subprocess on a CPU machine (the interpreter is chosen when the
kernels are defined), and on CUDA where there is a GPU; the checks are the same (`run_checks`):

- q/k norm + RoPE: forward and x's gradient against a float64 reference, at most the eager forms' error (one
  rounding where they have two), for bf16 / fp16 / fp32, head sizes 128 and 32, a table per sample or one for the
  batch; an output gradient in attention's transposed layout, or a strided input, gives what its contiguous copy
  gives, bit for bit;
- RMSNorm + modulation: the same against float64 and the eager forms, modulation rows of a [B, 6, W] tensor (as
  the block unbinds them) and a width that is not a power of two;
- SwiGLU: the same against float64 and the eager form, rows of a wider tensor (a view) and widths that are not a
  multiple of the kernel's block;
- gated residual: the same against float64 and torch's addcmul, gates that are rows of a [B, 6, W] tensor, a y that
  is a view of a wider tensor, and token counts and widths that are not multiples of the kernel's tile;
- RMSNorm + modulation + ConvRot INT8 codes: the output against float64 and the eager forms, the codes and scales
  bit for bit those of the activation quantiser on that output, left in the int8 Linears' activation cache, and the
  gradient that of the norm + modulation kernel; an INT8 block takes its q/k/v and FFN inputs' codes from it (the
  cache's hits counted) and gives what the separate quantiser gives, to rounding;
- a DiT block (frozen, as under a LoRA) with the kernels against its eager forms, and with full and selective
  checkpointing against no checkpointing, bit for bit under the interpreter (the recomputation launches the same
  kernels); the block launches the kernels for its two norms, q, k and the FFN (counted).

Host-side tests check where the kernels apply (`*_usable`, `dit.norm_rope`) and the kernels' check of themselves.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from library.moss_image.dit import MossImageBlock, MossImageConfig
from library.moss_image.rope import RopeTables, apply_rope
from library.runtime import fused_ops
from library.runtime.attention import Attention

ROOT = Path(__file__).resolve().parent.parent
CFG = MossImageConfig(hidden_size=256, num_heads=2, head_dim=128, ffn_hidden=512)


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


def _reference(x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """rotate(rms_norm(x) * w) in float64."""
    xd = x.double()
    n = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()).unflatten(-1, (-1, 2))
    c, s = cos.double()[:, :, None], sin.double()[:, :, None]
    return torch.stack([n[..., 0] * c - n[..., 1] * s, n[..., 0] * s + n[..., 1] * c], dim=-1).flatten(-2)


def _eager(x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """The block's eager forms: torch's rms_norm in x's dtype, then the complex product."""
    return apply_rope(F.rms_norm(x, (x.shape[-1],), w.to(x.dtype), eps), cos.expand(x.shape[0], -1, -1),
                      sin.expand(x.shape[0], -1, -1))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def _tables(bsz: int, seq: int, dim: int, one_table: bool, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    ang = torch.rand(1 if one_table else bsz, seq, dim // 2, generator=g, dtype=torch.float64) * 40
    return ang.cos().float().to(device), ang.sin().float().to(device)


def _case(dtype: torch.dtype, dim: int, one_table: bool, device: str) -> dict:
    g = torch.Generator().manual_seed(1)
    bsz, seq, heads, eps = 2, 29, 3, 1e-6
    x = (torch.randn(bsz, seq, heads, dim, generator=g) * 3).to(device, dtype)
    w = (1 + 0.2 * torch.randn(dim, generator=g)).to(device, dtype)
    gy = torch.randn(bsz, seq, heads, dim, generator=g).to(device, dtype)
    cos, sin = _tables(bsz, seq, dim, one_table, device)
    assert fused_ops.norm_rope_usable(x, w, cos, sin)
    xr = x.double().requires_grad_(True)
    ref = _reference(xr, w, cos, sin, eps)
    ref.backward(gy.double())
    xk = x.clone().requires_grad_(True)
    y = fused_ops.fused_norm_rope(xk, w, cos, sin, eps)
    y.backward(gy)
    xe = x.clone().requires_grad_(True)
    ye = _eager(xe, w, cos, sin, eps)
    ye.backward(gy)
    xt = x.clone().requires_grad_(True)  # the gradient in attention's layout: [B, H, S, D] memory seen as [B, S, H, D]
    fused_ops.fused_norm_rope(xt, w, cos, sin, eps).backward(gy.transpose(1, 2).contiguous().transpose(1, 2))
    wide = torch.cat([x, torch.zeros_like(x)], dim=-1)[..., :dim]  # heads 2 * dim apart: a strided input
    xs = wide.detach().requires_grad_(True)
    assert fused_ops.norm_rope_usable(xs, w, cos, sin) and not xs.is_contiguous()
    ys = fused_ops.fused_norm_rope(xs, w, cos, sin, eps)
    ys.backward(gy)
    return {"dtype": str(dtype), "dim": dim, "one_table": one_table, "out_dtype": str(y.dtype),
            "contiguous": y.is_contiguous(), "out_err": _rel(y, ref), "eager_out_err": _rel(ye, ref),
            "grad_err": _rel(xk.grad, xr.grad), "eager_grad_err": _rel(xe.grad, xr.grad),
            "strided_grad_equal": bool(torch.equal(xt.grad, xk.grad)),
            "strided_input_equal": bool(torch.equal(ys, y) and torch.equal(xs.grad, xk.grad))}


def _norm_modulate_case(dtype: torch.dtype, width: int, device: str) -> dict:
    g = torch.Generator().manual_seed(5)
    bsz, seq, eps = 2, 11, 1e-6
    x = (torch.randn(bsz, seq, width, generator=g) * 2).to(device, dtype)
    w = (1 + 0.2 * torch.randn(width, generator=g)).to(device, dtype)
    mod = (torch.randn(bsz, 6, width, generator=g) * 0.3).to(device, dtype)
    shift, scale = mod.unbind(1)[:2]  # rows of [B, 6, W], as the block's modulation
    gy = torch.randn(bsz, seq, width, generator=g).to(device, dtype)
    assert fused_ops.norm_modulate_usable(x, w, shift, scale)
    xr = x.double().requires_grad_(True)
    ref = (xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + eps) * w.double() * (1 + scale.double()[:, None])
           + shift.double()[:, None])
    ref.backward(gy.double())
    xk = x.clone().requires_grad_(True)
    y = fused_ops.fused_norm_modulate(xk, w, shift, scale, eps)
    y.backward(gy)
    xe = x.clone().requires_grad_(True)
    ye = torch.addcmul(shift[:, None], F.rms_norm(xe, (width,), w, eps), 1 + scale[:, None])
    ye.backward(gy)
    return {"dtype": str(dtype), "width": width, "out_dtype": str(y.dtype), "contiguous": y.is_contiguous(),
            "out_err": _rel(y, ref), "eager_out_err": _rel(ye, ref), "grad_err": _rel(xk.grad, xr.grad),
            "eager_grad_err": _rel(xe.grad, xr.grad)}


def _swiglu_case(dtype: torch.dtype, width: int, view: bool, device: str) -> dict:
    g = torch.Generator().manual_seed(4)
    wide = (torch.randn(3, 7, 2 * width + (6 if view else 0), generator=g) * 2).to(device, dtype)
    u = wide[..., 3:3 + 2 * width] if view else wide  # a view whose rows are further apart than 2F
    gy = torch.randn(3, 7, width, generator=g).to(device, dtype)
    assert fused_ops.swiglu_usable(u) and u.is_contiguous() != view
    ur = u.double().requires_grad_(True)
    value, gate = ur.chunk(2, dim=-1)
    ref = F.silu(gate) * value
    ref.backward(gy.double())
    uk = u.detach().clone() if not view else u.detach()
    uk.requires_grad_(True)
    y = fused_ops.fused_swiglu(uk)
    y.backward(gy)
    ue = u.detach().clone().requires_grad_(True)
    ve, ge = ue.chunk(2, dim=-1)
    ye = F.silu(ge) * ve
    ye.backward(gy)
    return {"dtype": str(dtype), "width": width, "view": view, "out_dtype": str(y.dtype), "shape": list(y.shape),
            "grad_contiguous": uk.grad.is_contiguous(), "out_err": _rel(y, ref), "eager_out_err": _rel(ye, ref),
            "grad_err": _rel(uk.grad, ur.grad), "eager_grad_err": _rel(ue.grad, ur.grad)}


def _norm_modulate_quant_case(dtype: torch.dtype, width: int, group_size: int, device: str) -> dict:
    from library.quant import convrot_kernels
    from library.quant.convrot_quant_kernels import _quantize_rows_triton
    from library.runtime import fused_kernels

    g = torch.Generator().manual_seed(7)
    bsz, seq, eps = 2, 11, 1e-6
    x = (torch.randn(bsz, seq, width, generator=g) * 2).to(device, dtype)
    w = (1 + 0.2 * torch.randn(width, generator=g)).to(device, dtype)
    shift, scale = (torch.randn(bsz, 6, width, generator=g) * 0.3).to(device, dtype).unbind(1)[:2]
    gy = torch.randn(bsz, seq, width, generator=g).to(device, dtype)
    assert fused_ops.norm_modulate_quant_usable(x, w, shift, scale, group_size)
    xr = x.double().requires_grad_(True)
    ref = (xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + eps) * w.double() * (1 + scale.double()[:, None])
           + shift.double()[:, None])
    ref.backward(gy.double())
    xk = x.clone().requires_grad_(True)
    y = fused_ops.fused_norm_modulate_quant(xk, w, shift, scale, eps, group_size)
    y.backward(gy)
    cached = convrot_kernels._ACT_CACHE.get(y, group_size, True)
    q_ref, s_ref = _quantize_rows_triton(y.detach().reshape(-1, width), group_size, kernel="quarters")
    xn = x.clone().requires_grad_(True)
    fused_ops.fused_norm_modulate(xn, w, shift, scale, eps).backward(gy)
    xe = x.clone().requires_grad_(True)
    ye = torch.addcmul(shift[:, None], F.rms_norm(xe, (width,), w, eps), 1 + scale[:, None])
    return {"dtype": str(dtype), "width": width, "group": group_size, "out_dtype": str(y.dtype),
            "out_err": _rel(y, ref), "eager_out_err": _rel(ye, ref), "cached": cached is not None,
            "codes_equal": cached is not None and bool(torch.equal(cached[0], q_ref)),
            "scales_equal": cached is not None and bool(torch.equal(cached[1], s_ref)),
            "grad_equal": bool(torch.equal(xk.grad, xn.grad)),
            "codes_only_equal": _codes_only_equal(
                dtype, lambda: fused_kernels.norm_modulate_quant_forward(x, w, shift, scale, eps, group_size,
                                                                         one_buffer=False, write_y=False),
                q_ref, s_ref),
            "residual": _residual_case(x, w, shift, scale, eps, group_size, g)}


def _residual_case(x: torch.Tensor, w: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float,
                   group_size: int, g: torch.Generator) -> dict | None:
    """The gated residual h = x + gate * r with the norm + modulation and codes of h in one kernel
    (`residual_norm_modulate_quant_forward`): h against float64 and against the torch form's error, and the norm's
    output, codes and scales the same bits as the plain kernel's of that h (with and without the output). None for
    fp32 (the compiled blocks launch it for bf16 and fp16 only)."""
    from library.runtime import fused_kernels

    if x.dtype == torch.float32:
        return None
    r = torch.randn(x.shape, generator=g).to(x.device, x.dtype)
    gate = (torch.randn(x.shape[0], 6, x.shape[-1], generator=g) * 0.5).to(x.device, x.dtype).unbind(1)[2]
    h, y, q, s = fused_kernels.residual_norm_modulate_quant_forward(x, gate, r, w, shift, scale, eps, group_size,
                                                                    write_y=True)
    ref = x.double() + gate.double()[:, None] * r.double()
    y_ref, q_ref, s_ref = fused_kernels.norm_modulate_quant_forward(h, w, shift, scale, eps, group_size,
                                                                    one_buffer=False)
    h2, y2, q2, s2 = fused_kernels.residual_norm_modulate_quant_forward(x, gate, r, w, shift, scale, eps, group_size)
    return {"h_err": _rel(h, ref), "eager_h_err": _rel(torch.addcmul(x, gate[:, None], r), ref),
            "same_as_plain": bool(torch.equal(y, y_ref) and torch.equal(q, q_ref) and torch.equal(s, s_ref)),
            "codes_only_same": y2 is None and bool(torch.equal(h2, h) and torch.equal(q2, q) and torch.equal(s2, s))}


def _codes_only_equal(dtype: torch.dtype, launch: Callable[[], tuple], q_ref: torch.Tensor,
                      s_ref: torch.Tensor) -> bool | None:
    """Whether the kernel without its output (`write_y=False`, the compiled inference blocks' codes-only ops) gives
    the codes and scales of the quantiser on its output; None for fp32, which those ops do not launch it for."""
    if dtype == torch.float32:
        return None
    y, q, s = launch()
    return y is None and bool(torch.equal(q, q_ref)) and bool(torch.equal(s, s_ref))


def _swiglu_quant_case(dtype: torch.dtype, width: int, group_size: int, device: str) -> dict:
    from library.quant import convrot_kernels
    from library.quant.convrot_quant_kernels import _quantize_rows_triton
    from library.runtime import fused_kernels

    g = torch.Generator().manual_seed(9)
    u = (torch.randn(2, 11, 2 * width, generator=g) * 2).to(device, dtype)
    gy = torch.randn(2, 11, width, generator=g).to(device, dtype)
    assert fused_ops.swiglu_quant_usable(u, group_size)
    ur = u.double()
    value, gate = ur.chunk(2, dim=-1)
    ref = F.silu(gate) * value
    uk = u.clone().requires_grad_(True)
    y = fused_ops.fused_swiglu_quant(uk, group_size)
    y.backward(gy)
    cached = convrot_kernels._ACT_CACHE.get(y, group_size, True)
    q_ref, s_ref = _quantize_rows_triton(y.detach().reshape(-1, width), group_size, kernel="quarters")
    us = u.clone().requires_grad_(True)
    ys = fused_ops.fused_swiglu(us)
    ys.backward(gy)
    ve, ge = u.chunk(2, dim=-1)
    return {"dtype": str(dtype), "width": width, "group": group_size, "out_dtype": str(y.dtype),
            "out_err": _rel(y, ref), "eager_out_err": _rel(F.silu(ge) * ve, ref), "cached": cached is not None,
            "codes_equal": cached is not None and bool(torch.equal(cached[0], q_ref)),
            "scales_equal": cached is not None and bool(torch.equal(cached[1], s_ref)),
            "grad_equal": bool(torch.equal(uk.grad, us.grad)),
            "codes_only_equal": _codes_only_equal(
                dtype, lambda: fused_kernels.swiglu_quant_forward(u, group_size, one_buffer=False, write_y=False),
                q_ref, s_ref)}


def _block_inputs(device: str) -> tuple[torch.Tensor, ...]:
    """A block step's RoPE tables, input (requiring grad), modulation and output gradient: two samples of 44 tokens."""
    g = torch.Generator().manual_seed(3)
    cos, sin = RopeTables(CFG.rope_axes_dims, CFG.rope_theta).cos_sin([5, 7], 8, 6, 6, torch.device(device))
    x = torch.randn(2, 44, CFG.hidden_size, generator=g).to(device, torch.bfloat16).requires_grad_(True)
    mod = (torch.randn(2, 6, CFG.hidden_size, generator=g) * 0.3).to(device, torch.bfloat16)
    gy = torch.randn(2, 44, CFG.hidden_size, generator=g).to(device, torch.bfloat16)
    return cos, sin, x, mod, gy


def _int8_block_step(norm_quant: bool, device: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A bf16 block whose six Linears are ConvRot INT8 (groups of 64): output, input gradient, and the activation
    cache's hits in one step (each int8 Linear whose input's codes were there)."""
    from library.quant import convrot_kernels
    from library.quant.convrot import ConvRotInt8Linear

    blk = _block(device)
    for name in ("q", "k", "v", "o", "ffn_up_gate", "ffn_down"):
        setattr(blk.proj, name, ConvRotInt8Linear.from_linear(getattr(blk.proj, name), 64))
    cos, sin, x, mod, gy = _block_inputs(device)
    previous = fused_ops.set_fused_quant(norm_quant)
    hits = convrot_kernels._ACT_CACHE.hits
    try:
        y = blk(x, cos, sin, None, mod)
        y.backward(gy)
    finally:
        fused_ops.set_fused_quant(previous)
    return y.detach(), x.grad, convrot_kernels._ACT_CACHE.hits - hits


def _gated_residual_case(dtype: torch.dtype, seq: int, width: int, device: str) -> dict:
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(2, seq, width, generator=g) * 2).to(device, dtype)
    y = torch.randn(2, seq, width + 8, generator=g).to(device, dtype)[..., 4:4 + width]  # rows further apart
    gate = (torch.randn(2, 6, width, generator=g) * 0.5).to(device, dtype).unbind(1)[2]  # as the block unbinds it
    gy = torch.randn(2, seq, width, generator=g).to(device, dtype)
    assert fused_ops.gated_residual_usable(x, gate, y) and not y.is_contiguous()
    xr, yr = x.double().requires_grad_(True), y.double().requires_grad_(True)
    ref = xr + gate.double()[:, None] * yr
    ref.backward(gy.double())
    xk, yk = x.clone().requires_grad_(True), y.detach().requires_grad_(True)
    out = fused_ops.fused_gated_residual(xk, gate, yk)
    out.backward(gy)
    xe, ye = x.clone().requires_grad_(True), y.detach().clone().requires_grad_(True)
    oe = torch.addcmul(xe, gate[:, None], ye)
    oe.backward(gy)
    return {"dtype": str(dtype), "seq": seq, "width": width, "out_dtype": str(out.dtype),
            "contiguous": out.is_contiguous(), "x_grad_is_output_grad": bool(torch.equal(xk.grad, gy)),
            "out_err": _rel(out, ref), "eager_out_err": _rel(oe, ref), "grad_err": _rel(yk.grad, yr.grad),
            "eager_grad_err": _rel(ye.grad, yr.grad)}


def _block(device: str) -> MossImageBlock:
    torch.manual_seed(0)
    blk = MossImageBlock(CFG, True, Attention()).to(device, torch.bfloat16)
    with torch.no_grad():
        blk.scale_shift_table.normal_(0, 0.2)
        for norm in (blk.norm1, blk.norm2, blk.q_norm, blk.k_norm):
            norm.weight.normal_(1, 0.1)
    return blk.requires_grad_(False)  # frozen, as the DiT is under a LoRA


def _block_step(blk: MossImageBlock, kernels: bool, checkpointing: str | None, device: str
                ) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin, x, mod, gy = _block_inputs(device)
    previous = fused_ops.set_fused_kernels(kernels)
    blk.checkpointing = checkpointing
    try:
        y = blk(x, cos, sin, None, mod)
        y.backward(gy)
    finally:
        fused_ops.set_fused_kernels(previous)
        blk.checkpointing = None
    return y.detach(), x.grad


LAUNCHES = ("norm_rope_forward", "norm_rope_backward", "swiglu_forward", "swiglu_backward", "norm_modulate_forward",
            "norm_modulate_backward", "gated_residual_forward", "gated_residual_backward")


@contextlib.contextmanager
def _counted_launches() -> Iterator[dict[str, int]]:
    """The kernel module's launches counted while inside."""
    module = fused_ops._kernels()
    counts = dict.fromkeys(LAUNCHES, 0)
    real = {name: getattr(module, name) for name in LAUNCHES}

    def counted(name: str) -> Callable[..., torch.Tensor]:
        def call(*args: object) -> torch.Tensor:
            counts[name] += 1
            return real[name](*args)

        return call

    try:
        for name in LAUNCHES:
            setattr(module, name, counted(name))
        yield counts
    finally:
        for name, fn in real.items():
            setattr(module, name, fn)


def _tuning_invariant(device: str) -> float:
    """The largest relative difference that other launch parameters (rows per program, block, warps) make: none on
    the interpreter; on a GPU another reduction order can flip a rounding."""
    from library.runtime import fused_kernels

    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 9, 3, 128, generator=g).to(device, torch.bfloat16)
    w = torch.ones(128, dtype=torch.bfloat16, device=device)
    cos, sin = _tables(2, 9, 128, False, device)
    u = torch.randn(3, 1100, generator=g).to(device, torch.bfloat16)
    h = torch.randn(2, 9, 300, generator=g).to(device, torch.bfloat16)
    hw = torch.ones(300, dtype=torch.bfloat16, device=device)
    mod = torch.randn(2, 2, 300, generator=g).to(device, torch.bfloat16)

    def outputs() -> list[torch.Tensor]:
        return [fused_kernels.norm_rope_forward(x, w, cos, sin, 1e-6), fused_kernels.swiglu_forward(u),
                fused_kernels.swiglu_backward(u[:, :550], u), fused_kernels.norm_modulate_forward(h, hw, mod[:, 0],
                                                                                                  mod[:, 1], 1e-6),
                fused_kernels.gated_residual_forward(h, mod[:, 0], h), fused_kernels.gated_residual_backward(h,
                                                                                                         mod[:, 1])]

    before = outputs()
    previous = fused_kernels.set_tuning(rope_rows=8, rope_warps=2, swiglu_block=256, swiglu_warps=8, row_warps=4,
                                        residual_rows=4, residual_block=128, residual_warps=8)
    try:
        after = outputs()
    finally:
        fused_kernels.set_tuning(**previous)
    return max(_rel(a, b) for a, b in zip(after, before))


def _launch_paths(device: str) -> dict[str, bool]:
    """Each kernel's first launch of a specialisation (through Triton) and the next (the direct launch that every
    later call takes, `library.quant.triton_launch`) give the same bits: with the launchers' caches cleared, so the
    first call of each goes through Triton again."""
    from library.runtime import fused_kernels

    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 5, 3, 64, generator=g).to(device, torch.bfloat16)
    w = (1 + 0.1 * torch.randn(64, generator=g)).to(device, torch.bfloat16)
    cos, sin = _tables(2, 5, 64, False, device)
    u = torch.randn(2, 5, 2 * 72, generator=g).to(device, torch.bfloat16)
    h = torch.randn(2, 5, 200, generator=g).to(device, torch.bfloat16)
    hw = (1 + 0.1 * torch.randn(200, generator=g)).to(device, torch.bfloat16)
    mod = (torch.randn(2, 2, 200, generator=g) * 0.3).to(device, torch.bfloat16)
    calls = {
        "norm_rope_forward": lambda: fused_kernels.norm_rope_forward(x, w, cos, sin, 1e-6),
        "norm_rope_backward": lambda: fused_kernels.norm_rope_backward(x, x, w, cos, sin, 1e-6),
        "swiglu_forward": lambda: fused_kernels.swiglu_forward(u),
        "swiglu_backward": lambda: fused_kernels.swiglu_backward(u[..., :72], u),
        "norm_modulate_forward": lambda: fused_kernels.norm_modulate_forward(h, hw, mod[:, 0], mod[:, 1], 1e-6),
        "norm_modulate_backward": lambda: fused_kernels.norm_modulate_backward(h, h, hw, mod[:, 1], 1e-6),
        "gated_residual_forward": lambda: fused_kernels.gated_residual_forward(h, mod[:, 0], h),
        "gated_residual_backward": lambda: fused_kernels.gated_residual_backward(h, mod[:, 1]),
    }
    fused_kernels._LAUNCHERS.clear()
    return {name: bool(torch.equal(call(), call())) for name, call in calls.items()}


def run_checks(device: str) -> dict:
    checked = fused_ops.prepare(device) and fused_ops.prepare_fused_quant(device)
    cases = [_case(dtype, dim, one, device) for dtype in (torch.bfloat16, torch.float16, torch.float32)
             for dim in (128, 32) for one in (False, True)]
    swiglu = [_swiglu_case(dtype, width, view, device) for dtype in (torch.bfloat16, torch.float16, torch.float32)
              for width in (48, 1100) for view in (False, True)]
    norm_modulate = [_norm_modulate_case(dtype, width, device) for dtype in (torch.bfloat16, torch.float16,
                                                                             torch.float32) for width in (96, 256)]
    gated_residual = [_gated_residual_case(dtype, seq, width, device) for dtype in (torch.bfloat16, torch.float16,
                                                                                   torch.float32)
                      for seq, width in ((11, 96), (37, 300))]
    norm_quant = [_norm_modulate_quant_case(dtype, width, group, device)
                  for dtype in (torch.bfloat16, torch.float16, torch.float32) for width, group in ((768, 64), (256, 16))]
    swiglu_quant = [_swiglu_quant_case(dtype, width, group, device)
                    for dtype in (torch.bfloat16, torch.float16) for width, group in ((768, 64), (80, 16))]
    swiglu_quant_fp32 = fused_ops.swiglu_quant_usable(torch.zeros(2, 3, 1536, device=device), 64)
    y_q, gx_q, hits_q = _int8_block_step(True, device)
    y_s, gx_s, hits_s = _int8_block_step(False, device)
    blk = _block(device)
    with _counted_launches() as launches:
        y_k, gx_k = _block_step(blk, True, None, device)
    y_e, gx_e = _block_step(blk, False, None, device)
    ckpt = {}  # the largest relative difference checkpointing makes (none: the recomputation is the same launches)
    for policy in ("full", "selective"):
        y_c, gx_c = _block_step(blk, True, policy, device)
        ckpt[policy] = max(_rel(y_c, y_k), _rel(gx_c, gx_k))
    return {"interpreted": os.environ.get("TRITON_INTERPRET") == "1", "checked": checked,
            "launch_paths_equal": _launch_paths(device),
            "tuning_invariant": _tuning_invariant(device), "cases": cases, "swiglu": swiglu,
            "norm_modulate": norm_modulate, "gated_residual": gated_residual, "norm_quant": norm_quant,
            "swiglu_quant": swiglu_quant, "swiglu_quant_fp32": swiglu_quant_fp32,
            "int8_block": {"hits_fused": hits_q, "hits_separate": hits_s, "out_rel_diff": _rel(y_q, y_s),
                           "grad_rel_diff": _rel(gx_q, gx_s)},
            "block": {"out_rel_diff": _rel(y_k, y_e), "grad_rel_diff": _rel(gx_k, gx_e), "launches": launches,
                      "checkpointed_diff": ckpt}}


def _assert_checks(res: dict) -> None:
    assert res["checked"]  # the kernels' own check passed on this device
    assert res["launch_paths_equal"] == dict.fromkeys(LAUNCHES, True), res["launch_paths_equal"]
    assert res["tuning_invariant"] == 0 if res["interpreted"] else res["tuning_invariant"] < 1e-3
    assert len(res["cases"]) == 12
    for c in res["cases"]:
        assert c["contiguous"] and c["out_dtype"] == c["dtype"] and c["strided_grad_equal"], c
        assert c["strided_input_equal"], c
        if c["dtype"] == "torch.float32":  # no rounding in the kernel: the reference to fp32 accuracy
            assert c["out_err"] < 1e-6 and c["grad_err"] < 1e-5, c
        else:  # one rounding to bf16/fp16 where the eager forms have two; the interpreter rounds to bf16 towards
            # zero (twice the error of the GPU's round-to-nearest), so there the check only rules out wrong math
            slack = 1.6 if res["interpreted"] and c["dtype"] == "torch.bfloat16" else 1.02
            assert c["out_err"] <= c["eager_out_err"] * slack and c["grad_err"] <= c["eager_grad_err"] * slack, c
    assert len(res["norm_modulate"]) == 6
    for c in res["norm_modulate"]:
        assert c["contiguous"] and c["out_dtype"] == c["dtype"], c
        if c["dtype"] == "torch.float32":
            assert c["out_err"] < 1e-6 and c["grad_err"] < 1e-5, c
        else:
            slack = 1.6 if res["interpreted"] and c["dtype"] == "torch.bfloat16" else 1.02
            assert c["out_err"] <= c["eager_out_err"] * slack and c["grad_err"] <= c["eager_grad_err"] * slack, c
    assert len(res["swiglu"]) == 12
    for c in res["swiglu"]:
        assert c["out_dtype"] == c["dtype"] and c["grad_contiguous"] and c["shape"] == [3, 7, c["width"]], c
        if c["dtype"] == "torch.float32":
            assert c["out_err"] < 1e-6 and c["grad_err"] < 1e-6, c
        else:
            slack = 1.6 if res["interpreted"] and c["dtype"] == "torch.bfloat16" else 1.02
            assert c["out_err"] <= c["eager_out_err"] * slack and c["grad_err"] <= c["eager_grad_err"] * slack, c
    assert len(res["gated_residual"]) == 6
    for c in res["gated_residual"]:
        assert c["contiguous"] and c["out_dtype"] == c["dtype"] and c["x_grad_is_output_grad"], c
        if c["dtype"] == "torch.float32":
            assert c["out_err"] < 1e-6 and c["grad_err"] < 1e-6, c
        else:  # one rounding to nearest even, as addcmul's (the kernel rounds so under the interpreter too)
            slack = 1.02
            assert c["out_err"] <= c["eager_out_err"] * slack and c["grad_err"] <= c["eager_grad_err"] * slack, c
    assert len(res["norm_quant"]) == 6
    for c in res["norm_quant"]:
        assert c["out_dtype"] == c["dtype"] and c["cached"] and c["codes_equal"] and c["scales_equal"], c
        assert c["codes_only_equal"] is (None if c["dtype"] == "torch.float32" else True), c
        if c["dtype"] == "torch.float32":
            assert c["residual"] is None, c
        else:  # the residual rounded once to nearest even, as the compiled graph's; then the plain kernel's bits
            r = c["residual"]
            assert r["same_as_plain"] and r["codes_only_same"] and r["h_err"] <= r["eager_h_err"] * 1.02, c
        assert c["grad_equal"], c  # the norm + modulation's backward kernel
        if c["dtype"] == "torch.float32":
            assert c["out_err"] < 1e-6, c
        else:  # rounded to nearest even, also under the interpreter (the eager forms round twice)
            assert c["out_err"] <= c["eager_out_err"] * 1.02, c
    assert len(res["swiglu_quant"]) == 4
    for c in res["swiglu_quant"]:
        assert c["out_dtype"] == c["dtype"] and c["cached"] and c["codes_equal"] and c["scales_equal"], c
        assert c["codes_only_equal"], c  # without its output: the same codes
        assert c["grad_equal"], c  # SwiGLU's backward kernel
        # rounded to nearest even, also under the interpreter (the eager forms round twice)
        assert c["out_err"] <= c["eager_out_err"] * 1.02, c
    assert not res["swiglu_quant_fp32"]  # fp32: the product and the rotation could be contracted (see the check)
    ib = res["int8_block"]
    # q's and the FFN up/gate's inputs come from the norm's kernel, ffn_down's from SwiGLU's (the separate
    # quantiser: only k and v hit, after q)
    assert ib["hits_fused"] - ib["hits_separate"] == 3 and ib["hits_separate"] == 2, ib
    assert ib["out_rel_diff"] < 1e-2 and ib["grad_rel_diff"] < 2e-2, ib
    b = res["block"]
    assert b["launches"] == {"norm_rope_forward": 2, "norm_rope_backward": 2, "swiglu_forward": 1,
                             "swiglu_backward": 1, "norm_modulate_forward": 2, "norm_modulate_backward": 2,
                             "gated_residual_forward": 2, "gated_residual_backward": 2,
                             }, b  # q and k, the FFN, the two norms, the two branches, each way
    assert b["out_rel_diff"] < 5e-3 and b["grad_rel_diff"] < 1e-2, b  # bf16 rounding apart from the eager forms
    # bit for bit on the interpreter; on a GPU the attention backward may sum in another order from run to run
    limit = 0 if res["interpreted"] else 1e-3
    assert set(b["checkpointed_diff"]) == {"full", "selective"}, b
    assert all(d <= limit for d in b["checkpointed_diff"].values()), b


@pytest.mark.skipif(not _triton_importable(), reason="needs triton")
def test_fused_kernels_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "tests.test_fused_kernels"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_checks(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.mark.skipif(not torch.cuda.is_available() or not _triton_importable(), reason="needs a CUDA GPU and triton")
def test_fused_kernels_on_cuda():
    _assert_checks(run_checks("cuda"))


# ------------------------------------------------------------------------------------------------ host logic
@pytest.fixture
def usable_on_cpu(monkeypatch):
    """`norm_rope_usable` as under the interpreter (CPU tensors allowed, the kernels' check passed), without
    launching anything."""
    if not _triton_importable():
        pytest.skip("needs triton")
    assert fused_ops._kernels() is not None
    monkeypatch.setattr(fused_ops, "_INTERPRET", True)
    monkeypatch.setattr(fused_ops, "prepare", lambda device: True)
    return fused_ops.norm_rope_usable


def _args(bsz=2, seq=5, heads=3, dim=128, table_batch=None):
    x = torch.zeros(bsz, seq, heads, dim, dtype=torch.bfloat16)
    w = torch.ones(dim, dtype=torch.bfloat16)
    cos = torch.zeros(bsz if table_batch is None else table_batch, seq, dim // 2)
    return x, w, cos, cos.clone()


def test_where_the_kernels_apply(usable_on_cpu):
    x, w, cos, sin = _args()
    assert usable_on_cpu(x, w, cos, sin)
    assert usable_on_cpu(*_args(table_batch=1))  # one table for the batch
    assert not usable_on_cpu(*_args(table_batch=3))
    assert not usable_on_cpu(*_args(dim=96))  # head size not a power of two
    assert not usable_on_cpu(x.transpose(1, 2), w, cos, sin)  # a layout of other shape
    assert not usable_on_cpu(x[..., ::2], w[::2], cos[..., ::2], sin[..., ::2])  # no unit stride
    assert not usable_on_cpu(x.long(), w, cos, sin)
    assert not usable_on_cpu(x, w, cos.double(), sin.double())
    assert not usable_on_cpu(x, w, cos, sin.transpose(0, 1).contiguous().transpose(0, 1))  # another table layout
    trained = w.clone().requires_grad_(True)
    assert not usable_on_cpu(x, trained, cos, sin)  # the kernel gives the norm weight no gradient
    with torch.no_grad():
        assert usable_on_cpu(x, trained, cos, sin)  # no gradient to compute
    previous = fused_ops.set_fused_kernels(False)
    try:
        assert not usable_on_cpu(x, w, cos, sin)
    finally:
        fused_ops.set_fused_kernels(previous)


def test_where_the_swiglu_kernel_applies(usable_on_cpu):
    u = torch.zeros(2, 5, 64, dtype=torch.bfloat16)
    assert fused_ops.swiglu_usable(u)
    assert fused_ops.swiglu_usable(torch.zeros(2, 5, 80)[..., 8:72])  # rows 80 apart
    assert fused_ops.swiglu_usable(torch.zeros(1, 1, 64).expand(1, 1, 64))  # one row: any stride
    assert not fused_ops.swiglu_usable(torch.zeros(2, 5, 63))  # no [value | gate] halves
    assert not fused_ops.swiglu_usable(torch.zeros(2, 5, 128)[..., ::2])  # no unit stride
    assert not fused_ops.swiglu_usable(torch.zeros(2, 6, 64)[:, :5])  # rows 64 apart, samples 384: uneven
    assert not fused_ops.swiglu_usable(u.long())
    previous = fused_ops.set_fused_kernels(False)
    try:
        assert not fused_ops.swiglu_usable(u)
    finally:
        fused_ops.set_fused_kernels(previous)


class _TorchKernels:
    """The kernel module's launches written with torch operators (for the check's own tests; `wrong` spoils one)."""

    def __init__(self, wrong: str | None = None, raises: bool = False):
        self.wrong, self.raises = wrong, raises

    def _out(self, name: str, y: torch.Tensor) -> torch.Tensor:
        if self.raises:
            raise RuntimeError("PassManager::run failed")  # as a Triton compile error reads
        return y * 1.5 if name == self.wrong else y

    def norm_rope_forward(self, x, w, cos, sin, eps):
        return self._out("norm_rope_forward", _reference(x.float(), w.float(), cos, sin, eps).to(x.dtype))

    def norm_rope_backward(self, g, x, w, cos, sin, eps):
        xr = x.double().requires_grad_(True)
        _reference(xr, w.float(), cos, sin, eps).backward(g.double())
        return self._out("norm_rope_backward", xr.grad.to(x.dtype))

    def norm_modulate_forward(self, x, w, shift, scale, eps):
        n = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps) * w.float()
        return self._out("norm_modulate_forward", (n * (1 + scale.float()[:, None]) + shift.float()[:, None])
                         .to(x.dtype))

    def norm_modulate_backward(self, g, x, w, scale, eps):
        xr = x.double().requires_grad_(True)
        n = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + eps) * w.double()
        (n * (1 + scale.double()[:, None])).backward(g.double())
        return self._out("norm_modulate_backward", xr.grad.to(x.dtype))

    def swiglu_forward(self, u):
        value, gate = u.float().chunk(2, dim=-1)
        return self._out("swiglu_forward", (F.silu(gate) * value).to(u.dtype))

    def swiglu_backward(self, g, u):
        ur = u.double().requires_grad_(True)
        value, gate = ur.chunk(2, dim=-1)
        (F.silu(gate) * value).backward(g.double())
        return self._out("swiglu_backward", ur.grad.to(u.dtype))

    def fused_quant_plan(self, width, group_size):
        return None  # no quantiser here: the check leaves the norm + modulation + codes kernel out (its own check)

    def gated_residual_forward(self, x, gate, y):
        return self._out("gated_residual_forward", (x.float() + gate.float()[:, None] * y.float()).to(x.dtype))

    def gated_residual_backward(self, g, gate):
        return self._out("gated_residual_backward", (gate.float()[:, None] * g.float()).to(g.dtype))


@pytest.mark.parametrize("wrong", [None, "norm_rope_forward", "norm_rope_backward", "swiglu_forward",
                                   "swiglu_backward", "norm_modulate_forward", "norm_modulate_backward",
                                   "gated_residual_forward", "gated_residual_backward", "raises"])
def test_the_kernels_check_themselves_before_their_first_use(monkeypatch, caplog, wrong):
    """A kernel that fails to run or gives other numbers on a device turns the kernels off there, with one warning;
    kernels that pass are used, and the check runs once per device."""
    module = _TorchKernels(raises=True) if wrong == "raises" else _TorchKernels(wrong)
    monkeypatch.setitem(fused_ops._STATE, "kernels", module)
    monkeypatch.setattr(fused_ops, "_INTERPRET", True)
    monkeypatch.setattr(fused_ops, "_CHECKED", {})
    with caplog.at_level("WARNING", logger="library.runtime.fused_ops"):
        assert fused_ops.prepare("cpu") is (wrong is None)
        assert fused_ops.prepare("cpu") is (wrong is None)  # decided once
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    if wrong is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and "PyTorch's kernels run instead" in warnings[0], warnings
        assert (wrong if wrong != "raises" else "failed to run") in warnings[0]
    x, w, cos, sin = _args()
    assert fused_ops.norm_rope_usable(x, w, cos, sin) is (wrong is None)


class _TorchKernelsWithCodes(_TorchKernels):
    """`_TorchKernels` with the norm + modulation + codes and SwiGLU + codes launches, whose codes are ones, or zeros
    for the one named `wrong`."""

    def __init__(self, wrong: str | None):
        super().__init__()
        self.wrong_codes = wrong

    def fused_quant_plan(self, width, group_size):
        return (1, 8, 4, 2, True)

    def _with_codes(self, name: str, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = y.numel() // y.shape[-1]
        codes = 0 if name == self.wrong_codes else 1
        return y, torch.full((rows, y.shape[-1]), codes, dtype=torch.int8), torch.ones(rows)

    def norm_modulate_quant_forward(self, x, w, shift, scale, eps, group_size):
        return self._with_codes("norm", self.norm_modulate_forward(x, w, shift, scale, eps))

    def swiglu_quant_forward(self, u, group_size):
        return self._with_codes("swiglu", self.swiglu_forward(u))

    def residual_norm_modulate_quant_forward(self, x, gate, r, w, shift, scale, eps, group_size, write_y=False):
        h = (x.float() + gate.float()[:, None] * r.float()).to(x.dtype)
        return (h, *self._with_codes("residual", self.norm_modulate_forward(h, w, shift, scale, eps)))


@pytest.mark.parametrize("wrong", [None, "norm", "residual", "swiglu"])
def test_the_kernels_that_write_codes_are_checked_on_their_own(monkeypatch, caplog, wrong):
    """The norm + modulation (alone and after a gated residual) and the SwiGLU that write int8 codes too are checked
    apart from the other kernels, once per device: codes other than the activation quantiser's from any turn all
    off, with one warning, and leave the other kernels on."""
    monkeypatch.setitem(fused_ops._STATE, "kernels", _TorchKernelsWithCodes(wrong))
    monkeypatch.setitem(fused_ops._STATE, "fused_quant", True)
    monkeypatch.setattr(fused_ops, "_quantised_rows",
                        lambda x2, group: (torch.ones(x2.shape, dtype=torch.int8), torch.ones(x2.shape[0])))
    monkeypatch.setattr(fused_ops, "_INTERPRET", True)
    monkeypatch.setattr(fused_ops, "_CHECKED", {})
    monkeypatch.setattr(fused_ops, "_FUSED_QUANT_CHECKED", {})
    with caplog.at_level("WARNING", logger="library.runtime.fused_ops"):
        assert fused_ops.prepare_fused_quant("cpu") is (wrong is None)
        assert fused_ops.prepare_fused_quant("cpu") is (wrong is None)  # decided once
        assert fused_ops.prepare("cpu")  # the other kernels stay on
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    if wrong:
        assert len(warnings) == 1 and "quantise their inputs themselves" in warnings[0], warnings
        assert ("SwiGLU" in warnings[0]) is (wrong == "swiglu"), warnings
        assert ("gated residual" in warnings[0]) is (wrong == "residual"), warnings
    else:
        assert warnings == []


def test_no_check_under_compile_or_when_off(monkeypatch):
    monkeypatch.setattr(fused_ops, "_INTERPRET", True)
    monkeypatch.setattr(fused_ops, "_CHECKED", {})
    monkeypatch.setattr(fused_ops, "_self_check", lambda device: pytest.fail("no check expected"))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not fused_ops.prepare("cpu")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    previous = fused_ops.set_fused_kernels(False)
    try:
        assert not fused_ops.prepare("cpu")
    finally:
        fused_ops.set_fused_kernels(previous)


def test_where_the_norm_modulate_kernel_applies(usable_on_cpu):
    x = torch.zeros(2, 5, 96, dtype=torch.bfloat16)
    w = torch.ones(96, dtype=torch.bfloat16)
    mod = torch.zeros(2, 6, 96, dtype=torch.bfloat16)
    shift, scale = mod[:, 0], mod[:, 1]
    usable = fused_ops.norm_modulate_usable
    assert usable(x, w, shift, scale)
    assert usable(x, w.float(), shift, scale)  # the weight may be of another dtype (read as fp32)
    assert not usable(x, w, shift.float(), scale.float())  # the modulation in x's dtype, as the block makes it
    assert not usable(x, w, shift, scale.contiguous())  # shift and scale of one layout
    assert not usable(x, w, shift[:1], scale[:1])  # one row per sample
    assert not usable(x[..., ::2], w[::2], shift[:, ::2], scale[:, ::2])  # no unit stride
    assert not usable(x.unsqueeze(0), w, shift, scale)
    assert not usable(x, w, shift, scale.clone().requires_grad_(True))  # no gradient for the modulation
    assert not usable(x, w.clone().requires_grad_(True), shift, scale)


def test_where_the_gated_residual_kernel_applies(usable_on_cpu):
    x = torch.zeros(2, 5, 96, dtype=torch.bfloat16)
    gate = torch.zeros(2, 6, 96, dtype=torch.bfloat16)[:, 2]
    usable = fused_ops.gated_residual_usable
    assert usable(x, gate, x) and usable(x, gate, torch.zeros(2, 5, 100, dtype=torch.bfloat16)[..., :96])
    assert not usable(x, gate.float(), x)  # one dtype for all three
    assert not usable(x, gate, x.float())
    assert not usable(x, gate[:1], x)  # one gate row per sample
    assert not usable(x, gate, x[:, :4])  # x and y of one shape
    assert not usable(x[..., ::2], gate[:, ::2], x[..., ::2])  # no unit stride
    assert not usable(x.transpose(0, 1), gate[:1].expand(5, -1), x.transpose(0, 1))  # rows not evenly spaced
    assert not usable(x, gate.clone().requires_grad_(True), x)  # no gradient for the gate
    assert not usable(x.unsqueeze(0), gate, x.unsqueeze(0))


def test_unknown_launch_parameters_are_refused():
    pytest.importorskip("triton")
    from library.runtime import fused_kernels

    with pytest.raises(ValueError, match="unknown launch parameters"):
        fused_kernels.set_tuning(rope_cols=8)


def test_cpu_tensors_keep_the_eager_forms():
    x, w, cos, sin = _args()
    assert not fused_ops.norm_rope_usable(x, w, cos, sin)
    assert not fused_ops.swiglu_usable(torch.zeros(2, 5, 64))


def test_the_block_calls_a_hooked_or_replaced_norm_as_it_is(monkeypatch, usable_on_cpu):
    """A hook on a norm, a wrapped forward or another norm module must run: the block then keeps the eager forms."""
    from library.moss_image import dit

    used = []
    monkeypatch.setattr(dit, "fused_norm_rope", lambda *a: used.append("rope") or apply_rope(a[0], a[2], a[3]))
    monkeypatch.setattr(dit, "fused_norm_modulate", lambda *a: used.append("modulate") or a[0])
    blk = _block("cpu")
    x, _, cos, sin = _args(dim=128, heads=2)
    h = torch.zeros(2, 5, CFG.hidden_size, dtype=torch.bfloat16)
    shift, scale = torch.zeros(2, 6, CFG.hidden_size, dtype=torch.bfloat16).unbind(1)[:2]

    def both() -> None:
        dit.norm_rope(blk.q_norm, x, cos, sin)
        dit.norm_modulate(blk.norm1, h, shift, scale)

    both()
    assert used == ["rope", "modulate"]
    seen = []
    handles = [blk.q_norm.register_forward_hook(lambda *a: seen.append("q")),
               blk.norm1.register_forward_pre_hook(lambda *a: seen.append("norm1"))]
    try:
        both()
    finally:
        for handle in handles:
            handle.remove()
    assert used == ["rope", "modulate"] and seen == ["q", "norm1"]
    blk.q_norm.forward = lambda t: seen.append("wrapped") or t  # as an adapter that wraps a module's forward does
    blk.norm1 = type("OtherNorm", (dit.RMSNorm,), {})(CFG.hidden_size).to(torch.bfloat16)
    both()
    assert used == ["rope", "modulate"] and seen == ["q", "norm1", "wrapped"]


if __name__ == "__main__":  # python -m tests.test_fused_kernels, from the repository root
    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    print(json.dumps(run_checks(device)))
