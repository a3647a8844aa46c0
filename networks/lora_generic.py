"""Generic LoRA network module for MOSS-Image (`--network_module networks.lora_generic`).

The module follows the sd-scripts network-module contract (`create_network`, `create_network_from_weights` and the
network object's methods that `NetworkTrainer` calls). Targets are found from the model itself
(`networks.network_base`, the same selection as `networks.loha` and `networks.lokr`):

- DiT (`MossImage`): every Linear-like module inside a `MossImageBlock` (`layers.<i>.proj.{q,k,v,o,ffn_up_gate,
  ffn_down}`); with `train_text_embedder=True` (alias `train_llm_adapter=True`) also every Linear-like module inside
  `MossImageTextEmbedder` (`text_embedder.proj`, `text_embedder.blocks.<i>.proj.*`). Nothing else (patch embedder,
  time embedding, modulation, norms, final layer) is a target.
- Text encoder (Qwen3.5): Linear-like modules inside `Qwen3_5Attention`, `Qwen3_5GatedDeltaNet` and `Qwen3_5MLP`, with
  `.*in_proj_[ab]` excluded by default.

"Linear-like" means `nn.Linear` or any module that reports integer `in_features` / `out_features` (the ConvRot INT8
Linear replacement included). The LoRA wraps the module's forward and never touches its weights.

Keys of the saved file: `lora_unet_<module path with "." as "_">.{lora_down.weight, lora_up.weight, alpha}` for the
DiT and `lora_te_<...>` for the text encoder (sd-scripts single text-encoder naming; ComfyUI loads these directly).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from library.lora.compiled_group import PlainPart, up_projection
from library.lora.conventions import ALPHA, LORA_DOWN, LORA_PREFIX_TEXT_ENCODER, LORA_PREFIX_UNET, lora_name_for
from library.lora.eager_node import DenseProduct, LoRAAddmm, LoRALinear, NodePart, one_node
from library.runtime.eager_fusion import eager_fused
from networks.network_args import (
    COMMON_NETWORK_ARGS as ACCEPTED_NETWORK_ARGS,
)
from networks.network_args import (
    DEFAULT_NETWORK_ALPHA,
    DEFAULT_NETWORK_DIM,
    NetworkOptions,
    parse_bool,
    parse_float,
    parse_pattern_list,
    parse_regex_values,
)
from networks.network_base import (
    AdapterModule,
    AdapterNetwork,
    dit_candidates,
    entry_points,
    is_linear_like,
    normalize_lora_state_dict,
    text_encoder_candidates,
)

__all__ = [
    "ACCEPTED_NETWORK_ARGS", "DEFAULT_NETWORK_ALPHA", "DEFAULT_NETWORK_DIM", "LORA_PREFIX_TEXT_ENCODER",
    "LORA_PREFIX_UNET", "LoRAModule", "LoRANetwork", "NetworkOptions", "create_network", "create_network_from_weights",
    "dit_candidates", "is_linear_like", "lora_name_for", "normalize_lora_state_dict", "parse_bool", "parse_float",
    "parse_pattern_list", "parse_regex_values", "text_encoder_candidates",
]


def _frozen(t: torch.Tensor | None, dtype: torch.dtype) -> bool:
    return t is None or (not t.requires_grad and t.dtype == dtype)


class LoRAModule(AdapterModule):
    """y = org(x) + multiplier * (alpha / rank) * up(down(x)); wraps the original forward, never touches its weights."""

    PLUS_PARAMS = ("lora_up",)

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
        self.lora_down = nn.Linear(self.in_dim, self.lora_dim, bias=False)
        self.lora_up = nn.Linear(self.lora_dim, self.out_dim, bias=False)
        nn.init.kaiming_uniform_(self.lora_down.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_up.weight)

    def delta_output(self, x: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
        """Dropout on the rank activations, rank dropout on whole ranks per sample (rescaled), then up; times `factor`
        (the scale on the rank side: `library.lora.compiled_group.up_projection`)."""
        lx = self.lora_down(self._adapter_input(x, self.lora_down.weight))
        if self.training and self.dropout:
            lx = nn.functional.dropout(lx, p=self.dropout)
        scale = self.scale * factor
        if self.training and self.rank_dropout and lx.dim() >= 2:
            keep = torch.rand(lx.shape[0], self.lora_dim, device=lx.device) > self.rank_dropout
            keep = keep.to(lx.dtype).view(lx.shape[0], *([1] * (lx.dim() - 2)), self.lora_dim)
            lx = lx * keep
            scale = scale / (1.0 - self.rank_dropout)
        return up_projection(lx, self.lora_up, scale)

    def _plain_delta(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out + multiplier * delta(x) with the operators, the multiplier on the rank side too (`delta_output`)."""
        return out + self.delta_output(x, self.multiplier).to(out.dtype)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        product = self._node_product(x, args, kwargs)
        if product is None:
            return super().forward(x, *args, **kwargs)
        org = self.org_module
        return LoRALinear.apply(x, self.lora_down.weight, self.lora_up.weight, self.scale * self.multiplier, org,
                                 product, *product.tensors(org))

    def node_part(self, x: torch.Tensor) -> NodePart | None:
        """This module's share of a `LoRAGroup` node over a block's Linears of one input (`library.lora.eager_node.
        lora_group_parts`), or None where its call would not be one `LoRALinear` node."""
        product = self._node_product(x, (), {})
        if product is None:
            return None
        org = self.org_module
        return NodePart(self.lora_down.weight, self.lora_up.weight, self.scale * self.multiplier, org, product,
                        tuple(product.tensors(org)))

    def plain_part(self, x: torch.Tensor) -> PlainPart | None:
        """This module's share of a q/k/v group of the plain forms (`library.lora.compiled_group`: what a compiled
        block traces, and the eager plain forms), or None where its call is not the plain LoRA of x: the eager forms
        on (the one-node group runs there), the adapter off, a training-time dropout, or weights not of x's dtype
        where autocast does not cast them."""
        if eager_fused() or not self.enabled or self.multiplier == 0 or x.dim() < 2:
            return None
        if self.training and (self.module_dropout or self.dropout or self.rank_dropout):
            return None
        down, up = self.lora_down.weight, self.lora_up.weight
        if not torch.is_autocast_enabled(x.device.type) and not (down.dtype == up.dtype == x.dtype):
            return None
        return PlainPart(down, up, self.scale * self.multiplier, self._org_forward,
                         self.org_module if self.org_forward_is_own else None)

    def _node_product(self, x: torch.Tensor, args: tuple, kwargs: dict) -> type | None:
        """The frozen product that `LoRALinear` (`library.lora.eager_node`) can run for this call, or None: the one
        node where the eager form applies (as `add_delta`'s, with x in the compute dtype and nothing of the base to
        train), else the base's own forward and `add_delta`."""
        if (args or kwargs or not one_node() or not self.enabled or self.multiplier == 0 or x.dim() < 2
                or not eager_fused()):
            return None
        if self.training and (self.module_dropout or self.dropout or self.rank_dropout):
            return None
        device = x.device.type
        if torch.is_autocast_enabled(device) and x.dtype != torch.get_autocast_dtype(device):
            return None
        if not torch.is_autocast_enabled(device) and not (self.lora_down.weight.dtype == self.lora_up.weight.dtype
                                                           == x.dtype):
            return None
        org = self.org_module
        if type(org) is nn.Linear:
            if not self.org_forward_is_own:
                return None  # another wrapper's forward, which must run
            return DenseProduct if _frozen(org.weight, x.dtype) and _frozen(org.bias, x.dtype) else None
        frozen_product = getattr(org, "frozen_product", None)
        if frozen_product is None or not self.org_forward_is_own:
            return None
        return frozen_product()

    def add_delta(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Eager form (`library.runtime.eager_fusion`): one autograd node (`library.lora.eager_node.LoRAAddmm`) in
        which the up-projection accumulates into the base output by addmm, multiplier * scale as its alpha. The plain
        form is used under torch.compile, with the training-time dropouts, for inputs of another dtype than the
        output, or when the dtypes would need casts that autocast does not make."""
        up, down, device = self.lora_up.weight, self.lora_down.weight, out.device.type
        if torch.is_autocast_enabled(device):  # addmm returns the autocast dtype: only where out has it already
            casts = out.dtype != torch.get_autocast_dtype(device)
        else:
            casts = not (down.dtype == up.dtype == out.dtype)
        if (not eager_fused() or casts or x.dtype != out.dtype or out.dim() < 2
                or (self.training and (self.dropout or self.rank_dropout))):
            return self._plain_delta(out, x)
        alpha = self.scale * self.multiplier
        if one_node():
            return LoRAAddmm.apply(out, x, down, up, alpha)
        lx = self.lora_down(x)
        y = torch.addmm(out.reshape(-1, out.shape[-1]), lx.reshape(-1, lx.shape[-1]), up.t(), alpha=alpha)
        return y.view(out.shape)

    def weight_delta(self) -> torch.Tensor:
        up = self.lora_up.weight.detach().float()
        down = self.lora_down.weight.detach().float()
        return (up @ down) * self.scale

    def scale_weights_(self, ratio: float) -> None:
        factor = math.sqrt(ratio)
        with torch.no_grad():
            self.lora_up.weight.mul_(factor)
            self.lora_down.weight.mul_(factor)


class LoRANetwork(AdapterNetwork):
    """The set of LoRA modules of one run; its state_dict is the LoRA file."""

    MODULE_NAME = "networks.lora_generic"
    ALGORITHM = "lora"
    ALGORITHM_NAMES = ("lora", "locon")  # LoCon is LoRA plus convolutions, and these models have none
    module_class: ClassVar[type[AdapterModule]] = LoRAModule

    @classmethod
    def module_args_from_parts(cls, parts: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        return {"lora_dim": int(parts[LORA_DOWN].shape[0]), "alpha": parts.get(ALPHA)}


create_network, create_network_from_weights = entry_points(LoRANetwork)
