"""The embedded default: a tiny MOSS-Image snapshot in the official file layouts, built offline in seconds.

Layout written under OUT_DIR (the same as the official repository, plus the ComfyUI single files):
    transformer/diffusion_pytorch_model-0000{1,2,3}-of-00003.safetensors, its index, config.json
    text_encoder/model-0000{1..4}-of-00004.safetensors (+ dummy vision tower, lm_head and MTP tensors), index, config.json
    tokenizer/tokenizer.json, tokenizer_config.json (a tiny byte-level BPE with the Qwen special tokens)
    vae/diffusion_pytorch_model.safetensors, config.json (diffusers layout)
    flux2-vae.safetensors (BFL / ComfyUI layout)
    moss_image_base_bf16.safetensors (ComfyUI single-file DiT with fused qkv)
    moss_image_base_int8_convrot.safetensors, text_encoder_int8/qwen3.5_9b_int8_convrot.safetensors (ComfyUI ConvRot
    INT8 files made by the project's own quantiser; the tiny text encoder's config.json lies beside its file)
Weights are deterministic random numbers (seeded), so every build gives the same tensors.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from library.moss_image.dit import MossImage, MossImageConfig
from library.files.safetensors_io import save_file_atomic, write_text_atomic

logger = logging.getLogger(__name__)

TINY_DIT_CONFIG = MossImageConfig(
    hidden_size=64,
    num_layers=24,  # > 22 so that the official uncond skip layer exists
    num_heads=4,
    head_dim=16,
    ffn_hidden=128,
    in_channels=128,
    text_dim=64,
    num_refiner_layers=2,
    timestep_embed_dim=256,
    rope_axes_dims=(4, 6, 6),
)

TINY_TEXT_CONFIG: dict[str, Any] = dict(
    model_type="qwen3_5_text",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    attn_output_gate=True,
    tie_word_embeddings=False,
    rope_parameters=dict(
        rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25, mrope_section=[2, 1, 1], mrope_interleaved=True
    ),
    eos_token_id=0,
    pad_token_id=0,
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen-style pre-tokenizer regex (letters with combining marks, numbers one by one, punctuation runs, spaces)
_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_CORPUS = [
    "A photo of a cat sitting on a windowsill, soft daylight, detailed fur.",
    "A red cube on a blue table, studio lighting, high contrast.",
    "A watercolor painting of mountains at sunset with a calm lake.",
    "Portrait of an old fisherman, weathered face, dramatic side light.",
    "A bowl of ramen with an egg, steam rising, close-up food photography.",
    "Neon street at night in the rain, reflections on the wet asphalt.",
    "A refrigerator door with a handwritten note held by a magnet.",
    "Line drawing of a bicycle, minimal, black ink on white paper.",
    "The quick brown fox jumps over the lazy dog 0123456789.",
    "user assistant system image caption style color light shadow.",
]
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

DIT_SHARDS = 3
TE_SHARDS = 4


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _random_like(name: str, t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Deterministic values that keep a tiny model's activations in a sensible range."""
    if t.ndim == 1 and "norm" in name:
        return 1.0 + 0.1 * torch.randn(t.shape, generator=g)
    if name.endswith("scale_shift_table"):
        return 0.1 * torch.randn(t.shape, generator=g)
    fan_in = t.shape[-1] if t.ndim > 1 else 1
    return torch.randn(t.shape, generator=g) / max(fan_in, 1) ** 0.5


def tiny_dit_state_dict(seed: int = 0, config: MossImageConfig = TINY_DIT_CONFIG) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = MossImage(config)
    g = _generator(seed)
    return {k: _random_like(k, v, g).to(torch.bfloat16) for k, v in model.state_dict().items()}


def _split_into_shards(sd: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    keys = list(sd)
    per = -(-len(keys) // n)
    return [{k: sd[k] for k in keys[i * per : (i + 1) * per]} for i in range(n)]


def _write_sharded(folder: Path, stem: str, sd: dict[str, torch.Tensor], n: int, index_name: str) -> None:
    weight_map = {}
    for i, part in enumerate(_split_into_shards(sd, n), start=1):
        name = f"{stem}-{i:05d}-of-{n:05d}.safetensors"
        save_file_atomic(part, folder / name, {"format": "pt"})
        weight_map.update({k: name for k in part})
    total = sum(t.numel() * t.element_size() for t in sd.values())
    write_text_atomic(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2), folder / index_name)


def write_dit(out: Path, seed: int) -> dict[str, torch.Tensor]:
    sd = tiny_dit_state_dict(seed)
    folder = out / "transformer"
    _write_sharded(folder, "diffusion_pytorch_model", sd, DIT_SHARDS, "diffusion_pytorch_model.safetensors.index.json")
    cfg = {"_class_name": "MossImageTransformer2DModel"}
    cfg.update({k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(TINY_DIT_CONFIG).items() if k != "extra"})
    write_text_atomic(json.dumps(cfg, indent=2), folder / "config.json")
    return sd


def write_comfy_dit(out: Path, sd: dict[str, torch.Tensor]) -> None:
    """The ComfyUI single-file form: each block's q/k/v fused into `proj.qkv` (rows q | k | v)."""
    fused: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if k.endswith(".proj.q.weight"):
            b = k[: -len(".q.weight")]
            fused[f"{b}.qkv.weight"] = torch.cat([sd[f"{b}.q.weight"], sd[f"{b}.k.weight"], sd[f"{b}.v.weight"]])
        elif not (k.endswith(".proj.k.weight") or k.endswith(".proj.v.weight")):
            fused[k] = v
    save_file_atomic(fused, out / "moss_image_base_bf16.safetensors")


TINY_CONVROT_GROUP_SIZE = 64  # the tiny widths (64, 128) take 64; the full models use the official 256


def _int8_layer(prefix: str, weight: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
    """`prefix.weight` int8 + `.weight_scale` fp32 [N, 1] + `.comfy_quant` marker, as ComfyUI writes them."""
    from library.quant import convrot_kernels as kernels
    from library.quant import convrot as cr

    q, scale = kernels.quantize_convrot_weight(weight, TINY_CONVROT_GROUP_SIZE)
    out[f"{prefix}.weight"] = q
    out[f"{prefix}.weight_scale"] = scale
    out[f"{prefix}.comfy_quant"] = cr.comfy_quant_tensor(cr.comfy_quant_spec(TINY_CONVROT_GROUP_SIZE))


def write_comfy_int8_dit(out: Path, sd: dict[str, torch.Tensor]) -> None:
    """`moss_image_base_int8_convrot.safetensors`: the block Linears as ConvRot INT8 (q/k/v fused into `proj.qkv`,
    rows and per-row scales concatenated), everything else bf16, as the ComfyUI files are made."""
    from library.quant.convrot import dit_convrot_filter

    result: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        module = k[: -len(".weight")] if k.endswith(".weight") else None
        if module is None or not dit_convrot_filter(module):
            result[k] = v
        elif module.endswith(".proj.q"):
            b = module[: -len(".q")]
            _int8_layer(f"{b}.qkv", torch.cat([sd[f"{b}.q.weight"], sd[f"{b}.k.weight"], sd[f"{b}.v.weight"]]), result)
        elif not module.endswith((".proj.k", ".proj.v")):
            _int8_layer(module, v, result)
    save_file_atomic(result, out / "moss_image_base_int8_convrot.safetensors")


def write_comfy_int8_text_encoder(out: Path, text: dict[str, torch.Tensor]) -> None:
    """`qwen3.5_9b_int8_convrot.safetensors`: the ComfyUI scope (projections + embed_tokens) as ConvRot INT8."""
    from library.quant.convrot import text_encoder_convrot_filter

    result: dict[str, torch.Tensor] = {}
    for k, v in text.items():
        module = k[: -len(".weight")] if k.endswith(".weight") else None
        if module is not None and text_encoder_convrot_filter(module):
            _int8_layer(f"model.language_model.{module}", v, result)
        else:
            result[f"model.language_model.{k}"] = v
    folder = out / "text_encoder_int8"  # with the tiny config beside it (the real file uses the bundled 9B config)
    save_file_atomic(result, folder / "qwen3.5_9b_int8_convrot.safetensors")
    shutil.copy(out / "text_encoder" / "config.json", folder / "config.json")


def tiny_text_state_dict(seed: int) -> dict[str, torch.Tensor]:
    from transformers import Qwen3_5TextConfig, Qwen3_5TextModel

    torch.manual_seed(seed)
    cfg = Qwen3_5TextConfig(**{k: v for k, v in TINY_TEXT_CONFIG.items() if k != "model_type"})
    model = Qwen3_5TextModel(cfg)
    g = _generator(seed + 1)
    sd = {}
    for k, v in model.state_dict().items():
        if k.endswith("layernorm.weight") or k.endswith("norm.weight"):
            v = v + 0.1 * torch.randn(v.shape, generator=g)  # non-trivial norms (zero-centred or plain)
        sd[k] = v.detach().to(torch.bfloat16)
    return sd


def write_text_encoder(out: Path, seed: int) -> dict[str, torch.Tensor]:
    """The official VL layout: text weights under model.language_model., plus vision / lm_head / MTP tensors that a
    text-encoder loader must skip."""
    g = _generator(seed + 2)
    text = tiny_text_state_dict(seed)
    h, vocab = TINY_TEXT_CONFIG["hidden_size"], TINY_TEXT_CONFIG["vocab_size"]
    sd = {f"model.language_model.{k}": v for k, v in text.items()}
    extras = {
        "model.visual.patch_embed.proj.weight": (32, 3, 2, 16, 16),
        "model.visual.blocks.0.attn.qkv.weight": (96, 32),
        "model.visual.blocks.0.mlp.linear_fc1.weight": (64, 32),
        "model.visual.merger.linear_fc2.weight": (h, 128),
        "lm_head.weight": (vocab, h),
        "mtp.fc.weight": (h, 2 * h),
    }
    sd.update({k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in extras.items()})
    folder = out / "text_encoder"
    _write_sharded(folder, "model", sd, TE_SHARDS, "model.safetensors.index.json")
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=h, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64, in_channels=3)
    cfg = dict(architectures=["Qwen3_5ForConditionalGeneration"], model_type="qwen3_5", text_config=TINY_TEXT_CONFIG,
               vision_config=vision, tie_word_embeddings=False)
    write_text_atomic(json.dumps(cfg, indent=2), folder / "config.json")
    return text


def write_tokenizer(out: Path) -> None:
    """A tiny byte-level BPE with Qwen's special tokens and pre-tokenizer, trained offline on a fixed corpus."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    folder = out / "tokenizer"
    folder.mkdir(parents=True, exist_ok=True)
    write_text_atomic(tok.to_str(), folder / "tokenizer.json")
    config = {
        "tokenizer_class": "TokenizersBackend",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 262144,
        "padding_side": "right",
        "add_prefix_space": False,
        "chat_template": _CHAT_TEMPLATE,
    }
    write_text_atomic(json.dumps(config, indent=2), folder / "tokenizer_config.json")


def write_vae(out: Path, seed: int) -> None:
    from library.moss_image.vae import make_tiny_vae, save_flux2_vae_bfl, save_flux2_vae_diffusers

    vae = make_tiny_vae(seed)
    save_flux2_vae_diffusers(vae, out / "vae")
    save_flux2_vae_bfl(vae, out / "flux2-vae.safetensors")


def build_tiny_snapshot(out_dir: str | os.PathLike, seed: int = 0, overwrite: bool = False) -> Path:
    """Write the tiny snapshot to `out_dir` (built in a temp folder beside it, then renamed: never half-written)."""
    out = Path(out_dir)
    if out.exists():
        if not overwrite and (out / "transformer").is_dir():
            logger.info("tiny snapshot already at %s", out)
            return out
        if overwrite:
            shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        dit = write_dit(tmp, seed)
        write_comfy_dit(tmp, dit)
        write_comfy_int8_dit(tmp, dit)
        text = write_text_encoder(tmp, seed)
        write_comfy_int8_text_encoder(tmp, text)
        write_tokenizer(tmp)
        write_vae(tmp, seed)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("wrote the tiny MOSS-Image snapshot to %s", out)
    return out
