"""A third-party network module with the interface of LyCORIS' `lycoris.kohya` (what the trainer must cope with).

Like LyCORIS it: reads the dropout from `kwargs["dropout"]` (no `neuron_dropout` parameter); iterates
`text_encoder` when it is a list (a None in it fails as in LyCORIS: `None.named_modules()`); has only
`prepare_optimizer_params` (no `prepare_optimizer_params_with_multiple_te_lrs`); writes with safetensors' own
`save_file` (which fails when the folder does not exist); returns `self.parameters()` from get_trainable_params.
It trains a plain LoRA on the Linear modules of the DiT blocks. `CALLS` records what the trainer passed.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

CALLS: dict[str, Any] = {}


class _Lora(nn.Module):
    def __init__(self, name: str, org: nn.Linear, dim: int, alpha: float, dropout: float):
        super().__init__()
        self.lora_name, self.lora_dim = name, dim
        self.lora_down = nn.Linear(org.in_features, dim, bias=False)
        self.lora_up = nn.Linear(dim, org.out_features, bias=False)
        nn.init.zeros_(self.lora_up.weight)
        self.register_buffer("alpha", torch.tensor(float(alpha)))
        self.drop = nn.Dropout(dropout)
        self.org = [org]

    def apply_to(self) -> None:
        self.org_forward = self.org[0].forward
        self.org[0].forward = self.forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.org_forward(x)
        lx = self.lora_up(self.drop(self.lora_down(x.to(self.lora_down.weight.dtype))))
        return out + (lx * (float(self.alpha) / self.lora_dim)).to(out.dtype)


class FakeLycorisNetwork(nn.Module):
    def __init__(self, text_encoder: Any, unet: nn.Module, dim: int, alpha: float, dropout: float):
        super().__init__()
        self.text_encoder_loras: list[_Lora] = []
        if text_encoder:
            for te in text_encoder if isinstance(text_encoder, list) else [text_encoder]:
                te.named_modules()  # LyCORIS walks each text encoder it is given
        self.unet_loras = [
            _Lora(f"lora_unet_{name}".replace(".", "_"), m, dim, alpha, dropout)
            for name, m in unet.named_modules() if isinstance(m, nn.Linear) and ".proj." in name
            and name.startswith("layers.")
        ]

    def apply_to(self, text_encoder: Any, unet: Any, apply_text_encoder: Any = None, apply_unet: Any = None) -> None:
        assert apply_text_encoder is not None and apply_unet is not None
        for lora in self.unet_loras:
            lora.apply_to()
            self.add_module(lora.lora_name, lora)

    def prepare_optimizer_params(self, text_encoder_lr: Any = None, unet_lr: Any = 1e-4, learning_rate: Any = None):
        CALLS["prepare_optimizer_params"] = (text_encoder_lr, unet_lr, learning_rate)
        self.requires_grad_(True)
        lr = unet_lr if unet_lr is not None else learning_rate
        params = {f"{lora.lora_name}.{n}": p for lora in self.unet_loras for n, p in lora.named_parameters()}
        return [{"params": params.values(), "lr": lr}], ["unet"]

    def enable_gradient_checkpointing(self) -> None:
        pass

    def prepare_grad_etc(self, *args: Any) -> None:
        self.requires_grad_(True)

    def on_epoch_start(self, *args: Any) -> None:
        self.train()

    def on_step_start(self, *args: Any) -> None:
        pass

    def get_trainable_params(self) -> Any:
        return self.parameters()

    def load_weights(self, file: str) -> Any:
        from safetensors.torch import load_file

        return self.load_state_dict(load_file(file), strict=False)

    def apply_max_norm_regularization(self, max_norm_value: float, device: Any) -> tuple[int, float, float]:
        return 0, 0.0, 0.0

    def save_weights(self, file: str, dtype: Any, metadata: Any) -> None:
        state = {k: v.detach().clone().to("cpu", dtype or v.dtype) for k, v in self.state_dict().items()}
        assert os.path.splitext(file)[1] == ".safetensors"
        save_file(state, file, metadata or None)


def create_network(multiplier: float, network_dim: Any, network_alpha: Any, vae: Any, text_encoder: Any, unet: Any,
                   **kwargs: Any) -> FakeLycorisNetwork:
    CALLS["text_encoder"] = text_encoder
    CALLS["kwargs"] = dict(kwargs)
    dropout = float(kwargs.get("dropout", 0.0) or 0.0)
    return FakeLycorisNetwork(text_encoder, unet, int(network_dim or 4), float(network_alpha or 1.0), dropout)
