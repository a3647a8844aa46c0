"""The FLUX.2 autoencoder (VAE) in the BFL / ComfyUI key layout, its loader and its latent helpers.

The network is the FLUX.1 autoencoder with 32 latent channels plus a BatchNorm over the 2x2-patchified latents
(128 channels, running statistics only). The DiT of MOSS-Image consumes

    normalize_latents(patchify_latents(vae.encode(images)), vae.bn.running_mean, vae.bn.running_var)

and `vae.decode(unpatchify_latents(denormalize_latents(z, mean, var)))` turns a DiT latent back into an image.

The BatchNorm is never run through its forward: the closed-form formula is used, so `.train()` on the module can
never touch the running statistics.

Checkpoints: a BFL / ComfyUI single file (`flux2-vae.safetensors`, `ae.safetensors`, the small-decoder
`full_encoder_small_decoder.safetensors`) or a diffusers `vae/` folder (`AutoencoderKLFlux2`). The layout is detected
from the keys; the widths are inferred from the tensor shapes, so the full VAE, the small decoder and tiny test VAEs
all load through the same path.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from library.errors import UserError

logger = logging.getLogger(__name__)

GROUP_NORM_EPS = 1e-6
BN_EPS = 1e-4
PATCH = 2
DIFFUSERS_WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
DIFFUSERS_CONFIG_NAME = "config.json"


# ----------------------------------------------------------------------------------------------------------------
# configuration
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Flux2VAEConfig:
    """Hyperparameters of the FLUX.2 VAE. The defaults are the released FLUX.2 VAE.

    `decoder_block_out_channels` is None when the decoder mirrors the encoder widths; the FLUX.2 small decoder sets it
    to (96, 192, 384, 384).
    """

    in_channels: int = 3
    out_channels: int = 3
    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    z_channels: int = 32
    decoder_block_out_channels: tuple[int, ...] | None = None
    norm_num_groups: int = 32
    bn_eps: float = BN_EPS
    bn_momentum: float = 0.1

    def __post_init__(self) -> None:
        object.__setattr__(self, "ch_mult", tuple(int(m) for m in self.ch_mult))
        if self.decoder_block_out_channels is not None:
            dec = tuple(int(w) for w in self.decoder_block_out_channels)
            object.__setattr__(self, "decoder_block_out_channels", None if dec == self.encoder_widths else dec)
        self._validate()

    def _validate(self) -> None:
        if not self.ch_mult:
            raise ValueError("ch_mult must not be empty")
        if self.num_res_blocks < 1 or self.z_channels < 1 or self.ch < 1:
            raise ValueError("ch, num_res_blocks and z_channels must be positive")
        if len(self.decoder_widths) != len(self.ch_mult):
            raise ValueError(
                f"decoder_block_out_channels {self.decoder_widths} must have {len(self.ch_mult)} entries like ch_mult"
            )
        for width in (self.ch, *self.encoder_widths, *self.decoder_widths):
            if width < 1 or width % self.norm_num_groups != 0:
                raise ValueError(f"width {width} is not a positive multiple of norm_num_groups={self.norm_num_groups}")

    @property
    def encoder_widths(self) -> tuple[int, ...]:
        return tuple(self.ch * m for m in self.ch_mult)

    @property
    def decoder_widths(self) -> tuple[int, ...]:
        return self.decoder_block_out_channels or self.encoder_widths

    @property
    def has_small_decoder(self) -> bool:
        return self.decoder_block_out_channels is not None

    @property
    def bn_channels(self) -> int:
        return self.z_channels * PATCH * PATCH

    @property
    def downscale(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)

    @classmethod
    def from_state_dict(cls, sd: Mapping[str, torch.Tensor], norm_num_groups: int = 32) -> "Flux2VAEConfig":
        """Infer the config from the tensor shapes of a BFL-layout state dict (full VAE, small decoder, tiny VAEs).

        GroupNorm group counts leave no trace in the shapes, so `norm_num_groups` is taken from the argument.
        Raises KeyError naming a required key when the state dict lacks it and ValueError on inconsistent shapes.
        """
        ch = _shape(sd, "encoder.conv_in.weight")[0]
        in_channels = _shape(sd, "encoder.conv_in.weight")[1]
        levels = _count_indices(sd, r"encoder\.down\.(\d+)\.")
        if levels == 0:
            raise KeyError("encoder.down.0.block.0.conv1.weight")
        enc_widths = [_shape(sd, f"encoder.down.{i}.block.0.conv1.weight")[0] for i in range(levels)]
        for w in enc_widths:
            if w % ch != 0:
                raise ValueError(f"encoder width {w} is not a multiple of the base width {ch}")
        num_res_blocks = _count_indices(sd, r"encoder\.down\.0\.block\.(\d+)\.")
        dec_levels = _count_indices(sd, r"decoder\.up\.(\d+)\.")
        if dec_levels != levels:
            raise ValueError(f"the encoder has {levels} levels but the decoder has {dec_levels}")
        dec_widths = tuple(_shape(sd, f"decoder.up.{i}.block.0.conv1.weight")[0] for i in range(levels))
        z_channels = _shape(sd, "decoder.conv_in.weight")[1]
        return cls(
            in_channels=in_channels,
            out_channels=_shape(sd, "decoder.conv_out.weight")[0],
            ch=ch,
            ch_mult=tuple(w // ch for w in enc_widths),
            num_res_blocks=num_res_blocks,
            z_channels=z_channels,
            decoder_block_out_channels=dec_widths,
            norm_num_groups=norm_num_groups,
        )

    def to_diffusers_config(self) -> dict:
        """The config.json content that diffusers' AutoencoderKLFlux2 accepts for these widths."""
        levels = len(self.ch_mult)
        if self.encoder_widths[0] != self.ch:
            raise ValueError("the diffusers layout requires ch_mult[0] == 1 (conv_in width == first level width)")
        return {
            "_class_name": "AutoencoderKLFlux2",
            "_diffusers_version": "0.42.1",
            "in_channels": self.in_channels,
            "out_channels": self.out_channels,
            "down_block_types": ["DownEncoderBlock2D"] * levels,
            "up_block_types": ["UpDecoderBlock2D"] * levels,
            "block_out_channels": list(self.encoder_widths),
            "decoder_block_out_channels": list(self.decoder_block_out_channels) if self.has_small_decoder else None,
            "layers_per_block": self.num_res_blocks,
            "act_fn": "silu",
            "latent_channels": self.z_channels,
            "norm_num_groups": self.norm_num_groups,
            "sample_size": 1024,
            "use_quant_conv": True,
            "use_post_quant_conv": True,
            "mid_block_add_attention": True,
            "batch_norm_eps": self.bn_eps,
            "batch_norm_momentum": self.bn_momentum,
            "patch_size": [PATCH, PATCH],
        }


def _shape(sd: Mapping[str, torch.Tensor], key: str) -> tuple[int, ...]:
    if key not in sd:
        raise KeyError(key)
    return tuple(sd[key].shape)


def _count_indices(sd: Mapping[str, torch.Tensor], pattern: str) -> int:
    regex = re.compile(pattern)
    found = {int(m.group(1)) for k in sd if (m := regex.match(k))}
    return max(found) + 1 if found else 0


TINY_VAE_CONFIG = Flux2VAEConfig(ch=32, ch_mult=(1, 1, 2, 2), num_res_blocks=2, z_channels=32, norm_num_groups=32)
"""Tiny VAE for tests and the embedded snapshot: widths (32, 32, 64, 64), real z=32 latent space and 128-ch BN."""


# ----------------------------------------------------------------------------------------------------------------
# network (BFL module names)
# ----------------------------------------------------------------------------------------------------------------


def group_norm_parallel(x: torch.Tensor, groups: int, weight: torch.Tensor, bias: torch.Tensor,
                        eps: float) -> torch.Tensor:
    """`F.group_norm` as one reduction over each group (`torch.var_mean`, which spreads a long row over many thread
    blocks) and one multiply-add: torch's CUDA kernel gives each (image, group) row one thread block, so a decode at
    batch 1 keeps 32 blocks busy on a GPU of 132 SMs (45 of the 111 ms of a 1024x1024 float32 decode on an H200,
    `python -m bench.vae_decode --profile`). Statistics in float32, as torch's kernel keeps them."""
    b, c = x.shape[:2]
    rows = x.reshape(b, groups, -1)
    var, mean = torch.var_mean(rows if x.dtype == torch.float32 else rows.float(), dim=-1, correction=0)
    scale = (torch.rsqrt(var + eps)[:, :, None] * weight.float().view(1, groups, -1)).reshape(b, c)
    shift = bias.float().view(1, c) - (mean[:, :, None] * scale.view(b, groups, -1)).reshape(b, c)
    spatial = (1,) * (x.ndim - 2)
    return torch.addcmul(shift.to(x.dtype).view(b, c, *spatial), x, scale.to(x.dtype).view(b, c, *spatial))


def _parallel_statistics(x: torch.Tensor) -> bool:
    return x.is_cuda


class GroupNorm(nn.GroupNorm):
    """nn.GroupNorm (same parameters and state dict) whose statistics on a CUDA device come from
    `group_norm_parallel`; elsewhere torch's own kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _parallel_statistics(x):
            return super().forward(x)
        return group_norm_parallel(x, self.num_groups, self.weight, self.bias, self.eps)


def _norm(channels: int, groups: int) -> nn.GroupNorm:
    return GroupNorm(groups, channels, eps=GROUP_NORM_EPS, affine=True)


class ResnetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, groups: int) -> None:
        super().__init__()
        self.norm1 = _norm(in_channels, groups)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.norm2 = _norm(out_channels, groups)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.nin_shortcut = nn.Conv2d(in_channels, out_channels, 1) if in_channels != out_channels else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        skip = x if self.nin_shortcut is None else self.nin_shortcut(x)
        return skip + h


class AttnBlock(nn.Module):
    """Single-head self-attention over the H*W positions, 1x1 convolutions for q, k, v and the output."""

    def __init__(self, channels: int, groups: int) -> None:
        super().__init__()
        self.norm = _norm(channels, groups)
        self.q = nn.Conv2d(channels, channels, 1)
        self.k = nn.Conv2d(channels, channels, 1)
        self.v = nn.Conv2d(channels, channels, 1)
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, height, width = x.shape
        h = self.norm(x)

        def tokens(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(b, 1, c, height * width).transpose(-1, -2)

        out = F.scaled_dot_product_attention(tokens(self.q(h)), tokens(self.k(h)), tokens(self.v(h)))
        out = out.transpose(-1, -2).reshape(b, c, height, width)
        return x + self.proj_out(out)


class Downsample(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1), mode="constant", value=0.0))


class Upsample(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class MidBlock(nn.Module):
    def __init__(self, channels: int, groups: int) -> None:
        super().__init__()
        self.block_1 = ResnetBlock(channels, channels, groups)
        self.attn_1 = AttnBlock(channels, groups)
        self.block_2 = ResnetBlock(channels, channels, groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_2(self.attn_1(self.block_1(x)))


class _Level(nn.Module):
    """One resolution level: `block` (resnets) and an optional `downsample` / `upsample`."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.block = nn.ModuleList(blocks)


class Encoder(nn.Module):
    def __init__(self, cfg: Flux2VAEConfig) -> None:
        super().__init__()
        groups = cfg.norm_num_groups
        self.conv_in = nn.Conv2d(cfg.in_channels, cfg.ch, 3, padding=1)
        self.down = nn.ModuleList()
        width_in = cfg.ch
        for i, width in enumerate(cfg.encoder_widths):
            blocks = [ResnetBlock(width_in if j == 0 else width, width, groups) for j in range(cfg.num_res_blocks)]
            level = _Level(blocks)
            if i != len(cfg.ch_mult) - 1:
                level.downsample = Downsample(width)
            self.down.append(level)
            width_in = width
        self.mid = MidBlock(width_in, groups)
        self.norm_out = _norm(width_in, groups)
        self.conv_out = nn.Conv2d(width_in, 2 * cfg.z_channels, 3, padding=1)
        self.quant_conv = nn.Conv2d(2 * cfg.z_channels, 2 * cfg.z_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for level in self.down:
            for block in level.block:
                h = block(h)
            if hasattr(level, "downsample"):
                h = level.downsample(h)
        h = self.mid(h)
        h = self.conv_out(F.silu(self.norm_out(h)))
        return self.quant_conv(h)


class Decoder(nn.Module):
    def __init__(self, cfg: Flux2VAEConfig) -> None:
        super().__init__()
        groups = cfg.norm_num_groups
        widths = cfg.decoder_widths
        self.post_quant_conv = nn.Conv2d(cfg.z_channels, cfg.z_channels, 1)
        self.conv_in = nn.Conv2d(cfg.z_channels, widths[-1], 3, padding=1)
        self.mid = MidBlock(widths[-1], groups)
        levels: list[_Level] = []
        width_in = widths[-1]
        for i in reversed(range(len(widths))):
            width = widths[i]
            blocks = [ResnetBlock(width_in if j == 0 else width, width, groups) for j in range(cfg.num_res_blocks + 1)]
            level = _Level(blocks)
            if i != 0:
                level.upsample = Upsample(width)
            levels.insert(0, level)
            width_in = width
        self.up = nn.ModuleList(levels)
        self.norm_out = _norm(widths[0], groups)
        self.conv_out = nn.Conv2d(widths[0], cfg.out_channels, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(self.post_quant_conv(z))
        h = self.mid(h)
        for level in reversed(self.up):
            for block in level.block:
                h = block(h)
            if hasattr(level, "upsample"):
                h = level.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class AutoEncoder(nn.Module):
    """FLUX.2 VAE. `encode` gives raw latents [B, z, H/8, W/8] (the mean), `decode` maps them back to images.

    encode/decode run without autograd (the VAE is frozen in this project).
    """

    def __init__(self, config: Flux2VAEConfig | None = None) -> None:
        super().__init__()
        self.config = config or Flux2VAEConfig()
        self.encoder = Encoder(self.config)
        self.decoder = Decoder(self.config)
        self.bn = nn.BatchNorm2d(
            self.config.bn_channels,
            eps=self.config.bn_eps,
            momentum=self.config.bn_momentum,
            affine=False,
            track_running_stats=True,
        )

    @property
    def device(self) -> torch.device:
        return self.encoder.conv_in.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder.conv_in.weight.dtype

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Images [B, 3, H, W] in [-1, 1] (H, W multiples of 8) -> raw latent means [B, z, H/8, W/8], float32."""
        _check_spatial(images, self.config.downscale, "image")
        moments = self.encoder(images.to(device=self.device, dtype=self.dtype))
        return moments[:, : self.config.z_channels].float()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Raw latents [B, z, h, w] -> images [B, 3, 8h, 8w] in about [-1, 1] (not clamped), float32."""
        if latents.ndim != 4 or latents.shape[1] != self.config.z_channels:
            raise ValueError(f"expected raw latents [B, {self.config.z_channels}, h, w], got {tuple(latents.shape)}")
        return self.decoder(latents.to(device=self.device, dtype=self.dtype)).float()

    WARM_UP_LATENT = 8  # the warm-up decode's latent side: a 64x64 image, a few MB on any card

    @torch.no_grad()
    def warm_up_decoder(self) -> None:
        """One decode of a small zero latent, so that the first image's decode does not pay the device's one-time
        set-up of the convolution library (its handles and kernels): the inference script runs it on the loading
        thread, which waits on the text encoder anyway."""
        side = self.WARM_UP_LATENT
        self.decode(torch.zeros(1, self.config.z_channels, side, side, device=self.device, dtype=self.dtype))

    def normalize(self, latents: torch.Tensor) -> torch.Tensor:
        """Patchified latents [B, 4z, h, w] -> BN-normalised DiT latents (closed form, running stats)."""
        return normalize_latents(latents, self.bn.running_mean, self.bn.running_var, eps=self.bn.eps)

    def denormalize(self, latents: torch.Tensor) -> torch.Tensor:
        return denormalize_latents(latents, self.bn.running_mean, self.bn.running_var, eps=self.bn.eps)

    def encode_to_dit_latents(self, images: torch.Tensor) -> torch.Tensor:
        """Images -> the DiT latent [B, 4z, H/16, W/16]: encode, 2x2 patchify, BN normalisation (float32)."""
        _check_spatial(images, self.config.downscale * PATCH, "image")
        return self.normalize(patchify_latents(self.encode(images)))

    def decode_from_dit_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """The DiT latent [B, 4z, h, w] -> images [B, 3, 16h, 16w] (inverse BN, unpatchify, decode)."""
        return self.decode(unpatchify_latents(self.denormalize(latents.float())))


def _check_spatial(x: torch.Tensor, multiple: int, what: str) -> None:
    if x.ndim != 4 or x.shape[-1] % multiple or x.shape[-2] % multiple:
        raise ValueError(f"expected {what} [B, C, H, W] with H and W multiples of {multiple}, got {tuple(x.shape)}")


# ----------------------------------------------------------------------------------------------------------------
# latent helpers
# ----------------------------------------------------------------------------------------------------------------


def patchify_latents(x: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, 4C, H/2, W/2]; out[:, c*4 + i*2 + j, y, x] = in[:, c, 2y + i, 2x + j]."""
    if x.ndim != 4 or x.shape[-2] % PATCH or x.shape[-1] % PATCH:
        raise ValueError(f"patchify_latents expects [B, C, H, W] with even H and W, got {tuple(x.shape)}")
    b, c, h, w = x.shape
    x = x.reshape(b, c, h // PATCH, PATCH, w // PATCH, PATCH).permute(0, 1, 3, 5, 2, 4)
    return x.reshape(b, c * PATCH * PATCH, h // PATCH, w // PATCH)


def unpatchify_latents(x: torch.Tensor) -> torch.Tensor:
    """Exact inverse of `patchify_latents`: [B, 4C, h, w] -> [B, C, 2h, 2w]."""
    if x.ndim != 4 or x.shape[1] % (PATCH * PATCH):
        raise ValueError(f"unpatchify_latents expects [B, 4C, h, w], got {tuple(x.shape)}")
    b, c4, h, w = x.shape
    c = c4 // (PATCH * PATCH)
    x = x.reshape(b, c, PATCH, PATCH, h, w).permute(0, 1, 4, 2, 5, 3)
    return x.reshape(b, c, h * PATCH, w * PATCH)


def _bn_stats(x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if x.ndim != 4 or mean.numel() != x.shape[1] or var.numel() != x.shape[1]:
        raise ValueError(
            f"latents {tuple(x.shape)} do not match BatchNorm statistics of {mean.numel()} channels "
            "(patchify the 32-channel VAE latents first)"
        )
    mean = mean.detach().to(device=x.device, dtype=torch.float32).reshape(1, -1, 1, 1)
    std = torch.sqrt(var.detach().to(device=x.device, dtype=torch.float32).reshape(1, -1, 1, 1) + eps)
    return mean, std


def normalize_latents(
    x: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor, eps: float = BN_EPS
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) per channel on patchified latents; computed in float32, returned in x's dtype."""
    mean, std = _bn_stats(x, running_mean, running_var, eps)
    return ((x.float() - mean) / std).to(x.dtype)


def denormalize_latents(
    x: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor, eps: float = BN_EPS
) -> torch.Tensor:
    """Inverse of `normalize_latents`: x * sqrt(var + eps) + mean."""
    mean, std = _bn_stats(x, running_mean, running_var, eps)
    return (x.float() * std + mean).to(x.dtype)


# ----------------------------------------------------------------------------------------------------------------
# key conversion BFL <-> diffusers
# ----------------------------------------------------------------------------------------------------------------

_RESNET_PARTS = {
    "norm1": "norm1",
    "conv1": "conv1",
    "norm2": "norm2",
    "conv2": "conv2",
    "nin_shortcut": "conv_shortcut",
}
_ATTN_PARTS = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}
_BFL_TOP = {
    "encoder.quant_conv.": "quant_conv.",
    "decoder.post_quant_conv.": "post_quant_conv.",
    "encoder.norm_out.": "encoder.conv_norm_out.",
    "decoder.norm_out.": "decoder.conv_norm_out.",
}


def _levels_of(keys: list[str], pattern: str) -> int:
    regex = re.compile(pattern)
    found = {int(m.group(1)) for k in keys if (m := regex.match(k))}
    return max(found) + 1 if found else 0


def _bfl_key_to_diffusers(key: str, levels: int) -> str:
    for src, dst in _BFL_TOP.items():
        if key.startswith(src):
            return dst + key[len(src) :]
    if m := re.fullmatch(r"(encoder|decoder)\.mid\.block_([12])\.(\w+)\.(.+)", key):
        part = _RESNET_PARTS.get(m.group(3), m.group(3))
        return f"{m.group(1)}.mid_block.resnets.{int(m.group(2)) - 1}.{part}.{m.group(4)}"
    if m := re.fullmatch(r"(encoder|decoder)\.mid\.attn_1\.(\w+)\.(.+)", key):
        part = _ATTN_PARTS.get(m.group(2), m.group(2))
        return f"{m.group(1)}.mid_block.attentions.0.{part}.{m.group(3)}"
    if m := re.fullmatch(r"encoder\.down\.(\d+)\.block\.(\d+)\.(\w+)\.(.+)", key):
        part = _RESNET_PARTS.get(m.group(3), m.group(3))
        return f"encoder.down_blocks.{m.group(1)}.resnets.{m.group(2)}.{part}.{m.group(4)}"
    if m := re.fullmatch(r"encoder\.down\.(\d+)\.downsample\.conv\.(.+)", key):
        return f"encoder.down_blocks.{m.group(1)}.downsamplers.0.conv.{m.group(2)}"
    if m := re.fullmatch(r"decoder\.up\.(\d+)\.block\.(\d+)\.(\w+)\.(.+)", key):
        part = _RESNET_PARTS.get(m.group(3), m.group(3))
        return f"decoder.up_blocks.{levels - 1 - int(m.group(1))}.resnets.{m.group(2)}.{part}.{m.group(4)}"
    if m := re.fullmatch(r"decoder\.up\.(\d+)\.upsample\.conv\.(.+)", key):
        return f"decoder.up_blocks.{levels - 1 - int(m.group(1))}.upsamplers.0.conv.{m.group(2)}"
    return key


def _diffusers_key_to_bfl(key: str, levels: int) -> str:
    for dst, src in _BFL_TOP.items():
        if key.startswith(src):
            return dst + key[len(src) :]
    resnet_back = {v: k for k, v in _RESNET_PARTS.items()}
    attn_back = {v: k for k, v in _ATTN_PARTS.items()}
    if m := re.fullmatch(r"(encoder|decoder)\.mid_block\.resnets\.([01])\.(\w+)\.(.+)", key):
        part = resnet_back.get(m.group(3), m.group(3))
        return f"{m.group(1)}.mid.block_{int(m.group(2)) + 1}.{part}.{m.group(4)}"
    if m := re.fullmatch(r"(encoder|decoder)\.mid_block\.attentions\.0\.(to_out\.0|\w+)\.(.+)", key):
        part = attn_back.get(m.group(2), m.group(2))
        return f"{m.group(1)}.mid.attn_1.{part}.{m.group(3)}"
    if m := re.fullmatch(r"encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.(\w+)\.(.+)", key):
        part = resnet_back.get(m.group(3), m.group(3))
        return f"encoder.down.{m.group(1)}.block.{m.group(2)}.{part}.{m.group(4)}"
    if m := re.fullmatch(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.+)", key):
        return f"encoder.down.{m.group(1)}.downsample.conv.{m.group(2)}"
    if m := re.fullmatch(r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(\w+)\.(.+)", key):
        part = resnet_back.get(m.group(3), m.group(3))
        return f"decoder.up.{levels - 1 - int(m.group(1))}.block.{m.group(2)}.{part}.{m.group(4)}"
    if m := re.fullmatch(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.+)", key):
        return f"decoder.up.{levels - 1 - int(m.group(1))}.upsample.conv.{m.group(2)}"
    return key


def _is_bfl_attn_weight(key: str) -> bool:
    return bool(re.fullmatch(r"(encoder|decoder)\.mid\.attn_1\.(q|k|v|proj_out)\.weight", key))


def bfl_to_diffusers_state_dict(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """BFL / ComfyUI keys -> diffusers AutoencoderKLFlux2 keys (1x1 attention convs become Linear weights).

    Keys that follow neither rule pass through unchanged (a strict load then reports them).
    """
    levels = _levels_of(list(sd), r"decoder\.up\.(\d+)\.")
    out: dict[str, torch.Tensor] = {}
    for key, tensor in sd.items():
        if _is_bfl_attn_weight(key) and tensor.ndim == 4:
            tensor = tensor.reshape(tensor.shape[0], tensor.shape[1])
        out[_bfl_key_to_diffusers(key, levels)] = tensor
    return out


def diffusers_to_bfl_state_dict(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers AutoencoderKLFlux2 keys -> BFL / ComfyUI keys (Linear attention weights become 1x1 convs)."""
    levels = _levels_of(list(sd), r"decoder\.up_blocks\.(\d+)\.")
    out: dict[str, torch.Tensor] = {}
    for key, tensor in sd.items():
        new_key = _diffusers_key_to_bfl(key, levels)
        if _is_bfl_attn_weight(new_key) and tensor.ndim == 2:
            tensor = tensor.reshape(tensor.shape[0], tensor.shape[1], 1, 1)
        out[new_key] = tensor
    return out


# ----------------------------------------------------------------------------------------------------------------
# loading
# ----------------------------------------------------------------------------------------------------------------

_BFL_MARKERS = ("encoder.down.", "decoder.up.", "encoder.mid.", "decoder.mid.")
_DIFFUSERS_MARKERS = ("encoder.down_blocks.", "decoder.up_blocks.", "encoder.mid_block.", "decoder.mid_block.")
_TOP_LEVEL_NAMES = {"encoder", "decoder", "bn", "quant_conv", "post_quant_conv"}


def _resolve_files(path: str | os.PathLike) -> tuple[Path, Path | None]:
    """Return (weights file, config.json or None) for a single file or a diffusers vae/ folder."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(
            f"The FLUX.2 VAE path '{p}' does not exist; check --vae (a flux2-vae.safetensors file or a diffusers "
            "vae/ folder)."
        )
    if p.is_dir():
        weights = p / DIFFUSERS_WEIGHTS_NAME
        if not weights.is_file():
            raise UserError(
                f"The folder '{p}' has no {DIFFUSERS_WEIGHTS_NAME}; pass --vae as a flux2-vae.safetensors file "
                "or a diffusers vae/ folder."
            )
        p = weights
    if p.suffix != ".safetensors":
        raise UserError(
            f"The FLUX.2 VAE file '{p}' is not a .safetensors file; only safetensors checkpoints are loaded "
            "(use flux2-vae.safetensors or a diffusers vae/ folder)."
        )
    config = p.parent / DIFFUSERS_CONFIG_NAME
    return p, config if config.is_file() else None


def vae_weights_file(path: str | os.PathLike) -> Path:
    """The weights file a --vae path (a single file or a diffusers vae/ folder) is read from."""
    return _resolve_files(path)[0]


def _strip_common_prefix(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], str]:
    """Remove a prefix such as 'vae.' or 'first_stage_model.' carried by every key."""
    prefix = ""
    while sd:
        heads = {k.split(".", 1)[0] for k in sd}
        if len(heads) != 1 or any("." not in k for k in sd):
            break
        head = next(iter(heads))
        if head in _TOP_LEVEL_NAMES:
            break
        prefix += head + "."
        sd = {k[len(head) + 1 :]: v for k, v in sd.items()}
    return sd, prefix


def _detect_layout(sd: Mapping[str, torch.Tensor], file: Path) -> str:
    keys = list(sd)
    if any(k.startswith(_DIFFUSERS_MARKERS) for k in keys):
        return "diffusers"
    if any(k.startswith(_BFL_MARKERS) for k in keys):
        return "bfl"
    if any(k.startswith(("up.", "mid.", "conv_in.")) for k in keys):
        raise UserError(
            f"'{file}' looks like a decoder-only file (keys without 'decoder.'); load the full VAE instead, "
            "e.g. flux2-vae.safetensors or full_encoder_small_decoder.safetensors."
        )
    sample = ", ".join(keys[:3]) or "no tensors"
    raise UserError(f"'{file}' is not a FLUX.2 VAE checkpoint (keys start with: {sample}); check --vae.")


def _comfy_internal_to_bfl(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI keeps quant_conv / post_quant_conv at the top level in memory; move them back into encoder/decoder."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in sd.items():
        if key.startswith("quant_conv."):
            key = "encoder." + key
        elif key.startswith("post_quant_conv."):
            key = "decoder." + key
        out[key] = tensor
    return out


def _read_norm_groups(config_file: Path | None) -> int:
    if config_file is None:
        return 32
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"Cannot read the diffusers VAE config '{config_file}' ({e}); fix or remove that file.") from e
    groups = config.get("norm_num_groups", 32) if isinstance(config, dict) else None
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
        what = "is not a JSON object" if not isinstance(config, dict) else f"sets norm_num_groups={groups!r}"
        raise UserError(f"The diffusers VAE config '{config_file}' {what}: it is not a valid AutoencoderKLFlux2"
                        " config; fix or remove that file.")
    for key, expected in (("use_quant_conv", True), ("use_post_quant_conv", True), ("mid_block_add_attention", True)):
        if config.get(key, expected) != expected:
            raise UserError(f"'{config_file}' sets {key}={config[key]}, which the FLUX.2 VAE does not support.")
    if config.get("act_fn", "silu") != "silu":
        raise UserError(f"'{config_file}' sets act_fn={config['act_fn']}; the FLUX.2 VAE uses silu.")
    return groups


def _check_keys(
    model: AutoEncoder, sd_bfl: Mapping[str, torch.Tensor], layout: str, file: Path, prefix: str
) -> None:
    expected = set(model.state_dict().keys())
    optional = {"bn.num_batches_tracked"}
    missing = sorted(expected - set(sd_bfl) - optional)
    unexpected = sorted(set(sd_bfl) - expected)
    if not missing and not unexpected:
        return
    levels = len(model.config.ch_mult)

    def shown(keys: list[str]) -> list[str]:
        names = [_bfl_key_to_diffusers(k, levels) for k in keys] if layout == "diffusers" else keys
        return [prefix + k for k in names]

    from library.files.safetensors_io import describe_key_mismatch

    message = describe_key_mismatch(f"FLUX.2 VAE file ({layout} layout)", file, shown(missing), shown(unexpected))
    if "bn.running_mean" in missing and model.config.z_channels == 16:
        message += " It looks like a FLUX.1 VAE (16 latent channels, no BatchNorm): MOSS-Image needs the FLUX.2 VAE."
    raise UserError(message)


def _to_target(sd: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Cast floating tensors to dtype (BN statistics stay float32) and move them, one tensor at a time."""
    out: dict[str, torch.Tensor] = {}
    for key in list(sd):
        tensor = sd.pop(key)
        if key.startswith("bn."):
            target = torch.float32 if tensor.is_floating_point() else tensor.dtype
        else:
            target = dtype if tensor.is_floating_point() else tensor.dtype
        out[key] = tensor.to(device=device, dtype=target)
    return out


def load_flux2_vae(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    disable_mmap: bool = False,
) -> AutoEncoder:
    """Load a FLUX.2 VAE (BFL/ComfyUI single file or diffusers vae/ folder) strictly, in eval mode and frozen.

    Floating weights are cast to `dtype` and placed on `device`; the BatchNorm statistics stay float32.
    """
    from library.files.safetensors_io import load_safetensors

    file, config_file = _resolve_files(path)
    try:
        sd = load_safetensors(str(file), device="cpu", disable_mmap=disable_mmap)
    except UserError:
        raise
    except Exception as e:  # a truncated or non-safetensors file surfaces as various errors from the reader
        raise UserError(f"Cannot read the FLUX.2 VAE file '{file}' ({e}); re-download it.") from e
    sd, prefix = _strip_common_prefix(dict(sd))
    layout = _detect_layout(sd, file)
    sd_bfl = diffusers_to_bfl_state_dict(sd) if layout == "diffusers" else _comfy_internal_to_bfl(sd)
    groups = _read_norm_groups(config_file) if layout == "diffusers" else 32
    config = _infer_config(sd_bfl, groups, file, layout)

    with torch.device("meta"):
        model = AutoEncoder(config)
    _check_keys(model, sd_bfl, layout, file, prefix)
    sd_bfl = _to_target(sd_bfl, dtype, torch.device(device))
    try:
        model.load_state_dict(sd_bfl, strict=True, assign=True)
    except RuntimeError as e:
        raise UserError(f"The FLUX.2 VAE file '{file}' has tensors of unexpected shapes: {e}".replace("\n", " ")) from e
    if model.bn.num_batches_tracked.is_meta:
        model.bn.num_batches_tracked = torch.zeros((), dtype=torch.long, device=device)
    model.eval().requires_grad_(False)
    _log_loaded(model, file, layout, prefix)
    return model


def _infer_config(sd_bfl: Mapping[str, torch.Tensor], groups: int, file: Path, layout: str) -> Flux2VAEConfig:
    try:
        return Flux2VAEConfig.from_state_dict(sd_bfl, norm_num_groups=groups)
    except KeyError as e:
        key = e.args[0]
        if layout == "diffusers":
            key = _bfl_key_to_diffusers(key, _levels_of(list(sd_bfl), r"decoder\.up\.(\d+)\."))
        raise UserError(
            f"The FLUX.2 VAE file '{file}' ({layout} layout) lacks the key '{key}'; "
            "it is incomplete or not a FLUX.2 VAE."
        ) from e
    except ValueError as e:
        raise UserError(f"The FLUX.2 VAE file '{file}' has an unsupported structure: {e}.") from e


def _log_loaded(model: AutoEncoder, file: Path, layout: str, prefix: str) -> None:
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "Loaded FLUX.2 VAE from %s (%s layout%s): encoder widths %s, decoder widths %s%s, z=%d, %.1fM params, %s on %s",
        file,
        layout,
        f", prefix '{prefix}' stripped" if prefix else "",
        list(cfg.encoder_widths),
        list(cfg.decoder_widths),
        " (small decoder)" if cfg.has_small_decoder else "",
        cfg.z_channels,
        n_params / 1e6,
        str(model.dtype).replace("torch.", ""),
        model.device,
    )


# ----------------------------------------------------------------------------------------------------------------
# saving and the tiny test VAE
# ----------------------------------------------------------------------------------------------------------------


def _cpu_state(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}


def save_flux2_vae_bfl(model: AutoEncoder, path: str | os.PathLike) -> None:
    """Write the model as a BFL / ComfyUI single safetensors file (atomic)."""
    from library.files.safetensors_io import save_file_atomic

    save_file_atomic(_cpu_state(model.state_dict()), str(path), metadata={"format": "pt"})


def save_flux2_vae_diffusers(model: AutoEncoder, folder: str | os.PathLike) -> None:
    """Write a diffusers vae/ folder: diffusion_pytorch_model.safetensors + config.json for AutoencoderKLFlux2."""
    from library.files.safetensors_io import save_file_atomic, write_text_atomic

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sd = bfl_to_diffusers_state_dict(_cpu_state(model.state_dict()))
    save_file_atomic(sd, str(folder / DIFFUSERS_WEIGHTS_NAME), metadata={"format": "pt"})
    write_text_atomic(json.dumps(model.config.to_diffusers_config(), indent=2) + "\n", folder / DIFFUSERS_CONFIG_NAME)


def _tiny_tensor(name: str, like: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    shape = tuple(like.shape)
    if name == "bn.running_mean":
        return torch.randn(shape, generator=gen) * 0.3
    if name == "bn.running_var":
        return torch.rand(shape, generator=gen) * 2.0 + 0.1
    if name == "bn.num_batches_tracked":
        return torch.zeros((), dtype=torch.long)
    noise = torch.randn(shape, generator=gen) * 0.05
    is_norm_weight = name.endswith(".weight") and len(shape) == 1
    return noise + 1.0 if is_norm_weight else noise


def make_tiny_vae(seed: int = 0, config: Flux2VAEConfig = TINY_VAE_CONFIG) -> AutoEncoder:
    """A deterministic random VAE (same bytes for the same seed and config), float32 on CPU, eval mode.

    Conv / attention weights and biases ~ randn * 0.05, GroupNorm weights 1 + randn * 0.05,
    bn.running_mean ~ N(0, 0.3), bn.running_var ~ U(0.1, 2.1). The global RNG is not touched.
    """
    with torch.device("meta"):
        model = AutoEncoder(config)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    template = model.state_dict()
    sd = {name: _tiny_tensor(name, template[name], gen) for name in sorted(template)}
    model.load_state_dict(sd, strict=True, assign=True)
    return model.eval().requires_grad_(False)


__all__ = [
    "AutoEncoder",
    "Flux2VAEConfig",
    "TINY_VAE_CONFIG",
    "bfl_to_diffusers_state_dict",
    "denormalize_latents",
    "diffusers_to_bfl_state_dict",
    "load_flux2_vae",
    "make_tiny_vae",
    "normalize_latents",
    "patchify_latents",
    "save_flux2_vae_bfl",
    "save_flux2_vae_diffusers",
    "unpatchify_latents",
]
