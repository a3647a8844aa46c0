"""A LoRA-wrapped Linear as one autograd node in eager mode (`networks.lora_generic.LoRAModule`).

Written as operators, ``org(x) + alpha * up(down(x))`` records about nine autograd nodes per Linear (the casts of the
two LoRA weights to the compute dtype, two transposes, two products, views) on top of the base Linear's own. Each
costs host time in every pass of an eager step: the forward, the recomputation under checkpointing and the backward;
on a fast GPU that host time is the step's time. The nodes here launch the kernels the operators would, and keep what
they would keep (x, the rank activations, the two cast weights, the base's frozen tensors):

- `LoRAAddmm`: ``out + alpha * (x @ down^T) @ up^T`` given the base's output, one node (the up-projection accumulated
  into out by addmm). Used where the base's own forward must run.
- `LoRALinear`: the whole wrapped Linear, where the base is frozen and its product can run inside the node
  (`DenseProduct` for `nn.Linear`, `library.quant.convrot.Int8Product` for the ConvRot INT8 Linear, both with the
  methods ``tensors``, ``forward`` and ``grad_input(..., in_place=)``). The base's node goes too, and with it the add that would sum
  the base's and the LoRA's input gradients: the LoRA's input gradient is the addend of the base's backward product.

Where `LoRALinear` can, it adds in place, into tensors that it made itself: the up-projection into the product's
output, and the base's input gradient into the LoRA's (the base's backward product takes it as its addend). A new
tensor from addmm costs a device copy of its addend first (torch's addmm copies ``self`` into the result, then
accumulates): two M x N copies per Linear and step, twelve per block, about 10 ms of a 1024x1024 step on an H200. The
forward's in-place add is skipped where a dispatch mode is active: selective checkpointing may keep the product's
output for the recomputation, which an add in place would change.

`set_lora_one_node(False)` makes LoRAModule use the operators again (the same kernels; the benchmark's comparison);
`set_lora_in_place(False)` makes the nodes add into new tensors (the same sums, bit for bit).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["DenseProduct", "LoRAAddmm", "LoRALinear", "in_place", "one_node", "set_lora_in_place",
           "set_lora_one_node"]

_ONE_NODE = {"enabled": True, "in_place": True}


def set_lora_one_node(enabled: bool) -> bool:
    """Let eager LoRA modules run as one autograd node (the default) or as separate operators. Returns the previous
    setting."""
    previous = _ONE_NODE["enabled"]
    _ONE_NODE["enabled"] = bool(enabled)
    return previous


def one_node() -> bool:
    return _ONE_NODE["enabled"]


def set_lora_in_place(enabled: bool) -> bool:
    """Let `LoRALinear` add into the tensors it made (the default) or into new ones (a device copy each: the
    benchmark's comparison). Returns the previous setting."""
    previous = _ONE_NODE["in_place"]
    _ONE_NODE["in_place"] = bool(enabled)
    return previous


def in_place() -> bool:
    return _ONE_NODE["in_place"]


def _no_dispatch_mode() -> bool:
    """True when no Python dispatch mode (selective checkpointing's, a fake-tensor mode) sees the operators."""
    return torch._C._len_torch_dispatch_stack() == 0


def _rank_forward(x: torch.Tensor, down: torch.Tensor, up: torch.Tensor, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x as rows, the rank activations x @ down^T, and the two weights in `dtype`."""
    d, u = down.to(dtype), up.to(dtype)
    x2 = x.reshape(-1, x.shape[-1])
    return x2, torch.mm(x2, d.t()), d, u


def _rank_backward(ctx: Any, saved: tuple[torch.Tensor, ...], g2: torch.Tensor, need_x: bool, need_down: bool,
                   need_up: bool) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """From the output's gradient (rows) and the saved x rows, rank activations and cast weights: the LoRA path's
    input gradient (rows), and the gradients of down and up in their own dtypes; None for what is not needed.
    (`ctx.saved_tensors` is read once by the caller: non-reentrant checkpointing allows one unpacking.)"""
    x2, lx, d, u = saved
    grad_x = grad_down = grad_up = None
    if need_x or need_down:
        glx = torch.mm(g2, u).mul_(ctx.alpha)
        if need_x:
            grad_x = torch.mm(glx, d)
        if need_down:
            grad_down = torch.mm(glx.t(), x2).to(ctx.dtypes[0])
    if need_up:
        grad_up = torch.mm(g2.t(), lx).mul_(ctx.alpha).to(ctx.dtypes[1])
    return grad_x, grad_down, grad_up


class LoRAAddmm(torch.autograd.Function):
    """out + alpha * (x @ down^T) @ up^T, with down and up in out's dtype (x must have it), as one autograd node."""

    @staticmethod
    def forward(ctx, out, x, down, up, alpha):  # type: ignore[override]
        x2, lx, d, u = _rank_forward(x, down, up, out.dtype)
        y = torch.addmm(out.reshape(-1, out.shape[-1]), lx, u.t(), alpha=alpha)
        ctx.save_for_backward(x2, lx, d, u)
        ctx.alpha, ctx.x_shape, ctx.dtypes = alpha, x.shape, (down.dtype, up.dtype)
        return y.view(out.shape)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        need_out, need_x, need_down, need_up = ctx.needs_input_grad[:4]
        grad_x, grad_down, grad_up = _rank_backward(ctx, ctx.saved_tensors, grad.reshape(-1, grad.shape[-1]), need_x,
                                                    need_down, need_up)
        if grad_x is not None:
            grad_x = grad_x.view(ctx.x_shape)
        return (grad if need_out else None), grad_x, grad_down, grad_up, None


class DenseProduct:
    """A frozen `nn.Linear`'s product as `LoRALinear` runs it: F.linear forward, addmm backward (the LoRA's input
    gradient as the addend)."""

    @staticmethod
    def tensors(m: nn.Linear) -> tuple[torch.Tensor, ...]:
        """What the node keeps for backward (what the Linear's own node keeps): the weight (and the bias)."""
        return (m.weight,) if m.bias is None else (m.weight, m.bias)

    @staticmethod
    def forward(m: nn.Linear, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def grad_input(m: nn.Linear, grad: torch.Tensor, accumulate: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None, in_place: bool = False) -> torch.Tensor:
        """accumulate + the gradient of x, from the output's gradient (both 2-D, rows x features); with `in_place`,
        added into `accumulate` (the caller's own tensor)."""
        if in_place:
            return accumulate.addmm_(grad, weight)
        return torch.addmm(accumulate, grad, weight)


class LoRALinear(torch.autograd.Function):
    """org(x) + alpha * (x @ down^T) @ up^T as one autograd node, where org is a frozen Linear whose product the node
    runs itself (`product`: `DenseProduct` or `Int8Product`); x in the compute dtype."""

    @staticmethod
    def forward(ctx, x, down, up, alpha, org, product, *base):  # type: ignore[override]
        x2, lx, d, u = _rank_forward(x, down, up, x.dtype)
        out = product.forward(org, x, *base)
        out2 = out.reshape(-1, out.shape[-1])
        if in_place() and _no_dispatch_mode():  # the product's output is the node's own: no copy of it
            y = out2.addmm_(lx, u.t(), alpha=alpha).view(out.shape)
        else:  # selective checkpointing may keep the product's output for the recomputation: a new tensor
            y = torch.addmm(out2, lx, u.t(), alpha=alpha).view(out.shape)
        ctx.save_for_backward(x2, lx, d, u, *base)
        ctx.alpha, ctx.x_shape, ctx.dtypes, ctx.org, ctx.product = alpha, x.shape, (down.dtype, up.dtype), org, product
        return y

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        need_x, need_down, need_up = ctx.needs_input_grad[:3]
        g2 = grad.reshape(-1, grad.shape[-1])
        saved = ctx.saved_tensors
        base = saved[4:]
        grad_x, grad_down, grad_up = _rank_backward(ctx, saved[:4], g2, need_x, need_down, need_up)
        if grad_x is not None:
            # grad_x is the node's own tensor (`_rank_backward` made it): the base's gradient is added into it
            grad_x = ctx.product.grad_input(ctx.org, g2, grad_x, *base, in_place=in_place()).view(ctx.x_shape)
        return grad_x, grad_down, grad_up, None, None, None, *(None for _ in base)
