"""Int8 Linears that read one input, stacked: their codes and scales made views of one buffer each, so that one GEMM
over the stacked weight [sum N, K] gives all their outputs (for the DiT's q, k and v, `MossImage.stack_qkv_weights`).

Stacking costs no memory once done (each Linear's `weight` and `weight_scale` become views of the stacked buffers;
the file format and the state dict keys are untouched), and it pays where the separate products are too narrow to
fill the GPU: three 3,072-wide GEMMs at 4,352 rows leave a partial last wave of tiles each, one 9,216-wide GEMM one.

A stack is only valid while every member still reads from it: moving a module (`.to`), block swap (which replaces
`.data`), or assigning a new weight breaks the sharing. `stack_intact` tells, from the data pointers, and the owner
drops a stack that is no longer intact (`BlockProjections.qkv_stack`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

from library.quant import convrot_ops as ops
from library.quant.convrot import ConvRotInt8Linear, _input_for

__all__ = ["stack_int8_linears", "stack_intact", "stackable", "stacked_forward"]


def _plain_int8(linear: nn.Module) -> bool:
    return type(linear) is ConvRotInt8Linear and not linear.full_precision and linear.bias is None


def stackable(linears: Sequence[nn.Module]) -> bool:
    """Whether `linears` can share one stacked weight: plain ConvRot int8 Linears (no bias, not full precision) of
    one input width, one rotation group and one device, with int8 codes [N, K] and fp32 scales [N, 1]."""
    if len(linears) < 2 or not all(_plain_int8(m) for m in linears):
        return False
    first = linears[0]
    for m in linears:
        w, s = m.weight, m.weight_scale
        if (w.dtype != torch.int8 or w.dim() != 2 or s.dtype != torch.float32 or s.shape != (w.shape[0], 1)
                or w.device.type == "meta"):
            return False
        if m.in_features != first.in_features or m.group_size != first.group_size or w.device != first.weight.device:
            return False
    return True


def stack_int8_linears(linears: Sequence[nn.Module]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Copy the codes and scales of `linears` into one int8 buffer [sum N, K] and one fp32 buffer [sum N, 1], in
    order, and make each Linear's `weight` and `weight_scale` views of them; returns the two buffers, or None (nothing
    changed) where the Linears are not `stackable`. The old tensors are released as each Linear is re-pointed, so the
    peak is one extra copy of the largest member."""
    if not stackable(linears):
        return None
    first = linears[0].weight
    rows = sum(m.weight.shape[0] for m in linears)
    weight = torch.empty((rows, first.shape[1]), dtype=torch.int8, device=first.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=first.device)
    start = 0
    for m in linears:
        n = m.weight.shape[0]
        weight[start:start + n].copy_(m.weight)
        scale[start:start + n].copy_(m.weight_scale)
        m.weight = weight[start:start + n]
        m.weight_scale = scale[start:start + n]
        start += n
    return weight, scale


def stack_intact(weight: torch.Tensor, scale: torch.Tensor, linears: Sequence[nn.Module]) -> bool:
    """Whether every one of `linears` still reads its codes and scales from the stacked `weight` and `scale`, in
    order (its tensors are the views `stack_int8_linears` made, or tensors at the same addresses and shapes)."""
    w_ptr, s_ptr, start = weight.data_ptr(), scale.data_ptr(), 0
    width = weight.shape[1]
    for m in linears:
        w, s = getattr(m, "weight", None), getattr(m, "weight_scale", None)
        if not isinstance(w, torch.Tensor) or not isinstance(s, torch.Tensor):
            return False
        n = w.shape[0]
        if w.dtype != torch.int8 or w.shape != (n, width) or w.stride() != (width, 1) or s.shape != (n, 1):
            return False
        if w.data_ptr() != w_ptr + start * width or s.data_ptr() != s_ptr + start * 4 or s.dtype != torch.float32:
            return False
        start += n
    return start == weight.shape[0]


def stacked_forward(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, like: nn.Module,
                    plans: object | None = None) -> torch.Tensor:
    """What the stacked Linears' own forwards give for x, side by side ([..., sum N]), from one product over the
    stacked `weight` and `scale`, with `like`'s (any member's) group and backward: the registered op while compiling,
    the eager product otherwise (`plans`: its launch plans, `library.quant.linear_plan.LinearPlans`). Differentiable in
    x, as `ConvRotInt8Linear.forward` is."""
    x = _input_for(x)
    if torch.compiler.is_compiling():
        return ops.linear(x, weight, scale, None, like.group_size, like.bwd)
    return ops.linear_eager(x, weight, scale, None, like.group_size, like.bwd, plans)
