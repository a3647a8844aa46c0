"""Loading the three MOSS-Image models from the files users hold.

DiT (`load_moss_image_model`):
- the official diffusers shards, given the FIRST shard (`transformer/diffusion_pytorch_model-00001-of-00003.safetensors`;
  the others are found beside it, no index needed; `config.json` beside it overrides the numeric config fields), or the
  `transformer/` folder, or a snapshot root;
- a ComfyUI single file (`moss_image_{base,sft}_bf16.safetensors`) whose blocks hold a fused `proj.qkv`, split here
  into q / k / v while reading (each fused tensor is read once).
The architecture is inferred from tensor shapes, so the full model, the tiny test model and a differently sized
checkpoint all load through the same code. The model is built on the meta device and filled tensor by tensor: one
copy of the weights in memory, never two. For a GPU the tensors are read straight into GPU memory through pinned
staging buffers (`TensorSource.iter_tensors`), cast and merged there; for the CPU they stay memory-mapped.

The text encoder is loaded by `library.text_encoder` (its own package). VAE: `library.moss_image.vae.load_flux2_vae`.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from library.errors import UserError
from library.moss_image.dit import MossImage, MossImageConfig, default_rope_axes
from library.files.safetensors_io import (
    SplitSpec,
    SplitTensorAdapter,
    TensorSource,
    check_safetensors_path,
    describe_key_mismatch,
    discover_shards,
    hooked_tensor,
    read_device,
)

logger = logging.getLogger(__name__)

TensorHook = Callable[[str, torch.Tensor], torch.Tensor]

_DIT_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "transformer.", "model.")
_FUSED_QKV = re.compile(r"^(?P<block>.+\.proj)\.qkv\.(?P<param>weight|bias)$")


# ------------------------------------------------------------------------------------------ snapshot layout
@dataclass(frozen=True)
class SnapshotPaths:
    dit: Path
    text_encoder: Path
    vae: Path
    tokenizer: Path | None


def resolve_snapshot(root: str | os.PathLike) -> SnapshotPaths:
    """The model paths inside an official-layout snapshot folder (transformer/, text_encoder/, vae/, tokenizer/)."""
    r = Path(root)
    if not r.is_dir():
        raise UserError(f"The snapshot '{r}' is not a folder: give the folder that holds transformer/, text_encoder/ and vae/.")
    missing = [d for d in ("transformer", "text_encoder", "vae") if not (r / d).is_dir()]
    if missing:
        raise UserError(f"The snapshot '{r}' has no {', '.join(d + '/' for d in missing)} folder: it is not a MOSS-Image snapshot.")
    tok = r / "tokenizer"
    return SnapshotPaths(r / "transformer", r / "text_encoder", r / "vae", tok if tok.is_dir() else None)


def fill_paths_from_snapshot(
    args: Any, dit_attr: str | None = None, te_attr: str | None = None, vae_attr: str | None = None
) -> None:
    """`--snapshot DIR`: set the named model-path options (and `tokenizer_cache_dir`) that were not given."""
    if not getattr(args, "snapshot", None):
        return
    snap = resolve_snapshot(args.snapshot)
    for attr, value in ((dit_attr, snap.dit), (te_attr, snap.text_encoder), (vae_attr, snap.vae)):
        if attr and not getattr(args, attr, None):
            setattr(args, attr, str(value))
    if hasattr(args, "tokenizer_cache_dir") and args.tokenizer_cache_dir is None and snap.tokenizer is not None:
        args.tokenizer_cache_dir = str(snap.tokenizer)


def _first_shard_in(folder: Path, stem: str) -> Path:
    files = sorted(folder.glob("*.safetensors"))
    firsts = [f for f in files if "00001-of-" in f.name]
    if firsts:
        return firsts[0]
    if len(files) == 1:
        return files[0]
    raise UserError(
        f"Cannot tell which file of '{folder}' is the {stem} checkpoint ({len(files)} .safetensors files):"
        " give the path of the first shard or of the single file."
    )


def _dit_checkpoint(path: str | os.PathLike) -> Path:
    p = Path(path)
    if p.is_dir():
        p = _first_shard_in(p / "transformer" if (p / "transformer").is_dir() else p, "DiT")
    return check_safetensors_path(p, "DiT checkpoint")


def dit_checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The files a DiT path (file, shard, transformer/ or snapshot folder) is read from: its shards in order."""
    return discover_shards(_dit_checkpoint(path))


# --------------------------------------------------------------------------------------------- DiT source
def _strip_prefix(keys: list[str]) -> str:
    for prefix in _DIT_PREFIXES:
        if keys and all(k.startswith(prefix) for k in keys if not k.endswith(".comfy_attention.config")):
            return prefix
    return ""


def open_dit_source(checkpoint: Path, disable_mmap: bool = False) -> SplitTensorAdapter:
    """A lazy view of the DiT tensors under the model's own names (prefix stripped, fused qkv split)."""
    shards = discover_shards(checkpoint)
    probe = TensorSource(shards, disable_mmap=disable_mmap)
    keys = probe.keys()
    probe.close()
    prefix = _strip_prefix(keys)
    source = TensorSource(shards, disable_mmap=disable_mmap, key_map=lambda k: k[len(prefix) :] if k.startswith(prefix) else k)
    splits = []
    for key in source.keys():
        m = _FUSED_QKV.match(key)
        if m:
            rows = source.shape(key)[0]
            if rows % 3:
                raise UserError(f"Fused tensor '{key}' in '{checkpoint}' has {rows} rows, not a multiple of 3: the file is damaged.")
            b, param = m.group("block"), m.group("param")
            splits.append(SplitSpec(key, tuple(f"{b}.{n}.{param}" for n in "qkv"), (rows // 3,) * 3))
    if splits:
        logger.info("ComfyUI layout: splitting %d fused qkv tensors into q/k/v", len(splits))
    return SplitTensorAdapter(source, splits)


def infer_dit_config(source: SplitTensorAdapter | TensorSource, overrides: dict[str, Any] | None = None) -> MossImageConfig:
    """The DiT architecture from tensor shapes (width, depth, heads via the q_norm size, FFN, text width, refiners),
    then any fields given in `overrides` (config.json)."""
    keys = source.keys()

    def need(key: str) -> tuple[int, ...]:
        if key not in source:
            raise UserError(
                f"The DiT checkpoint has no '{key}' tensor: it is not a MOSS-Image DiT (or not a supported layout)."
            )
        return source.shape(key)

    hidden, in_ch = need("video_embedder.weight")
    head_dim = need("layers.0.q_norm.weight")[0]
    num_layers = 1 + max(int(m.group(1)) for k in keys if (m := re.match(r"layers\.(\d+)\.", k)))
    refiners = {int(m.group(1)) for k in keys if (m := re.match(r"text_embedder\.blocks\.(\d+)\.", k))}
    cfg = MossImageConfig(
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=hidden // head_dim,
        head_dim=head_dim,
        ffn_hidden=need("layers.0.proj.ffn_down.weight")[1],
        in_channels=in_ch,
        text_dim=need("text_embedder.proj.weight")[1],
        num_refiner_layers=len(refiners),
        timestep_embed_dim=need("t_embedder.linear_1.weight")[1],
        rope_axes_dims=default_rope_axes(head_dim),
    )
    return cfg.updated(overrides) if overrides else cfg


def _read_config_json(checkpoint: Path) -> dict[str, Any] | None:
    path = checkpoint.parent / "config.json"
    if not path.exists():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise UserError(f"The DiT config '{path}' is not valid JSON ({e}): fix or remove it.") from e
    if not isinstance(raw, dict):
        raise UserError(f"The DiT config '{path}' is not a JSON object: fix or remove it.")
    if "model_type" in raw and "_class_name" not in raw:  # a transformers config (e.g. a text encoder's) lying there
        logger.debug("ignoring %s: not a DiT config", path)
        return None
    return {k: v for k, v in raw.items() if not k.startswith("_")}


# --------------------------------------------------------------------------------------------- DiT loader
def load_moss_image_model(
    device: str | torch.device,
    dit_path: str | os.PathLike,
    attn_mode: str = "torch",
    split_attn: bool = False,
    loading_device: str | torch.device | None = None,
    dtype: torch.dtype | None = torch.bfloat16,
    disable_mmap: bool = False,
    tensor_hook: TensorHook | None = None,
    convrot_int8: bool = False,
    convrot_int8_bwd: str = "bf16",
    calc_device: str | torch.device | None = None,
) -> MossImage:
    """Load the DiT from any supported layout onto `loading_device` (default `device`) in `dtype`.

    `tensor_hook(key, tensor)` sees each tensor under the model's key, on the device it is read to, before the
    final dtype cast (LoRA merge at load): a float tensor comes in the wider of the checkpoint's dtype and `dtype`
    (`safetensors_io.load_dtype_for_hook`), so a merge is rounded once, to `dtype`. `dtype=None` keeps the
    checkpoint's dtypes. `convrot_int8` quantises the 252 block Linears after loading (and after the merge), layer
    by layer on `calc_device` when given. A ComfyUI pre-quantised file (`.comfy_quant` markers) is detected and
    loaded as it is, whatever `convrot_int8` says.
    """
    from library.quant import convrot as cr

    checkpoint = _dit_checkpoint(dit_path)
    loading_device = torch.device(loading_device or device)
    source = open_dit_source(checkpoint, disable_mmap)
    what = f"the DiT checkpoint '{checkpoint}'"
    cr.check_quantization_format(source.source, source.source.metadata, what)
    if cr.is_comfy_quantized_state_dict(source.source.keys(), source.source.metadata):
        return _load_prequantized_dit(checkpoint, source, dtype, loading_device, attn_mode, split_attn,
                                      convrot_int8_bwd, tensor_hook)
    config = infer_dit_config(source, _read_config_json(checkpoint))
    with torch.device("meta"):
        model = MossImage(config, attn_mode=attn_mode, split_attn=split_attn)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    found = {k for k in source.keys() if not k.endswith(".comfy_attention.config")}
    if set(expected) != found:
        raise UserError(
            describe_key_mismatch("DiT checkpoint", checkpoint, sorted(set(expected) - found), sorted(found - set(expected)))
        )
    state = {}
    with source.source:
        for key, t in source.iter_tensors(expected, read_device(loading_device)):
            t = hooked_tensor(key, t, dtype, tensor_hook)
            if tuple(t.shape) != expected[key]:
                raise UserError(
                    f"Tensor '{key}' of '{checkpoint}' has shape {tuple(t.shape)}, expected {expected[key]}:"
                    " the config.json beside the checkpoint does not match its weights."
                )
            state[key] = t.to(loading_device)
    model.load_state_dict(state, strict=True, assign=True)
    del state
    if convrot_int8:
        quantize_dit(model, convrot_int8_bwd, calc_device)
    model.requires_grad_(False)
    model.eval()
    total = sum(p.numel() for p in model.parameters())
    logger.info(
        "loaded MOSS-Image DiT from %s: %d blocks, width %d, %.3fB parameters, %s on %s (attn_mode=%s, split_attn=%s)",
        checkpoint, config.num_layers, config.hidden_size, total / 1e9, dtype, loading_device, attn_mode, split_attn,
    )
    return model


# ------------------------------------------------------------------------------------------- ConvRot INT8
def quantize_dit(model: MossImage, bwd: str = "bf16", calc_device: str | torch.device | None = None) -> int:
    """ConvRot INT8 for the block Linears of a loaded DiT (in place, one layer at a time)."""
    from library.quant import convrot as cr

    g = cr.convrot_group_size(model, cr.dit_convrot_filter)
    return cr.convert_model_to_convrot_int8(model, cr.dit_convrot_filter, calc_device, g, bwd)


def reject_lora_merge_into_quantized(checkpoint: Path, option: str) -> None:
    raise UserError(
        f"Merging a LoRA into the pre-quantised ConvRot INT8 checkpoint '{checkpoint}' is not possible: use the bf16"
        f" checkpoint with {option} instead (the LoRA is merged first, then quantised)."
    )


class _DictShapes:
    """keys() / shape() / __contains__ over a state dict, for `infer_dit_config`."""

    def __init__(self, sd: dict[str, torch.Tensor]):
        self.sd = sd

    def keys(self) -> list[str]:
        return list(self.sd)

    def __contains__(self, key: str) -> bool:
        return key in self.sd

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.sd[key].shape)


def _cast_floats(sd: dict[str, torch.Tensor], dtype: torch.dtype | None, device: torch.device) -> None:
    """Float tensors to `dtype` (the fp32 `weight_scale`s and the int8 codes stay as they are), all to `device`."""
    for k, t in sd.items():
        if dtype is not None and t.is_floating_point() and not k.endswith(".weight_scale"):
            t = t.to(dtype)
        sd[k] = t.to(device)


def _load_prequantized_dit(
    checkpoint: Path, source: SplitTensorAdapter, dtype: torch.dtype | None, loading_device: torch.device,
    attn_mode: str, split_attn: bool, bwd: str, tensor_hook: TensorHook | None,
) -> MossImage:
    """A ComfyUI ConvRot INT8 single file as it is: int8 codes + per-row scales, fused qkv split with its scales."""
    from library.quant import convrot as cr

    if tensor_hook is not None:
        reject_lora_merge_into_quantized(checkpoint, "--convrot_int8")
    raw = source.source
    what = f"the DiT checkpoint '{checkpoint}'"
    with raw:
        keys = [k for k in raw.keys() if cr.comfy_key_filter(k)]
        markers = [k for k in keys if k.endswith(cr.COMFY_QUANT_SUFFIX)]  # small JSON tensors, parsed on the host
        sd = {k: raw.get_tensor(k) for k in markers}
        skip = set(markers)
        sd.update(raw.iter_tensors([k for k in keys if k not in skip], read_device(loading_device)))
        metadata = raw.metadata
    cr.split_fused_int8_qkv_state_dict(sd)
    specs = cr.comfy_int8_layer_specs(sd, metadata, what)
    config = infer_dit_config(_DictShapes(sd), _read_config_json(checkpoint))
    with torch.device("meta"):
        model = MossImage(config, attn_mode=attn_mode, split_attn=split_attn)
    cr.prepare_model_for_comfy_int8(model, specs, bwd, what, compute_dtype=dtype)
    _cast_floats(sd, dtype, loading_device)
    expected = set(model.state_dict().keys())
    found = set(sd)
    if expected != found:
        raise UserError(describe_key_mismatch("DiT checkpoint", checkpoint, sorted(expected - found),
                                              sorted(found - expected)))
    model.load_state_dict(sd, strict=True, assign=True)
    model.requires_grad_(False)
    model.eval()
    logger.info("loaded the pre-quantised ConvRot INT8 DiT %s: %d int8 layers, %d blocks, %s on %s", checkpoint,
                len(specs), config.num_layers, dtype, loading_device)
    return model
