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
  methods ``tensors``, ``forward`` and ``grad_input(..., in_place=)``). The base's node goes too, and with it the add
  that would sum the base's and the LoRA's input gradients: the LoRA's input gradient is the addend of the base's
  backward product.

Where `LoRALinear` can, it adds in place, into tensors that it made itself: the up-projection into the product's
output, and the base's input gradient into the LoRA's (the base's backward product takes it as its addend). A new
tensor from addmm costs a device copy of its addend first (torch's addmm copies ``self`` into the result, then
accumulates): two M x N copies per Linear and step, twelve per block, about 10 ms of a 1024x1024 step on an H200. The
forward's in-place add is skipped where a dispatch mode is active: selective checkpointing may keep the product's
output for the recomputation, which an add in place would change.

- `LoRAGroup`: several such Linears of one input (a block's q, k and v), one node for all. Their down-projections
  are one product (x read once, the rank activations side by side), and so are the LoRA parts of the input gradient
  and the down-projections' gradients; the bases' input gradients are added in place into that one tensor, instead
  of three tensors that autograd adds up. A block asks for it with `lora_group_parts` (None: call the Linears).

The gradients of the LoRA weights: each is one product of two rank-wide or full-width activations, scaled by alpha,
in the weight's dtype (fp32 for trained LoRA weights, whatever the compute dtype). On CUDA, with bf16 or fp16
activations and fp32 weights, one addmm writes it (`_weight_grad`: alpha applied to the fp32 accumulator, fp32
output, the ``out_dtype`` of torch's addmm), where the operators take three kernels (the product rounded to bf16, a
multiply, a cast to fp32): about 500 kernels fewer per step of the full-size DiT, and the gradient is no longer
rounded to bf16 on the way (its sum over the rows always was accumulated in fp32). Elsewhere (the CPU has no such
addmm) the product is scaled and cast as before.

`set_lora_one_node(False)` makes LoRAModule use the operators again (the same kernels; the benchmark's comparison);
`set_lora_in_place(False)` makes the nodes add into new tensors (the same sums, bit for bit); `set_lora_grouped(
False)` makes each Linear of a group its own `LoRALinear`; `set_lora_fp32_grads(False)` takes the weight gradients
as bf16 products, scaled and cast (the benchmark's comparison).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# the attribute (in a module's __dict__, not a submodule) that names the network module applied to it
ADAPTER_ATTR = "_lora_adapter"

__all__ = ["ADAPTER_ATTR", "DenseProduct", "LoRAAddmm", "LoRAGroup", "LoRALinear", "NodePart", "adapter_of",
           "adapter_parts", "fp32_grads", "grouped", "in_place", "lora_group", "lora_group_parts", "one_node",
           "scale_on_ranks", "set_lora_fp32_grads", "set_lora_grouped", "set_lora_in_place", "set_lora_one_node",
           "set_scale_on_ranks"]

_ONE_NODE = {"enabled": True, "in_place": True, "grouped": True, "scale_on_ranks": True, "fp32_grads": True}


def _switch(name: str, enabled: bool) -> bool:
    """Set one of the switches; returns its previous setting."""
    previous = _ONE_NODE[name]
    _ONE_NODE[name] = bool(enabled)
    return previous


def set_lora_one_node(enabled: bool) -> bool:
    """Let eager LoRA modules run as one autograd node (the default) or as separate operators. Returns the previous
    setting."""
    return _switch("enabled", enabled)


def one_node() -> bool:
    return _ONE_NODE["enabled"]


def set_lora_in_place(enabled: bool) -> bool:
    """Let `LoRALinear` add into the tensors it made (the default) or into new ones (a device copy each: the
    benchmark's comparison). Returns the previous setting."""
    return _switch("in_place", enabled)


def in_place() -> bool:
    return _ONE_NODE["in_place"]


def set_lora_grouped(enabled: bool) -> bool:
    """Let a block's Linears of one input run as one `LoRAGroup` node (the default), and in compiled blocks as one
    down-projection (`library.lora.compiled_group`), or each as its own (the benchmark's comparison). Returns the
    previous setting."""
    return _switch("grouped", enabled)


def grouped() -> bool:
    return _ONE_NODE["grouped"]


def set_scale_on_ranks(enabled: bool) -> bool:
    """Let the plain LoRA (what compiled blocks trace: `library.lora.compiled_group.up_projection`) scale its rank
    activations (the default) or its output, as it did before (the benchmark's comparison). Returns the previous
    setting."""
    return _switch("scale_on_ranks", enabled)


def scale_on_ranks() -> bool:
    return _ONE_NODE["scale_on_ranks"]


def set_lora_fp32_grads(enabled: bool) -> bool:
    """Let the nodes write the LoRA weights' gradients in fp32 from one addmm where CUDA offers it (the default), or
    take them as products in the compute dtype, scaled and cast (the benchmark's comparison). Returns the previous
    setting."""
    return _switch("fp32_grads", enabled)


def fp32_grads() -> bool:
    return _ONE_NODE["fp32_grads"]


_HALF = (torch.bfloat16, torch.float16)
_FP32_ADDMM: dict[torch.device, bool] = {}


def _fp32_addmm_works(device: torch.device) -> bool:
    """Whether this torch's addmm writes fp32 from half operands on `device` (``out_dtype``: CUDA only, recent torch),
    tried once per device on a 2 x 2 product against the fp32 one."""
    if device.type == "cuda" and device.index is None:  # one key per GPU, however the caller names it
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _FP32_ADDMM:
        a = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device=device, dtype=torch.bfloat16)
        try:
            got = _fp32_addmm(a, a, 0.5)
            works = got.dtype == torch.float32 and torch.equal(got, 0.5 * (a.float() @ a.float()))
        except (RuntimeError, TypeError, NotImplementedError):
            works = False
        _FP32_ADDMM[device] = works
    return _FP32_ADDMM[device]


def _fp32_addmm(a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha * a @ b written in fp32 from half operands by one addmm (``out_dtype``). torch's CUDA implementation wants
    an addend of the operands' dtype and the output's shape (it sizes the output by it); beta 0 leaves it unread, so
    an uninitialised one does: no kernel to fill it."""
    return torch.addmm(a.new_empty((a.shape[0], b.shape[1])), a, b, beta=0, alpha=alpha, out_dtype=torch.float32)


def _scaled_product(a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha * a @ b as one addmm (alpha in the product's epilogue), not a product and a multiply. With beta 0 the
    addend is not read (torch's documented contract: not even its NaNs), so an uninitialised scalar does: no kernel to
    fill it."""
    return torch.addmm(a.new_empty(()), a, b, beta=0, alpha=alpha)


def _weight_grad(a: torch.Tensor, b: torch.Tensor, alpha: float, dtype: torch.dtype) -> torch.Tensor:
    """alpha * a @ b as a LoRA weight's gradient in its dtype: one addmm writing fp32 where the weight is fp32, the
    operands half and the device's addmm can (`set_lora_fp32_grads`); else the product in the operands' dtype, scaled
    and cast."""
    if (dtype == torch.float32 and a.dtype in _HALF and a.is_cuda and fp32_grads()
            and _fp32_addmm_works(a.device)):
        return _fp32_addmm(a, b, alpha)
    g = torch.mm(a, b)
    if alpha != 1.0:
        g.mul_(alpha)
    return g.to(dtype)


def _no_dispatch_mode() -> bool:
    """True when no Python dispatch mode (selective checkpointing's, a fake-tensor mode) sees the operators."""
    return torch._C._len_torch_dispatch_stack() == 0


def _add_up(out: torch.Tensor, lx: torch.Tensor, up: torch.Tensor, alpha: float) -> torch.Tensor:
    """out + alpha * lx @ up^T (out: the product's output, the node's own tensor), shaped as out: in place, where no
    dispatch mode is active (selective checkpointing may keep the product's output for the recomputation, which an
    add in place would change) and `set_lora_in_place` allows it; else into a new tensor."""
    out2 = out.reshape(-1, out.shape[-1])
    if in_place() and _no_dispatch_mode():
        return out2.addmm_(lx, up.t(), alpha=alpha).view(out.shape)
    return torch.addmm(out2, lx, up.t(), alpha=alpha).view(out.shape)


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
        glx = _scaled_product(g2, u, ctx.alpha)
        if need_x:
            grad_x = torch.mm(glx, d)
        if need_down:
            grad_down = _weight_grad(glx.t(), x2, 1.0, ctx.dtypes[0])
    if need_up:
        grad_up = _weight_grad(g2.t(), lx, ctx.alpha, ctx.dtypes[1])
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
        y = _add_up(product.forward(org, x, *base), lx, u, alpha)
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


@dataclass(frozen=True)
class NodePart:
    """What `LoRALinear` takes for one wrapped Linear (an adapter's `node_part`): the LoRA weights, the multiplier x
    scale, the frozen Linear and its product (`DenseProduct` or `Int8Product`) with the tensors that product keeps."""

    down: torch.Tensor
    up: torch.Tensor
    alpha: float
    org: nn.Module
    product: Any
    base: tuple[torch.Tensor, ...]


def lora_group_parts(linears: Sequence[nn.Module], x: torch.Tensor) -> list[NodePart] | None:
    """The parts of one `LoRAGroup` over `linears`, all called with x, or None where the group does not apply: the
    grouping off, a Linear without an adapter that offers its part for this call (`node_part`: one-node LoRA in
    eager mode, no dropout, nothing of the base to train), or LoRA weights of several dtypes."""
    if not (grouped() and one_node()):
        return None
    return adapter_parts(linears, x, "node_part")


def adapter_of(module: nn.Module) -> Any:
    """The network module whose forward replaced `module`'s last (`networks.network_base` sets `ADAPTER_ATTR` when
    it applies one), or None. Read from the module's attributes, not from its bound forward's `__self__`, which
    torch.compile does not trace in every torch version."""
    return getattr(module, ADAPTER_ATTR, None)


def adapter_parts(linears: Sequence[nn.Module], x: torch.Tensor, method: str) -> list[Any] | None:
    """Each Linear's part of a group as its adapter's `method` gives it for x (`node_part`, `plain_part`), or None
    where one Linear has no such adapter or its adapter declines, or the LoRA weights are of several dtypes."""
    parts = []
    for m in linears:
        adapter = adapter_of(m)
        part_of = getattr(adapter, method, None)
        part = part_of(x) if part_of is not None else None
        if part is None:
            return None
        parts.append(part)
    if len({p.down.dtype for p in parts}) > 1 or len({p.up.dtype for p in parts}) > 1:
        return None
    return parts


def lora_group(x: torch.Tensor, parts: Sequence[NodePart]) -> tuple[torch.Tensor, ...]:
    """Each part's org(x) + alpha * (x @ down^T) @ up^T, as one autograd node (`LoRAGroup`)."""
    meta = tuple((p.alpha, p.org, p.product, len(p.base)) for p in parts)
    flat = [t for p in parts for t in (p.down, p.up, *p.base)]
    return LoRAGroup.apply(x, meta, *flat)


def _unflatten(meta: tuple, flat: Sequence[Any]) -> tuple[list[Any], list[Any], list[tuple[Any, ...]]]:
    """`lora_group`'s flat tensors back as the downs, the ups and each part's base tensors."""
    downs, ups, bases, i = [], [], [], 0
    for _alpha, _org, _product, n_base in meta:
        downs.append(flat[i])
        ups.append(flat[i + 1])
        bases.append(tuple(flat[i + 2:i + 2 + n_base]))
        i += 2 + n_base
    return downs, ups, bases


class LoRAGroup(torch.autograd.Function):
    """`LoRALinear` for several frozen Linears of one input x (in the compute dtype), one node: the down-projections
    as one product, the LoRA's input gradient as one product into which the bases' input gradients are added."""

    @staticmethod
    def forward(ctx, x, meta, *flat):  # type: ignore[override]
        dtype = x.dtype
        downs, ups, bases = _unflatten(meta, flat)
        d = torch.cat(downs).to(dtype)  # [sum of ranks, K]
        x2 = x.reshape(-1, x.shape[-1])
        lx = torch.mm(x2, d.t())
        us = [u.to(dtype) for u in ups]
        outs, start = [], 0
        for (alpha, org, product, _), u, base in zip(meta, us, bases):
            rank = u.shape[1]
            outs.append(_add_up(product.forward(org, x, *base), lx[:, start:start + rank], u, alpha))
            start += rank
        ctx.save_for_backward(x2, lx, d, *us, *(t for base in bases for t in base))
        ctx.meta, ctx.x_shape = meta, x.shape
        ctx.dtypes = [(dn.dtype, up.dtype) for dn, up in zip(downs, ups)]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        saved = ctx.saved_tensors  # read once (non-reentrant checkpointing allows one unpacking)
        meta, n = ctx.meta, len(ctx.meta)
        x2, lx, d, us = saved[0], saved[1], saved[2], saved[3:3 + n]
        base_flat, bases, i = saved[3 + n:], [], 0
        for *_, n_base in meta:
            bases.append(base_flat[i:i + n_base])
            i += n_base
        needs = ctx.needs_input_grad
        need_x = needs[0]
        g2s = [g.reshape(-1, g.shape[-1]) for g in grads]
        flat_index, need_down, need_up = 2, [], []
        for *_, n_base in meta:  # the positions of each part's down and up among the inputs
            need_down.append(needs[flat_index])
            need_up.append(needs[flat_index + 1])
            flat_index += 2 + n_base
        grad_x = grad_down = None
        if need_x or any(need_down):
            glx = torch.cat([_scaled_product(g2, u, alpha) for g2, u, (alpha, *_) in zip(g2s, us, meta)], dim=1)
            if need_x:
                grad_x = torch.mm(glx, d)  # every part's LoRA input gradient, in one product
                for g2, (_, org, product, _), base in zip(g2s, meta, bases):
                    grad_x = product.grad_input(org, g2, grad_x, *base, in_place=in_place())
                grad_x = grad_x.view(ctx.x_shape)
            if any(need_down):  # the parts' down dtypes are one (`adapter_parts`)
                grad_down = _weight_grad(glx.t(), x2, 1.0, ctx.dtypes[0][0])
        out: list[torch.Tensor | None] = [grad_x, None]
        start = 0
        for k, (g2, u, part_meta) in enumerate(zip(g2s, us, meta)):
            alpha, n_base, rank = part_meta[0], part_meta[3], u.shape[1]
            gd = grad_down[start:start + rank] if need_down[k] else None
            gu = _weight_grad(g2.t(), lx[:, start:start + rank], alpha, ctx.dtypes[k][1]) if need_up[k] else None
            out += [gd, gu, *(None for _ in range(n_base))]
            start += rank
        return tuple(out)
