"""Loading the Qwen3.5 text encoder for a run: the one function the trainer, the inference script and the cache tool
call, with one dtype rule, and the prediction of what it will load (for checking caches before reading anything).

- dtype: bf16 (`TEXT_ENCODER_DTYPE`) wherever the encoder runs, GPU or CPU, whatever `--mixed_precision` or the
  inference `--dtype` say: the model is a bf16 model, and one dtype everywhere makes a cache made on the CPU valid on
  a GPU (see `library.text_encoder.variant`). A ConvRot INT8 encoder computes its float parts in bf16 too.
- where it runs: the CPU with `--te_device cpu` / `--text_encoder_cpu`, when `device` is the CPU or names CUDA without
  one, or when `--te_quant auto` finds too little VRAM; else `device` (`library.text_encoder.quant`).
- reading: LoRA files merged while the tensors are read (`tensor_hook`), then ConvRot INT8 (quantised layer by layer
  on `device`), then `--te_quant` (bitsandbytes layers, quantised on the move to the GPU: the encoder is read to the
  CPU whenever that may happen). Building the model draws random numbers: the run's RNG is left as it was, so a run
  is the same whether the encoder was read or not.
- a bitsandbytes encoder (`--te_quant int8/nf4`, or `auto` choosing one) is quantised once, on the device it runs on,
  and never moved again: it goes there at load whatever `home` says, and `place_text_encoder` leaves it where it is.
  bitsandbytes quantises a weight on its first move to any device, the CPU included, and a whole-model `.to()` then
  moves only the weight's data: the int8 codes and scales (`CB`/`SCB`, the layer's state) stay on the old device, so
  an encoder quantised on the CPU and then moved to the GPU (or offloaded after use) runs its CUDA kernels on CPU
  weights.
- `predict_text_encoder_variant` gives the cache variant `load_text_encoder` will return from the options and the
  checkpoint's header alone, or None when only the load can tell (`--te_quant auto` on a GPU for a float encoder,
  which depends on the free VRAM then); callers use it to read the encoder only when something is to be encoded
  (`library.text_encoder.encoding.LazyEncoder`), and check the loaded variant with `check_predicted_variant`.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from library.text_encoder import quant as te_quant
from library.text_encoder.qwen35 import load_qwen35_text_model, text_encoder_file_is_prequantised
from library.text_encoder.variant import (
    BNB_VARIANTS,
    cache_variant,
    dtype_name,
    weights_variant,
)

logger = logging.getLogger(__name__)

TEXT_ENCODER_DTYPE = torch.bfloat16
TensorHook = Callable[[str, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TextEncoderOptions:
    """The options that decide how the text encoder of a run is read, quantised and placed."""

    path: str | os.PathLike  # --text_encoder: a checkpoint file, a text_encoder/ folder or a snapshot root
    quant: str = "none"  # --te_quant
    on_cpu: bool = False  # --te_device cpu / --text_encoder_cpu
    convrot_int8: bool = False  # --convrot_int8_text_encoder
    convrot_int8_bwd: str = "bf16"  # --convrot_int8_bwd
    disable_mmap: bool = False  # --disable_mmap_load_safetensors

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TextEncoderOptions:
        """From a parsed command line of any of the scripts (options a script does not have take their default)."""
        return cls(
            path=args.text_encoder,
            quant=getattr(args, "te_quant", None) or "none",
            on_cpu=te_quant.te_on_cpu(args),
            convrot_int8=bool(getattr(args, "convrot_int8_text_encoder", False)),
            convrot_int8_bwd=getattr(args, "convrot_int8_bwd", None) or "bf16",
            disable_mmap=bool(getattr(args, "disable_mmap_load_safetensors", False)),
        )


@dataclass(frozen=True)
class LoadedTextEncoder:
    """A text encoder read for a run: the model, where it runs, its compute dtype and its cache variant."""

    model: nn.Module  # transformers.Qwen3_5TextModel, frozen, in eval mode
    device: torch.device
    dtype: torch.dtype
    variant: str

    @property
    def convrot_int8(self) -> bool:
        return self.variant.startswith("convrot_int8")

    def placed(self) -> nn.Module:
        """The model, moved to the device it runs on (a bitsandbytes encoder is there already)."""
        return place_text_encoder(self.model, self.device)


def stays_on_its_device(model: nn.Module) -> bool:
    """True for a bitsandbytes-quantised encoder: it is never moved once quantised (see the module docstring)."""
    return weights_variant(model) in (BNB_VARIANTS["int8"], BNB_VARIANTS["nf4"])


def place_text_encoder(model: nn.Module, device: str | torch.device) -> nn.Module:
    """Move the encoder to `device` (to run it there, or to offload it), except a bitsandbytes one, which stays on the
    device it was quantised on; returns the model."""
    if stays_on_its_device(model):
        return model
    return model.to(device)


def resting_device(plan: te_quant.TextEncoderPlan, home: str | torch.device | None) -> torch.device:
    """Where a freshly read encoder goes: `home` when given (the trainer's CPU), else where it runs; a bitsandbytes
    encoder always goes where it runs (it is quantised by that move and stays there)."""
    if home is None or plan.quant != "none":
        return plan.device
    return torch.device(home)


def _tensor_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def run_device(device: str | torch.device) -> torch.device:
    """`device`, or the CPU when it names CUDA and there is none."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        return torch.device("cpu")
    return device


def load_text_encoder(options: TextEncoderOptions, device: str | torch.device, tensor_hook: TensorHook | None = None,
                      frozen: bool = True, home: str | torch.device | None = None) -> LoadedTextEncoder:
    """Read the text encoder for a run on `device` (the run's accelerator; see the module docstring for the rules).

    `tensor_hook(key, tensor)` may change each tensor as it is read (a LoRA merge). `frozen`: False when its LoRA is
    trained (`--te_quant auto` then keeps the loaded weights). `home`: where the model waits until it is used (the
    trainer keeps it on the CPU; `LoadedTextEncoder.placed` moves it); None places it where it runs now. A
    bitsandbytes encoder is placed where it runs whatever `home` says (`resting_device`)."""
    device = run_device(device)
    first = te_quant.loading_device(options.quant, options.on_cpu, torch.device(home or device))
    dtype = TEXT_ENCODER_DTYPE
    logger.info("loading the Qwen3.5 text encoder (%s)", dtype_name(dtype))
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        model = load_qwen35_text_model(options.path, dtype=dtype, device=first, disable_mmap=options.disable_mmap,
                                       tensor_hook=tensor_hook, convrot_int8=options.convrot_int8,
                                       convrot_int8_bwd=options.convrot_int8_bwd, calc_device=device)
        plan = te_quant.prepare_text_encoder(model, options.quant, device, options.on_cpu, frozen)
    resting = resting_device(plan, home)
    model.to(resting)
    if plan.quant != "none" and home is not None and torch.device(home) != resting:
        where = torch.device("cuda", torch.cuda.current_device()) if resting == torch.device("cuda") else resting
        logger.info("text encoder: bitsandbytes %s stays on %s from now on (about %.1f GiB of VRAM): it is quantised"
                    " there and is not offloaded between caching and sampling", plan.quant, where,
                    _tensor_bytes(model) / 2**30)
    loaded = LoadedTextEncoder(model, plan.device, dtype, cache_variant(weights_variant(model), dtype))
    logger.info("text encoder: runs on %s, cache variant %s", loaded.device, loaded.variant)
    return loaded


def predict_text_encoder_variant(options: TextEncoderOptions, device: str | torch.device) -> str | None:
    """The cache variant of the frozen encoder `load_text_encoder(options, device)` will return, or None when it is
    decided at load time (--te_quant auto on a CUDA device for a float encoder). Reads no weights; the checks that
    `te_quant.choose_plan` makes at load time (int8/nf4 need CUDA and bitsandbytes, ...) raise the same UserErrors."""
    device = run_device(device)
    convrot = options.convrot_int8 or text_encoder_file_is_prequantised(options.path)
    if options.quant == "auto" and device.type == "cuda" and not options.on_cpu and not convrot:
        return None
    plan = te_quant.choose_plan(options.quant, device, None, None, te_quant.bitsandbytes_available(), options.on_cpu,
                                frozen=True, prequantised=convrot)
    return cache_variant("convrot_int8" if convrot else BNB_VARIANTS[plan.quant], TEXT_ENCODER_DTYPE)
