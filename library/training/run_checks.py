"""Checks that let a run fail in its first seconds instead of at its first save or sample: option bounds, the
output folder (`library.training.output_folder`), the sample prompt file, the network module, the room for saves.

Bounds (sd-scripts semantics): `--max_train_steps` (without `--max_train_epochs`) and `--max_train_epochs` must be
1 or more; the `--save_every_n_*`, `--save_n_epoch_ratio`, `--save_last_n_*`, `--sample_every_n_*` and
`--validate_every_n_*` counts may be 0 (off, as when they are not given) but not negative; `--seed` lies in
0 .. 2**32 - 1 (leave it out for a random one); `--max_nan_loss_steps` is 1 or more.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from types import ModuleType
from typing import Any

from library.errors import UserError
from library.sampling.sampler import load_prompts, parse_uncond_skip_layers
from library.training import output_folder
from library.training.output_folder import OutputLock

logger = logging.getLogger(__name__)

MAX_SEED = 2**32 - 1
_COUNTS_OFF_AT_ZERO = (
    "save_every_n_epochs", "save_n_epoch_ratio", "save_every_n_steps", "save_last_n_epochs", "save_last_n_steps",
    "save_last_n_epochs_state", "save_last_n_steps_state", "sample_every_n_epochs", "sample_every_n_steps", "validate_every_n_epochs",
    "validate_every_n_steps", "max_validation_steps",
)
_NETWORK_METHODS = ("apply_to", "prepare_grad_etc", "get_trainable_params", "save_weights", "load_weights")


def check_run_options(args: argparse.Namespace) -> None:
    """The counts and the seed of a training run are in range (one sentence for the first that is not)."""
    if args.max_train_epochs is not None and args.max_train_epochs < 1:
        raise UserError(f"--max_train_epochs {args.max_train_epochs} trains nothing: give 1 or more.")
    if args.max_train_epochs is None and args.max_train_steps is not None and args.max_train_steps < 1:
        raise UserError(f"--max_train_steps {args.max_train_steps} trains nothing: give 1 or more.")
    for name in _COUNTS_OFF_AT_ZERO:
        value = getattr(args, name, None)
        if value is not None and value < 0:
            raise UserError(f"--{name} {value} is negative: give a positive count, or 0 (or nothing) to turn it off.")
    check_seed(args.seed, "--seed")
    limit = getattr(args, "max_nan_loss_steps", None)
    if limit is not None and limit < 1:
        raise UserError(f"--max_nan_loss_steps {limit} is below 1: give how many steps in a row may have a NaN or"
                        " infinite loss before training stops (1 stops at the first).")
    output_folder.check_output_name(output_folder.output_name(args))


def check_seed(seed: int | None, option: str) -> None:
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise UserError(f"{option} {seed} is out of range: give 0 to {MAX_SEED}, or leave {option} out for a random"
                        " seed.")


def is_global_main_process() -> bool:
    """Before the accelerator exists: the process of rank 0 (a plain run, or the first of a launch)."""
    return int(os.environ.get("RANK", "0")) == 0


def prepare_output(args: argparse.Namespace) -> OutputLock | None:
    """The output folder usable, this run the only one writing its output name (the lock, held by the main
    process), and the leftovers of killed saves of that name removed. Returns the lock (None on other processes)."""
    folder = output_folder.check_output_dir(args.output_dir)
    if not is_global_main_process():
        return None
    name = output_folder.output_name(args)
    lock = OutputLock.acquire(folder, name)
    try:
        output_folder.remove_leftovers(folder, name)
    except BaseException:
        lock.release()
        raise
    return lock


def check_sample_prompts(args: argparse.Namespace) -> None:
    """--sample_prompts parsed now (every prompt's options checked by the parser), not at the first sampling step."""
    if not args.sample_prompts:
        return
    prompts = load_prompts(args.sample_prompts)
    parse_uncond_skip_layers(args.sample_uncond_skip_layers)
    logger.info("sample prompts: %d in %s", len(prompts), args.sample_prompts)


def check_network_module(module: ModuleType, args: argparse.Namespace) -> None:
    """The --network_module module makes networks (sd-scripts' create_network / create_network_from_weights)."""
    needed = "create_network_from_weights" if args.dim_from_weights else "create_network"
    if not callable(getattr(module, needed, None)):
        raise UserError(f"--network_module '{args.network_module}' is not a network module (it has no {needed}"
                        " function): use networks.lora_generic, or a module written for sd-scripts' train_network.")


def check_network(network: Any, args: argparse.Namespace) -> None:
    """What the module created behaves as a network."""
    missing = [m for m in _NETWORK_METHODS if not callable(getattr(network, m, None))]
    if missing:
        raise UserError(f"--network_module '{args.network_module}' created a {type(network).__name__}, which is not a"
                        f" network (it has no {', '.join(missing)}): use networks.lora_generic, or a module written"
                        " for sd-scripts' train_network.")


def check_room_for_saves(args: argparse.Namespace, network: Any, save_dtype: Any) -> None:
    """The output folder's disk has room for one LoRA file and, when states are saved, one state."""
    lora, state = output_folder.network_save_sizes(network, save_dtype)
    with_state = bool(args.save_state or args.save_state_on_train_end)
    output_folder.check_free_space(Path(args.output_dir), lora, state if with_state else None)
