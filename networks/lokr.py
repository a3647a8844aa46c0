"""LoKr network module for MOSS-Image (`--network_module networks.lokr`): a Kronecker product of two factors.

dW = (alpha / rank) * kron(w1, w2) (`library.lora.weights`), w1 (a x c), w2 (b x d) with out = a * b and in = c * d
from `factorization` of the module's sizes. The modules are chosen exactly as `networks.lora_generic` chooses them
(`networks.network_base`); `--network_dim` is the rank of the low-rank factors.

`--network_args` of its own (LyCORIS' names and meanings):

- `factor` (default -1): the size of the smaller Kronecker factor: -1 takes the most balanced split of each side
  (3072 -> 48 x 64), a positive value that divides a side takes it (factor=8: 3072 -> 8 x 384), else the most
  balanced split not above it.
- `decompose_both` (default False): w1 also becomes a low-rank pair when the rank is below half its larger side.
- `full_matrix` (default False): w1 and w2 both full matrices (no rank, scale 1).

(LyCORIS' `unbalanced_factorization` is refused: LyCORIS' own reader does not rebuild such files.)

w2 is a low-rank pair `lokr_w2_a` (b x rank) @ `lokr_w2_b` (rank x d) when the rank is below half of its larger side,
else a full matrix `lokr_w2` (a warning names how many modules). When both factors are full the module has no rank:
alpha is stored as the rank and the scale is 1, as LyCORIS and ComfyUI read it.

Keys (LyCORIS' names, read by ComfyUI and LyCORIS): `lora_unet_<module>.lokr_w1` or `.lokr_w1_a` / `.lokr_w1_b`,
`.lokr_w2` or `.lokr_w2_a` / `.lokr_w2_b`, `.alpha`. Initialisation as in LyCORIS (the w2 part that closes the product
starts at zero, so training starts from the base model). LoRA+ trains the w1 factor at lr * ratio, as sd-scripts'
LoKr does. The forward never forms kron(w1, w2): it is applied as w1 @ X @ w2^T on the input cut into (c, d) blocks.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from library.errors import UserError
from library.lora.conventions import ALPHA
from library.lora.weights import delta_weight, factorization, kron_linear
from networks.network_args import DEFAULT_NETWORK_ALPHA, DEFAULT_NETWORK_DIM, parse_bool, parse_int
from networks.network_base import AdapterModule, AdapterNetwork, entry_points

logger = logging.getLogger(__name__)

LOKR_ARGS: dict[str, str] = {
    "factor": "int, -1 (most balanced) or the size of the smaller Kronecker factor",
    "decompose_both": "bool, also make w1 a low-rank pair",
    "full_matrix": "bool, full w1 and w2 (no rank, scale 1)",
}


@dataclass(frozen=True)
class LoKrLayout:
    """The shapes of one LoKr module: w1 (a x c), w2 (b x d), each full (rank None) or a low-rank pair."""

    a: int
    b: int
    c: int
    d: int
    w1_rank: int | None
    w2_rank: int | None

    @property
    def full(self) -> bool:
        return self.w1_rank is None and self.w2_rank is None

    @classmethod
    def for_module(
        cls, out_dim: int, in_dim: int, rank: int, factor: int = -1, decompose_both: bool = False,
        full_matrix: bool = False,
    ) -> LoKrLayout:
        """The layout LyCORIS gives a Linear of these sizes with these options."""
        a, b = factorization(out_dim, factor)
        c, d = factorization(in_dim, factor)
        w1_rank = rank if decompose_both and not full_matrix and rank < max(a, c) / 2 else None
        w2_rank = rank if not full_matrix and rank < max(b, d) / 2 else None
        return cls(a, b, c, d, w1_rank, w2_rank)

    @classmethod
    def from_parts(cls, parts: Mapping[str, torch.Tensor]) -> LoKrLayout:
        """The layout of a saved module (its tensors' shapes)."""
        def factor(which: str) -> tuple[int, int, int | None]:
            full = parts.get(f"lokr_{which}")
            if full is not None:
                return int(full.shape[0]), int(full.shape[1]), None
            low, high = parts[f"lokr_{which}_a"], parts[f"lokr_{which}_b"]
            return int(low.shape[0]), int(high.shape[1]), int(high.shape[0])

        a, c, w1_rank = factor("w1")
        b, d, w2_rank = factor("w2")
        return cls(a, b, c, d, w1_rank, w2_rank)


class LoKrModule(AdapterModule):
    """y = org(x) + multiplier * scale * kron(w1, w2) @ x."""

    PLUS_PARAMS = ("lokr_w1",)

    def __init__(
        self,
        lora_name: str,
        original_name: str,
        org_module: nn.Module,
        multiplier: float = 1.0,
        lora_dim: int = DEFAULT_NETWORK_DIM,
        alpha: float | torch.Tensor | None = DEFAULT_NETWORK_ALPHA,
        dropout: float | None = None,
        rank_dropout: float | None = None,
        module_dropout: float | None = None,
        factor: int = -1,
        decompose_both: bool = False,
        full_matrix: bool = False,
        layout: LoKrLayout | None = None,
    ):
        super().__init__(lora_name, original_name, org_module, multiplier, lora_dim, alpha, dropout, rank_dropout,
                         module_dropout)
        self.layout = layout or LoKrLayout.for_module(self.out_dim, self.in_dim, self.lora_dim, factor,
                                                      decompose_both, full_matrix)
        lay = self.layout
        if (lay.a * lay.b, lay.c * lay.d) != (self.out_dim, self.in_dim):
            raise UserError(
                f"LoKr module '{lora_name}' has factors {lay.a}x{lay.c} and {lay.b}x{lay.d}, which do not fit"
                f" '{original_name}' ({self.out_dim}x{self.in_dim}): the file was trained for another model size."
            )
        self._make_factor("w1", lay.a, lay.c, lay.w1_rank, closes=False)
        self._make_factor("w2", lay.b, lay.d, lay.w2_rank, closes=True)
        if lay.full:
            self.alpha.fill_(float(self.lora_dim))  # no rank: scale 1 (stored as alpha = rank)
        self.scale = self._scale()

    def _make_factor(self, which: str, rows: int, cols: int, rank: int | None, closes: bool) -> None:
        """A full (rows x cols) matrix or a pair (rows x rank) @ (rank x cols); the closing factor of the product
        starts at zero (its full matrix, or the right half of its pair)."""
        if rank is None:
            tensors = {f"lokr_{which}": torch.empty(rows, cols)}
        else:
            tensors = {f"lokr_{which}_a": torch.empty(rows, rank), f"lokr_{which}_b": torch.empty(rank, cols)}
        for i, (name, tensor) in enumerate(tensors.items()):
            if closes and i == len(tensors) - 1:
                nn.init.zeros_(tensor)
            else:
                nn.init.kaiming_uniform_(tensor, a=math.sqrt(5))
            setattr(self, name, nn.Parameter(tensor))

    def _scale(self) -> float:
        layout = getattr(self, "layout", None)
        return 1.0 if layout is not None and layout.full else super()._scale()

    def _w1(self) -> torch.Tensor:
        return self.lokr_w1 if self.layout.w1_rank is None else self.lokr_w1_a @ self.lokr_w1_b

    def _w2(self) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.lokr_w2 if self.layout.w2_rank is None else (self.lokr_w2_a, self.lokr_w2_b)

    def delta_output(self, x: torch.Tensor) -> torch.Tensor:
        w1 = self._w1()
        return self.drop_output(kron_linear(self._adapter_input(x, w1), w1, self._w2()) * self.scale)

    def weight_delta(self) -> torch.Tensor:
        parts = {name: p.detach() for name, p in self.named_parameters()}
        return delta_weight({**parts, ALPHA: self.alpha}, "lokr")  # the reader's scale is the module's own

    def scale_weights_(self, ratio: float) -> None:
        factor = math.sqrt(ratio)
        with torch.no_grad():
            for which, rank in (("w1", self.layout.w1_rank), ("w2", self.layout.w2_rank)):
                getattr(self, f"lokr_{which}" if rank is None else f"lokr_{which}_a").mul_(factor)


class LoKrNetwork(AdapterNetwork):
    """The LoKr modules of one run; its state_dict is the LoKr file."""

    MODULE_NAME = "networks.lokr"
    ALGORITHM = "lokr"
    ALGORITHM_NAMES = ("lokr",)
    EXTRA_ARGS = LOKR_ARGS
    LAYOUT_ARGS = tuple(LOKR_ARGS)
    module_class: ClassVar[type[AdapterModule]] = LoKrModule

    @classmethod
    def parse_module_kwargs(cls, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        factor = parse_int("factor", kwargs.get("factor", -1))
        if factor == 0 or factor < -1:
            raise UserError(
                f"--network_args factor={factor} is not a factor: give -1 (the most balanced split) or a positive"
                " size such as 8."
            )
        flags = {k: parse_bool(k, kwargs.get(k, False)) for k in ("decompose_both", "full_matrix")}
        return {"factor": factor, **flags}

    @classmethod
    def module_args_from_parts(cls, parts: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        layout = LoKrLayout.from_parts(parts)
        rank = layout.w2_rank or layout.w1_rank
        alpha = parts.get(ALPHA)
        if rank is None:  # no rank: alpha is stored as the rank (LyCORIS); any positive value works, scale is 1
            rank = max(1, round(float(alpha))) if alpha is not None else 1
        return {"lora_dim": rank, "alpha": alpha, "layout": layout}

    def finish_build(self) -> None:
        requested = self.module_kwargs.get("full_matrix", False)
        forced = [m for m in self.unet_loras + self.text_encoder_loras if m.layout.w2_rank is None and not requested]
        if forced:
            logger.warning(
                "LoKr: for %d modules the rank is at least half of the larger side of w2 (e.g. %s, rank %d): their w2"
                " is a full matrix; a smaller --network_dim or another factor keeps it low-rank",
                len(forced), forced[0].original_name, forced[0].lora_dim,
            )


create_network, create_network_from_weights = entry_points(LoKrNetwork)
