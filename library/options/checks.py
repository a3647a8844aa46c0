"""Checks of the shared option groups that belong to no single module (the others sit beside their code:
`library.memory.block_swap.check_block_swap_args`, `library.runtime.compile.check_compile_args`,
`library.text_encoder.quant.check_text_encoder_memory_args`). They read the options after
`library.options.implications` ran and change nothing."""

from __future__ import annotations

import argparse

from library.errors import UserError


def check_attention_args(args: argparse.Namespace, training: bool) -> None:
    """--attn_mode (as `library.options.implications` resolved it) against --split_attn; sageattn cannot train."""
    if training and args.attn_mode == "sageattn":
        raise UserError("--attn_mode sageattn supports inference only, not training: use torch, flash or xformers.")
    if args.attn_mode == "xformers" and not args.split_attn:
        raise UserError("--attn_mode xformers requires --split_attn.")
