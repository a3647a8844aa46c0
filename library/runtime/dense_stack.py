"""Plain (bf16 / fp32) Linears that read one input, stacked: their weights made views of one buffer [sum N, K], so
that one product gives all their outputs (the DiT's q, k and v, `MossImage.stack_qkv_weights`), the dense
counterpart of `library.quant.int8_stack`.

Stacking costs no memory once done: each Linear's `weight` becomes a frozen Parameter viewing its rows of the stacked
buffer, so the state dict keys and values are unchanged. One product of [M, K] x [K, 3W] leaves one partial last wave
of GPU tiles where three [K, W] products leave three, and its input gradient is one product instead of three and two
additions. A stack is valid while every member still reads from it (`dense_stack_intact`); moving a module, block
swap or a replaced weight breaks it, and the owner drops it (`BlockProjections.check_qkv_stack`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["dense_stack_intact", "dense_stackable", "stack_dense_linears"]


def dense_stackable(linears: Sequence[nn.Module]) -> bool:
    """Whether `linears` can share one stacked weight: plain `nn.Linear`s without bias whose weights are frozen,
    2-D, of one input width, dtype and device (not on the meta device)."""
    if len(linears) < 2 or not all(type(m) is nn.Linear and m.bias is None for m in linears):
        return False
    first = linears[0].weight
    return all(m.weight.dim() == 2 and not m.weight.requires_grad and m.weight.shape[1] == first.shape[1]
               and m.weight.dtype == first.dtype and m.weight.device == first.device
               and m.weight.device.type != "meta" for m in linears)


def stack_dense_linears(linears: Sequence[nn.Module]) -> torch.Tensor | None:
    """Copy the weights of `linears` into one buffer [sum N, K], in order, and make each Linear's `weight` a frozen
    Parameter viewing its rows; returns the buffer, or None (nothing changed) where they are not `dense_stackable`.
    The old weights are released as each Linear is re-pointed: the peak is one extra copy of the largest member."""
    if not dense_stackable(linears):
        return None
    first = linears[0].weight
    rows = sum(m.weight.shape[0] for m in linears)
    weight = torch.empty((rows, first.shape[1]), dtype=first.dtype, device=first.device)
    start = 0
    for m in linears:
        n = m.weight.shape[0]
        weight[start:start + n].copy_(m.weight.detach())
        m.weight = nn.Parameter(weight[start:start + n], requires_grad=False)
        start += n
    return weight


def dense_stack_intact(weight: torch.Tensor, linears: Sequence[nn.Module]) -> bool:
    """Whether every one of `linears` still reads its weight from the stacked `weight`, in order."""
    ptr, width, start = weight.data_ptr(), weight.shape[1], 0
    for m in linears:
        w = getattr(m, "weight", None)
        if not isinstance(w, torch.Tensor) or w.dtype != weight.dtype or w.dim() != 2:
            return False
        n = w.shape[0]
        if w.shape != (n, width) or w.stride() != (width, 1) or w.data_ptr() != ptr + start * width * w.element_size():
            return False
        start += n
    return start == weight.shape[0]
