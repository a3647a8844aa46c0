"""The trainer's command line: the shared option groups (`library.options.groups`), the options only the trainer
has (sd-scripts names and defaults), `--config_file` / `--output_config`, and what becomes of the sd-scripts options
that do not apply to a flow-matching DiT (`library.options.sd_scripts`: ignored with one warning line, or refused).

Trainer-only groups here: network, training, saving, logging, sampling, validation. The dataset, optimizer/scheduler
and flow-matching groups live beside their code (`library.datasets.args`, `library.training.optimizers`,
`library.training.flow_matching`) and are added by `setup_parser`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from library.errors import UserError
from library.files.safetensors_io import write_text_atomic
from library.options import groups, sd_scripts
from library.options.implications import FP8_OPTIONS
from library.runtime.checkpointing import CHECKPOINTING_POLICIES, DEFAULT_CHECKPOINTING_POLICY
from library.sampling.sampler import EULER_SAMPLER_NAMES
from library.training.sensitive_options import without_secrets

logger = logging.getLogger(__name__)

def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The shared model, attention, ConvRot, caching, memory and compile groups, plus the fp8 options (disabled)."""
    groups.add_model_file_arguments(parser, dit_dest="pretrained_model_name_or_path", text_encoder=True, vae=True)
    groups.add_attention_arguments(parser)
    groups.add_convrot_arguments(parser, dit=True, text_encoder=True, backward=True)
    g = parser.add_argument_group("fp8 (not supported for MOSS-Image)")
    for name in FP8_OPTIONS:
        g.add_argument(f"--{name}", action="store_true", help="not supported for MOSS-Image (use --convrot_int8)")
    groups.add_caching_arguments(parser, latents=True, text_encoder_outputs=True)
    groups.add_memory_arguments(parser, training=True)
    groups.add_text_encoder_memory_arguments(parser)
    groups.add_compile_arguments(parser)


def _add_network_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("network")
    g.add_argument("--network_module", type=str, default=None, help="network module, e.g. networks.lora_generic")
    g.add_argument("--network_dim", type=int, default=None, help="LoRA rank (module default 4)")
    g.add_argument("--network_alpha", type=float, default=1, help="LoRA alpha (default 1)")
    g.add_argument("--network_dropout", type=float, default=None, help="neuron dropout of the LoRA down output")
    g.add_argument("--network_args", type=str, default=None, nargs="*", help="extra network options, key=value")
    g.add_argument("--network_weights", type=str, default=None, help="LoRA weights to continue training from")
    g.add_argument("--dim_from_weights", action="store_true", help="take rank/alpha from --network_weights")
    g.add_argument("--network_multiplier", type=float, default=1.0, help="LoRA multiplier during training")
    g.add_argument("--network_train_unet_only", action="store_true", help="train the DiT LoRA only")
    g.add_argument("--network_train_text_encoder_only", action="store_true", help="train the text encoder LoRA only")
    g.add_argument("--base_weights", type=str, default=None, nargs="*", help="LoRA files merged into the base first")
    g.add_argument("--base_weights_multiplier", type=float, default=None, nargs="*",
                   help="multipliers of --base_weights (default 1.0 each)")
    g.add_argument("--scale_weight_norms", type=float, default=None, help="max-norm regularisation of LoRA weights")
    g.add_argument("--training_comment", type=str, default=None, help="stored in the ss_training_comment metadata")
    g.add_argument("--unet_lr", type=float, default=None, help="learning rate of the DiT LoRA")
    g.add_argument("--text_encoder_lr", type=float, default=None, nargs="*", help="learning rate of the TE LoRA")


def _add_training_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--output_dir", type=str, default=None, help="folder for the LoRA files and states")
    g.add_argument("--output_name", type=str, default=None, help="base name of the saved files (default 'last')")
    g.add_argument("--max_train_steps", type=int, default=1600, help="training steps (default 1600)")
    g.add_argument("--max_train_epochs", type=int, default=None, help="training epochs (overrides max_train_steps)")
    g.add_argument("--max_nan_loss_steps", type=int, default=1,
                   help="stop training after this many steps in a row with a NaN or infinite loss (1: the first)")
    groups.add_seed_argument(g)
    g.add_argument("--gradient_checkpointing", action="store_true", help="recompute activations in backward")
    g.add_argument("--checkpointing_policy", type=str, default=DEFAULT_CHECKPOINTING_POLICY,
                   choices=list(CHECKPOINTING_POLICIES),
                   help="what a checkpointed DiT block keeps: full = only its inputs (least memory), selective = also"
                        " the attention and down-projection outputs (faster, more memory)")
    g.add_argument("--checkpointing_skip_blocks", type=int, default=0,
                   help="with --gradient_checkpointing: the last N DiT blocks are not checkpointed and keep all their"
                        " activations (faster, about 0.4 GiB more per block at 1024x1024, batch 1; default 0)")
    g.add_argument("--gradient_accumulation_steps", type=int, default=1, help="steps accumulated per update")
    g.add_argument("--mixed_precision", type=str, default="no", choices=["no", "fp16", "bf16"],
                   help="mixed precision (bf16 recommended)")
    g.add_argument("--full_fp16", action="store_true", help="LoRA weights and gradients in fp16")
    g.add_argument("--full_bf16", action="store_true", help="LoRA weights and gradients in bf16")
    g.add_argument("--initial_epoch", type=int, default=None, help="epoch to start at (with --resume or alone)")
    g.add_argument("--initial_step", type=int, default=None, help="step to start at")
    g.add_argument("--skip_until_initial_step", action="store_true", help="consume batches up to the initial step")
    g.add_argument("--ddp_timeout", type=int, default=None, help="DDP timeout in minutes")
    g.add_argument("--ddp_gradient_as_bucket_view", action="store_true", help="DDP gradient_as_bucket_view")
    g.add_argument("--ddp_static_graph", action="store_true", help="DDP static_graph")
    g.add_argument("--torch_compile", action="store_true", help="accelerate's dynamo compile of the DiT")
    g.add_argument("--dynamo_backend", type=str, default="inductor", help="backend of --torch_compile")
    g.add_argument("--output_config", action="store_true", help="write the arguments to a TOML file and exit")
    g.add_argument("--overwrite_config", action="store_true", help="let --output_config replace an existing file")
    g.add_argument("--config_file", type=str, default=None, help="TOML file of arguments (command line wins)")


def _add_saving_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("saving")
    g.add_argument("--save_model_as", type=str, default="safetensors", choices=["safetensors"],
                   help="file format (safetensors only)")
    g.add_argument("--save_precision", type=str, default=None, choices=[None, "float", "fp16", "bf16"],
                   help="precision of the saved LoRA (default: the training precision)")
    g.add_argument("--save_every_n_epochs", type=int, default=None, help="save every N epochs")
    g.add_argument("--save_n_epoch_ratio", type=int, default=None,
                   help="save at least N times over the run: every floor(epochs / N) epochs (replaces"
                        " --save_every_n_epochs)")
    g.add_argument("--save_every_n_steps", type=int, default=None, help="save every N steps")
    g.add_argument("--save_last_n_epochs", type=int, default=None, help="keep only the last N epoch saves")
    g.add_argument("--save_last_n_steps", type=int, default=None, help="keep only the saves of the last N steps")
    g.add_argument("--save_last_n_epochs_state", type=int, default=None, help="keep the last N epoch states")
    g.add_argument("--save_last_n_steps_state", type=int, default=None, help="keep the states of the last N steps")
    g.add_argument("--save_state", action="store_true", help="also save the training state with each save")
    g.add_argument("--save_state_on_train_end", action="store_true", help="save the training state at the end")
    g.add_argument("--resume", type=str, default=None, help="training state folder to resume from")
    g.add_argument("--resume_inexact", action="store_true",
                   help="resume even when the run cannot continue exactly (other seed, batch size, dataset, gradient"
                        " accumulation or an unreadable random state): a warning instead of an error")
    g.add_argument("--no_metadata", action="store_true", help="save no ss_* metadata in the LoRA file")
    for name in ("title", "author", "description", "license", "tags", "usage_hint", "trigger_phrase", "merged_from",
                 "preprocessor", "is_negative_embedding"):
        g.add_argument(f"--metadata_{name}", type=str, default=None, help=f"modelspec.{name} of the saved LoRA")
    g.add_argument("--metadata_thumbnail", type=str, default=None,
                   help="modelspec.thumbnail of the saved LoRA: a data: URL, or an image file stored as one")


def _add_logging_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("logging")
    g.add_argument("--logging_dir", type=str, default=None, help="tensorboard log folder")
    g.add_argument("--log_with", type=str, default=None, choices=["tensorboard", "wandb", "all"],
                   help="logging backend (default tensorboard when --logging_dir is given)")
    g.add_argument("--log_prefix", type=str, default=None, help="prefix of the log sub-folder name")
    g.add_argument("--log_tracker_name", type=str, default=None, help="tracker (project) name")
    g.add_argument("--log_tracker_config", type=str, default=None, help="tracker config TOML")
    g.add_argument("--log_config", action="store_true", help="log the training arguments to the tracker")
    g.add_argument("--wandb_run_name", type=str, default=None, help="wandb run name")
    g.add_argument("--wandb_api_key", type=str, default=None, help="wandb API key")
    g.add_argument("--console_log_level", type=str, default=None, choices=["DEBUG", "INFO", "WARNING", "ERROR",
                   "CRITICAL"], help="level of the console log (default INFO)")
    g.add_argument("--console_log_file", type=str, default=None,
                   help="write the log to this file instead of the console (replaced at each run)")
    g.add_argument("--console_log_simple", action="store_true",
                   help="plain log lines (the log here is always plain, as with this option in sd-scripts)")


def _add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sample images")
    g.add_argument("--sample_prompts", type=str, default=None, help="prompt file (.txt/.toml/.json) for samples")
    g.add_argument("--sample_every_n_steps", type=int, default=None, help="sample every N steps")
    g.add_argument("--sample_every_n_epochs", type=int, default=None, help="sample every N epochs")
    g.add_argument("--sample_at_first", action="store_true", help="sample before training")
    g.add_argument("--sample_sampler", type=str, default="euler",
                   help="sampler of the sample images: the official flow-matching Euler (euler, or sd-scripts'"
                        " k_euler); other samplers are refused")
    g.add_argument("--sample_uncond_skip_layers", type=str, default="22",
                   help="DiT blocks skipped in the unconditional CFG branch (default 22; '' disables)")


def _add_validation_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("validation")
    g.add_argument("--validate_every_n_steps", type=int, default=None, help="validation loss every N steps")
    g.add_argument("--validate_every_n_epochs", type=int, default=None,
                   help="validation loss every N epochs (default every epoch when a validation set exists)")
    g.add_argument("--max_validation_steps", type=int, default=None, help="validation batches per run (all by default)")


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Every trainer option except the dataset, optimizer and flow-matching ones."""
    _add_model_arguments(parser)
    _add_network_arguments(parser)
    _add_training_arguments(parser)
    _add_saving_arguments(parser)
    _add_logging_arguments(parser)
    _add_sampling_arguments(parser)
    _add_validation_arguments(parser)
    sd_scripts.add_sd_scripts_arguments(parser)


def apply_console_log_options(args: argparse.Namespace) -> None:
    """--console_log_level and --console_log_file, as sd-scripts applies them: the level of the root logger, and the
    log written to the file (opened anew) instead of the console. The console log is plain text here, which is what
    --console_log_simple asks for."""
    root = logging.getLogger()
    if args.console_log_level:
        root.setLevel(args.console_log_level)
    if not args.console_log_file:
        return
    consoles = [h for h in root.handlers if type(h) is logging.StreamHandler and h.stream in (sys.stderr, sys.stdout)]
    try:
        handler = logging.FileHandler(args.console_log_file, mode="w", encoding="utf-8")
    except OSError as e:
        raise UserError(f"--console_log_file '{args.console_log_file}' cannot be written ({e.strerror}): check the"
                        " folder and its permissions.") from e
    handler.setFormatter(consoles[0].formatter if consoles else None)
    for console in consoles:
        root.removeHandler(console)
    root.addHandler(handler)


# ---------------------------------------------------------------------------------------------- config files
def _flatten(table: dict[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat.update(_flatten(value))
        else:
            flat[key] = value
    return flat


def read_config_file(path: str, parser: argparse.ArgumentParser) -> tuple[dict[str, Any], list[str]]:
    """(the values of the options `parser` knows, the other keys, sorted) of a `--config_file` TOML; table sections
    are flattened. The other keys (those of the kohya_ss GUI, of other trainers) are the caller's to report."""
    import tomllib  # standard library from Python 3.11 (the project allows 3.10): imported where it is needed

    p = Path(path)
    if not p.exists() and p.with_suffix(".toml").exists():
        p = p.with_suffix(".toml")
    try:
        table = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise UserError(f"--config_file '{path}' does not exist: check the path.") from e
    except (OSError, ValueError) as e:
        raise UserError(f"--config_file '{path}' is not valid TOML ({e}): fix the file.") from e
    values = _flatten(table)
    known = {a.dest for a in parser._actions}
    return {k: v for k, v in values.items() if k in known}, sorted(k for k in values if k not in known)


def parse_args_with_config(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line on top of `--config_file` values (the command line wins); keys of the file that are
    not options of the script are ignored with one warning line that names them (sd-scripts takes them silently)."""
    args = parser.parse_args(argv)
    if args.config_file and not args.output_config:  # with --output_config the file is the output
        values, unknown = read_config_file(args.config_file, parser)
        if unknown:
            logger.warning("--config_file %s: keys that are not options of this script are ignored: %s",
                           args.config_file, ", ".join(unknown))
        parser.set_defaults(**values)
        args = parser.parse_args(argv)
        logger.info("loaded arguments from %s", args.config_file)
    return args


def write_config_file(args: argparse.Namespace, parser: argparse.ArgumentParser, path: str) -> None:
    """`--output_config`: the non-default arguments as TOML, without secrets (`--wandb_api_key`, ...); an existing
    file is replaced only with `--overwrite_config`."""
    try:
        import toml  # optional: only --output_config writes TOML (tomllib reads it)
    except ImportError as e:
        raise UserError("--output_config needs the 'toml' package: pip install toml (it is in requirements.txt).") from e

    if Path(path).exists() and not args.overwrite_config:
        raise UserError(f"--output_config would overwrite '{path}', which exists: give another --config_file, remove"
                        " the file, or add --overwrite_config.")
    defaults = {a.dest: a.default for a in parser._actions}
    skip = {"output_config", "overwrite_config", "config_file", "help"}
    values = {k: v for k, v in vars(args).items() if k not in skip and v is not None and v != defaults.get(k)}
    write_text_atomic(toml.dumps(without_secrets(values)), path)


# ------------------------------------------------------------------------------------------------- checks
def _sample_sampler_mentions(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """--sample_sampler other than Euler: refused when sample images are made, else ignored (it selects nothing)."""
    name = str(args.sample_sampler or "euler")  # a config file may leave it empty
    if name.lower() in EULER_SAMPLER_NAMES:
        return [], []
    if args.sample_prompts:
        return [], [(f"--sample_sampler {name} (the sample images use the official flow-matching Euler sampler of"
                     " MOSS-Image: --sample_sampler euler, the default)")]
    return [f"--sample_sampler {name} (no --sample_prompts, so no sample images are made)"], []


def check_sd_scripts_options(args: argparse.Namespace) -> None:
    """The sd-scripts options whose meaning differs here (nothing is changed): those of `library.options.sd_scripts`
    and a non-Euler --sample_sampler are named in one warning line when they are ignored, in one error when they are
    refused."""
    ignored, refused = sd_scripts.set_sd_scripts_options(args)
    more_ignored, more_refused = _sample_sampler_mentions(args)
    ignored += more_ignored
    refused += more_refused
    if refused:
        raise UserError(f"MOSS-Image training cannot honour {'; '.join(refused)}: remove "
                        f"{'it' if len(refused) == 1 else 'them'} from the command (or the config file).")
    if ignored:
        logger.warning("sd-scripts options that do not apply to MOSS-Image are ignored: %s", "; ".join(ignored))
