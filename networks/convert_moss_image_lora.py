"""Convert MOSS-Image LoRA files between the sd-scripts naming and the PEFT (diffusers / ComfyUI) naming.

Our trainer writes sd-scripts keys: `lora_unet_layers_3_proj_q.lora_down.weight`, `.lora_up.weight`, `.alpha`
(`lora_te_...` for the Qwen3.5 text encoder). ComfyUI loads that file directly, so no conversion is needed for ComfyUI;
this tool is for tools that expect the PEFT naming:

- `--target comfyui`:   `diffusion_model.layers.3.proj.q.lora_A.weight` / `.lora_B.weight` (DiT),
- `--target diffusers`: `transformer.layers.3.proj.q.lora_A.weight` / `.lora_B.weight` (DiT),
- text encoder keys become `text_encoder.layers.3.self_attn.q_proj.lora_A.weight` / `.lora_B.weight` in both;
- `--target sd-scripts` converts a PEFT file back to our naming.

Alpha: PEFT files carry no per-module alpha, so by default the scale alpha / rank is folded into lora_B
(lora_B' = lora_B * alpha / rank; the file then means "alpha = rank" and loads with scale 1 anywhere). With
`--keep_alpha` lora_B is left as is and a `<path>.alpha` scalar is written instead (ComfyUI reads it; strict PEFT
loaders may reject the extra key). Going back to sd-scripts, a missing `.alpha` means alpha = rank.

q / k / v stay separate in every direction: ComfyUI maps separate q / k / v LoRA keys onto its fused qkv weight itself.
A LoRA made for a fused `<block>.proj.qkv` module (ComfyUI layout, from another trainer) is split exactly into q / k / v
on the way in: the three modules share lora_down and alpha, and lora_up is cut into three row blocks.

The sd-scripts -> PEFT direction needs the dotted module path back from the underscored name (`proj_ffn_up_gate` is
ambiguous), so it uses a table of the module names networks.lora_generic can train (DiT blocks, text embedder,
Qwen3.5 attention / linear attention / MLP); `module_names=` extends it with the names of any model.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Iterable, Mapping

import torch

from library.errors import UserError

logger = logging.getLogger(__name__)

SD_PREFIXES = ("lora_unet", "lora_te")
TARGETS = ("comfyui", "diffusers", "sd-scripts")
DIT_PEFT_PREFIX = {"comfyui": "diffusion_model.", "diffusers": "transformer."}
TE_PEFT_PREFIX = "text_encoder."
_SD_SUFFIXES = ("lora_down.weight", "lora_up.weight", "alpha")
_PEFT_SUFFIXES = {".lora_A.weight": "lora_down.weight", ".lora_B.weight": "lora_up.weight", ".alpha": "alpha"}

_BLOCK_LINEAR = r"(q|k|v|o|ffn_up_gate|ffn_down)"
# (sd-scripts prefix, regex on the underscored name after the prefix, dotted template)
_KNOWN_MODULES: tuple[tuple[str, re.Pattern[str], str], ...] = tuple(
    (prefix, re.compile(pattern), template)
    for prefix, pattern, template in (
        ("lora_unet", rf"layers_(\d+)_proj_{_BLOCK_LINEAR}", r"layers.\1.proj.\2"),
        ("lora_unet", r"text_embedder_proj", "text_embedder.proj"),
        ("lora_unet", rf"text_embedder_blocks_(\d+)_proj_{_BLOCK_LINEAR}", r"text_embedder.blocks.\1.proj.\2"),
        ("lora_te", r"layers_(\d+)_self_attn_(q|k|v|o)_proj", r"layers.\1.self_attn.\2_proj"),
        (
            "lora_te",
            r"layers_(\d+)_linear_attn_(in_proj_qkv|in_proj_z|in_proj_a|in_proj_b|out_proj)",
            r"layers.\1.linear_attn.\2",
        ),
        ("lora_te", r"layers_(\d+)_mlp_(gate|up|down)_proj", r"layers.\1.mlp.\2_proj"),
    )
)


def is_sd_scripts_state_dict(sd: Mapping[str, torch.Tensor]) -> bool:
    """True when every key is an sd-scripts LoRA key (`lora_unet_...` / `lora_te_...`)."""
    return all(k.startswith(("lora_unet_", "lora_te_")) for k in sd)


def split_sd_key(key: str) -> tuple[str, str, str]:
    """`lora_unet_layers_0_proj_q.lora_down.weight` -> ("lora_unet", "layers_0_proj_q", "lora_down.weight")."""
    name, _, suffix = key.partition(".")
    for prefix in SD_PREFIXES:
        if name.startswith(prefix + "_") and suffix in _SD_SUFFIXES:
            return prefix, name[len(prefix) + 1 :], suffix
    raise UserError(
        f"LoRA key '{key}' is not an sd-scripts LoRA key (lora_unet_/lora_te_ + .lora_down.weight / .lora_up.weight /"
        " .alpha): only plain LoRA files (networks.lora_generic) are supported, not LoHa / LoKr or other adapters."
    )


def dotted_module_path(prefix: str, underscored: str, module_names: Iterable[str] = ()) -> str:
    """Recover `layers.3.proj.ffn_up_gate` from `layers_3_proj_ffn_up_gate` (table, then the given module names)."""
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


def _group_sd(sd: Mapping[str, torch.Tensor]) -> dict[tuple[str, str], dict[str, torch.Tensor]]:
    groups: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key, value in sd.items():
        prefix, name, suffix = split_sd_key(key)
        groups.setdefault((prefix, name), {})[suffix] = value
    for (prefix, name), parts in groups.items():
        if "lora_down.weight" not in parts or "lora_up.weight" not in parts:
            raise UserError(f"LoRA module '{prefix}_{name}' lacks lora_down or lora_up: the file is incomplete.")
    return groups


def _alpha_value(parts: Mapping[str, torch.Tensor], rank: int) -> float:
    alpha = parts.get("alpha")
    if alpha is None:
        return float(rank)
    value = float(alpha.float().item())
    return float(rank) if value == 0 else value


def to_peft(
    sd: Mapping[str, torch.Tensor],
    target: str = "comfyui",
    keep_alpha: bool = False,
    module_names: Iterable[str] = (),
) -> dict[str, torch.Tensor]:
    """sd-scripts keys -> PEFT keys (`diffusion_model.` or `transformer.` for the DiT, `text_encoder.` for the TE)."""
    if target not in DIT_PEFT_PREFIX:
        raise UserError(f"Unknown PEFT target '{target}': choose comfyui or diffusers.")
    names = list(module_names)
    out: dict[str, torch.Tensor] = {}
    for (prefix, name), parts in _group_sd(sd).items():
        path = dotted_module_path(prefix, name, names)
        head = (DIT_PEFT_PREFIX[target] if prefix == "lora_unet" else TE_PEFT_PREFIX) + path
        down, up = parts["lora_down.weight"], parts["lora_up.weight"]
        alpha = _alpha_value(parts, down.shape[0])
        out[f"{head}.lora_A.weight"] = down
        if keep_alpha:
            out[f"{head}.lora_B.weight"] = up
            out[f"{head}.alpha"] = parts.get("alpha", torch.tensor(alpha, dtype=torch.float32))
        else:
            out[f"{head}.lora_B.weight"] = (up.float() * (alpha / down.shape[0])).to(up.dtype)
    return out


def _split_peft_key(key: str) -> tuple[str, str, str]:
    for peft_suffix, sd_suffix in _PEFT_SUFFIXES.items():
        if not key.endswith(peft_suffix):
            continue
        head = key[: -len(peft_suffix)]
        for peft_prefix, sd_prefix in (
            (DIT_PEFT_PREFIX["comfyui"], "lora_unet"),
            (DIT_PEFT_PREFIX["diffusers"], "lora_unet"),
            (TE_PEFT_PREFIX, "lora_te"),
        ):
            if head.startswith(peft_prefix) and len(head) > len(peft_prefix):
                return sd_prefix, head[len(peft_prefix) :], sd_suffix
    raise UserError(
        f"LoRA key '{key}' is neither sd-scripts (lora_unet_/lora_te_) nor PEFT (diffusion_model./transformer./"
        "text_encoder. + .lora_A.weight / .lora_B.weight / .alpha): this file is not a MOSS-Image LoRA this tool knows."
    )


def split_fused_qkv(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """sd-scripts keys with any `..._proj_qkv` DiT module split into `_proj_q`, `_proj_k`, `_proj_v` (same math)."""
    out = dict(sd)
    names = {k.partition(".")[0] for k in sd}
    fused = sorted(n for n in names if n.startswith("lora_unet_") and n.endswith("_proj_qkv"))
    for name in fused:
        down = out.pop(f"{name}.lora_down.weight", None)
        up = out.pop(f"{name}.lora_up.weight", None)
        alpha = out.pop(f"{name}.alpha", None)
        if down is None or up is None:
            raise UserError(f"LoRA module '{name}' lacks lora_down or lora_up: the file is incomplete.")
        if up.shape[0] % 3:
            raise UserError(
                f"LoRA module '{name}' has {up.shape[0]} output rows, not a multiple of 3: it is not a fused q/k/v."
            )
        stem = name[: -len("qkv")]
        for part, piece in zip("qkv", up.chunk(3, dim=0)):
            out[f"{stem}{part}.lora_down.weight"] = down.clone()
            out[f"{stem}{part}.lora_up.weight"] = piece.clone()
            if alpha is not None:
                out[f"{stem}{part}.alpha"] = alpha.clone()
    return out


def to_sd_scripts(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Any supported naming -> sd-scripts keys: PEFT keys (either DiT prefix; `text_encoder.` for the TE) are renamed,
    a missing alpha means alpha = rank, fused qkv modules are split; sd-scripts keys pass through."""
    if is_sd_scripts_state_dict(sd):
        return split_fused_qkv(sd)
    groups: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key, value in sd.items():
        prefix, path, suffix = _split_peft_key(key)
        groups.setdefault((prefix, path), {})[suffix] = value
    out: dict[str, torch.Tensor] = {}
    for (prefix, path), parts in groups.items():
        name = f"{prefix}_{path}".replace(".", "_")
        if "lora_down.weight" not in parts or "lora_up.weight" not in parts:
            raise UserError(f"LoRA module '{path}' lacks lora_A or lora_B: the file is incomplete.")
        if name + ".lora_down.weight" in out:
            raise UserError(f"LoRA module '{path}' appears twice (under two prefixes): the file is inconsistent.")
        down = parts["lora_down.weight"]
        out[f"{name}.lora_down.weight"] = down
        out[f"{name}.lora_up.weight"] = parts["lora_up.weight"]
        alpha = parts.get("alpha")
        if alpha is None:
            alpha = torch.tensor(float(down.shape[0]), dtype=down.dtype if down.is_floating_point() else torch.float32)
        out[f"{name}.alpha"] = alpha
    return split_fused_qkv(out)


def convert_state_dict(
    sd: Mapping[str, torch.Tensor], target: str, keep_alpha: bool = False, module_names: Iterable[str] = ()
) -> dict[str, torch.Tensor]:
    """Convert whatever naming `sd` has into `target` (comfyui, diffusers or sd-scripts)."""
    if target not in TARGETS:
        raise UserError(f"Unknown target format '{target}': choose one of {', '.join(TARGETS)}.")
    ours = to_sd_scripts(sd)
    if target == "sd-scripts":
        _group_sd(ours)  # validates the keys
        return ours
    return to_peft(ours, target, keep_alpha, module_names)


def convert_file(src: str | os.PathLike, dst: str | os.PathLike, target: str, keep_alpha: bool = False) -> int:
    """Convert a LoRA file; metadata is kept (the sshs_* hashes are recomputed for the new tensors)."""
    from library.files.model_spec import add_hashes
    from library.files.safetensors_io import load_safetensors, read_metadata, save_file_atomic

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Convert a MOSS-Image LoRA between sd-scripts and PEFT naming.")
    parser.add_argument("src", help="input LoRA (.safetensors)")
    parser.add_argument("dst", help="output LoRA (.safetensors)")
    parser.add_argument("--target", choices=TARGETS, default="comfyui",
                        help="output naming: comfyui (diffusion_model.*), diffusers (transformer.*) or sd-scripts")
    parser.add_argument("--keep_alpha", action="store_true",
                        help="PEFT output: write <path>.alpha instead of folding alpha / rank into lora_B")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        convert_file(args.src, args.dst, args.target, args.keep_alpha)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
