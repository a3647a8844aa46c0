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
