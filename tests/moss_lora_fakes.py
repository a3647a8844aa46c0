"""Tiny stand-ins for the MOSS-Image DiT module tree (same class and module names) and a tiny Qwen3.5 text model.

Used by the LoRA / merge tests; the real DiT lives in library/moss_image/dit.py.
"""

from __future__ import annotations

import torch
from torch import nn


class BlockProj(nn.Module):
    def __init__(self, width: int, ffn: int):
        super().__init__()
        self.q = nn.Linear(width, width, bias=False)
        self.k = nn.Linear(width, width, bias=False)
        self.v = nn.Linear(width, width, bias=False)
        self.o = nn.Linear(width, width, bias=False)
        self.ffn_up_gate = nn.Linear(width, 2 * ffn, bias=False)
        self.ffn_down = nn.Linear(ffn, width, bias=False)


class MossImageBlock(nn.Module):
    def __init__(self, width: int, ffn: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.norm2 = nn.LayerNorm(width)
        self.proj = BlockProj(width, ffn)
        self.scale_shift_table = nn.Parameter(torch.zeros(6, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        attn = torch.softmax(self.proj.q(h) @ self.proj.k(h).transpose(-1, -2), dim=-1) @ self.proj.v(h)
        x = x + self.proj.o(attn)
        value, gate = self.proj.ffn_up_gate(self.norm2(x)).chunk(2, dim=-1)
        return x + self.proj.ffn_down(value * torch.nn.functional.silu(gate))


class MossImageTextEmbedder(nn.Module):
    def __init__(self, text_dim: int, width: int, ffn: int):
        super().__init__()
        self.proj = nn.Linear(text_dim, width, bias=False)
        # the refiner blocks share the block class: they must still not be a default target
        self.blocks = nn.ModuleList([MossImageBlock(width, ffn) for _ in range(2)])

    def forward(self, text: torch.Tensor) -> torch.Tensor:
        h = self.proj(text)
        for block in self.blocks:
            h = block(h)
        return h


class FinalLayer(nn.Module):
    def __init__(self, width: int, out_dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(width, elementwise_affine=False)
        self.adaLN_modulation = nn.Linear(width, 2 * width)
        self.linear = nn.Linear(width, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm(x))


class MossImage(nn.Module):
    """in 8 -> width 16, 3 blocks, text 12 -> width."""

    def __init__(self, num_layers: int = 3, width: int = 16, ffn: int = 24, in_dim: int = 8, text_dim: int = 12):
        super().__init__()
        self.video_embedder = nn.Linear(in_dim, width)
        self.t_embedder = nn.Sequential(nn.Linear(4, width), nn.SiLU(), nn.Linear(width, width))
        self.modulation = nn.Linear(width, 6 * width)
        self.text_embedder = MossImageTextEmbedder(text_dim, width, ffn)
        self.layers = nn.ModuleList([MossImageBlock(width, ffn) for _ in range(num_layers)])
        self.final_layer = FinalLayer(width, in_dim)

    def forward(self, x: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.text_embedder(text), self.video_embedder(x)], dim=1)
        for block in self.layers:
            h = block(h)
        return self.final_layer(h[:, text.shape[1] :])


class FakeInt8Linear(nn.Module):
    """A quantized Linear replacement: int8 weight buffer + per-row scale, in/out_features, its own forward."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127
        self.register_buffer("weight", torch.round(w / scale).to(torch.int8))
        self.register_buffer("weight_scale", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, (self.weight.float() * self.weight_scale).to(x.dtype))


def quantize_blocks(model: MossImage) -> None:
    """Replace every block Linear by FakeInt8Linear (what --convrot_int8 does to the 42 blocks)."""
    for block in model.layers:
        for name in ("q", "k", "v", "o", "ffn_up_gate", "ffn_down"):
            setattr(block.proj, name, FakeInt8Linear(getattr(block.proj, name)))


def tiny_qwen35() -> nn.Module:
    """The tiny snapshot's Qwen3.5 text config, cut to two layers (one linear-attention, one full-attention)."""
    from transformers import Qwen3_5TextConfig, Qwen3_5TextModel

    from library.moss_image.tiny_snapshot import TINY_TEXT_CONFIG

    fields = {k: v for k, v in TINY_TEXT_CONFIG.items() if k != "model_type"}
    fields.update(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    return Qwen3_5TextModel(Qwen3_5TextConfig(**fields)).eval()
