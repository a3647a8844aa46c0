"""`--network_module networks.lora`, sd-scripts' name for its LoRA, is `networks.lora_generic` here (same network,
same files); the run says so in its log."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from networks import lora_generic
from networks.lora_generic import LoRAModule, LoRANetwork

__all__ = ["LoRAModule", "LoRANetwork", "create_network", "create_network_from_weights"]

logger = logging.getLogger(__name__)


def _note() -> None:
    logger.info("--network_module networks.lora is networks.lora_generic, the MOSS-Image LoRA (sd-scripts' name)")


def create_network(
    multiplier: float,
    network_dim: int | None,
    network_alpha: float | None,
    vae: Any,
    text_encoders: Any,
    unet: nn.Module | None,
    neuron_dropout: float | None = None,
    **kwargs: Any,
) -> LoRANetwork:
    """networks.lora_generic.create_network."""
    _note()
    return lora_generic.create_network(multiplier, network_dim, network_alpha, vae, text_encoders, unet,
                                       neuron_dropout, **kwargs)


def create_network_from_weights(
    multiplier: float,
    file: str | os.PathLike | None,
    vae: Any,
    text_encoders: Any,
    unet: nn.Module | None,
    weights_sd: Mapping[str, torch.Tensor] | None = None,
    for_inference: bool = False,
    **kwargs: Any,
) -> tuple[LoRANetwork, dict[str, torch.Tensor]]:
    """networks.lora_generic.create_network_from_weights."""
    _note()
    return lora_generic.create_network_from_weights(multiplier, file, vae, text_encoders, unet, weights_sd,
                                                    for_inference, **kwargs)
