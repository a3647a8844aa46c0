"""LoHa network module for MOSS-Image (`--network_module networks.loha`): the Hadamard product of two low-rank pairs.

dW = (alpha / rank) * (w1_a @ w1_b) * (w2_a @ w2_b), element by element (`library.lora.weights`): with rank r it
reaches rank r^2 for the parameters of a rank-2r LoRA. The modules are chosen exactly as `networks.lora_generic`
chooses them (`networks.network_base`: DiT blocks, `train_text_embedder`, the text encoder, include / exclude
patterns, `network_reg_dims` / `network_reg_lrs`, LoRA+, dropouts); `--network_dim` is the rank of each pair.

Keys (LyCORIS' names, which ComfyUI and LyCORIS read): `lora_unet_<module>.hada_w1_a` (out x rank), `.hada_w1_b`
(rank x in), `.hada_w2_a`, `.hada_w2_b`, `.alpha`; `lora_te_<module>.*` for the text encoder. Initialisation as in
LyCORIS: w1_a ~ N(0, 0.1), w1_b and w2_b ~ N(0, 1), w2_a = 0, so training starts from the base model. LoRA+
(`loraplus_*`) trains hada_w2_a at lr * ratio, as sd-scripts' LoHa does. Dropout and rank dropout act on the
module's output change (rank dropout drops output features), as LyCORIS defines them for LoHa.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from library.lora.conventions import ALPHA
from library.lora.weights import delta_weight, hadamard_product
from networks.network_args import DEFAULT_NETWORK_ALPHA, DEFAULT_NETWORK_DIM
from networks.network_base import AdapterModule, AdapterNetwork, entry_points


class LoHaModule(AdapterModule):
    """y = org(x) + multiplier * (alpha / rank) * ((w1_a @ w1_b) * (w2_a @ w2_b)) @ x."""

    PLUS_PARAMS = ("hada_w2_a",)

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
    ):
        super().__init__(lora_name, original_name, org_module, multiplier, lora_dim, alpha, dropout, rank_dropout,
                         module_dropout)
        r = self.lora_dim
        self.hada_w1_a = nn.Parameter(torch.empty(self.out_dim, r))
        self.hada_w1_b = nn.Parameter(torch.empty(r, self.in_dim))
        self.hada_w2_a = nn.Parameter(torch.empty(self.out_dim, r))
        self.hada_w2_b = nn.Parameter(torch.empty(r, self.in_dim))
        nn.init.normal_(self.hada_w1_a, std=0.1)
        nn.init.normal_(self.hada_w1_b, std=1.0)
        nn.init.zeros_(self.hada_w2_a)
        nn.init.normal_(self.hada_w2_b, std=1.0)

    def _product(self) -> torch.Tensor:
        return hadamard_product(self.hada_w1_a, self.hada_w1_b, self.hada_w2_a, self.hada_w2_b)

    def delta_output(self, x: torch.Tensor) -> torch.Tensor:
        x = self._adapter_input(x, self.hada_w1_a)
        return self.drop_output(nn.functional.linear(x, self._product()) * self.scale)

    def weight_delta(self) -> torch.Tensor:
        parts = {name: p.detach() for name, p in self.named_parameters()}
        return delta_weight({**parts, ALPHA: self.alpha}, "loha")

    def scale_weights_(self, ratio: float) -> None:
        factor = math.sqrt(ratio)
        with torch.no_grad():
            self.hada_w1_a.mul_(factor)
            self.hada_w2_a.mul_(factor)


class LoHaNetwork(AdapterNetwork):
    """The LoHa modules of one run; its state_dict is the LoHa file."""

    MODULE_NAME = "networks.loha"
    ALGORITHM = "loha"
    ALGORITHM_NAMES = ("loha",)
    module_class: ClassVar[type[AdapterModule]] = LoHaModule

    @classmethod
    def module_args_from_parts(cls, parts: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        return {"lora_dim": int(parts["hada_w1_b"].shape[0]), "alpha": parts.get(ALPHA)}


create_network, create_network_from_weights = entry_points(LoHaNetwork)
