"""Where a DiT block's element-wise code takes the fused Triton kernels (`library.runtime.fused_kernels`).

- `fused_norm_rope(x, weight, cos, sin, eps)`: `apply_rope(rms_norm(x, weight, eps), cos, sin)` of q or k, one kernel
  forward and one backward (x's gradient only);
- `fused_norm_modulate(x, weight, shift, scale, eps)`: `modulate(rms_norm(x, weight, eps), shift, scale)` of a block
  input, one kernel forward and one backward (x's gradient only);
- `fused_swiglu(u)`: `silu(gate) * value` of the FFN's up/gate output u = [value | gate], one kernel each way;
- `fused_gated_residual(x, gate, y)`: `x + gate * y` of a block's branch, one kernel each way (y's gradient only);
- `fused_norm_modulate_quant(x, weight, shift, scale, eps, group_size)`: `fused_norm_modulate` whose kernel also
  writes the ConvRot INT8 codes of its output rows into the int8 Linears' activation cache
  (`library.quant.convrot_kernels`), for a block input that only ConvRot INT8 Linears read: they launch no quantiser;
- `fused_swiglu_quant(u, group_size)`: `fused_swiglu` whose kernel also writes its output's codes there, for a
  ConvRot INT8 `ffn_down`.

The `*_usable` functions say where they apply: eager CUDA tensors of the layouts the kernels take, and norm weights,
RoPE tables, modulation and gates that need no gradient. Anywhere else (the CPU, torch.compile, where inductor fuses the
plain forms itself, a trained norm weight) the block keeps its eager forms (`library.runtime.eager_fusion`). The
kernel module, and Triton with it, is imported on the first CUDA call, so a CPU run never loads it.

Before a device's first use the kernels check themselves (`prepare`, which `MossImage` calls before its blocks run):
each runs forward and backward on a small bf16 input against the same math in fp32 torch operators, twice (the first
launch goes through Triton, later ones take the direct launch). A kernel that fails to compile on this Triton or gives
other numbers turns the kernels off for the process with one warning, and the eager forms run: a training step never
meets a kernel that has not passed. `set_fused_kernels(False)` turns them off for same-run comparisons
(`bench/eager_block.py`, `bench/checkpointing.py`). Under ``TRITON_INTERPRET=1`` CPU tensors take the kernels too (the
tests run them so).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from types import ModuleType
from typing import Any

import torch

logger = logging.getLogger(__name__)

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_STATE: dict[str, Any] = {"enabled": True, "kernels": None, "failed": False, "fused_quant": True}
_CHECKED: dict[torch.device, bool] = {}  # device -> whether the kernels passed their check there
_CHECK_TOLERANCE = 2e-2  # relative error of the bf16 check against fp32 (a broken kernel is off by O(1))


def set_fused_kernels(enabled: bool) -> bool:
    """Turn the fused kernels on (default) or off; returns the previous setting."""
    previous, _STATE["enabled"] = _STATE["enabled"], bool(enabled)
    return previous


def _kernels() -> ModuleType | None:
    """The kernel module, imported on first use (None where Triton is missing or fails to import)."""
    module = _STATE["kernels"]
    if module is None and not _STATE["failed"]:
        try:
            if importlib.util.find_spec("triton") is None:
                raise ImportError("triton is not installed")
            module = _STATE["kernels"] = importlib.import_module("library.runtime.fused_kernels")
        except Exception as e:  # noqa: BLE001 - a missing or broken Triton: the eager forms, said once
            _STATE["failed"] = True
            logger.info("the fused element-wise kernels are not available (%s); PyTorch's kernels run", e)
    return module


def set_fused_quant(enabled: bool) -> bool:
    """Let the kernels that produce an INT8 block's Linear inputs (the norm + modulation before q/k/v and the FFN,
    SwiGLU before `ffn_down`) write their ConvRot INT8 codes too (the default), or leave the quantisation to the int8
    Linears (the benchmark's comparison). Returns the previous setting."""
    previous, _STATE["fused_quant"] = _STATE["fused_quant"], bool(enabled)
    return previous


def fused_quant_enabled() -> bool:
    """Whether the kernels that produce an INT8 block's Linear inputs write their codes too (`set_fused_quant`)."""
    return _STATE["fused_quant"]


def kernels_enabled() -> bool:
    """Whether the kernels are on (`set_fused_kernels`), whatever the device."""
    return _STATE["enabled"]


def kernel_module() -> ModuleType | None:
    """The kernel module (`library.runtime.fused_kernels`), None where Triton is missing."""
    return _kernels()


def checked(device: torch.device) -> bool:
    """Whether the kernels passed their check on `device` already (`prepare` runs it; this never does): what code
    being traced by torch.compile may read."""
    return bool(_CHECKED.get(_device_key(device)))


def fused_quant_checked(device: torch.device) -> bool:
    """Whether the kernels that write codes passed their check on `device` already (`prepare_fused_quant` runs it;
    this never does): what code being traced by torch.compile may read."""
    return bool(_FUSED_QUANT_CHECKED.get(_device_key(device)))


def _device_key(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def prepare(device: torch.device | str) -> bool:
    """Whether the kernels run on `device`: on, a CUDA device (any under Triton's interpreter), outside
    torch.compile, and their check there passed (run on the first call for each device; see the module docstring).
    """
    if not _STATE["enabled"] or torch.compiler.is_compiling():
        return False
    ok = _CHECKED.get(device)  # a tensor's device, checked before: the per-call path
    if ok is not None:
        return ok
    device = torch.device(device)
    if device.type != "cuda" and not _INTERPRET:
        return False
    key = _device_key(device)
    ok = _CHECKED.get(key)
    if ok is None:
        ok = _CHECKED[key] = _self_check(key)
    return ok


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _twice(launch: Any, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A launch made twice: the first compiles and goes through Triton, the second takes the direct launch that every
    later call takes (`library.quant.triton_launch`), so the check covers both."""
    return launch(*args), launch(*args)


def _worst(pair: tuple[torch.Tensor, torch.Tensor], ref: torch.Tensor) -> float:
    return max(_rel(pair[0], ref), _rel(pair[1], ref))


def _self_check(device: torch.device) -> bool:
    """Run each kernel forward and backward on a small bf16 input of the DiT's head size against fp32 torch
    operators; False (with one warning) where one fails to run or differs."""
    kernels = _kernels()
    if kernels is None:
        return False
    try:
        with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False):
            errors = _check_errors(kernels, device)
    except Exception as e:  # noqa: BLE001 - any failure (a compile error on this Triton, a launch error) means off
        logger.warning("the fused element-wise kernels failed to run on %s (%s: %s); PyTorch's kernels run instead",
                       device, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return False
    bad = {name: err for name, err in errors.items() if not err <= _CHECK_TOLERANCE}
    if bad:
        logger.warning("the fused element-wise kernels gave other numbers than PyTorch on %s (relative errors %s);"
                       " PyTorch's kernels run instead", device, bad)
        return False
    logger.debug("fused element-wise kernels checked on %s: %s", device, errors)
    return True


_FUSED_QUANT_CHECKED: dict[torch.device, bool] = {}  # device -> whether the kernels that write codes passed their check


def prepare_fused_quant(device: torch.device | str) -> bool:
    """Whether the kernels that write ConvRot INT8 codes with their output (norm + modulation, SwiGLU) run on
    `device`: the other kernels run there (`prepare`), the switch is on (`set_fused_quant`), and their own check passed
    (run on the first call for each device; a failure turns these two kernels off alone). `MossImage.prepare_text`
    calls it for a DiT with ConvRot INT8 blocks, outside any checkpointed or compiled code; `norm_modulate_quant_usable`
    and `swiglu_quant_usable` only read the outcome."""
    if not (_STATE["fused_quant"] and prepare(device)):
        return False
    key = _device_key(torch.device(device))
    ok = _FUSED_QUANT_CHECKED.get(key)
    if ok is None:
        ok = _FUSED_QUANT_CHECKED[key] = _fused_quant_checked(_STATE["kernels"], key)
    return ok


def _fused_quant_checked(kernels: ModuleType, device: torch.device) -> bool:
    """The kernels that write ConvRot INT8 codes too, checked on their own at the DiT's widths: each output against
    fp32 torch operators, its codes and scales against the activation quantiser's on that output (bit for bit),
    twice (Triton's launch, then the direct one). False, with one warning, where one fails to run or differs."""
    if kernels.fused_quant_plan(3072, 256) is None:  # the DiT's width and ConvRot group
        return True
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 16, 3072, generator=g).to(device)
    hw = (1 + 0.1 * torch.randn(3072, generator=g)).to(device)
    mod = (torch.randn(2, 2, 3072, generator=g) * 0.3).to(device)
    u = torch.randn(32, 2 * 8192, generator=g).to(device)  # the FFN's width (SwiGLU of 8,192)
    value, gate = u.chunk(2, dim=-1)
    r = torch.randn(2, 16, 3072, generator=g).to(device)
    hb, hwb, modb, ub, rb = h.bfloat16(), hw.bfloat16(), mod.bfloat16(), u.bfloat16(), r.bfloat16()
    gated = hb.float() + modb[:, 1, None].float() * rb.float()  # the residual's gate: mod[:, 1] again

    def normed(t: torch.Tensor) -> torch.Tensor:
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * hw * (1 + mod[:, 1, None]) + mod[:, 0, None]

    launches = {
        "norm + modulation": (lambda: kernels.norm_modulate_quant_forward(hb, hwb, modb[:, 0], modb[:, 1], 1e-6, 256),
                              normed(h)),
        "gated residual + norm + modulation": (
            lambda: kernels.residual_norm_modulate_quant_forward(hb, modb[:, 1], rb, hwb, modb[:, 0], modb[:, 1], 1e-6,
                                                                 256, write_y=True)[1:],
            normed(gated)),
        "SwiGLU": (lambda: kernels.swiglu_quant_forward(ub, 256), torch.nn.functional.silu(gate) * value),
    }
    for name, (launch, ref) in launches.items():
        try:
            with torch.inference_mode(False), torch.autocast(device.type, enabled=False):
                for _ in range(2):
                    y, q, scales = launch()
                    q_ref, s_ref = _quantised_rows(y.reshape(-1, y.shape[-1]), 256)
                    err = _rel(y, ref)
                    if not (err <= _CHECK_TOLERANCE and torch.equal(q, q_ref) and torch.equal(scales, s_ref)):
                        logger.warning("the fused %s with ConvRot INT8 codes gave other numbers on %s (relative error"
                                       " %.3g, codes equal: %s); the int8 Linears quantise their inputs themselves",
                                       name, device, err, bool(torch.equal(q, q_ref)))
                        return False
        except Exception as e:  # noqa: BLE001 - any failure (a compile error on this Triton) means these kernels off
            logger.warning("the fused %s with ConvRot INT8 codes failed to run on %s (%s: %s); the int8 Linears"
                           " quantise their inputs themselves", name, device, type(e).__name__,
                           str(e).splitlines()[0] if str(e) else "")
            return False
    return True


def _check_errors(kernels: ModuleType, device: torch.device) -> dict[str, float]:
    """Relative error of each launch against fp32 torch operators. The shapes give the kernels the specialisations
    a full-size block's launches take (head size 128, width 3,072; sizes and strides multiples of 16 where a 1024x1024
    step's are), so the check compiles no kernel that the step would not compile anyway."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 4, 128, generator=g).to(device)
    w = (1 + 0.1 * torch.randn(128, generator=g)).to(device)
    ang = torch.rand(1, 16, 64, generator=g) * 6
    cos, sin = ang.cos().to(device), ang.sin().to(device)
    gy = torch.randn(1, 16, 4, 128, generator=g).to(device)
    xr = x.clone().requires_grad_(True)
    n = (xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6) * w).unflatten(-1, (-1, 2))
    c, s = cos[:, :, None], sin[:, :, None]
    ref = torch.stack([n[..., 0] * c - n[..., 1] * s, n[..., 0] * s + n[..., 1] * c], dim=-1).flatten(-2)
    ref.backward(gy)
    xb, wb, gb = x.bfloat16(), w.bfloat16(), gy.bfloat16()
    errors = {"norm_rope_forward": _worst(_twice(kernels.norm_rope_forward, xb, wb, cos, sin, 1e-6), ref),
              "norm_rope_backward": _worst(_twice(kernels.norm_rope_backward, gb, xb, wb, cos, sin, 1e-6), xr.grad)}
    u = torch.randn(16, 512, generator=g).to(device)
    gu = torch.randn(16, 256, generator=g).to(device)
    ur = u.clone().requires_grad_(True)
    value, gate = ur.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * value
    ref.backward(gu)
    errors["swiglu_forward"] = _worst(_twice(kernels.swiglu_forward, u.bfloat16()), ref)
    errors["swiglu_backward"] = _worst(_twice(kernels.swiglu_backward, gu.bfloat16(), u.bfloat16()), ur.grad)
    h = torch.randn(2, 16, 3072, generator=g).to(device)  # the DiT's width: the kernel the blocks will launch
    hw = (1 + 0.1 * torch.randn(3072, generator=g)).to(device)
    mod = (torch.randn(2, 2, 3072, generator=g) * 0.3).to(device)
    gh = torch.randn(2, 16, 3072, generator=g).to(device)
    hr = h.clone().requires_grad_(True)
    ref = hr * torch.rsqrt(hr.pow(2).mean(-1, keepdim=True) + 1e-6) * hw * (1 + mod[:, 1, None]) + mod[:, 0, None]
    ref.backward(gh)
    hb, hwb, modb = h.bfloat16(), hw.bfloat16(), mod.bfloat16()
    errors["norm_modulate_forward"] = _worst(_twice(kernels.norm_modulate_forward, hb, hwb, modb[:, 0], modb[:, 1],
                                                    1e-6), ref)
    errors["norm_modulate_backward"] = _worst(_twice(kernels.norm_modulate_backward, gh.bfloat16(), hb, hwb,
                                                     modb[:, 1], 1e-6), hr.grad)
    errors["gated_residual_forward"] = _worst(_twice(kernels.gated_residual_forward, hb, modb[:, 0], gh.bfloat16()),
                                              h + mod[:, 0, None] * gh)
    errors["gated_residual_backward"] = _worst(_twice(kernels.gated_residual_backward, gh.bfloat16(), modb[:, 1]),
                                               mod[:, 1, None] * gh)
    return errors


def _quantised_rows(x2: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation quantiser's codes and scales of rows x2 (its "quarters" kernel)."""
    from library.quant.convrot_quant_kernels import _quantize_rows_triton

    return _quantize_rows_triton(x2, group_size, kernel="quarters")


def _on(x: torch.Tensor) -> bool:
    """Kernels on, and x where they run: a CUDA tensor (any under Triton's interpreter) of a float dtype."""
    return _STATE["enabled"] and (x.device.type == "cuda" or _INTERPRET) and x.dtype in _DTYPES


# --------------------------------------------------------------------------------------------------------------------
# q/k head norm + RoPE
# --------------------------------------------------------------------------------------------------------------------
class _NormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight, cos, sin)
        ctx.eps = eps
        return _STATE["kernels"].norm_rope_forward(x, weight, cos, sin, eps)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        x, weight, cos, sin = ctx.saved_tensors
        return _STATE["kernels"].norm_rope_backward(grad, x, weight, cos, sin, ctx.eps), None, None, None, None


def fused_norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    eps: float) -> torch.Tensor:
    """`apply_rope(rms_norm(x, weight, eps), cos, sin)` of x [B, S, H, D] and tables [B or 1, S, D/2] in one kernel
    (one more in backward, for x's gradient); only where `norm_rope_usable` says so."""
    return _NormRope.apply(x, weight, cos, sin, eps)


def norm_rope_usable(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `fused_norm_rope` takes these tensors: kernels on, x [B, S, H, D] where they run with D a power of two
    and unit stride, a weight [D] without a gradient to compute, and fp32 tables [B or 1, S, D/2] of one layout that
    need no gradient."""
    if not _on(x) or x.dim() != 4 or x.stride(-1) != 1:
        return False
    bsz, seq, _, dim = x.shape
    if dim < 2 or dim & (dim - 1) or weight.shape != (dim,) or not weight.is_contiguous():
        return False
    if torch.is_grad_enabled() and (weight.requires_grad or cos.requires_grad or sin.requires_grad):
        return False
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.dim() != 3 or cos.shape != sin.shape:
        return False
    if cos.shape[0] not in (1, bsz) or cos.shape[1:] != (seq, dim // 2):
        return False
    if cos.stride() != sin.stride() or cos.stride(-1) != 1 or not cos.device == x.device == weight.device:
        return False
    return prepare(x.device)


# --------------------------------------------------------------------------------------------------------------------
# RMSNorm + adaLN modulation
# --------------------------------------------------------------------------------------------------------------------
class _NormModulate(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight, scale)
        ctx.eps = eps
        return _STATE["kernels"].norm_modulate_forward(x, weight, shift, scale, eps)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        x, weight, scale = ctx.saved_tensors
        return _STATE["kernels"].norm_modulate_backward(grad, x, weight, scale, ctx.eps), None, None, None, None


def fused_norm_modulate(x: torch.Tensor, weight: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                        eps: float) -> torch.Tensor:
    """`rms_norm(x, weight, eps) * (1 + scale) + shift` of x [B, S, W] with shift/scale [B, W] in one kernel (one
    more in backward, for x's gradient); only where `norm_modulate_usable` says so."""
    return _NormModulate.apply(x, weight, shift, scale, eps)


def norm_modulate_usable(x: torch.Tensor, weight: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether `fused_norm_modulate` takes these tensors: kernels on, x [B, S, W] where they run with unit column
    stride and evenly spaced rows, a weight [W], and shift/scale [B, W] of one layout with unit column stride, none
    of them needing a gradient, all of x's dtype but the weight."""
    if not _on(x) or x.dim() != 3 or x.stride(-1) != 1:
        return False
    bsz, _, width = x.shape
    if weight.shape != (width,) or not weight.is_contiguous():
        return False
    if shift.shape != (bsz, width) or scale.shape != (bsz, width) or shift.stride() != scale.stride():
        return False
    if scale.stride(-1) != 1 or shift.dtype != x.dtype or scale.dtype != x.dtype:
        return False
    if torch.is_grad_enabled() and (weight.requires_grad or shift.requires_grad or scale.requires_grad):
        return False
    if not x.device == weight.device == shift.device or not prepare(x.device):
        return False
    return _STATE["kernels"].row_stride(x) is not None


# --------------------------------------------------------------------------------------------------------------------
# SwiGLU
# --------------------------------------------------------------------------------------------------------------------
class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, u: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(u)
        return _STATE["kernels"].swiglu_forward(u)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (u,) = ctx.saved_tensors
        return _STATE["kernels"].swiglu_backward(grad, u)


def fused_swiglu(u: torch.Tensor) -> torch.Tensor:
    """silu(gate) * value of u [..., 2F] = [value | gate] in one kernel (one more in backward, for u's gradient, both
    halves in one tensor); only where `swiglu_usable` says so."""
    return _SwiGLU.apply(u)


def swiglu_usable(u: torch.Tensor) -> bool:
    """Whether `fused_swiglu` takes u: kernels on, u where they run, its last dim even, of unit stride, and its rows
    evenly spaced (a Linear's output, or a view of one)."""
    if not _on(u) or u.dim() < 1 or u.shape[-1] % 2 or u.stride(-1) != 1 or not prepare(u.device):
        return False
    return _STATE["kernels"].row_stride(u) is not None


class _SwiGLUQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, u: torch.Tensor, group_size: int) -> torch.Tensor:
        from library.quant import convrot_kernels

        ctx.save_for_backward(u)
        y, q, s = _STATE["kernels"].swiglu_quant_forward(u, group_size)
        convrot_kernels.cache_quantized_activation(y, group_size, (q, s))
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (u,) = ctx.saved_tensors
        return _STATE["kernels"].swiglu_backward(grad, u), None


def fused_swiglu_quant(u: torch.Tensor, group_size: int) -> torch.Tensor:
    """`fused_swiglu`, whose kernel also quantises the output's rows for a ConvRot INT8 Linear of `group_size` and
    leaves the codes in its activation cache; only where `swiglu_quant_usable` says so."""
    return _SwiGLUQuant.apply(u, group_size)


def swiglu_quant_usable(u: torch.Tensor, group_size: int | None) -> bool:
    """Whether `fused_swiglu_quant` takes u for an int8 Linear of `group_size`: the switch on (`set_fused_quant`), a
    rotation group, u in bf16 or fp16, `swiglu_usable`, an output width the quantiser's one-pass form takes, no
    inference tensor (the activation cache keeps none), and the kernels' own check passed on u's device
    (`prepare_fused_quant`). Not fp32: there no rounding separates the product from the rotation's first sums, so the
    compiler may contract them into fused multiply-adds, and the codes would differ in the last bits from the
    quantiser's on the stored product (seen on an H200)."""
    if u.dtype not in (torch.bfloat16, torch.float16) or torch.is_inference_mode_enabled():
        return False
    if not (_STATE["fused_quant"] and group_size and swiglu_usable(u)):
        return False
    if not _FUSED_QUANT_CHECKED.get(_device_key(u.device)):
        return False
    return _STATE["kernels"].fused_quant_plan(u.shape[-1] // 2, group_size) is not None


# --------------------------------------------------------------------------------------------------------------------
# gated residual
# --------------------------------------------------------------------------------------------------------------------
class _GatedResidual(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate)
        return _STATE["kernels"].gated_residual_forward(x, gate, y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, torch.Tensor | None]:
        (gate,) = ctx.saved_tensors
        grad_y = _STATE["kernels"].gated_residual_backward(grad, gate) if ctx.needs_input_grad[2] else None
        return (grad if ctx.needs_input_grad[0] else None), None, grad_y


def fused_gated_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + gate * y of x, y [B, S, W] with gate [B, W] in one kernel (one more in backward, for y's gradient; x's is
    the output's); only where `gated_residual_usable` says so."""
    return _GatedResidual.apply(x, gate, y)


def gated_residual_usable(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether `fused_gated_residual` takes these tensors: kernels on, x and y [B, S, W] of one shape and dtype where
    they run, with unit column stride and evenly spaced rows, and a gate [B, W] of that dtype with unit column stride
    that needs no gradient. Called twice per block and pass, so the common case (contiguous x and y, as a block makes
    them) is decided without the general row-stride walk."""
    if not _on(x) or x.dim() != 3 or y.shape != x.shape or y.dtype != x.dtype or gate.dtype != x.dtype:
        return False
    if gate.shape != (x.shape[0], x.shape[2]) or gate.stride(-1) != 1 or x.stride(-1) != 1 or y.stride(-1) != 1:
        return False
    if (gate.requires_grad and torch.is_grad_enabled()) or not x.get_device() == y.get_device() == gate.get_device():
        return False
    if not prepare(x.device):
        return False
    if x.is_contiguous() and y.is_contiguous():
        return True
    kernels = _STATE["kernels"]
    return kernels.row_stride(x) is not None and kernels.row_stride(y) is not None


# --------------------------------------------------------------------------------------------------------------------
# RMSNorm + modulation with the ConvRot INT8 codes of its output
# --------------------------------------------------------------------------------------------------------------------
class _NormModulateQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                eps: float, group_size: int) -> torch.Tensor:
        from library.quant import convrot_kernels

        ctx.save_for_backward(x, weight, scale)
        ctx.eps = eps
        y, q, s = _STATE["kernels"].norm_modulate_quant_forward(x, weight, shift, scale, eps, group_size)
        convrot_kernels.cache_quantized_activation(y, group_size, (q, s))
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None
        x, weight, scale = ctx.saved_tensors
        return _STATE["kernels"].norm_modulate_backward(grad, x, weight, scale, ctx.eps), None, None, None, None, None


def fused_norm_modulate_quant(x: torch.Tensor, weight: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                              eps: float, group_size: int) -> torch.Tensor:
    """`fused_norm_modulate`, whose kernel also quantises the output's rows for ConvRot INT8 Linears of
    `group_size` and leaves the codes in their activation cache; only where `norm_modulate_quant_usable` says so."""
    return _NormModulateQuant.apply(x, weight, shift, scale, eps, group_size)


def norm_modulate_quant_usable(x: torch.Tensor, weight: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                               group_size: int | None) -> bool:
    """Whether `fused_norm_modulate_quant` takes these tensors for int8 Linears of `group_size`: the switch on
    (`set_fused_quant`), a rotation group, `norm_modulate_usable`, a row shape the quantiser's one-pass form takes,
    an output the activation cache may keep (not an inference tensor, which has no version counter), and the kernel's
    own check passed on x's device (`prepare_fused_quant`)."""
    if not (_STATE["fused_quant"] and group_size and norm_modulate_usable(x, weight, shift, scale)):
        return False
    if torch.is_inference_mode_enabled():
        return False
    if not _FUSED_QUANT_CHECKED.get(_device_key(x.device)):
        return False
    return _STATE["kernels"].fused_quant_plan(x.shape[-1], group_size) is not None
