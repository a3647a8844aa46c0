"""The option groups that several scripts share, each declared once (sd-scripts' `add_*_arguments` style).

The trainer (`moss_image_train_network.py`, through `library.training.args`), the inference script
(`moss_image_minimal_inference.py`) and the two cache tools (`tools/cache_latents.py`,
`tools/cache_text_encoder_outputs.py`) call these functions, so that an option they share has one name, one default
and one help text everywhere (`tests/test_shared_options.py` compares them). Keyword arguments select the options of a
group that a script takes; options only one script has stay in that script.

| function | options |
| --- | --- |
| `add_model_file_arguments` | --pretrained_model_name_or_path / --dit, --text_encoder, --vae, --snapshot, --tokenizer_cache_dir, --moss_max_token_length, --disable_mmap_load_safetensors |
| `add_attention_arguments` | --attn_mode, --split_attn, --xformers, --sdpa |
| `add_convrot_arguments` | --convrot_int8, --convrot_int8_text_encoder, --convrot_int8_bwd |
| `add_caching_arguments` | --cache_latents(_to_disk), --vae_batch_size, --cache_text_encoder_outputs(_to_disk), --text_encoder_batch_size, --skip_cache_check |
| `add_text_encoder_batch_argument` | --text_encoder_batch_size (alone, for the inference script) |
| `add_memory_arguments` | --blocks_to_swap, --block_swap_h2d_only, --no_pinned_memory_for_block_swap, --cpu_offload_checkpointing, --unsloth_offload_checkpointing, --lowram, --highvram, --cuda_expandable_segments |
| `add_text_encoder_memory_arguments` | --te_quant, --te_device, --text_encoder_cpu |
| `add_compile_arguments` | --compile, --compile_backend, --compile_mode, --compile_dynamic, --compile_fullgraph, --compile_cache_size_limit, --cuda_allow_tf32, --cuda_cudnn_benchmark |
| `add_seed_argument`, `add_device_argument` | --seed, --device |

What one option implies for another (e.g. `--cache_latents_to_disk` turns on `--cache_latents`) is applied after
parsing by `library.options.implications`, not here.
"""

from __future__ import annotations

import argparse
from typing import Union

from library.memory.block_swap import MOSS_IMAGE_NUM_LAYERS, max_blocks_to_swap
from library.runtime.attention import ATTN_MODES
from library.runtime.compile import COMPILE_MODES
from library.text_encoder.quant import TE_DEVICE_CHOICES, TE_QUANT_CHOICES
from library.text_encoder.qwen35 import DEFAULT_MAX_TOKEN_LENGTH

ArgumentContainer = Union[argparse.ArgumentParser, "argparse._ArgumentGroup"]

# the two names of the DiT path: sd-scripts' name first (the trainer's), the inference script's second
DIT_OPTIONS = ("--pretrained_model_name_or_path", "--dit")


def add_model_file_arguments(parser: argparse.ArgumentParser, dit_dest: str | None, text_encoder: bool,
                             vae: bool) -> None:
    """The model files: the DiT (stored under `dit_dest`, none when None), the text encoder with its tokenizer and
    token limit, the VAE, --snapshot for all of them, and how safetensors are read."""
    g = parser.add_argument_group("model files")
    if dit_dest is not None:
        g.add_argument(*DIT_OPTIONS, dest=dit_dest, metavar="PATH", type=str, default=None,
                       help="MOSS-Image DiT: first shard of the official diffusers files, the transformer/ folder, a"
                            " snapshot folder, or a ComfyUI single file (bf16 or ConvRot INT8)")
    if text_encoder:
        g.add_argument("--text_encoder", type=str, default=None,
                       help="Qwen3.5-9B text encoder: first shard of the official files"
                            " (text_encoder/model-00001-of-0000N) or a single file")
    if vae:
        g.add_argument("--vae", type=str, default=None,
                       help="FLUX.2 VAE: flux2-vae.safetensors (BFL/ComfyUI) or the diffusers vae/ folder")
    g.add_argument("--snapshot", type=str, default=None,
                   help="a MOSS-Image snapshot folder (transformer/, text_encoder/, vae/, tokenizer/): fills the model"
                        " paths and the tokenizer folder that are not given")
    if text_encoder:
        g.add_argument("--tokenizer_cache_dir", type=str, default=None,
                       help="folder with the tokenizer files, or a Hugging Face cache folder (for offline use)")
        g.add_argument("--moss_max_token_length", type=int, default=DEFAULT_MAX_TOKEN_LENGTH,
                       help=f"maximum text tokens including the chat template (default and maximum"
                            f" {DEFAULT_MAX_TOKEN_LENGTH})")
    g.add_argument("--disable_mmap_load_safetensors", action="store_true",
                   help="read safetensors with plain reads instead of memory mapping")


def add_attention_arguments(parser: argparse.ArgumentParser) -> None:
    """--attn_mode (None: --xformers, else torch; resolved by `library.options.implications`) and its aliases."""
    g = parser.add_argument_group("attention")
    g.add_argument("--attn_mode", type=str, default=None, choices=list(ATTN_MODES),
                   help="attention implementation: torch (the default, PyTorch SDPA), xformers (needs --split_attn),"
                        " flash, or sageattn (inference only); overrides --xformers")
    g.add_argument("--split_attn", action="store_true",
                   help="attention one sample at a time (less memory; needed for --attn_mode xformers)")
    g.add_argument("--xformers", action="store_true", help="same as --attn_mode xformers")
    g.add_argument("--sdpa", action="store_true", help="same as --attn_mode torch (the default)")


def flag_value(text: str) -> bool:
    """The value of a flag that may be given one: true / false (also yes / no, on / off, 1 / 0)."""
    low = text.strip().lower()
    if low in ("true", "yes", "on", "1"):
        return True
    if low in ("false", "no", "off", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got '{text}'")


def add_convrot_arguments(parser: argparse.ArgumentParser, dit: bool, text_encoder: bool, backward: bool) -> None:
    """ConvRot INT8 of the DiT and of the text encoder, and (training) the backward of the INT8 layers."""
    g = parser.add_argument_group("ConvRot INT8")
    if dit:
        g.add_argument("--convrot_int8", nargs="?", const=True, default=False, type=flag_value, metavar="true|false",
                       help="quantise the DiT block Linears to ConvRot INT8 at load time, after any LoRA merge"
                            " (pre-quantised checkpoints are detected without it); `--convrot_int8 false` keeps the"
                            " bf16 weights where --vram_budget would otherwise choose INT8")
    if text_encoder:
        g.add_argument("--convrot_int8_text_encoder", action="store_true",
                       help="quantise the text encoder to ConvRot INT8 at load time (pre-quantised checkpoints are"
                            " detected without it)")
    if backward:
        g.add_argument("--convrot_int8_bwd", type=str, default="bf16", choices=["bf16", "int8"],
                       help="backward of the ConvRot INT8 layers: bf16 (default, exact) or int8 (fused GEMM, needs"
                            " triton)")


def add_caching_arguments(parser: argparse.ArgumentParser, latents: bool, text_encoder_outputs: bool) -> None:
    """The latent and text-encoder output caches (the trainer takes both, each cache tool its own)."""
    g = parser.add_argument_group("caching")
    if latents:
        g.add_argument("--cache_latents", action="store_true",
                       help="cache the FLUX.2 VAE latents before training, in memory (tools/cache_latents.py always"
                            " caches)")
        g.add_argument("--cache_latents_to_disk", action="store_true",
                       help="cache the latents to <image>_<W>x<H>_moss.npz files beside the images (implies"
                            " --cache_latents; required by tools/cache_latents.py)")
        g.add_argument("--vae_batch_size", type=int, default=1, help="images per VAE call while caching latents")
    if text_encoder_outputs:
        g.add_argument("--cache_text_encoder_outputs", action="store_true",
                       help="cache the Qwen3.5 outputs before training, so that the text encoder can leave the GPU"
                            " (needs --network_train_unet_only; tools/cache_text_encoder_outputs.py always caches)")
        g.add_argument("--cache_text_encoder_outputs_to_disk", action="store_true",
                       help="cache the Qwen3.5 outputs to <image>_moss_te.npz files beside the images (implies"
                            " --cache_text_encoder_outputs; required by tools/cache_text_encoder_outputs.py)")
        add_text_encoder_batch_argument(g)
    g.add_argument("--skip_cache_check", action="store_true",
                   help="trust every existing cache file without checking it")


def add_text_encoder_batch_argument(group: ArgumentContainer) -> None:
    """--text_encoder_batch_size (with the caching options; the inference script takes it alone)."""
    group.add_argument("--text_encoder_batch_size", type=int, default=None,
                       help="captions per text-encoder call, grouped by length (default 1: one at a time)")


def add_memory_arguments(parser: argparse.ArgumentParser, training: bool) -> None:
    """Block swap, activation offloading (training), where the models wait, and the CUDA allocator switch."""
    g = parser.add_argument_group("memory")
    g.add_argument("--blocks_to_swap", type=int, default=None,
                   help=f"DiT blocks swapped between CPU and GPU, to save VRAM (max"
                        f" {max_blocks_to_swap(MOSS_IMAGE_NUM_LAYERS)}; needs CUDA)")
    if training:
        g.add_argument("--block_swap_h2d_only", action="store_true",
                       help="LoRA training: stream frozen blocks host-to-device only (needs --gradient_checkpointing)")
        g.add_argument("--no_pinned_memory_for_block_swap", action="store_true",
                       help="do not pin the host copies of swapped blocks")
        g.add_argument("--cpu_offload_checkpointing", action="store_true",
                       help="checkpointed inputs kept on the CPU (implies --gradient_checkpointing)")
        g.add_argument("--unsloth_offload_checkpointing", action="store_true",
                       help="block inputs offloaded to the CPU asynchronously, blocks recomputed in backward (implies"
                            " --gradient_checkpointing)")
        g.add_argument("--lowram", action="store_true",
                       help="load the text encoder and the VAE straight to the GPU (less CPU RAM, more VRAM)")
        g.add_argument("--highvram", action="store_true", help="keep the VAE on the GPU after caching latents")
    g.add_argument("--cuda_expandable_segments", action="store_true",
                   help="turn on the CUDA allocator's expandable segments (less memory held beyond what is in use;"
                        " ConvRot INT8 selective + compile fits 9 GiB with it); a PYTORCH_CUDA_ALLOC_CONF you set wins")


def add_text_encoder_memory_arguments(parser: argparse.ArgumentParser) -> None:
    """--te_quant (bitsandbytes), --te_device and its older form --text_encoder_cpu
    (`library.text_encoder.quant`)."""
    g = parser.add_argument_group("text encoder memory")
    g.add_argument("--te_quant", type=str, default="none", choices=list(TE_QUANT_CHOICES),
                   help="text encoder quantisation with bitsandbytes: none (default), int8 (LLM.int8), nf4, or auto"
                        " (by free VRAM: bf16 >= ~18.3 GiB, int8 >= ~11.2 GiB, nf4 >= ~7.8 GiB, else the CPU)")
    g.add_argument("--te_device", type=str, default=None, choices=list(TE_DEVICE_CHOICES),
                   help="where the text encoder runs: gpu (default) or cpu (slow, for caching its outputs)")
    g.add_argument("--text_encoder_cpu", action="store_true",
                   help="run the text encoder on the CPU (same as --te_device cpu)")


def add_compile_arguments(parser: argparse.ArgumentParser) -> None:
    """`--compile` (per-block torch.compile, `library.runtime.compile`) and its `--compile_*` options, with the CUDA
    backend switches that sd-scripts' torch.compile guide names beside them (`--cuda_allow_tf32`,
    `--cuda_cudnn_benchmark`)."""
    g = parser.add_argument_group("torch.compile")
    g.add_argument("--compile", action="store_true", help="per-block torch.compile of the DiT blocks")
    g.add_argument("--compile_backend", type=str, default="inductor", help="torch.compile backend")
    g.add_argument("--compile_mode", type=str, default="default", choices=COMPILE_MODES, help="torch.compile mode")
    g.add_argument("--compile_dynamic", type=str, default="auto", choices=["auto", "true", "false"],
                   help="dynamic shapes for --compile (auto: dynamic when the run has several sequence lengths,"
                        " i.e. several bucket or image sizes)")
    g.add_argument("--compile_fullgraph", action="store_true", help="fullgraph=True for --compile")
    g.add_argument("--compile_cache_size_limit", type=int, default=None,
                   help="dynamo recompile limit (raised automatically for several bucket or image sizes)")
    g.add_argument("--cuda_allow_tf32", action="store_true",
                   help="TF32 matmuls and convolutions from the start of the run (TF32 is turned on anyway once the"
                        " DiT is placed)")
    g.add_argument("--cuda_cudnn_benchmark", action="store_true",
                   help="cuDNN autotuning: only the VAE has convolutions, and its search can take workspaces as large"
                        " as the free GPU memory")


def add_seed_argument(group: ArgumentContainer) -> None:
    group.add_argument("--seed", type=int, default=None, help="random seed (random when not given)")


def add_device_argument(group: ArgumentContainer) -> None:
    """--device of the inference script and the cache tools (the trainer's device comes from accelerate)."""
    group.add_argument("--device", type=str, default=None,
                       help="where the models run: cpu, cuda or cuda:N (default: cuda when available, else cpu); the"
                            " cache tools take cpu or cuda and use each process's own GPU under accelerate launch")
