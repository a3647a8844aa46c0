"""Where the q/k head norm and RoPE of a DiT block take the fused Triton kernels (`library.runtime.norm_rope_kernels`).

`fused_norm_rope(x, weight, cos, sin, eps)` is `apply_rope(rms_norm(x, weight, eps), cos, sin)` as one kernel forward
and one backward (x's gradient only). `norm_rope_kernel_usable` says where it applies: eager CUDA tensors of the
layouts the kernels take, a norm weight that needs no gradient and fp32 tables that need none; anywhere else (the
CPU, torch.compile, where inductor fuses the plain form itself, a trained norm weight) the block keeps its eager
forms. The kernel module, and Triton with it, is imported on the first CUDA call, so a CPU run never loads it.
`set_norm_rope_kernel(False)` turns the kernels off for same-run comparisons (`bench/eager_block.py`).
Under ``TRITON_INTERPRET=1`` CPU tensors take the kernels too (the tests run them so).
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
_STATE: dict[str, Any] = {"enabled": True, "kernels": None, "failed": False}


def set_norm_rope_kernel(enabled: bool) -> bool:
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
            module = _STATE["kernels"] = importlib.import_module("library.runtime.norm_rope_kernels")
        except Exception as e:  # noqa: BLE001 - a missing or broken Triton: the eager forms, said once
            _STATE["failed"] = True
            logger.info("the fused q/k norm + RoPE kernels are not available (%s); the eager forms run", e)
    return module


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
    (one more in backward, for x's gradient); only where `norm_rope_kernel_usable` says so."""
    return _NormRope.apply(x, weight, cos, sin, eps)


def norm_rope_kernel_usable(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `fused_norm_rope` takes these tensors: on, a CUDA x (any device under Triton's interpreter) of a float
    dtype, [B, S, H, D] with D a power of two and unit stride, a weight [D] without a gradient to compute, and fp32
    tables [B or 1, S, D/2] of one layout that need no gradient."""
    if not _STATE["enabled"] or (x.device.type != "cuda" and not _INTERPRET):
        return False
    if x.dim() != 4 or x.dtype not in _DTYPES or x.stride(-1) != 1:
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
    return _kernels() is not None
