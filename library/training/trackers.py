"""The experiment trackers' set-up (`--log_with`): their init arguments, and the command line masked before wandb
uploads it."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from library.errors import UserError
from library.training import sensitive_options


def init_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """--log_tracker_config (TOML: one table per tracker), --wandb_run_name, --wandb_api_key."""
    kwargs: dict[str, Any] = {}
    if args.log_tracker_config:
        import tomllib

        try:
            kwargs = tomllib.loads(Path(args.log_tracker_config).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise UserError(f"--log_tracker_config '{args.log_tracker_config}' cannot be read as TOML ({e}).") from e
    if args.wandb_run_name:
        kwargs.setdefault("wandb", {})["name"] = args.wandb_run_name
    if args.wandb_api_key:
        os.environ["WANDB_API_KEY"] = args.wandb_api_key
    return kwargs


def hide_private_values(args: argparse.Namespace, log_with: str | None) -> None:
    """wandb uploads the command line with the run: the values of secret and path options are masked in `sys.argv`
    before the tracker starts (nothing reads the command line after parsing)."""
    if log_with in ("wandb", "all"):
        sys.argv[1:] = sensitive_options.mask_command_line(sys.argv[1:], vars(args))
