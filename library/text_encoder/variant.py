"""The cache variant of the Qwen3.5 text encoder: what, besides the captions, fixes the numbers of its outputs.

The text-encoder output caches record it (`encoder` in `*_moss_te.npz`) and a file made by another variant is re-made,
so a cache made by the trainer, the cache tool or any other caller is valid for the others exactly when their numbers
are the same. A variant is the format of the weights and the dtype the encoder computes in:
- weights: `none` (float weights), `convrot_int8` (ConvRot INT8, quantised at load or a pre-quantised file),
  `bnb_int8` / `bnb_nf4` (`--te_quant`); `weights_variant` reads it from a loaded model.
- dtype: bf16, the one dtype a run computes in (`library.text_encoder.loading.TEXT_ENCODER_DTYPE`), adds nothing to
  the name. So `none`, `convrot_int8`, ... keep the meaning the files of earlier versions give them: on a GPU the
  trainer and the cache tool always ran the encoder in bf16. Another dtype is a suffix (`none_fp32`): earlier
  versions ran it in fp32 in the cache tool on the CPU, and such files are told apart by their values
  (`library.caching.strategies`).
- The device is not part of it: bf16 on the CPU and on a GPU compute the same operations in the same format, and
  differ only by the summation order of their kernels (as two GPUs, or two batch shapes, do).
"""

from __future__ import annotations

import torch
from torch import nn

BF16 = "bf16"
DTYPE_NAMES = {torch.bfloat16: BF16, torch.float32: "fp32", torch.float16: "fp16"}
WEIGHTS_VARIANTS = ("none", "convrot_int8", "bnb_int8", "bnb_nf4")
BNB_VARIANTS = {"none": "none", "int8": "bnb_int8", "nf4": "bnb_nf4"}  # by --te_quant plan


def weights_variant(model: nn.Module) -> str:
    """How the text encoder's weights are stored: none (float), convrot_int8, bnb_int8, bnb_nf4."""
    names = {type(m).__name__ for m in model.modules()}
    if "ConvRotInt8Linear" in names:
        return "convrot_int8"
    if "Linear8bitLt" in names:
        return "bnb_int8"
    if "Linear4bit" in names:
        return "bnb_nf4"
    return "none"


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def cache_variant(weights: str, dtype: torch.dtype | str) -> str:
    """The recorded name: `weights` for bf16, `weights_<dtype>` otherwise (`dtype` as a torch dtype or its name)."""
    name = dtype if isinstance(dtype, str) else dtype_name(dtype)
    return weights if name == BF16 else f"{weights}_{name}"


def variant_dtype(variant: str) -> str:
    """The dtype name of a variant made by `cache_variant` (bf16 when it has no dtype suffix)."""
    weights, _, suffix = variant.rpartition("_")
    return suffix if weights in WEIGHTS_VARIANTS and suffix in DTYPE_NAMES.values() else BF16


def check_predicted_variant(predicted: str, loaded: str) -> None:
    """After a deferred load: the caches were checked against `predicted`, so the real variant must equal it."""
    if predicted != loaded:
        raise RuntimeError(
            f"internal error: the text encoder was predicted to load as '{predicted}' but loaded as '{loaded}'; the"
            " text-encoder caches were checked against the prediction. Please report this (with the command line)."
        )
