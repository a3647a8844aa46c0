"""Convert a MOSS-Image LoRA file between the sd-scripts naming and the PEFT (diffusers / ComfyUI) naming.

    python networks/convert_moss_image_lora.py ours.safetensors comfy.safetensors --target comfyui
    python networks/convert_moss_image_lora.py comfy.safetensors ours.safetensors --target sd-scripts
    python networks/convert_moss_image_lora.py peft_output_folder ours.safetensors --target sd-scripts
    python networks/convert_moss_image_lora.py ours.safetensors fused.safetensors --target comfyui_fused

Our trainer writes sd-scripts keys (`lora_unet_layers_3_proj_q.lora_down.weight`, `.lora_up.weight`, `.alpha`;
`lora_te_...` for the Qwen3.5 text encoder), which ComfyUI loads directly. `--target comfyui` / `diffusers` write the
PEFT naming (`diffusion_model.` / `transformer.` + `.lora_A.weight` / `.lora_B.weight`, `text_encoder.` for the text
encoder) with alpha / rank folded into lora_B, or kept as `<path>.alpha` with `--keep_alpha`; `--target sd-scripts`
converts back (PEFT `save_pretrained` folders and files too; alpha from the file's `lora_adapter_metadata`, an
`adapter_config.json` beside it or `--adapter_config`); `--target comfyui_fused` writes the sd-scripts naming with each
block's q / k / v fused into one `proj_qkv` module, for a ComfyUI model with a fused qkv Linear. The conversion
itself is `library.lora.convert`; its functions are re-exported here.
"""

from __future__ import annotations

import argparse
import logging
import sys

from library.errors import UserError
from library.lora.conventions import fuse_qkv, is_sd_scripts_state_dict, split_fused_qkv, split_sd_key
from library.lora.convert import (
    TARGETS,
    convert_file,
    convert_state_dict,
    dotted_module_path,
    normalize_peft_keys,
    read_lora,
    to_peft,
    to_sd_scripts,
)

__all__ = [
    "TARGETS", "convert_file", "convert_state_dict", "dotted_module_path", "fuse_qkv", "is_sd_scripts_state_dict",
    "main", "normalize_peft_keys", "read_lora", "split_fused_qkv", "split_sd_key", "to_peft", "to_sd_scripts",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Convert a MOSS-Image LoRA between sd-scripts and PEFT naming.")
    parser.add_argument("src", help="input LoRA (.safetensors) or PEFT save_pretrained folder")
    parser.add_argument("dst", help="output LoRA (.safetensors)")
    parser.add_argument("--target", choices=TARGETS, default="comfyui",
                        help="output naming: comfyui (diffusion_model.*), diffusers (transformer.*), sd-scripts, or"
                        " comfyui_fused (sd-scripts keys with q / k / v fused into one proj_qkv module)")
    parser.add_argument("--keep_alpha", action="store_true",
                        help="PEFT output: write <path>.alpha instead of folding alpha / rank into lora_B")
    parser.add_argument("--adapter_config", default=None,
                        help="PEFT input: the adapter_config.json that gives its lora_alpha (default: the file's"
                        " lora_adapter_metadata, else the adapter_config.json beside it)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        convert_file(args.src, args.dst, args.target, args.keep_alpha, args.adapter_config)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
