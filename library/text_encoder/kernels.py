"""Which kernels the Qwen3.5 linear-attention layers run: flash-linear-attention and causal-conv1d for CUDA tensors when
they are installed, the PyTorch reference for every other tensor.

transformers picks the implementation of `chunk_gated_delta_rule` / `fused_recurrent_gated_delta_rule` (package `fla`,
from `flash-linear-attention` or `fla-core`) and of `causal_conv1d_fn` / `causal_conv1d_update` (package
`causal_conv1d`) once, when its `modeling_qwen3_5` module is imported: if the package imports, its Triton or CUDA
kernel then serves every call, CPU tensors included, where Triton has no driver (`RuntimeError: 0 active drivers`).
`route_linear_attention_kernels` replaces those four functions of that module by ones that pass CUDA tensors to
what transformers picked and any other tensor to the PyTorch reference (the function transformers wraps), so the CPU
path (the tiny snapshot, `--te_device cpu`, the inference script on the CPU) works with or without those packages.
The loader calls it for every text encoder it builds; calling it again changes nothing. transformers 5.25 and later
route by device themselves (their functions are `kernels` objects without `__wrapped__`), and there it leaves them
as they are.

Triton compiles fla's kernels for each new sequence length, so with fla the batches are padded to a multiple of
`FLA_LENGTH_MULTIPLE` tokens (`length_multiple`): one compilation per length bucket instead of one per caption.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

ROUTED_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                    "causal_conv1d_update")
FLA_PACKAGE = "fla"
FLA_LENGTH_MULTIPLE = 64  # fla's chunk size: lengths of one bucket share a compiled kernel


def _routed(chosen: Callable[..., Any], reference: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(reference)
    def call(*args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else next(iter(kwargs.values()))
        if isinstance(first, torch.Tensor) and first.device.type == "cuda":
            return chosen(*args, **kwargs)
        return reference(*args, **kwargs)

    call.routed_by_device = True  # type: ignore[attr-defined]
    return call


def route_linear_attention_kernels() -> int:
    """Make the optional kernels of Qwen3.5's linear-attention layers CUDA-only (see the module docstring); returns
    how many functions were routed now (0 when done before)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling  # heavy import (seconds): the loader's

    count = 0
    for name in ROUTED_FUNCTIONS:
        chosen = getattr(modeling, name, None)
        reference = getattr(chosen, "__wrapped__", None)  # transformers' wrapper keeps the torch function there
        if chosen is None or reference is None or getattr(chosen, "routed_by_device", False):
            continue
        setattr(modeling, name, _routed(chosen, reference))
        count += 1
    if count:
        logger.debug("Qwen3.5 linear-attention kernels: %d functions run the PyTorch reference off CUDA", count)
    return count


def fla_installed() -> bool:
    return importlib.util.find_spec(FLA_PACKAGE) is not None


def length_multiple(device: torch.device) -> int:
    """The multiple batched sequences are padded to on `device`: FLA_LENGTH_MULTIPLE where fla's kernels run (CUDA
    with fla installed), else 1 (no padding beyond the longest caption)."""
    return FLA_LENGTH_MULTIPLE if device.type == "cuda" and fla_installed() else 1
