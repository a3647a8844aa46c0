"""What the two cache tools (`tools/cache_latents.py`, `tools/cache_text_encoder_outputs.py`) share: their own
options (the model, caching and dataset groups come from `library.options.groups` and `library.datasets.args`), the
process's accelerator, the sum of a count over processes, and the command-line entry with its one-sentence errors."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import Any

import torch
from accelerate import Accelerator

from library.errors import UserError
from library.options import groups

TOOL_DEVICES = (None, "cpu", "cuda")


def add_cache_tool_arguments(parser: argparse.ArgumentParser) -> None:
    """The options both cache tools take besides the shared groups: --moss_image, --device and --seed (the seed of
    the validation split; the cache holds every image whatever the split)."""
    g = parser.add_argument_group("cache tool")
    g.add_argument("--moss_image", action="store_true",
                   help="required: cache for MOSS-Image (the only model this tool supports)")
    groups.add_device_argument(g)
    groups.add_seed_argument(g)


def check_tool_device(device: str | None) -> None:
    """The cache tools run on the CPU or on this process's GPU (one per process under accelerate launch)."""
    if device not in TOOL_DEVICES:
        raise UserError(f"--device {device} is not available to the cache tools: give cpu or cuda (under accelerate"
                        " launch each process uses its own GPU).")


def make_accelerator(device: str | None) -> Any:
    """The accelerator of this process (`accelerate launch` sets the process count); `device` cpu forces the CPU."""
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was given but no CUDA GPU is available: use --device cpu or run on a GPU.")
    return Accelerator(cpu=device == "cpu")


def total_over_processes(acc: Any, value: int) -> int:
    return int(acc.reduce(torch.tensor([value], device=acc.device), reduction="sum").item())


def tool_main(run: Callable[[list[str] | None], Any], argv: list[str] | None, logger: logging.Logger) -> int:
    """Run a tool: 0 on success, 2 with the error's sentence (no traceback) for bad input."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run(argv)
    except UserError as e:
        logger.error("%s", e)
        return 2
    return 0
