"""Options whose values must not leave the machine: secrets and local paths.

What is kept out, and where:
- the tracker config (`--log_config`: TensorBoard's hparams, wandb's uploaded run config): secrets and paths;
- the command line that wandb records with a run (`sys.argv`): secrets and paths are masked before the tracker
  starts (`mask_command_line`);
- `--output_config`: secrets only. The file is written for re-running the same job on this machine
  (`--config_file`), so it keeps the paths, as sd-scripts does;
- the LoRA metadata never holds an option value that is a path: the base-model keys hold file names only
  (`library.files.base_model_hash`), the dataset keys folder names only.

Which options are which (a rule on the option name, so that an option added later is covered without a list to keep
in step; a test checks every option of the trainer's parser against it):
- a secret is named `token`, `api_key`, `secret` or `password`, or ends in `_token`, `_api_key`, `_secret`,
  `_password` (sd-scripts' `wandb_api_key` and `huggingface_token`);
- a path ends in `_dir`, `_path` or `_file` (`output_dir`, `pretrained_model_name_or_path`, `config_file`, ...) or
  is one of `PATH_OPTIONS`, the options that name a file or folder without saying so in their name (`vae`,
  `network_weights`, `dataset_config`, ...): sd-scripts' list of path options plus ours.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from typing import Any

SECRET_WORDS: tuple[str, ...] = ("token", "api_key", "secret", "password")
PATH_SUFFIXES: tuple[str, ...] = ("_dir", "_path", "_file")
PATH_OPTIONS: frozenset[str] = frozenset({
    "pretrained_model_name_or_path", "text_encoder", "vae", "snapshot", "tokenizer_cache_dir",
    "network_weights", "base_weights", "resume", "output_dir", "logging_dir", "config_file", "log_tracker_config",
    "sample_prompts", "dataset_config", "train_data_dir", "reg_data_dir", "conditioning_data_dir", "in_json",
    "metadata_thumbnail",
})


def is_secret_option(name: str) -> bool:
    """True for an option (dest name) whose value is a credential."""
    return any(name == word or name.endswith("_" + word) for word in SECRET_WORDS)


def is_path_option(name: str) -> bool:
    """True for an option (dest name) whose value names a local file or folder."""
    return name in PATH_OPTIONS or name.endswith(PATH_SUFFIXES)


def is_private_option(name: str) -> bool:
    return is_secret_option(name) or is_path_option(name)


def _tracker_value(value: Any) -> bool | int | float | str:
    """Trackers take bool, int, float or str (TensorBoard's hparams refuse the rest): others as text."""
    if isinstance(value, (bool, int, float, str)):
        return value
    if value is None:
        return "None"
    return str(value)


def tracker_config(args: argparse.Namespace | Mapping[str, Any]) -> dict[str, bool | int | float | str]:
    """The options as the trackers get them with `--log_config`: no secret, no path, every value a scalar."""
    values = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    return {k: _tracker_value(v) for k, v in values.items() if not is_private_option(k)}


def without_secrets(values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` without the secret options (what `--output_config` writes)."""
    return {k: v for k, v in values.items() if not is_secret_option(k)}


MASK = "<hidden>"


def mask_command_line(argv: Iterable[str], option_names: Iterable[str]) -> list[str]:
    """A copy of the command-line words with the values of secret and path options replaced by '<hidden>'.

    `option_names`: the option names of the script without the dashes (its argparse dests, e.g. `vars(args)`).
    Handles `--opt value`, `--opt=value`, options with several values (`--base_weights a b`: every word up to the
    next option) and unambiguous abbreviations, which argparse accepts too."""
    names = set(option_names)
    masked: list[str] = []
    hiding = False
    for word in argv:
        if not _is_option(word):
            masked.append(MASK if hiding else word)
            continue
        option, eq, _value = word.partition("=")
        name = _resolve(option[2:], names) if option.startswith("--") else None
        hiding = name is not None and is_private_option(name)
        if hiding and eq:
            masked.append(f"{option}={MASK}")
            hiding = False
        else:
            masked.append(word)
    return masked


def _is_option(word: str) -> bool:
    return word.startswith("-") and len(word) > 1 and not _is_number(word)


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def _resolve(name: str, names: set[str]) -> str | None:
    """`name` itself, else the one option it abbreviates (None when unknown or ambiguous)."""
    if name in names:
        return name
    matches = [n for n in names if n.startswith(name)]
    return matches[0] if len(matches) == 1 else None
