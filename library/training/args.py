"""The trainer's command line: the shared option groups (`library.options.groups`), the options only the trainer
has (sd-scripts names and defaults), `--config_file` / `--output_config`, and the rejection of options that cannot
apply to a flow-matching DiT.

Trainer-only groups here: network, training, saving, logging, sampling, validation. The dataset, optimizer/scheduler
and flow-matching groups live beside their code (`library.datasets.args`, `library.training.optimizers`,
`library.training.flow_matching`) and are added by `setup_parser`.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from library.errors import UserError
from library.files.safetensors_io import write_text_atomic
from library.options import groups
from library.options.implications import FP8_OPTIONS
from library.runtime.checkpointing import CHECKPOINTING_POLICIES, DEFAULT_CHECKPOINTING_POLICY
from library.training.sensitive_options import without_secrets

logger = logging.getLogger(__name__)

# Options of sd-scripts that have no meaning for a flow-matching DiT. They are accepted by the parser (so that a
# pasted command gives a clear sentence instead of "unrecognized arguments") and rejected when set.
SD_ONLY_OPTIONS: dict[str, str] = {
    "v2": "selects Stable Diffusion 2 models",
    "v_parameterization": "is for v-prediction SD models; MOSS-Image predicts the flow velocity",
    "clip_skip": "is for CLIP text encoders; MOSS-Image uses the last hidden state of Qwen3.5",
    "max_token_length": "is for CLIP; use --moss_max_token_length",
    "noise_offset": "is a DDPM noise trick that does not apply to rectified flow",
    "noise_offset_random_strength": "is a DDPM noise trick that does not apply to rectified flow",
    "adaptive_noise_scale": "is a DDPM noise trick that does not apply to rectified flow",
    "multires_noise_iterations": "is a DDPM noise trick that does not apply to rectified flow",
    "multires_noise_discount": "is a DDPM noise trick that does not apply to rectified flow",
    "min_snr_gamma": "weights DDPM timesteps by SNR; use --weighting_scheme for flow matching",
    "scale_v_pred_loss_like_noise_pred": "is for v-prediction SD models",
    "v_pred_like_loss": "is for v-prediction SD models",
    "debiased_estimation_loss": "weights DDPM timesteps; use --weighting_scheme for flow matching",
    "zero_terminal_snr": "changes a DDPM noise schedule",
    "min_timestep": "restricts DDPM timesteps, which flow-matching sampling ignores; use --timestep_sampling options",
    "max_timestep": "restricts DDPM timesteps, which flow-matching sampling ignores; use --timestep_sampling options",
    "no_half_vae": "is for the SD VAE; the FLUX.2 VAE always runs in fp32",
    "mem_eff_attn": "is the SD U-Net attention switch; use --attn_mode",
    "weighted_captions": "is the CLIP prompt-weighting syntax",
}


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
    for name in ("title", "author", "description", "license", "tags"):
        g.add_argument(f"--metadata_{name}", type=str, default=None, help=f"modelspec.{name} of the saved LoRA")


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


def _add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sample images")
    g.add_argument("--sample_prompts", type=str, default=None, help="prompt file (.txt/.toml/.json) for samples")
    g.add_argument("--sample_every_n_steps", type=int, default=None, help="sample every N steps")
    g.add_argument("--sample_every_n_epochs", type=int, default=None, help="sample every N epochs")
    g.add_argument("--sample_at_first", action="store_true", help="sample before training")
    g.add_argument("--sample_sampler", type=str, default="euler", choices=["euler"],
                   help="sampler (the official flow-matching Euler)")
    g.add_argument("--sample_uncond_skip_layers", type=str, default="22",
                   help="DiT blocks skipped in the unconditional CFG branch (default 22; '' disables)")


def _add_validation_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("validation")
    g.add_argument("--validate_every_n_steps", type=int, default=None, help="validation loss every N steps")
    g.add_argument("--validate_every_n_epochs", type=int, default=None,
                   help="validation loss every N epochs (default every epoch when a validation set exists)")
    g.add_argument("--max_validation_steps", type=int, default=None, help="validation batches per run (all by default)")


def _add_sd_only_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Stable Diffusion options (rejected: they do not apply to MOSS-Image)")
    for name in SD_ONLY_OPTIONS:
        g.add_argument(f"--{name}", nargs="?", const=True, default=None, help=argparse.SUPPRESS)


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Every trainer option except the dataset, optimizer and flow-matching ones."""
    _add_model_arguments(parser)
    _add_network_arguments(parser)
    _add_training_arguments(parser)
    _add_saving_arguments(parser)
    _add_logging_arguments(parser)
    _add_sampling_arguments(parser)
    _add_validation_arguments(parser)
    _add_sd_only_arguments(parser)


# ---------------------------------------------------------------------------------------------- config files
def _flatten(table: dict[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat.update(_flatten(value))
        else:
            flat[key] = value
    return flat


def read_config_file(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Arguments from a `--config_file` TOML (sections are flattened); unknown keys are an error naming them."""
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
    unknown = sorted(k for k in values if k not in known)
    if unknown:
        raise UserError(f"--config_file '{path}' has unknown options {', '.join(unknown)}: remove or rename them.")
    return values


def parse_args_with_config(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line on top of `--config_file` values (the command line wins)."""
    args = parser.parse_args(argv)
    if args.config_file and not args.output_config:  # with --output_config the file is the output
        values = read_config_file(args.config_file, parser)
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
def reject_sd_only_options(args: argparse.Namespace) -> None:
    """A set option of SD_ONLY_OPTIONS is an error naming why it does not apply (nothing is changed)."""
    for name, why in SD_ONLY_OPTIONS.items():
        value = getattr(args, name)
        if value not in (None, False, 0):
            raise UserError(f"--{name} {why}: remove it from the command (or the config file).")
