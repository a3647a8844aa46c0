"""Convert MOSS-Image LoRA state dicts between the sd-scripts naming and the PEFT (diffusers / ComfyUI) naming.

The names are those of `library.lora.conventions`. ComfyUI loads the sd-scripts file directly; the PEFT naming is for
tools that expect it:

- `comfyui`:   `diffusion_model.layers.3.proj.q.lora_A.weight` / `.lora_B.weight` (DiT),
- `diffusers`: `transformer.layers.3.proj.q.lora_A.weight` / `.lora_B.weight` (DiT),
- text encoder keys become `text_encoder.layers.3.self_attn.q_proj.lora_A.weight` / `.lora_B.weight` in both;
- `sd-scripts`: a PEFT file back to our naming.

Alpha: PEFT files carry no per-module alpha, so by default the scale alpha / rank is folded into lora_B
(lora_B' = lora_B * alpha / rank; the file then means "alpha = rank" and loads with scale 1 anywhere). With
`keep_alpha` lora_B is left as is and a `<path>.alpha` scalar is written instead (ComfyUI reads it; strict PEFT
loaders may reject the extra key). Going back to sd-scripts, a missing `.alpha` means alpha = rank.

q / k / v stay separate in every direction (ComfyUI maps separate q / k / v LoRA keys onto its fused qkv weight
itself); a LoRA made for a fused `<block>.proj.qkv` module is split exactly into q / k / v on the way in.

LoHa and LoKr files (`networks.loha`, `networks.lokr`) have no PEFT form here: `to_sd_scripts` passes them through
(a fused q/k/v LoHa is split), `to_peft` refuses them with a sentence (ComfyUI and LyCORIS read them as they are).

The sd-scripts -> PEFT direction needs the dotted module path back from the underscored name; it uses the name table
of the MOSS-Image targets (`library.moss_image.lora_targets`), and `module_names=` extends it with any model's names.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping

import torch

from library.errors import UserError
from library.files.model_spec import add_hashes
from library.files.safetensors_io import load_safetensors, read_metadata, save_file_atomic
from library.lora.conventions import (
    ALGORITHM_LABELS,
    ALGORITHM_TENSORS,
    ALPHA,
    LORA_DOWN,
    LORA_PREFIX_TEXT_ENCODER,
    LORA_PREFIX_UNET,
    LORA_SUFFIXES,
    LORA_UP,
    PEFT_DIT_PREFIXES,
    PEFT_TEXT_ENCODER_PREFIX,
    effective_alpha,
    group_modules,
    is_sd_scripts_state_dict,
    lora_name_for,
    split_fused_qkv,
    split_peft_key,
    split_sd_key,
)
from library.moss_image.lora_targets import DIT_MODULE_PATHS, TEXT_ENCODER_MODULE_PATHS

logger = logging.getLogger(__name__)

TARGETS = ("comfyui", "diffusers", "sd-scripts")

_KNOWN_MODULES: tuple[tuple[str, re.Pattern[str], str], ...] = tuple(
    (prefix, re.compile(pattern), template)
    for prefix, table in ((LORA_PREFIX_UNET, DIT_MODULE_PATHS), (LORA_PREFIX_TEXT_ENCODER, TEXT_ENCODER_MODULE_PATHS))
    for pattern, template in table
)


def dotted_module_path(prefix: str, underscored: str, module_names: Iterable[str] = ()) -> str:
    """Recover `layers.3.proj.ffn_up_gate` from `layers_3_proj_ffn_up_gate` (the given module names, then the table)."""
    for name in module_names:
        if name.replace(".", "_") == underscored:
            return name
    for rule_prefix, pattern, template in _KNOWN_MODULES:
        if rule_prefix == prefix:
            m = pattern.fullmatch(underscored)
            if m is not None:
                return m.expand(template)
    raise UserError(
        f"Cannot map LoRA module '{prefix}_{underscored}' to a MOSS-Image module path: it is not a DiT block /"
        " text embedder / Qwen3.5 target of networks.lora_generic (pass module_names= for other models)."
    )


def to_peft(
    sd: Mapping[str, torch.Tensor],
    target: str = "comfyui",
    keep_alpha: bool = False,
    module_names: Iterable[str] = (),
) -> dict[str, torch.Tensor]:
    """sd-scripts keys -> PEFT keys (`diffusion_model.` or `transformer.` for the DiT, `text_encoder.` for the TE)."""
    if target not in PEFT_DIT_PREFIXES:
        raise UserError(f"Unknown PEFT target '{target}': choose comfyui or diffusers.")
    _refuse_other_algorithms(sd)
    names = list(module_names)
    out: dict[str, torch.Tensor] = {}
    for (prefix, name), parts in group_modules(sd).items():
        path = dotted_module_path(prefix, name, names)
        head = (PEFT_DIT_PREFIXES[target] if prefix == LORA_PREFIX_UNET else PEFT_TEXT_ENCODER_PREFIX) + path
        down, up = parts[LORA_DOWN], parts[LORA_UP]
        alpha = effective_alpha(parts.get(ALPHA), down.shape[0])
        out[f"{head}.lora_A.weight"] = down
        if keep_alpha:
            out[f"{head}.lora_B.weight"] = up
            out[f"{head}.alpha"] = parts.get(ALPHA, torch.tensor(alpha, dtype=torch.float32))
        else:
            out[f"{head}.lora_B.weight"] = (up.float() * (alpha / down.shape[0])).to(up.dtype)
    return out


def _refuse_other_algorithms(sd: Mapping[str, torch.Tensor]) -> None:
    for key in sd:
        suffix = split_sd_key(key)[2]
        if suffix not in LORA_SUFFIXES:
            label = next(ALGORITHM_LABELS[a] for a, names in ALGORITHM_TENSORS.items() if suffix in names)
            raise UserError(
                f"LoRA key '{key}' is not an sd-scripts LoRA key but a {label} one: the PEFT naming is written for LoRA"
                f" only; ComfyUI and LyCORIS read {label} files as they are, no conversion is needed."
            )


def to_sd_scripts(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Any supported naming -> sd-scripts keys: PEFT keys (either DiT prefix; `text_encoder.` for the TE) are renamed,
    a missing alpha means alpha = rank, fused qkv modules are split; sd-scripts keys pass through."""
    if is_sd_scripts_state_dict(sd):
        return split_fused_qkv(sd)
    groups: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key, value in sd.items():
        prefix, path, suffix = split_peft_key(key)
        groups.setdefault((prefix, path), {})[suffix] = value
    out: dict[str, torch.Tensor] = {}
    for (prefix, path), parts in groups.items():
        name = lora_name_for(prefix, path)
        if LORA_DOWN not in parts or LORA_UP not in parts:
            raise UserError(f"LoRA module '{path}' lacks lora_A or lora_B: the file is incomplete.")
        if f"{name}.{LORA_DOWN}" in out:
            raise UserError(f"LoRA module '{path}' appears twice (under two prefixes): the file is inconsistent.")
        down = parts[LORA_DOWN]
        out[f"{name}.{LORA_DOWN}"] = down
        out[f"{name}.{LORA_UP}"] = parts[LORA_UP]
        alpha = parts.get(ALPHA)
        if alpha is None:
            alpha = torch.tensor(float(down.shape[0]), dtype=down.dtype if down.is_floating_point() else torch.float32)
        out[f"{name}.{ALPHA}"] = alpha
    return split_fused_qkv(out)


def convert_state_dict(
    sd: Mapping[str, torch.Tensor], target: str, keep_alpha: bool = False, module_names: Iterable[str] = ()
) -> dict[str, torch.Tensor]:
    """Convert whatever naming `sd` has into `target` (comfyui, diffusers or sd-scripts)."""
    if target not in TARGETS:
        raise UserError(f"Unknown target format '{target}': choose one of {', '.join(TARGETS)}.")
    ours = to_sd_scripts(sd)
    if target == "sd-scripts":
        group_modules(ours)  # validates the keys
        return ours
    return to_peft(ours, target, keep_alpha, module_names)


def convert_file(src: str | os.PathLike, dst: str | os.PathLike, target: str, keep_alpha: bool = False) -> int:
    """Convert a LoRA file; metadata is kept (the sshs_* hashes are recomputed for the new tensors)."""
    if os.path.abspath(src) == os.path.abspath(dst):
        raise UserError(f"Source and destination are the same file '{src}': give another output path.")
    sd = load_safetensors(src)
    metadata = dict(read_metadata(src))
    out = convert_state_dict(sd, target, keep_alpha)
    for key in [k for k in metadata if k.startswith("sshs_") or k == "modelspec.hash_sha256"]:
        del metadata[key]
    if metadata:
        add_hashes(out, metadata)
    save_file_atomic(out, dst, metadata or None)
    logger.info("converted %d tensors from %s to %s (%s)", len(out), src, dst, target)
    return len(out)
