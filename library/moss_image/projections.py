"""The six Linears of a MOSS-Image block (`BlockProjections`, named as in the official checkpoints) and their q/k/v
stack: ConvRot INT8 q, k and v made views of one stacked weight so that compiled blocks run one product for the three
(`library.quant.int8_stack`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from library.quant.int8_stack import stack_int8_linears, stack_intact
from library.quant.linear_plan import LinearPlans

if TYPE_CHECKING:
    from library.moss_image.dit import MossImageConfig

logger = logging.getLogger(__name__)

__all__ = ["BlockProjections"]


class BlockProjections(nn.Module):
    """The six Linears of a block, named as in the official checkpoints (`proj.q`, ..., `proj.ffn_down`).

    With ConvRot INT8, `stack_qkv` makes q, k and v views of one stacked weight (`library.quant.int8_stack`), which a
    block compiled for inference multiplies by its input's codes in one product (`qkv_stack`). The stacked buffers
    are not state (not in the state dict); moving the module drops them."""

    def __init__(self, cfg: MossImageConfig):
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn_hidden
        self.q = nn.Linear(h, h, bias=False)
        self.k = nn.Linear(h, h, bias=False)
        self.v = nn.Linear(h, h, bias=False)
        self.o = nn.Linear(h, h, bias=False)
        self.ffn_up_gate = nn.Linear(h, 2 * f, bias=False)  # output [value | gate]
        self.ffn_down = nn.Linear(f, h, bias=False)
        self.register_buffer("qkv_weight", None, persistent=False)
        self.register_buffer("qkv_weight_scale", None, persistent=False)
        self.stack_plans: LinearPlans | None = None

    def stack_qkv(self) -> bool:
        """Stack q, k and v (ConvRot int8, no bias, one device; `int8_stack.stack_int8_linears`); False where they
        cannot be stacked."""
        stacked = stack_int8_linears((self.q, self.k, self.v))
        if stacked is None:
            return False
        self.qkv_weight, self.qkv_weight_scale = stacked
        self.stack_plans = LinearPlans()  # the eager stacked product's launch plans (`_stacked_bases`)
        return True

    def unstack_qkv(self) -> None:
        """Drop the stacked buffers (q, k and v keep their views, and with them the memory, until they are moved)."""
        self.qkv_weight = self.qkv_weight_scale = None

    def check_qkv_stack(self) -> bool:
        """Whether a stack is held and q, k and v still read from it; one that they no longer read (the module was
        moved, a weight replaced, block swap) is dropped here. Called outside the compiled region, once per
        image (`MossImage.prepare_text`; about 7 us a block on a slow host, too much for every pass)."""
        if self.qkv_weight is None:
            return False
        if stack_intact(self.qkv_weight, self.qkv_weight_scale, (self.q, self.k, self.v)):
            return True
        logger.warning("q, k and v no longer read their stacked weight (moved or replaced): dropping the stack")
        self.unstack_qkv()
        return False

    def qkv_stack(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The stacked codes [3W, W] and scales [3W, 1] of q, k and v, or None where they are not stacked."""
        return None if self.qkv_weight is None else (self.qkv_weight, self.qkv_weight_scale)

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        self.unstack_qkv()  # q, k and v move as three tensors; the stack would be a stale fourth copy
        return super()._apply(fn, recurse)
