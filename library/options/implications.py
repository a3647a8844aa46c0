"""What one option implies for another ("X is enabled, so Y is also enabled"), applied in one place, right after
parsing and before any check, each change with its warning line (sd-scripts' wording).

The checks (`library.training.args`, `library.memory.block_swap.check_block_swap_args`,
`library.runtime.compile.check_compile_args`, `library.text_encoder.quant.check_text_encoder_memory_args`, the
scripts' own) only read the options: they run on the values these rules leave. Aliases that resolve silently
(`--xformers` for `--attn_mode xformers`, and `--attn_mode torch` when nothing is given) are rules without a message.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

FP8_OPTIONS = ("fp8_base", "fp8_base_unet", "fp8_scaled")


@dataclass(frozen=True)
class Implication:
    """When `applies(args)` holds, the options in `sets` take those values; `message` is logged as a warning when
    that changes an option (None: a silent alias)."""

    applies: Callable[[argparse.Namespace], bool]
    sets: Mapping[str, Any]
    message: str | None = None


def apply_implications(args: argparse.Namespace, rules: Iterable[Implication]) -> list[str]:
    """Apply `rules` in order (each one sees what the earlier ones set); returns the warnings that were logged."""
    warnings = []
    for rule in rules:
        if not rule.applies(args):
            continue
        changed = {name: value for name, value in rule.sets.items() if getattr(args, name) != value}
        if not changed:
            continue
        if rule.message:
            logger.warning(rule.message)
            warnings.append(rule.message)
        for name, value in changed.items():
            setattr(args, name, value)
    return warnings


def _implies_gradient_checkpointing(option: str) -> Implication:
    return Implication(lambda a: bool(getattr(a, option)), {"gradient_checkpointing": True},
                       f"{option} is enabled, so gradient_checkpointing is also enabled")


ATTENTION_IMPLICATIONS: tuple[Implication, ...] = (
    Implication(lambda a: a.attn_mode is None and a.xformers, {"attn_mode": "xformers"}),
    Implication(lambda a: a.attn_mode is None, {"attn_mode": "torch"}),
)

TRAINING_IMPLICATIONS: tuple[Implication, ...] = (
    *ATTENTION_IMPLICATIONS,
    Implication(lambda a: any(getattr(a, n) for n in FP8_OPTIONS), dict.fromkeys(FP8_OPTIONS, False),
                "fp8_base / fp8_base_unet / fp8_scaled are not supported for MOSS-Image: use --convrot_int8"
                " (and --convrot_int8_text_encoder) instead. They are disabled."),
    Implication(lambda a: a.cache_text_encoder_outputs_to_disk, {"cache_text_encoder_outputs": True},
                "cache_text_encoder_outputs_to_disk is enabled, so cache_text_encoder_outputs is also enabled"),
    Implication(lambda a: a.cache_latents_to_disk, {"cache_latents": True},
                "cache_latents_to_disk is enabled, so cache_latents is also enabled"),
    _implies_gradient_checkpointing("unsloth_offload_checkpointing"),
    _implies_gradient_checkpointing("cpu_offload_checkpointing"),
    Implication(lambda a: a.checkpointing_policy == "selective", {"gradient_checkpointing": True},
                "checkpointing_policy selective is set, so gradient_checkpointing is also enabled"),
    # the default swap mode only: --block_swap_h2d_only without --gradient_checkpointing is an error (its check)
    Implication(lambda a: (a.blocks_to_swap or 0) > 0 and not a.block_swap_h2d_only, {"gradient_checkpointing": True},
                "blocks_to_swap is enabled, so gradient_checkpointing is also enabled (a swapped block's weights leave"
                " the GPU before backward, so its activations are recomputed)"),
)
