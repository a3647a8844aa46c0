"""Text encoder quantisation and placement: ConvRot INT8 (`--convrot_int8_text_encoder`),
`--te_quant auto|none|int8|nf4` (bitsandbytes) and `--te_device gpu|cpu` / `--text_encoder_cpu`.

- ConvRot INT8 (`quantize_text_encoder_convrot`): the attention / GatedDeltaNet / MLP projections and `embed_tokens`
  (`library.quant.convrot.text_encoder_convrot_filter`), after loading and after any LoRA merge, one layer at a time.

- `none` (default): the Qwen3.5 text encoder runs as loaded (bf16, or ConvRot INT8 when that was asked for).
- `int8`: the Linear layers of attention, Gated DeltaNet and MLP become bitsandbytes `Linear8bitLt` (LLM.int8(),
  outlier threshold 6.0); `nf4`: bitsandbytes `Linear4bit` (NF4, bf16 compute, double-quantised statistics). The
  token embedding, the norms and the tiny GDN gate projections (`in_proj_a`, `in_proj_b`) stay bf16. The weights are
  handed to the new layers without a copy and are quantised when the encoder moves to the GPU. Both need CUDA and
  bitsandbytes (`pip install bitsandbytes`); without them an explicit int8/nf4 is an error.
- `auto`: from the free VRAM of the training device when the encoder is about to be used (the DiT is not loaded
  yet): the first of bf16, int8, nf4 whose estimate fits, else the CPU (with a warning), also when bitsandbytes or
  CUDA is missing. Estimate = weights in that format x 1.10 + 2 GiB of activations (4096-token captions). For the
  Qwen3.5-9B encoder of MOSS-Image (14.8 GiB in bf16, of which 1.9 GiB token embedding) that is about:
  bf16 >= 18.3 GiB free, int8 >= 11.2 GiB, nf4 >= 7.8 GiB, else the CPU. So a 24 GB card keeps bf16, a 16 GB card
  gets int8, a 12 GB card int8 or nf4 (by what else is on it), an 8 GB card the CPU.
- `--te_device cpu` (= `--text_encoder_cpu`): the encoder runs on the CPU (slow; for caching the outputs when the GPU
  cannot hold it). It cannot be combined with int8/nf4 or with a text encoder LoRA.
Quantisation is for a frozen encoder: with a text encoder LoRA, `auto` keeps the loaded weights and int8/nf4 are
refused (use --convrot_int8_text_encoder).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
from dataclasses import dataclass

import torch
from torch import nn

from library.errors import UserError
from library.quant import convrot as cr

logger = logging.getLogger(__name__)

TE_QUANT_CHOICES = ("auto", "none", "int8", "nf4")
TE_DEVICE_CHOICES = ("gpu", "cuda", "cpu")
HEADROOM_BYTES = 2 * 2**30
HEADROOM_FACTOR = 1.10
INT8_THRESHOLD = 6.0
NF4_BLOCKSIZE = 64
# Linear layers left in bf16: the Gated DeltaNet decay/beta projections (a few dozen outputs, precision sensitive)
SKIPPED_LINEARS = ("in_proj_a", "in_proj_b")


# -------------------------------------------------------------------------------------------------- arguments
def te_on_cpu(args: argparse.Namespace) -> bool:
    return getattr(args, "te_device", None) == "cpu" or bool(getattr(args, "text_encoder_cpu", False))


def check_text_encoder_memory_args(args: argparse.Namespace, train_text_encoder: bool = False) -> None:
    """Conflicts that need no model: quantisation on the CPU, a quantised or CPU encoder that is trained."""
    mode = args.te_quant
    cpu = te_on_cpu(args)
    if args.te_device in ("gpu", "cuda") and args.text_encoder_cpu:
        raise UserError("--te_device gpu and --text_encoder_cpu contradict each other: keep one.")
    if cpu and mode in ("int8", "nf4"):
        raise UserError(f"--te_quant {mode} runs on the GPU only, but the text encoder is set to run on the CPU"
                        " (--te_device cpu / --text_encoder_cpu): drop one of them.")
    if train_text_encoder and mode in ("int8", "nf4"):
        raise UserError(f"--te_quant {mode} is for a frozen text encoder, but the text encoder LoRA is trained: use"
                        " --convrot_int8_text_encoder, or cache the outputs with --network_train_unet_only.")
    if train_text_encoder and cpu:
        raise UserError("--te_device cpu / --text_encoder_cpu cannot train a text encoder LoRA: cache the text"
                        " encoder outputs (--cache_text_encoder_outputs --network_train_unet_only) or run it on the"
                        " GPU.")


# ---------------------------------------------------------------------------------------------------- sizing
@dataclass(frozen=True)
class TextEncoderSizes:
    """Bytes of the encoder by part: the quantisable Linear weights (element count and rows) and everything else."""

    linear_weights: int
    linear_rows: int
    linear_bytes: int
    other_bytes: int

    def weight_bytes(self, quant: str) -> int:
        if quant == "int8":
            return self.linear_weights + 4 * self.linear_rows + self.other_bytes
        if quant == "nf4":
            return self.linear_weights // 2 + self.linear_weights // NF4_BLOCKSIZE + self.other_bytes
        return self.linear_bytes + self.other_bytes

    def needed_bytes(self, quant: str) -> int:
        return int(self.weight_bytes(quant) * HEADROOM_FACTOR) + HEADROOM_BYTES


def quantisable_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """Plain nn.Linear layers inside the decoder layers (attention, GDN, MLP), without the tiny GDN gates."""
    out = []
    for name, module in model.named_modules():
        if type(module) is nn.Linear and ".layers." in f".{name}" and not name.endswith(SKIPPED_LINEARS):
            out.append((name, module))
    return out


def text_encoder_sizes(model: nn.Module) -> TextEncoderSizes:
    linears = quantisable_linears(model)
    weights = {id(m.weight) for _, m in linears}
    lin_numel = sum(m.weight.numel() for _, m in linears)
    lin_bytes = sum(m.weight.numel() * m.weight.element_size() for _, m in linears)
    other = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()] if id(t) not in weights)
    return TextEncoderSizes(lin_numel, sum(m.out_features for _, m in linears), lin_bytes, other)


# --------------------------------------------------------------------------------------------------- decision
@dataclass(frozen=True)
class TextEncoderPlan:
    quant: str  # none | int8 | nf4
    device: torch.device
    reason: str


def bitsandbytes_available() -> bool:
    return importlib.util.find_spec("bitsandbytes") is not None


def choose_plan(mode: str, device: torch.device, sizes: TextEncoderSizes | None, free_bytes: int | None,
                bnb_available: bool, te_cpu: bool = False, frozen: bool = True, prequantised: bool = False
                ) -> TextEncoderPlan:
    """Where and how the text encoder runs. Raises UserError for an explicit int8/nf4 that cannot be honoured."""
    cpu = torch.device("cpu")
    if mode not in TE_QUANT_CHOICES:
        raise UserError(f"--te_quant {mode} is not one of {', '.join(TE_QUANT_CHOICES)}.")
    if mode in ("int8", "nf4"):
        if device.type != "cuda":
            raise UserError(f"--te_quant {mode} needs a CUDA GPU (bitsandbytes), and this run has none: use --te_quant"
                            " none (or auto).")
        if not bnb_available:
            raise UserError(f"--te_quant {mode} needs the 'bitsandbytes' package, which is not installed: pip install"
                            " bitsandbytes, or use --te_quant none / --convrot_int8_text_encoder.")
        if prequantised:
            raise UserError(f"--te_quant {mode} cannot quantise a ConvRot INT8 text encoder again: drop --te_quant.")
        return TextEncoderPlan(mode, device, "asked for")
    if te_cpu:
        return TextEncoderPlan("none", cpu, "--te_device cpu")
    if mode == "none":
        return TextEncoderPlan("none", device, "asked for")
    # auto
    if device.type != "cuda":
        return TextEncoderPlan("none", cpu, "no CUDA device")
    if not frozen or prequantised or sizes is None or free_bytes is None:
        why = "the text encoder is trained" if not frozen else "ConvRot INT8 already" if prequantised else "no size"
        return TextEncoderPlan("none", device, why)
    gib = 2**30
    for quant in ("none", "int8", "nf4"):
        need = sizes.needed_bytes(quant)
        if free_bytes >= need:
            if quant != "none" and not bnb_available:
                return TextEncoderPlan("none", cpu, f"{free_bytes / gib:.1f} GiB free is too little for bf16"
                                       f" ({sizes.needed_bytes('none') / gib:.1f} GiB) and bitsandbytes is missing")
            label = "bf16" if quant == "none" else quant
            return TextEncoderPlan(quant, device, f"{free_bytes / gib:.1f} GiB free >= {need / gib:.1f} GiB for"
                                                  f" {label}")
    return TextEncoderPlan("none", cpu, f"{free_bytes / gib:.1f} GiB free < {sizes.needed_bytes('nf4') / gib:.1f}"
                                        " GiB needed even with nf4")


def loading_device(mode: str, te_cpu: bool, device: torch.device) -> torch.device:
    """Where to load the encoder: the CPU whenever it may still be quantised (quantisation happens on the move)."""
    if te_cpu or (mode != "none" and device.type == "cuda"):
        return torch.device("cpu")
    return device


# ------------------------------------------------------------------------------------------------ quantisation
def _int8_layer(lin: nn.Linear) -> nn.Module:
    import bitsandbytes as bnb

    new = bnb.nn.Linear8bitLt(lin.in_features, lin.out_features, bias=lin.bias is not None, has_fp16_weights=False,
                              threshold=INT8_THRESHOLD, device="meta")
    new.weight = bnb.nn.Int8Params(lin.weight.data, requires_grad=False, has_fp16_weights=False)
    return new


def _nf4_layer(lin: nn.Linear) -> nn.Module:
    import bitsandbytes as bnb

    new = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                            compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4", device="meta")
    new.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, blocksize=NF4_BLOCKSIZE,
                                   compress_statistics=True, quant_type="nf4", module=new)
    return new


def quantise_linear_layers(model: nn.Module, quant: str) -> int:
    """Replace the quantisable Linear layers by bitsandbytes layers in place (quantised on the move to CUDA)."""
    make = {"int8": _int8_layer, "nf4": _nf4_layer}[quant]
    linears = quantisable_linears(model)
    for name, lin in linears:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        new = make(lin)
        if lin.bias is not None:
            new.bias = nn.Parameter(lin.bias.data, requires_grad=False)
        new.train(lin.training)
        setattr(parent, child, new)
    return len(linears)


def quantize_text_encoder_convrot(model: nn.Module, bwd: str = "bf16",
                                  calc_device: str | torch.device | None = None) -> int:
    """ConvRot INT8 for the text encoder's scope, in place (layer by layer on `calc_device` when given); returns the
    number of converted modules. A model that is ConvRot INT8 already (a pre-quantised file) is left as it is."""
    if cr.is_convrot_int8_model(model):
        return 0
    group = cr.convrot_group_size(model, cr.text_encoder_convrot_filter)
    return cr.convert_model_to_convrot_int8(model, cr.text_encoder_convrot_filter, calc_device, group, bwd)


def _is_prequantised(model: nn.Module) -> bool:
    return cr.is_convrot_int8_model(model)


def free_vram(device: torch.device) -> int | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return int(torch.cuda.mem_get_info(device)[0])


def prepare_text_encoder(model: nn.Module, mode: str, device: str | torch.device, te_cpu: bool = False,
                         frozen: bool = True) -> TextEncoderPlan:
    """Decide where/how the encoder runs and apply the quantisation (the caller moves it to `plan.device`)."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        device = torch.device("cpu")
    sizes = text_encoder_sizes(model) if mode == "auto" else None
    plan = choose_plan(mode, device, sizes, free_vram(device), bitsandbytes_available(), te_cpu, frozen,
                       _is_prequantised(model))
    if mode == "auto" and plan.device.type == "cpu" and not te_cpu:
        logger.warning("--te_quant auto: the text encoder runs on the CPU (%s); this is slow", plan.reason)
    if plan.quant != "none":
        n = quantise_linear_layers(model, plan.quant)
        logger.info("text encoder: %d Linear layers -> bitsandbytes %s (%s)", n, plan.quant, plan.reason)
    elif mode != "none" or te_cpu:
        logger.info("text encoder on %s, not quantised by --te_quant %s (%s)", plan.device, mode, plan.reason)
    return plan
