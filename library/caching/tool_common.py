"""What the two cache tools (`tools/cache_latents.py`, `tools/cache_text_encoder_outputs.py`) share: the process's
accelerator, the sum of a count over processes, and the command-line entry with its one-sentence errors."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from library.errors import UserError


def make_accelerator(device: str | None) -> Any:
    """The accelerator of this process (`accelerate launch` sets the process count); `device` cpu forces the CPU."""
    import torch
    from accelerate import Accelerator

    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was given but no CUDA GPU is available: use --device cpu or run on a GPU.")
    return Accelerator(cpu=device == "cpu")


def total_over_processes(acc: Any, value: int) -> int:
    import torch

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


def add_shared_tool_arguments(group: Any, runs: str) -> None:
    """The options both cache tools take (`runs`: what runs on --device, e.g. "the VAE")."""
    group.add_argument("--moss_image", action="store_true",
                       help="required: cache for MOSS-Image (the only model this tool supports)")
    group.add_argument("--disable_mmap_load_safetensors", action="store_true",
                       help="read safetensors with plain reads instead of memory mapping")
    group.add_argument("--skip_cache_check", action="store_true",
                       help="trust every existing cache file without checking it")
    group.add_argument("--device", type=str, default=None, choices=["cpu", "cuda"],
                       help=f"where {runs} runs (default: the GPU when there is one; under accelerate, its device)")
    group.add_argument("--seed", type=int, default=None,
                       help="dataset seed (validation_split; the cache holds every image whatever the split)")
