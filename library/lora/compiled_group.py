"""A block's q, k and v LoRA as one down-projection inside compiled regions (and in the eager plain forms, which
compute what a compiled region computes, `library.runtime.eager_fusion.plain_forms`).

The eager `library.lora.eager_node.LoRAGroup` runs the three LoRA-wrapped Linears of one input as one autograd node.
torch.compile traces operators, not that node, so here the same grouping is written as operators for it to trace:
the three down-projection weights side by side (``torch.cat``) and one product ``x @ [down_q; down_k; down_v]^T``,
whose gradient autograd then also takes as one product for x (rank 3r instead of three of rank r) and one for the
three weights. Each output is ``base(x) + alpha * lx[:, part] @ up^T`` as the plain LoRA computes it. A block asks
with `plain_group_parts` (None: call the Linears); `eager_node.set_lora_grouped(False)` turns the grouping off here
too (the benchmark's comparison).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from library.lora.eager_node import adapter_parts, grouped, scale_on_ranks

__all__ = ["PlainPart", "plain_group", "plain_group_parts", "up_projection"]


@dataclass(frozen=True)
class PlainPart:
    """One LoRA-wrapped Linear of a group (an adapter's `plain_part`): its LoRA weights, multiplier x scale, the
    base's forward, and the wrapped module where that forward is the module's own (None: another wrapper's)."""

    down: torch.Tensor
    up: torch.Tensor
    alpha: float
    base: Callable[[torch.Tensor], torch.Tensor]
    own_base: nn.Module | None = None


def up_projection(lx: torch.Tensor, up: Callable[[torch.Tensor], torch.Tensor], alpha: float) -> torch.Tensor:
    """alpha * up(lx) of the plain LoRA, alpha applied to the rank activations: the same product, and its backward
    scales a rank-wide gradient instead of the full-width output gradient (a pass over it per Linear in a compiled
    step). `eager_node.set_scale_on_ranks(False)` scales the output instead (the benchmark's comparison)."""
    return up(lx * alpha) if scale_on_ranks() else up(lx) * alpha


def plain_group_parts(linears: Sequence[nn.Module], x: torch.Tensor) -> list[PlainPart] | None:
    """The parts of a group over `linears`, all called with x, or None where it does not apply: the grouping off, a
    Linear without an adapter that offers its part for this call (`plain_part`: on, no dropout, dtypes that need no
    cast autocast would not make), or LoRA weights of several dtypes."""
    return adapter_parts(linears, x, "plain_part") if grouped() else None


def plain_group(x: torch.Tensor, parts: Sequence[PlainPart],
                bases: Sequence[torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
    """Each part's base(x) + alpha * (x @ down^T) @ up^T, in the base output's dtype, the down-projections as one
    product (alpha on the rank activations, as `LoRAModule.delta_output` has it). `bases`: the parts' base(x) where
    the caller computed them together (ConvRot INT8 q, k and v stacked: `MossImageBlock._stacked_bases`)."""
    lx = F.linear(x, torch.cat([p.down for p in parts]))
    outs, start = [], 0
    for i, p in enumerate(parts):
        rank = p.up.shape[1]
        out = p.base(x) if bases is None else bases[i]
        delta = up_projection(lx[..., start:start + rank], lambda t, u=p.up: F.linear(t, u), p.alpha)
        outs.append(out + delta.to(out.dtype))
        start += rank
    return tuple(outs)
