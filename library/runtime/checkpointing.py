"""Activation checkpointing policies (`--checkpointing_policy`): what a checkpointed block keeps for backward.

- `full` (the default): keep only the block's inputs and recompute the whole block in backward (the least memory).
- `selective`: keep the outputs that are cheap to store and expensive to recompute, recompute everything else.
  Kept: the attention outputs (with their log-sum-exp) and the outputs of *narrowing* matrix products, at most half
  as wide as their contraction dimension K (the FFN down-projection, every LoRA down-projection). A bf16 product
  costs K FLOPs per byte of output, attention about twice the sequence length: keeping the attention output (8,704
  FLOPs per byte at 1024x1024) and the FFN down-projection (8,192) saves the most recompute per byte kept, and the
  LoRA down-projections are tiny (rank 16). The wide products (q/k/v/o and the FFN up-projection: 3,072 FLOPs per
  byte; the LoRA up-projections: 16) are recomputed. At 1024x1024 (4,352 tokens) this keeps about 55 MB per block
  in bf16 (2.2 GiB for the 42 blocks at batch 1), where keeping every product and attention output would take about
  23 GiB (12 GiB for the base products and attention alone).

The policy works on the aten operators a block dispatches (`torch.utils.checkpoint` selective checkpointing), so it
behaves the same in eager mode and inside a `torch.compile`d block (where the partitioner reads the same tags).
Inside a compiled block, `full` is an all-recompute policy of the same kind (`COMPILED_FULL` says why). Any
operator it does not know (custom ops such as the ConvRot INT8 Linear, other attention backends) is recomputed.
"""

from __future__ import annotations

import argparse
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from library.errors import UserError

logger = logging.getLogger(__name__)

CHECKPOINTING_POLICIES = ("full", "selective")
DEFAULT_CHECKPOINTING_POLICY = "full"

# fused attention kernels of F.scaled_dot_product_attention (the names differ by device and torch version)
_ATTENTION_OP_NAMES = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable",
)
ATTENTION_OPS = frozenset(getattr(torch.ops.aten, n).default for n in _ATTENTION_OP_NAMES if hasattr(torch.ops.aten, n))
# matrix products -> the positions of their (M x K) and (K x N) operands
_MATMUL_OPERANDS = {
    torch.ops.aten.mm.default: (0, 1),
    torch.ops.aten.addmm.default: (1, 2),
    torch.ops.aten.bmm.default: (0, 1),
    torch.ops.aten.baddbmm.default: (1, 2),
}
NARROWING_RATIO = 2  # a product is kept when K >= NARROWING_RATIO * N


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The `selective` policy for `create_selective_checkpoint_contexts`: attention outputs and narrowing products
    are saved, every other operator is recomputed. Depends only on the operator and static shapes, so the forward
    and the recomputation (and every block of a compiled stack) decide alike."""
    if op in ATTENTION_OPS:
        return CheckpointPolicy.MUST_SAVE
    operands = _MATMUL_OPERANDS.get(op)
    if operands is not None:
        k, n = args[operands[0]].shape[-1], args[operands[1]].shape[-1]
        if isinstance(k, int) and isinstance(n, int) and k >= NARROWING_RATIO * n:
            return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def recompute_all_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The `full` policy as a selective-checkpointing policy: every operator recomputed."""
    return CheckpointPolicy.PREFER_RECOMPUTE


# `full` inside a compiled region: tag each aten operator through the all-recompute policy (True) or leave the
# tagging to dynamo's checkpoint operator (False, torch's plain form). With dynamo's tags the H200's compiled ConvRot
# INT8 step kept the outputs of the q/k/v/o and FFN up/gate int8 Linears for backward: 263.5 MiB per full-size block
# instead of its 25.5 MiB output, 18.0 GiB for the step against 8.5 (docs/benchmarks.md, sixth run). The likely reason,
# inferred rather than shown: dynamo tags the nodes of the traced checkpoint body, and the int8 Linear's operator runs
# inside an autograd.Function traced within it (`library.quant.convrot_ops`); on the CPU both forms recompute. The
# policy tags at dispatch, so it reaches every operator. Eager checkpointing keeps the plain form (a dispatch mode on
# every operator costs host time there).
COMPILED_FULL = {"per_operator_tags": True}


def _context_fn(policy: str, compiling: bool = False) -> Callable[[], Any] | None:
    """`context_fn` of torch.utils.checkpoint for `policy` (None: plain checkpointing), `compiling` when called
    inside a compiled region. A functools.partial of module functions, which torch.compile accepts there."""
    if policy == "selective":
        return functools.partial(create_selective_checkpoint_contexts, selective_policy)
    if policy == "full":
        if compiling and COMPILED_FULL["per_operator_tags"]:
            return functools.partial(create_selective_checkpoint_contexts, recompute_all_policy)
        return None
    raise ValueError(f"unknown checkpointing policy {policy!r}: choose one of {', '.join(CHECKPOINTING_POLICIES)}")


# `full` in eager mode: torch's reentrant checkpoint (True) or its non-reentrant form (False). The reentrant form runs
# the block's forward without autograd (no graph, no saved-tensor hooks) and recomputes it inside backward with a
# graph of its own; the non-reentrant form records the forward's graph with a pack hook per saved tensor (64 per block)
# and recomputes from an unpack hook. Same operators on the same values, so the same gradients bit for bit
# (tests/test_checkpointing.py); the reentrant form spends less host time per block, which is what an eager step on a
# fast GPU waits for (docs/benchmarks.md). Selective checkpointing needs the non-reentrant form (its policy), and so
# does a compiled region (dynamo traces only the non-reentrant checkpoint).
EAGER_FULL = {"reentrant": True}


def _grad_input(args: tuple[Any, ...]) -> bool:
    """Whether an input requires grad: the reentrant form differentiates only through its inputs, so without one the
    parameters inside (a LoRA of the text refiner) would get no gradient; the non-reentrant form gives them theirs."""
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def checkpointed(fn: Callable[..., torch.Tensor], policy: str, *args: Any) -> torch.Tensor:
    """`fn(*args)` under activation checkpointing with `policy` ("full" or "selective"): reentrant for `full` in eager
    mode (EAGER_FULL), non-reentrant otherwise."""
    compiling = torch.compiler.is_compiling()
    context_fn = _context_fn(policy, compiling)
    if context_fn is None and not compiling and EAGER_FULL["reentrant"] and _grad_input(args):
        return checkpoint(fn, *args, use_reentrant=True)
    # determinism_check "none": torch's default records the shape, dtype and device of every tensor the forward saves
    # and compares them after the recomputation (5,376 records and 42 comparisons per eager step of the full-size
    # DiT, 22 ms under cProfile on the H200); a block's shapes depend only on its inputs, so the check cannot fire
    if context_fn is None:
        return checkpoint(fn, *args, use_reentrant=False, determinism_check="none")
    return checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn, determinism_check="none")


def _check_skip_blocks(args: argparse.Namespace) -> None:
    """--checkpointing_skip_blocks: a count, for the plain checkpointing mode (the block count is checked once the
    DiT is loaded)."""
    skip = getattr(args, "checkpointing_skip_blocks", 0) or 0
    if skip < 0:
        raise UserError(f"--checkpointing_skip_blocks {skip} must be 0 or more (the number of DiT blocks, counted"
                        " from the last, that are not checkpointed).")
    if not skip:
        return
    if not getattr(args, "gradient_checkpointing", False):
        raise UserError(f"--checkpointing_skip_blocks {skip} needs --gradient_checkpointing: without it no block is"
                        " checkpointed.")
    for flag in ("cpu_offload_checkpointing", "unsloth_offload_checkpointing"):
        if getattr(args, flag, False):
            raise UserError(f"--checkpointing_skip_blocks cannot be used with --{flag}: that mode offloads every"
                            " block's input; use plain --gradient_checkpointing.")


def skip_blocks(args: argparse.Namespace, num_blocks: int) -> int:
    """--checkpointing_skip_blocks checked against the loaded DiT's `num_blocks` main blocks."""
    skip = getattr(args, "checkpointing_skip_blocks", 0) or 0
    if skip > num_blocks:
        raise UserError(f"--checkpointing_skip_blocks {skip} is more than the DiT's {num_blocks} blocks; give at most"
                        f" {num_blocks}.")
    return skip


def check_checkpointing_args(args: argparse.Namespace) -> None:
    """--checkpointing_policy (after `library.options.implications`, which turns --gradient_checkpointing on for
    `selective`): the offloaded modes keep only the block inputs (in host memory), so they take `full` only."""
    _check_skip_blocks(args)
    policy = args.checkpointing_policy
    if policy not in CHECKPOINTING_POLICIES:
        raise UserError(f"--checkpointing_policy {policy!r} is not known: choose one of"
                        f" {', '.join(CHECKPOINTING_POLICIES)}.")
    if policy == DEFAULT_CHECKPOINTING_POLICY:
        return
    for flag in ("cpu_offload_checkpointing", "unsloth_offload_checkpointing"):
        if getattr(args, flag, False):
            raise UserError(f"--checkpointing_policy {policy} cannot be used with --{flag}: that mode keeps only the"
                            f" block inputs, in host memory, and recomputes the whole block; use one of them.")
    if not getattr(args, "compile", False):
        logger.warning("checkpointing_policy %s without --compile decides per operation in Python, which costs more"
                       " host time than it saves (slower than full checkpointing); add --compile", policy)
