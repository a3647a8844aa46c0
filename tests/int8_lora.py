"""The tiny ConvRot INT8 DiT with the product's LoRA network on every block Linear (random non-zero LoRA weights,
trainable): what the compiled-INT8 and stacked q/k/v tests train."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from library.moss_image.loaders import load_moss_image_model
from networks import lora_generic


def dit_with_lora(snapshot: Path) -> tuple[Any, Any]:
    """(DiT quantised at load, its base frozen; its LoRA network) on the CPU in fp32."""
    dit = load_moss_image_model("cpu", snapshot, dtype=torch.float32, convrot_int8=True)
    dit.requires_grad_(False)
    net = lora_generic.create_network(1.0, 4, 4.0, None, [], dit)
    net.apply_to(None, dit, apply_text_encoder=False, apply_unet=True)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, 0.1)
    net.requires_grad_(True)
    return dit, net
