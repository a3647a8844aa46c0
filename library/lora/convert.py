"""Convert MOSS-Image LoRA state dicts between the sd-scripts naming and the PEFT (diffusers / ComfyUI) naming.

The names are those of `library.lora.conventions`. ComfyUI loads the sd-scripts file directly; the PEFT naming is for
tools that expect it:

- `comfyui`:   `diffusion_model.layers.3.proj.q.lora_A.weight` / `.lora_B.weight` (DiT),
- `diffusers`: `transformer.layers.3.proj.q.lora_A.weight` / `.lora_B.weight` (DiT),
- text encoder keys become `text_encoder.layers.3.self_attn.q_proj.lora_A.weight` / `.lora_B.weight` in both;
- `sd-scripts`: a PEFT file back to our naming;
- `comfyui_fused`: the sd-scripts naming with each block's q / k / v as one `..._proj_qkv` module, for a ComfyUI
  model whose attention holds one fused qkv Linear (`conventions.fuse_qkv`: exactly the same merged weights).

Alpha: PEFT files carry no per-module alpha, so by default the scale alpha / rank is folded into lora_B
(lora_B' = lora_B * alpha / rank; the file then means "alpha = rank" and loads with scale 1 anywhere). With
`keep_alpha` lora_B is left as is and a `<path>.alpha` scalar is written instead (ComfyUI reads it; strict PEFT
loaders may reject the extra key). Going back to sd-scripts, a module's alpha comes from its `.alpha` tensor, else from
the PEFT adapter config (`library.lora.peft_config`: the file's `lora_adapter_metadata`, an `adapter_config.json`),
else it is the rank (with one warning line for a file that has no alpha anywhere).

PEFT inputs in every form PEFT and diffusers write: a `save_pretrained` folder, `base_model.model.` keys, the adapter
name infix (`lora_A.default.weight`), keys without any model prefix (diffusers' `save_lora_adapter`; DiT or text
encoder is told by the module names), `transformer.` / `diffusion_model.` / `text_encoder.` keys.

q / k / v stay separate in every other direction; a LoRA made for a fused `<block>.proj.qkv` module is split exactly
into q / k / v on the way in.

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
from library.files.safetensors_io import check_safetensors_path, load_safetensors, read_metadata, save_file_atomic
from library.lora.conventions import (
    ALGORITHM_LABELS,
    ALGORITHM_TENSORS,
    ALPHA,
    FUSED_QKV,
    LORA_DOWN,
    LORA_PREFIX_TEXT_ENCODER,
    LORA_PREFIX_UNET,
    LORA_PREFIXES,
    LORA_SUFFIXES,
    LORA_UP,
    PEFT_DIT_PREFIXES,
    PEFT_TEXT_ENCODER_PREFIX,
    effective_alpha,
    fuse_qkv,
    group_modules,
    is_sd_scripts_state_dict,
    lora_name_for,
    split_fused_qkv,
    split_peft_key,
    split_sd_key,
)
from library.lora.peft_config import (
    ADAPTER_CONFIG_NAME,
    METADATA_KEY,
    AdapterConfig,
    config_for,
    find_adapter_configs,
    resolve_lora_input,
)
from library.moss_image.lora_targets import DIT_MODULE_PATHS, TEXT_ENCODER_MODULE_PATHS

logger = logging.getLogger(__name__)

TARGETS = ("comfyui", "diffusers", "sd-scripts", "comfyui_fused")

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


PEFT_MODEL_PREFIX = "base_model.model."  # what PeftModel.save_pretrained puts before every module path
_PEFT_KEY = re.compile(r"^(?P<head>.+)\.(?P<kind>lora_A|lora_B)(?:\.(?P<adapter>[^.]+))?\.weight$")
_PEFT_ALPHA_KEY = re.compile(r"^(?P<head>.+)\.alpha$")
_PEFT_KINDS = {"lora_A": ".lora_A.weight", "lora_B": ".lora_B.weight"}


def _known_path(prefix: str, path: str) -> bool:
    """Whether `path` is a MOSS-Image LoRA target of the model `prefix` names (a fused DiT `proj.qkv` counts)."""
    underscored = path.replace(".", "_")
    if prefix == LORA_PREFIX_UNET and underscored.endswith("_proj_" + FUSED_QKV):
        underscored = underscored[: -len(FUSED_QKV)] + "q"
    return any(p == prefix and pattern.fullmatch(underscored) for p, pattern, _ in _KNOWN_MODULES)


def _prefixed_head(head: str) -> tuple[str, str]:
    """(head with a PEFT model prefix, the module path PEFT's config patterns are matched against) for the head of a
    PEFT key: `base_model.model.` is dropped; a head without `transformer.` / `diffusion_model.` / `text_encoder.`
    gets the one its module names belong to (the text encoder's path from `layers.` on)."""
    head = head.removeprefix(PEFT_MODEL_PREFIX)
    for known in (*PEFT_DIT_PREFIXES.values(), PEFT_TEXT_ENCODER_PREFIX):
        if head.startswith(known):
            return head, head[len(known):]
    if _known_path(LORA_PREFIX_UNET, head):
        return PEFT_DIT_PREFIXES["diffusers"] + head, head
    at = head.find("layers.")
    if (at == 0 or (at > 0 and head[at - 1] == ".")) and _known_path(LORA_PREFIX_TEXT_ENCODER, head[at:]):
        return PEFT_TEXT_ENCODER_PREFIX + head[at:], head
    raise UserError(
        f"LoRA module '{head}' is neither a MOSS-Image DiT module nor a Qwen3.5 text-encoder module that"
        " networks.lora_generic trains: this file is not a MOSS-Image LoRA this tool knows."
    )


def normalize_peft_keys(
    sd: Mapping[str, torch.Tensor], configs: Mapping[str, AdapterConfig] | None = None
) -> dict[str, torch.Tensor]:
    """PEFT keys in any form PEFT / diffusers write -> `transformer.` / `diffusion_model.` / `text_encoder.` keys with
    `.lora_A.weight`, `.lora_B.weight` and `.alpha`; a module without `.alpha` gets the one its adapter config
    (`configs`, by scope: `library.lora.peft_config`) gives it. Keys of other kinds pass through unchanged."""
    out: dict[str, torch.Tensor] = {}
    adapters: set[str] = set()
    paths: dict[str, str] = {}  # prefixed head -> the path the config patterns see
    for key, value in sd.items():
        m = _PEFT_KEY.match(key)
        if m is not None:
            if m["adapter"] is not None:
                adapters.add(m["adapter"])
            head, paths[head] = _prefixed_head(m["head"])
            new_key = head + _PEFT_KINDS[m["kind"]]
        elif (m := _PEFT_ALPHA_KEY.match(key)) is not None and not key.startswith(tuple(p + "_" for p in LORA_PREFIXES)):
            head, paths[head] = _prefixed_head(m["head"])
            new_key = f"{head}.{ALPHA}"
        else:
            new_key = key
        if new_key in out:
            raise UserError(f"LoRA key '{key}' appears twice under two spellings: the file is inconsistent.")
        out[new_key] = value
    if len(adapters) > 1:
        raise UserError(
            f"The LoRA file holds several PEFT adapters ({', '.join(sorted(adapters))}): save one adapter per file."
        )
    untargeted: list[str] = []
    for head, path in paths.items():
        if configs and f"{head}.{ALPHA}" not in out and f"{head}.lora_A.weight" in out:
            config = config_for(configs, not head.startswith(PEFT_TEXT_ENCODER_PREFIX))
            if config is None:
                continue
            if not config.targets(path):
                untargeted.append(path)
            alpha = config.kohya_alpha(path, int(out[f"{head}.lora_A.weight"].shape[0]))
            out[f"{head}.{ALPHA}"] = torch.tensor(alpha, dtype=torch.float32)
    if untargeted:
        logger.warning(
            "%d LoRA modules are not in target_modules of their adapter config (e.g. %s): the config may belong to"
            " another file; their alpha is taken from it all the same", len(untargeted), ", ".join(untargeted[:3]))
    return out


def to_sd_scripts(
    sd: Mapping[str, torch.Tensor], configs: Mapping[str, AdapterConfig] | None = None
) -> dict[str, torch.Tensor]:
    """Any supported naming -> sd-scripts keys: PEFT keys in any form (`normalize_peft_keys`; alpha from the module's
    `.alpha`, else from `configs`, else the rank) are renamed, fused qkv modules are split; sd-scripts keys pass
    through."""
    if is_sd_scripts_state_dict(sd):
        return split_fused_qkv(sd)
    groups: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key, value in normalize_peft_keys(sd, configs).items():
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
    sd: Mapping[str, torch.Tensor],
    target: str,
    keep_alpha: bool = False,
    module_names: Iterable[str] = (),
    configs: Mapping[str, AdapterConfig] | None = None,
) -> dict[str, torch.Tensor]:
    """Convert whatever naming `sd` has into `target` (comfyui, diffusers, sd-scripts or comfyui_fused)."""
    if target not in TARGETS:
        raise UserError(f"Unknown target format '{target}': choose one of {', '.join(TARGETS)}.")
    ours = to_sd_scripts(sd, configs)
    if target == "sd-scripts":
        group_modules(ours)  # validates the keys
        return ours
    if target == "comfyui_fused":
        return fuse_qkv(ours)
    return to_peft(ours, target, keep_alpha, module_names)


def _lacks_alpha(sd: Mapping[str, torch.Tensor]) -> bool:
    """True for a PEFT state dict with a module that has no `.alpha` of its own."""
    heads = {m["head"] for k in sd if (m := _PEFT_KEY.match(k)) is not None}
    return any(f"{h}.{ALPHA}" not in sd for h in heads)


def read_lora(
    src: str | os.PathLike, adapter_config: str | os.PathLike | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, AdapterConfig]]:
    """(tensors, metadata, adapter configs) of a LoRA file or PEFT save_pretrained folder (`peft_config`); one warning
    line when a PEFT file has modules without alpha and no config says what it is."""
    weights = check_safetensors_path(resolve_lora_input(src), "LoRA file")
    sd = load_safetensors(weights)
    metadata = dict(read_metadata(weights))
    configs = find_adapter_configs(weights, metadata, adapter_config)
    if configs:
        logger.info("LoRA alpha from the adapter config %s", ", ".join(c.source for c in configs.values()))
    elif not is_sd_scripts_state_dict(sd) and _lacks_alpha(sd) and "ss_network_module" not in metadata:
        # a file with sd-scripts metadata is our converter's output: its alpha / rank is folded into lora_B
        logger.warning(
            "LoRA '%s' is a PEFT file without alpha and without an adapter config (no %s metadata, no %s beside it):"
            " it is read with alpha = rank (scale 1); if it was trained with another lora_alpha, put its %s beside"
            " the file (or convert it with networks/convert_moss_image_lora.py --adapter_config FILE).", weights,
            METADATA_KEY, ADAPTER_CONFIG_NAME, ADAPTER_CONFIG_NAME,
        )
    return sd, metadata, configs


def convert_file(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    target: str,
    keep_alpha: bool = False,
    adapter_config: str | os.PathLike | None = None,
) -> int:
    """Convert a LoRA file (or a PEFT save_pretrained folder); metadata is kept (the sshs_* hashes are recomputed for
    the new tensors; diffusers' adapter config is dropped: the alphas are now in the tensors)."""
    if target not in TARGETS:
        raise UserError(f"Unknown target format '{target}': choose one of {', '.join(TARGETS)}.")
    src_file = resolve_lora_input(src)
    if os.path.abspath(src_file) == os.path.abspath(dst):
        raise UserError(f"Source and destination are the same file '{src}': give another output path.")
    sd, metadata, configs = read_lora(src, adapter_config)
    out = convert_state_dict(sd, target, keep_alpha, configs=configs)
    for key in [k for k in metadata if k.startswith("sshs_") or k in ("modelspec.hash_sha256", METADATA_KEY)]:
        del metadata[key]
    if metadata:
        add_hashes(out, metadata)
    save_file_atomic(out, dst, metadata or None)
    logger.info("converted %d tensors from %s to %s (%s)", len(out), src_file, dst, target)
    return len(out)
