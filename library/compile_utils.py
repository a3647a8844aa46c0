"""`--compile`: per-block torch.compile of the DiT blocks, and the CUDA speed switches.

Each of the main blocks is compiled on its own (same code, so the compiled graph is shared and compile time stays
small). Buckets of different sizes change the sequence length: with `--compile_dynamic auto` the blocks are compiled
with dynamic shapes when the run has several buckets, and the dynamo recompile limit is raised to cover them.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


def apply_cuda_optimizations(args: argparse.Namespace) -> None:
    """TF32 matmuls and cuDNN autotuning: applied whenever CUDA is used, with or without --compile."""
    if not torch.cuda.is_available():
        return
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True


def compile_blocks(args: argparse.Namespace, dit: Any, num_shapes: int = 1) -> None:
    """Replace each block of `dit.layers` by its torch.compile'd version (in place)."""
    dynamic = {"true": True, "false": False}.get(args.compile_dynamic, None)
    if dynamic is None:
        dynamic = True if num_shapes > 1 else None
    limit = args.compile_cache_size_limit or max(8, 2 * num_shapes)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, limit)
    logger.info("torch.compile of %d blocks: backend=%s mode=%s dynamic=%s fullgraph=%s recompile limit=%d",
                len(dit.layers), args.compile_backend, args.compile_mode, dynamic, args.compile_fullgraph,
                torch._dynamo.config.cache_size_limit)
    for i, block in enumerate(dit.layers):
        dit.layers[i] = torch.compile(block, backend=args.compile_backend, mode=args.compile_mode, dynamic=dynamic,
                                      fullgraph=args.compile_fullgraph)
