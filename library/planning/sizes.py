"""Bytes of the models of a run, counted from the model classes built on the meta device (no weight is read).

- DiT (`MossImage`): every parameter in the run's float dtype, or ConvRot INT8: the 252 block Linears as int8 codes
  with one fp32 scale per output row, everything else (modulation, final layer, embedders, text refiner, norms) in
  the float dtype. One main block is what block swap moves.
- Text encoder (`transformers.Qwen3_5TextModel`): float, ConvRot INT8 (the ComfyUI scope: 200 Linears and the token
  embedding), bitsandbytes int8 / nf4 (`library.text_encoder.quant.TextEncoderSizes`).
- VAE: the weights as stored (fp32 at run time) and the base channel width, from the file's header.
- LoRA: rank x (in + out) per target Linear; the targets are the networks' defaults (`library.moss_image.lora_targets`:
  the Linears of the DiT's main blocks; those of the text encoder's attention, linear-attention and MLP modules
  without the `in_proj_a` / `in_proj_b` gates).

When a checkpoint path is given, its config (DiT: the tensor shapes and config.json; text encoder: the config.json
beside it) is read from the safetensors headers, and a ComfyUI ConvRot INT8 file is recognised; without a path the
full-size models are assumed.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from library.files.safetensors_io import TensorSource
from library.moss_image.dit import MossImage, MossImageConfig
from library.moss_image.loaders import dit_checkpoint_files, infer_dit_config, open_dit_source
from library.moss_image.lora_targets import TEXT_ENCODER_DEFAULT_EXCLUDE, TEXT_ENCODER_TARGET_CLASSES
from library.moss_image.vae import AutoEncoder, Flux2VAEConfig, vae_weights_file
from library.quant import convrot as cr
from library.text_encoder.quant import TextEncoderSizes, text_encoder_sizes
from library.text_encoder.qwen35 import BUNDLED_CONFIG_DIR, load_text_config, open_text_encoder_source

GIB = 2**30
SCALE_BYTES = 4  # ConvRot INT8: one fp32 scale per output row
TE_LORA_EXCLUDED = [re.compile(p) for p in TEXT_ENCODER_DEFAULT_EXCLUDE]
DIT_PRECISIONS = ("bf16", "int8")
TE_VARIANTS = ("none", "convrot_int8", "bnb_int8", "bnb_nf4")


@dataclass(frozen=True)
class Int8Scope:
    """The layers ConvRot INT8 quantises: int8 codes and fp32 scale rows."""

    codes: int
    rows: int

    @property
    def bytes(self) -> int:
        return self.codes + SCALE_BYTES * self.rows


@dataclass(frozen=True)
class LoraShapes:
    """(in_features, out_features) of each LoRA target Linear."""

    linears: tuple[tuple[int, int], ...]

    def params(self, rank: int) -> int:
        return sum(rank * (i + o) for i, o in self.linears)

    def factored_second_moment(self, rank: int) -> int:
        """Values of Adafactor's factored second moment: rows + columns of each LoRA matrix (down r x in, up out x r)."""
        return sum((rank + i) + (o + rank) for i, o in self.linears)


def _scope(modules: list[nn.Module]) -> Int8Scope:
    codes = rows = 0
    for m in modules:
        codes += m.weight.numel()
        rows += m.out_features if isinstance(m, nn.Linear) else m.num_embeddings
    return Int8Scope(codes, rows)


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters()) + sum(b.numel() for b in module.buffers())


# ------------------------------------------------------------------------------------------------------------ DiT
@dataclass(frozen=True)
class DitSizes:
    config: MossImageConfig
    total_params: int
    block_params: int
    int8: Int8Scope
    block_int8: Int8Scope
    lora: LoraShapes  # the targets of ALL main blocks

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def weight_bytes(self, precision: str, float_bytes: int) -> int:
        """All the DiT's weights: `precision` bf16 (meaning the float dtype of the run) or int8 (ConvRot)."""
        if precision == "int8":
            return self.int8.bytes + (self.total_params - self.int8.codes) * float_bytes
        return self.total_params * float_bytes

    def block_bytes(self, precision: str, float_bytes: int) -> int:
        """One main block, as block swap moves it."""
        if precision == "int8":
            return self.block_int8.bytes + (self.block_params - self.block_int8.codes) * float_bytes
        return self.block_params * float_bytes


def dit_sizes(config: MossImageConfig) -> DitSizes:
    """The DiT of `config`, built on the meta device."""
    with torch.device("meta"):
        model = MossImage(config)
    quantised = [m for n, m in model.named_modules() if n and cr.dit_convrot_filter(n) and type(m) is nn.Linear]
    block = model.layers[0]
    in_block = [m for n, m in block.named_modules() if n and cr.dit_convrot_filter(f"layers.0.{n}") and type(m) is nn.Linear]
    lora = [(m.in_features, m.out_features) for blk in model.layers for m in blk.modules() if type(m) is nn.Linear]
    return DitSizes(config, _params(model), _params(block), _scope(quantised), _scope(in_block), LoraShapes(tuple(lora)))


def read_dit(path: str | os.PathLike | None) -> tuple[DitSizes, bool]:
    """(sizes, is a pre-quantised ConvRot INT8 file) of the DiT checkpoint at `path` (headers only), or of the
    full-size model when `path` is None."""
    if path is None:
        return dit_sizes(MossImageConfig()), False
    source = open_dit_source(dit_checkpoint_files(path)[0])
    try:
        config = infer_dit_config(source)  # the shapes fix every size (config.json only adds RoPE settings)
        prequantised = cr.is_comfy_quantized_state_dict(source.source.keys(), source.source.metadata)
    finally:
        source.source.close()
    return dit_sizes(config), prequantised


# --------------------------------------------------------------------------------------------------- text encoder
@dataclass(frozen=True)
class EncoderSizes:
    total_params: int
    hidden: int
    intermediate: int
    convrot: Int8Scope
    bnb: TextEncoderSizes
    lora: LoraShapes

    def weight_bytes(self, variant: str, float_bytes: int = 2) -> int:
        """The encoder's weights as `variant` (a text-encoder cache variant: none, convrot_int8, bnb_int8, bnb_nf4)."""
        if variant == "convrot_int8":
            return self.convrot.bytes + (self.total_params - self.convrot.codes) * float_bytes
        if variant == "bnb_int8":
            return self.bnb.weight_bytes("int8")
        if variant == "bnb_nf4":
            return self.bnb.weight_bytes("nf4")
        return self.total_params * float_bytes


def encoder_sizes(config: object) -> EncoderSizes:
    """The Qwen3.5 text model of `config` (a `Qwen3_5TextConfig`), built on the meta device in bf16."""
    from transformers import Qwen3_5TextModel  # heavy import, only when a plan needs the text encoder

    with torch.device("meta"):
        model = Qwen3_5TextModel(config).to(torch.bfloat16)
    quantised = [m for n, m in model.named_modules()
                 if n and cr.text_encoder_convrot_filter(n) and type(m) in (nn.Linear, nn.Embedding)]
    lora = []
    for owner in model.modules():
        if type(owner).__name__ in TEXT_ENCODER_TARGET_CLASSES:
            for n, m in owner.named_modules():
                if type(m) is nn.Linear and not any(p.match(n) for p in TE_LORA_EXCLUDED):
                    lora.append((m.in_features, m.out_features))
    return EncoderSizes(_params(model), config.hidden_size, config.intermediate_size,
                        _scope(quantised), text_encoder_sizes(model), LoraShapes(tuple(lora)))


def read_text_encoder(path: str | os.PathLike | None) -> tuple[EncoderSizes, bool]:
    """(sizes, is a pre-quantised ConvRot INT8 file) of the text encoder at `path`, or of Qwen3.5-9B when None."""
    if path is None:  # no file beside it: the bundled Qwen3.5-9B config
        return encoder_sizes(load_text_config(BUNDLED_CONFIG_DIR / "model.safetensors")), False
    p = Path(path)
    if p.is_dir() and (p / "text_encoder").is_dir():
        p = p / "text_encoder"
    source, checkpoint = open_text_encoder_source(p)
    try:
        prequantised = cr.is_comfy_quantized_state_dict(source.keys(), source.metadata)
    finally:
        source.close()
    return encoder_sizes(load_text_config(checkpoint)), prequantised


# ------------------------------------------------------------------------------------------------------------ VAE
@dataclass(frozen=True)
class VaeSizes:
    weight_bytes: int  # fp32, as the VAE always runs
    base_width: int  # channels of the first encoder level (the widest feature maps, at full resolution)


def read_vae(path: str | os.PathLike | None) -> VaeSizes:
    """The VAE's fp32 weight bytes and base width from its file header, or the FLUX.2 VAE's when `path` is None."""
    if path is None:
        with torch.device("meta"):
            vae = AutoEncoder()
        return VaeSizes(_params(vae) * 4, vae.config.ch)
    with TensorSource([vae_weights_file(path)]) as source:
        numel = 0
        width = Flux2VAEConfig().ch  # the FLUX.2 width unless the header says otherwise
        for key in source.keys():  # noqa: SIM118 (a TensorSource, not a dict)
            shape = source.shape(key)
            n = 1
            for d in shape:
                n *= d
            numel += n
            if key.endswith("encoder.conv_in.weight"):
                width = shape[0]
    return VaeSizes(numel * 4, width)
