"""The variant the Qwen3.5 text encoder will have once loaded, known before it is read.

The text-encoder output caches record how the encoder's weights were stored (`strategy_moss_image.text_encoder_variant`:
none, convrot_int8, bnb_int8, bnb_nf4) and a file made by another variant is re-made. To check the caches without
reading the 9B encoder, the variant is predicted from the options and the checkpoint's safetensors header:
- a ConvRot INT8 encoder (`--convrot_int8_text_encoder`, or a pre-quantised ComfyUI file) is convrot_int8 whatever
  `--te_quant` says (int8/nf4 on it are refused, auto keeps it);
- otherwise `--te_quant` none/int8/nf4 give none/bnb_int8/bnb_nf4 (the CPU or a missing CUDA gives none with auto).
`--te_quant auto` on a CUDA device for a float encoder depends on the free VRAM when the encoder is loaded: there is no
prediction (None), and the caller loads the encoder before checking the caches. The checks that `te_quant.choose_plan`
makes at load time (int8/nf4 need CUDA and bitsandbytes, ...) raise the same UserErrors here.
"""

from __future__ import annotations

import argparse
import logging

import torch

logger = logging.getLogger(__name__)

_BNB_VARIANTS = {"none": "none", "int8": "bnb_int8", "nf4": "bnb_nf4"}


def run_device(device: str | torch.device) -> torch.device:
    """`device`, or the CPU when it names CUDA and there is none (as `te_quant.prepare_text_encoder` does)."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        return torch.device("cpu")
    return device


def predict_text_encoder_variant(args: argparse.Namespace, device: str | torch.device) -> str | None:
    """The `text_encoder_variant` of the frozen encoder that `args` will load for `device`, or None when it is
    decided at load time (--te_quant auto on a CUDA device for a float encoder). Reads no weights."""
    from library.moss_image.loaders import text_encoder_file_is_prequantised
    from library.text_encoder.quant import bitsandbytes_available, choose_plan, te_on_cpu

    device = run_device(device)
    mode = getattr(args, "te_quant", None) or "none"
    on_cpu = te_on_cpu(args)
    convrot = bool(getattr(args, "convrot_int8_text_encoder", False)) \
        or text_encoder_file_is_prequantised(args.text_encoder)
    if mode == "auto" and device.type == "cuda" and not on_cpu and not convrot:
        return None
    plan = choose_plan(mode, device, None, None, bitsandbytes_available(), on_cpu, frozen=True, prequantised=convrot)
    return "convrot_int8" if convrot else _BNB_VARIANTS[plan.quant]


def check_predicted_variant(predicted: str, loaded: str) -> None:
    """After a deferred load: the caches were checked against `predicted`, so the real variant must equal it."""
    if predicted != loaded:
        raise RuntimeError(
            f"internal error: the text encoder was predicted to load as '{predicted}' but loaded as '{loaded}'; the"
            " text-encoder caches were checked against the prediction. Please report this (with the command line)."
        )
