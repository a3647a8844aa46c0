"""sd-scripts options that have no counterpart in MOSS-Image training, declared so that a pasted kohya command or a
kohya_ss configuration parses, and what becomes of each one that is set.

* **Ignored**, all of them named in one warning line with the reason: options that describe a Stable Diffusion model
  or implementation whose MOSS-Image counterpart is fixed (`--v2`, `--v_parameterization`, `--clip_skip`, the CLIP
  token limit, the fp16 VAE switch, ...), and the Hugging Face upload. Dropping them trains what the command asked
  for.
* **Refused**, in one sentence that names them: options that change the training recipe (the noise, the loss weights,
  the timestep range, the caption syntax) in a way a flow-matching DiT cannot honour, a resume from the Hub, and
  DeepSpeed. Dropping them silently would train something else than was asked.

A value that means "off" in sd-scripts is neither (nothing is said): False, None, 0, `--clip_skip 1`,
`--max_token_length 75`, `--min_timestep 0`, `--max_timestep 1000`, an empty text, and an option that acts only
together with another (`--noise_offset_random_strength` with `--noise_offset`, the DeepSpeed settings with
`--deepspeed`) while that one is off. The kohya_ss GUI writes several of these values into every configuration
file.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

OFF_VALUES = (None, False, 0)


@dataclass(frozen=True)
class ForeignOption:
    """One sd-scripts option: its value type, whether it is refused (else ignored), why, and its "off" values."""

    name: str
    kind: type  # bool (a flag), int, float or str, as sd-scripts declares it
    reason: str
    refused: bool = False
    off: tuple[Any, ...] = OFF_VALUES
    needs: str | None = None  # acts only together with this option in sd-scripts: off while that one is off


def _ignored(name: str, kind: type, reason: str, off: tuple[Any, ...] = OFF_VALUES,
             needs: str | None = None) -> ForeignOption:
    return ForeignOption(name, kind, reason, False, off, needs)


def _refused(name: str, kind: type, reason: str, off: tuple[Any, ...] = OFF_VALUES,
             needs: str | None = None) -> ForeignOption:
    return ForeignOption(name, kind, reason, True, off, needs)


_DDPM_NOISE = "a DDPM noise trick without a faithful rectified-flow form"
_UPLOAD = ("uploading to the Hugging Face Hub is not part of this trainer; upload the saved LoRA yourself"
           " (huggingface-cli upload)")
_DEEPSPEED = "DeepSpeed is not supported; several GPUs train with accelerate launch (DDP)"
_DDPM_WEIGHT = "weights the loss by the SNR of DDPM timesteps; use --weighting_scheme for flow matching"

SD_SCRIPTS_OPTIONS: tuple[ForeignOption, ...] = (
    _ignored("v2", bool, "selects Stable Diffusion 2 models; the model is the given MOSS-Image DiT"),
    _ignored("v_parameterization", bool, "selects v-prediction SD models; MOSS-Image always predicts the flow"
             " velocity"),
    _ignored("clip_skip", int, "a CLIP layer choice; MOSS-Image uses the last hidden state of Qwen3.5",
             off=(*OFF_VALUES, 1)),
    _ignored("max_token_length", int, "the CLIP token limit; MOSS-Image uses --moss_max_token_length",
             off=(*OFF_VALUES, 75)),
    _ignored("no_half_vae", bool, "the FLUX.2 VAE always runs in fp32"),
    _ignored("mem_eff_attn", bool, "the SD U-Net attention switch; MOSS-Image uses --attn_mode"),
    _ignored("zero_terminal_snr", bool, "flow matching already ends in pure noise (sigma 1)"),
    _refused("noise_offset", float, _DDPM_NOISE),
    _refused("noise_offset_random_strength", bool, _DDPM_NOISE, needs="noise_offset"),
    _refused("adaptive_noise_scale", float, _DDPM_NOISE, needs="noise_offset"),
    _refused("multires_noise_iterations", int, _DDPM_NOISE),
    _refused("multires_noise_discount", float, _DDPM_NOISE, needs="multires_noise_iterations"),
    _refused("min_snr_gamma", float, _DDPM_WEIGHT),
    _refused("debiased_estimation_loss", bool, _DDPM_WEIGHT),
    _refused("scale_v_pred_loss_like_noise_pred", bool, _DDPM_WEIGHT),
    _refused("v_pred_like_loss", float, "adds a v-prediction loss of SD models"),
    _refused("min_timestep", int, "a DDPM timestep range; shape the distribution with --timestep_sampling,"
             " --sigmoid_scale and --discrete_flow_shift instead"),
    _refused("max_timestep", int, "a DDPM timestep range; shape the distribution with --timestep_sampling,"
             " --sigmoid_scale and --discrete_flow_shift instead", off=(*OFF_VALUES, 1000)),
    _refused("weighted_captions", bool, "the (word:1.2) weighting syntax of CLIP prompts; the captions would reach"
             " Qwen3.5 with the brackets as text"),
    _ignored("huggingface_repo_id", str, _UPLOAD),
    *(_ignored(name, kind, _UPLOAD, needs="huggingface_repo_id") for name, kind in (
        ("huggingface_repo_type", str), ("huggingface_path_in_repo", str), ("huggingface_token", str),
        ("huggingface_repo_visibility", str), ("save_state_to_huggingface", bool), ("async_upload", bool))),
    _refused("resume_from_huggingface", bool, "--resume reads a local training state here; download it from the Hub first"),
    _refused("deepspeed", bool, _DEEPSPEED),
    *(_refused(name, kind, _DEEPSPEED, needs="deepspeed") for name, kind in (
        ("zero_stage", int), ("offload_optimizer_device", str), ("offload_optimizer_nvme_path", str),
        ("offload_param_device", str), ("offload_param_nvme_path", str), ("zero3_init_flag", bool),
        ("zero3_save_16bit_model", bool), ("fp16_master_weights_and_gradients", bool))),
)
BY_NAME = {o.name: o for o in SD_SCRIPTS_OPTIONS}


def add_sd_scripts_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare every option of SD_SCRIPTS_OPTIONS with sd-scripts' type (a flag, an int or a float)."""
    g = parser.add_argument_group("sd-scripts options that do not apply to MOSS-Image (ignored with a warning, or"
                                  " refused)")
    for option in SD_SCRIPTS_OPTIONS:
        help_text = f"{'refused' if option.refused else 'ignored'}: {option.reason}"
        if option.kind is bool:
            g.add_argument(f"--{option.name}", action="store_true", help=help_text)
        else:
            g.add_argument(f"--{option.name}", type=option.kind, default=None, help=help_text)


def _is_off(option: ForeignOption, args: argparse.Namespace) -> bool:
    if option.needs is not None and _is_off(BY_NAME[option.needs], args):
        return True
    value = getattr(args, option.name)
    return value in option.off or value == ""  # the kohya_ss GUI writes "" for an empty text


def mention(option: ForeignOption, value: Any) -> str:
    """`--name value` for a number, `--name` otherwise (a flag; a text, which may be a token or a path), followed by
    the reason in brackets."""
    shown = f"--{option.name} {value}" if option.kind in (int, float) else f"--{option.name}"
    return f"{shown} ({option.reason})"


def set_sd_scripts_options(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(the ignored, the refused) options of SD_SCRIPTS_OPTIONS that are set in `args`, each as `mention` writes it;
    args is not changed."""
    ignored: list[str] = []
    refused: list[str] = []
    for option in SD_SCRIPTS_OPTIONS:
        if not _is_off(option, args):
            (refused if option.refused else ignored).append(mention(option, getattr(args, option.name)))
    return ignored, refused
