"""`--vram_budget GIB` on the command line: what the run is (workload), what the planner may change (the options
not given explicitly), and the chosen plan written back into the parsed options before anything loads.

An option counts as given explicitly when its value differs from the parser's own default (a `--config_file` value
counts) or when it appears on the command line (`--te_quant none` too). The planned options are:
- training: `--convrot_int8`, `--gradient_checkpointing` (+ `--checkpointing_policy` where the trainer has it),
  `--unsloth_offload_checkpointing`, `--blocks_to_swap` with `--block_swap_h2d_only`, `--convrot_int8_text_encoder`,
  `--te_quant`, `--te_device`, `--checkpointing_skip_blocks` (a given value is kept and modelled, full or selective
  checkpointing only; otherwise unswapped full/selective candidates get a twin with the most blocks left out that fits,
  up to `speed_model.PLANNED_SKIP_MAX`);
- inference: `--convrot_int8`, `--blocks_to_swap`, `--convrot_int8_text_encoder`, `--te_quant`, `--text_encoder_cpu`;
- both: `--cuda_expandable_segments`, on unless PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF) is set (then its
  own `expandable_segments` value is modelled): the allocator's slack is smaller with it, and on the H200 it was what let ConvRot INT8 with
  selective checkpointing and `--compile` fit 9 GiB (docs/benchmarks.md, seventh run).

The workload: the largest image of the run (training: the resolution of each dataset of the dataset config or of
`--resolution`, whose area bounds every bucket, times its batch size), `TEXT_TOKENS_ASSUMED` text tokens per caption
(at most `--moss_max_token_length`), the LoRA rank and optimizer, the precision, `--compile`, the caches.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from library.errors import UserError
from library.memory.block_swap import max_blocks_to_swap
from library.moss_image.loaders import fill_paths_from_snapshot
from library.planning import sizes
from library.planning.memory_model import InferenceWorkload, Workload
from library.planning.planner import Choices, Overheads, Plan, plan_inference, plan_training
from library.planning.speed_model import PLANNED_SKIP_MAX
from library.runtime.checkpointing import skip_blocks
from library.runtime.compile import allocator_conf_set
from library.text_encoder.quant import bitsandbytes_available

logger = logging.getLogger(__name__)

TEXT_TOKENS_ASSUMED = 256  # per caption, chat template included (the preflight reports the real lengths)
DEFAULT_RESOLUTION = (1024, 1024)
DEFAULT_LORA_RANK = 4  # networks.lora_generic's default --network_dim
PATCH_PIXELS = 16  # one DiT token per 16 x 16 pixels (VAE 8x, 2x2 patchify)

TRAINING_PLANNED = ("convrot_int8", "gradient_checkpointing", "checkpointing_policy", "unsloth_offload_checkpointing",
                    "cpu_offload_checkpointing", "blocks_to_swap", "block_swap_h2d_only",
                    "convrot_int8_text_encoder", "te_quant", "te_device", "text_encoder_cpu")


def add_vram_budget_argument(parser: argparse.ArgumentParser | Any) -> None:
    """--vram_budget (the trainer, the inference script, tools/plan_memory.py)."""
    parser.add_argument("--vram_budget", type=float, default=None, metavar="GIB",
                        help="GPU memory in GiB the run may use (CUDA context included): the DiT precision, block swap,"
                             " checkpointing and text-encoder placement are chosen to fit it, fastest first; options"
                             " given explicitly are kept (tools/plan_memory.py prints the plan without running)")


def check_budget(value: float) -> int:
    if not value or value <= 0 or math.isnan(value):
        raise UserError(f"--vram_budget {value} is not a size: give the GPU memory in GiB, e.g. --vram_budget 16.")
    return int(value * sizes.GIB)


# ------------------------------------------------------------------------------------------------ explicit options
def explicit_options(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str] | None,
                     fresh_defaults: dict[str, Any]) -> frozenset[str]:
    """The dests the user gave: named on the command line (exact or abbreviated), or with a value other than the
    default of a freshly built parser (so `--config_file` values count)."""
    words = list(sys.argv[1:] if argv is None else argv)
    by_string = {s: a.dest for a in parser._actions for s in a.option_strings}
    given = set()
    for word in words:
        if not word.startswith("--"):
            continue
        name = word.split("=", 1)[0]
        if name in by_string:
            given.add(by_string[name])
            continue
        matches = {d for s, d in by_string.items() if s.startswith(name)}
        if len(matches) == 1:  # argparse accepts unambiguous abbreviations
            given |= matches
    for dest, default in fresh_defaults.items():
        if hasattr(args, dest) and getattr(args, dest) != default:
            given.add(dest)
    return frozenset(given)


def parser_defaults(parser: argparse.ArgumentParser) -> dict[str, Any]:
    return {a.dest: a.default for a in parser._actions if a.dest != "help"}


# ---------------------------------------------------------------------------------------------------- the workload
def _dataset_sizes(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    """(width, height, batch size) of each dataset of the run, without reading any image."""
    from library.datasets.build import load_blueprints

    if any(getattr(args, n, None) for n in ("dataset_config", "train_data_dir", "in_json")):
        return [(bp.params.resolution[0], bp.params.resolution[1], bp.params.batch_size)
                for bp in load_blueprints(args)[0]]
    from library.datasets.config import parse_resolution_arg

    w, h = parse_resolution_arg(getattr(args, "resolution", None)) or DEFAULT_RESOLUTION
    return [(w, h, getattr(args, "train_batch_size", 1) or 1)]


def image_tokens(width: int, height: int) -> int:
    return (width // PATCH_PIXELS) * (height // PATCH_PIXELS)


def text_tokens(args: argparse.Namespace) -> int:
    return min(TEXT_TOKENS_ASSUMED, getattr(args, "moss_max_token_length", None) or TEXT_TOKENS_ASSUMED)


def optimizer_name(args: argparse.Namespace) -> str:
    """--optimizer_type with sd-scripts' legacy switches (as library.training.optimizers resolves it)."""
    if getattr(args, "use_8bit_adam", False):
        return "AdamW8bit"
    if getattr(args, "use_lion_optimizer", False):
        return "Lion"
    return getattr(args, "optimizer_type", None) or "AdamW"


def plans_expandable_segments(args: argparse.Namespace) -> bool:
    """Whether the planned run has the allocator's expandable segments: a PYTORCH_CUDA_ALLOC_CONF of the user's decides
    (it wins over the option); otherwise the planner turns --cuda_expandable_segments on."""
    conf = allocator_conf_set()
    if conf is not None:
        return "expandable_segments:true" in conf[1].replace(" ", "").lower()
    return hasattr(args, "cuda_expandable_segments")


def training_workload(args: argparse.Namespace) -> tuple[Workload, str]:
    """The workload of a training run and a short description of it."""
    w, h, batch = max(_dataset_sizes(args), key=lambda d: image_tokens(d[0], d[1]) * d[2])
    cache_te = bool(args.cache_text_encoder_outputs or args.cache_text_encoder_outputs_to_disk)
    work = Workload(
        image_tokens=image_tokens(w, h), text_tokens=text_tokens(args), batch_size=batch,
        float_bytes=4 if args.mixed_precision == "no" else 2, lora_rank=args.network_dim or DEFAULT_LORA_RANK,
        lora_bytes=2 if (args.full_bf16 or args.full_fp16) else 4, optimizer=optimizer_name(args),
        compile=bool(args.compile), expandable_segments=plans_expandable_segments(args),
        cache_latents=bool(args.cache_latents or args.cache_latents_to_disk), vae_batch_size=args.vae_batch_size or 1,
        cache_text_encoder_outputs=cache_te, train_text_encoder=not args.network_train_unet_only and not cache_te,
        highvram=bool(args.highvram), lowram=bool(args.lowram), sample_images=bool(args.sample_prompts),
        te_read_at_start=not (args.cache_text_encoder_outputs_to_disk and not args.sample_prompts),
    )
    what = (f"training at {w}x{h} ({work.image_tokens} image tokens) + {work.text_tokens} text tokens (assumed),"
            f" batch {batch}, LoRA rank {work.lora_rank}, {work.optimizer}" + (", --compile" if work.compile else ""))
    return work, what


# ------------------------------------------------------------------------------------------------------- the models
@dataclass(frozen=True)
class Models:
    dit: sizes.DitSizes
    dit_prequantised: bool
    te: sizes.EncoderSizes
    te_prequantised: bool
    vae: sizes.VaeSizes


def read_models(args: argparse.Namespace, dit_attr: str) -> Models:
    """The sizes of the run's models from their headers (--snapshot resolved on a copy of the options)."""
    paths = argparse.Namespace(**vars(args))
    fill_paths_from_snapshot(paths, dit_attr, "text_encoder", "vae")
    dit, dit_q = sizes.read_dit(getattr(paths, dit_attr, None))
    te, te_q = sizes.read_text_encoder(getattr(paths, "text_encoder", None))
    return Models(dit, dit_q, te, te_q, sizes.read_vae(getattr(paths, "vae", None)))


# ------------------------------------------------------------------------------------------------------ the choices
def _te_choices(args: argparse.Namespace, explicit: frozenset[str], prequantised: bool, trained: bool,
                allow_cpu: bool) -> tuple[tuple[tuple[str, bool], ...], bool]:
    """(variant, on the GPU) options in order of preference, and whether the encoder is planned at all (not with
    --te_quant auto, which decides at load time: the encoder is then left out of the estimate)."""
    convrot = prequantised or ("convrot_int8_text_encoder" in explicit and args.convrot_int8_text_encoder)
    quant = args.te_quant if "te_quant" in explicit else None
    if quant == "auto":
        return (("none", False),), False
    if convrot:
        variants = ["convrot_int8"]
    elif quant in ("int8", "nf4"):
        variants = ["bnb_" + quant]
    elif quant == "none":
        variants = ["none"]
    else:
        variants = ["none", "convrot_int8"] + ([] if trained or not bitsandbytes_available() else ["bnb_nf4"])
    options = [(v, True) for v in variants]
    if allow_cpu and not variants[0].startswith("bnb_"):
        options.append((variants[0], False))  # the CPU keeps the float (or ConvRot) variant: caches stay valid
    if {"te_device", "text_encoder_cpu"} & explicit:
        cpu = getattr(args, "te_device", None) == "cpu" or bool(getattr(args, "text_encoder_cpu", False))
        options = [o for o in options if o[1] != cpu] or [(variants[0], not cpu)]
    return tuple(options), True


def _fixed_words(args: argparse.Namespace, dests: set[str]) -> list[str]:
    """The options the user gave among `dests`, as the plan's messages name them (`--convrot_int8 false` included)."""
    return sorted(f"--{d} false" if d == "convrot_int8" and not args.convrot_int8 else f"--{d}" for d in dests)


def _dit_choices(args: argparse.Namespace, explicit: frozenset[str], prequantised: bool
                 ) -> tuple[tuple[str, ...], str]:
    """(the DiT precisions to plan, where INT8 comes from): a pre-quantised file is INT8; `--convrot_int8` fixes INT8
    and `--convrot_int8 false` bf16; otherwise both are candidates."""
    if prequantised:
        return ("int8",), "file"
    if "convrot_int8" in explicit:
        return ("int8",) if args.convrot_int8 else ("bf16",), "at load"
    return ("bf16", "int8"), "at load"


def training_choices(args: argparse.Namespace, explicit: frozenset[str], models: Models, work: Workload) -> Choices:
    fixed = _fixed_words(args, explicit & set(TRAINING_PLANNED))
    dit, source = _dit_choices(args, explicit, models.dit_prequantised)
    if models.dit_prequantised:
        fixed.append("a pre-quantised DiT file")
    has_policy = hasattr(args, "checkpointing_policy")
    modes = ["none"] + (["selective"] if has_policy else []) + ["full", "unsloth"]
    if "unsloth_offload_checkpointing" in explicit and args.unsloth_offload_checkpointing:
        modes = ["unsloth"]
    elif "cpu_offload_checkpointing" in explicit and args.cpu_offload_checkpointing:
        modes = ["cpu_offload"]
    elif has_policy and "checkpointing_policy" in explicit:
        modes = [args.checkpointing_policy]
    elif "gradient_checkpointing" in explicit and args.gradient_checkpointing:
        modes.remove("none")
    swap = None
    if "blocks_to_swap" in explicit:
        swap = args.blocks_to_swap or 0
    skip = skip_blocks(args, models.dit.num_layers)  # the trainer's own bound check, before anything loads
    if skip:
        fixed.append(f"--checkpointing_skip_blocks {skip}")
    planned_skip = hasattr(args, "checkpointing_skip_blocks") and "checkpointing_skip_blocks" not in explicit
    te, te_planned = _te_choices(args, explicit, models.te_prequantised, work.train_text_encoder,
                                 allow_cpu=not work.text_encoder_in_step)
    if models.te_prequantised:
        fixed.append("a pre-quantised text-encoder file")
    return Choices(tuple(dit), source, tuple(modes), swap, max_blocks_to_swap(models.dit.num_layers), te, te_planned,
                   "file" if models.te_prequantised else "at load", tuple(fixed), skip_blocks=skip,
                   skip_max=dict(PLANNED_SKIP_MAX) if planned_skip else {})


# ------------------------------------------------------------------------------------------------- applying a plan
def training_options(plan: Plan, args: argparse.Namespace, explicit: frozenset[str]) -> dict[str, Any]:
    """The option values of the chosen candidate that the user did not give (dest -> value)."""
    s = plan.chosen.setup
    values: dict[str, Any] = {
        "convrot_int8": s.dit == "int8" and plan.choices.dit_int8_source == "at load",
        "gradient_checkpointing": s.checkpointing != "none",
        "unsloth_offload_checkpointing": s.checkpointing == "unsloth",
        "cpu_offload_checkpointing": s.checkpointing == "cpu_offload",
        "blocks_to_swap": s.blocks_to_swap or None,
        "block_swap_h2d_only": s.blocks_to_swap > 0,
    }
    if hasattr(args, "checkpointing_policy") and s.checkpointing in ("full", "selective"):
        values["checkpointing_policy"] = s.checkpointing
    if plan.choices.skip_max:
        values["checkpointing_skip_blocks"] = s.skip_blocks
    values["cuda_expandable_segments"] = plans_expandable_segments(args)
    if plan.choices.te_planned:
        values["convrot_int8_text_encoder"] = s.te_variant == "convrot_int8" and plan.choices.te_int8_source == "at load"
        values["te_quant"] = {"bnb_int8": "int8", "bnb_nf4": "nf4"}.get(s.te_variant, "none")
        if not s.te_on_gpu:
            values["te_device"] = "cpu"
    return {k: v for k, v in values.items() if k not in explicit and hasattr(args, k)}


def option_words(values: dict[str, Any], defaults: dict[str, Any]) -> tuple[str, ...]:
    """The values that differ from the defaults, as command-line words."""
    words: list[str] = []
    for dest, value in values.items():
        if value == defaults.get(dest):
            continue
        if value is True:
            words.append(f"--{dest}")
        elif value not in (False, None):
            words += [f"--{dest}", str(value)]
    return tuple(words)


def _log_plan(plan: Plan) -> None:
    for line in plan.lines():
        logger.info("%s", line)


def make_training_plan(args: argparse.Namespace, explicit: frozenset[str], overheads: Overheads | None = None
                       ) -> tuple[Plan, dict[str, Any]]:
    """The plan of a training run and the option values it sets (not applied)."""
    budget = check_budget(args.vram_budget)
    models = read_models(args, "pretrained_model_name_or_path")
    work, what = training_workload(args)
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    over = overheads or Overheads.for_processes(processes)
    header = (f"VRAM plan for --vram_budget {args.vram_budget:g} GiB: {what}; a candidate needs its peak + "
              f"{over.context_bytes / sizes.GIB:.2f} GiB CUDA context + {over.margin_share:.0%} margin")
    plan = plan_training(models.dit, models.te, models.vae, work, training_choices(args, explicit, models, work),
                         budget, over, header)
    values = training_options(plan, args, explicit)
    return plan, values


def apply_vram_budget(args: argparse.Namespace, parser_factory: Callable[[], argparse.ArgumentParser],
                      argv: Sequence[str] | None = None) -> Plan | None:
    """The trainer's call, right after parsing: with --vram_budget, plan, log the table and set the options."""
    if args.vram_budget is None:
        return None
    if not torch.cuda.is_available():
        raise UserError("--vram_budget plans the memory of a CUDA GPU and this machine has none: drop --vram_budget.")
    parser = parser_factory()
    explicit = explicit_options(parser, args, argv, parser_defaults(parser))
    plan, values = make_training_plan(args, explicit)
    for dest, value in values.items():
        setattr(args, dest, value)
    plan = _with_options(plan, option_words(values, parser_defaults(parser)))
    _log_plan(plan)
    return plan


def _with_options(plan: Plan, words: tuple[str, ...]) -> Plan:
    return replace(plan, options=words)


# ------------------------------------------------------------------------------------------------------- inference
def inference_choices(args: argparse.Namespace, explicit: frozenset[str], models: Models, interactive: bool
                      ) -> Choices:
    fixed = _fixed_words(args, explicit & {"convrot_int8", "blocks_to_swap", "convrot_int8_text_encoder", "te_quant",
                                           "te_device", "text_encoder_cpu"})
    dit, source = _dit_choices(args, explicit, models.dit_prequantised)
    swap = (args.blocks_to_swap or 0) if "blocks_to_swap" in explicit else None
    te, te_planned = _te_choices(args, explicit, models.te_prequantised, False, allow_cpu=True)
    return Choices(dit, source, ("none",), swap, max_blocks_to_swap(models.dit.num_layers), te, te_planned,
                   "file" if models.te_prequantised else "at load", tuple(fixed))


def make_inference_plan(args: argparse.Namespace, explicit: frozenset[str], image_sizes: Sequence[tuple[int, int]],
                        overheads: Overheads | None = None) -> tuple[Plan, dict[str, Any]]:
    budget = check_budget(args.vram_budget)
    models = read_models(args, "dit")
    h, w = max(image_sizes, key=lambda s: s[0] * s[1])
    dtype = getattr(args, "dtype", None)
    work = InferenceWorkload(
        image_tokens=image_tokens(w, h), text_tokens=text_tokens(args), float_bytes=4 if dtype == "fp32" else 2,
        compile=bool(getattr(args, "compile", False)),
        expandable_segments=plans_expandable_segments(args),
        decode=getattr(args, "output_type", "images") != "latent", interactive=bool(getattr(args, "interactive", False)),
        guided=float(getattr(args, "guidance_scale", 3.0)) != 1.0,
    )
    over = overheads or Overheads()
    header = (f"VRAM plan for --vram_budget {args.vram_budget:g} GiB: inference at {w}x{h} ({work.image_tokens} image"
              f" tokens) + {work.text_tokens} text tokens (assumed); a candidate needs its peak +"
              f" {over.context_bytes / sizes.GIB:.2f} GiB CUDA context + {over.margin_share:.0%} margin")
    choices = inference_choices(args, explicit, models, work.interactive)
    plan = plan_inference(models.dit, models.te, models.vae, work, choices, budget, over, header)
    s = plan.chosen.setup
    values: dict[str, Any] = {"convrot_int8": s.dit == "int8" and choices.dit_int8_source == "at load",
                              "blocks_to_swap": s.blocks_to_swap or None,
                              "cuda_expandable_segments": plans_expandable_segments(args)}
    if choices.te_planned:
        values["convrot_int8_text_encoder"] = s.te_variant == "convrot_int8" and choices.te_int8_source == "at load"
        values["te_quant"] = {"bnb_int8": "int8", "bnb_nf4": "nf4"}.get(s.te_variant, "none")
        values["text_encoder_cpu"] = not s.te_on_gpu
    return plan, {k: v for k, v in values.items() if k not in explicit and hasattr(args, k)}


def apply_inference_vram_budget(args: argparse.Namespace, parser_factory: Callable[[], argparse.ArgumentParser],
                                image_sizes: Sequence[tuple[int, int]], argv: Sequence[str] | None = None
                                ) -> Plan | None:
    """The inference script's call, before any model is read: with --vram_budget, plan, log and set the options."""
    if args.vram_budget is None:
        return None
    device = getattr(args, "device", None)
    if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        raise UserError("--vram_budget plans the memory of a CUDA GPU and this run has none: drop --vram_budget.")
    parser = parser_factory()
    explicit = explicit_options(parser, args, argv, parser_defaults(parser))
    plan, values = make_inference_plan(args, explicit, image_sizes)
    for dest, value in values.items():
        setattr(args, dest, value)
    plan = _with_options(plan, option_words(values, parser_defaults(parser)))
    _log_plan(plan)
    return plan
