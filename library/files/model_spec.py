"""Metadata of saved LoRA files: sd-scripts `ss_*` training keys, SAI ModelSpec `modelspec.*` keys, `sshs_*` hashes.

All values in a safetensors header are strings; `stringify` writes them the way sd-scripts does (`str(value)`:
booleans "True"/"False", missing values "None").

Architecture. `modelspec.architecture` is `moss-image-base/lora` for a LoRA and `moss-image-base` for a full model.
The SAI ModelSpec names an adapter `<base architecture>/<adapter type>`, sd-scripts appends `/lora` for every LoRA it
saves (`flux-1-dev/lora`, `anima-preview/lora`), and the tools that read the key match on the prefix (model browsers
such as SwarmUI sort LoRAs by the base they fit; the A1111 network loader tests `startswith(...)`). ComfyUI does not
read the key at all: it maps the tensor names. So the base architecture is `moss-image-base`, as seed 001 §10 states,
and a LoRA file carries it with the `/lora` suffix, exactly what the seed's trainer (sd-scripts' model-spec builder
with `lora=True`) writes.

Prediction type. MOSS-Image is a rectified-flow model whose target is the velocity noise - x0;
`modelspec.prediction_type` is "flow". "v" would tell SD tools "v-parameterisation" (alpha * eps - sigma * x0),
a different target; "epsilon", which sd-scripts writes for Anima, is wrong.

Hashes (what the sd-webui additional-networks extension and sd-scripts compute; `precalculate_safetensors_hashes`):
the state dict is serialised in memory with only the `ss_*` metadata;
- `sshs_model_hash`: sha256 (hex) of every byte after the 8-byte length and the JSON header (the tensor data);
- `sshs_legacy_hash`: first 8 hex digits of the sha256 of the 64 KiB at offset 0x100000 of that buffer.
Editing non-`ss_*` metadata later changes neither. `modelspec.hash_sha256` ("0x" + the tensor-data sha256, as the SAI
spec defines it) is written too when modelspec keys are present.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import logging
import mimetypes
import os
import random
import struct
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from library.files.base_model_hash import LEGACY_HASH_LENGTH, LEGACY_HASH_OFFSET, legacy_model_hash, sha256_of_files

logger = logging.getLogger(__name__)

BASE_MODEL_VERSION = "moss_image_base"
ARCHITECTURE = "moss-image-base"
ADAPTER_LORA = "lora"
ARCHITECTURE_LORA = f"{ARCHITECTURE}/{ADAPTER_LORA}"
IMPLEMENTATION = "https://github.com/OpenMOSS/MOSS-Image"
IMPLEMENTATION_NAME = "moss-image-scripts"
MODELSPEC_VERSION = "1.0.1"
PREDICTION_TYPE = "flow"
DEFAULT_RESOLUTION = (1024, 1024)
DEFAULT_NETWORK_DIM = 4


# ss_<name> = str(args.<name>): the sd-scripts training keys that mean something for a flow-matching DiT LoRA.
# Left out on purpose (SD-only options this trainer ignores or refuses): clip_skip, max_token_length,
# noise_offset(+_random_strength), multires_noise_*, adaptive_noise_scale, zero_terminal_snr, min_snr_gamma,
# debiased_estimation, fp8_base(_unet). full_bf16 is added next to sd-scripts' full_fp16.
TRAINING_ARG_KEYS: tuple[str, ...] = (
    "output_name",
    "learning_rate",
    "text_encoder_lr",
    "unet_lr",
    "gradient_checkpointing",
    "gradient_accumulation_steps",
    "max_train_steps",
    "lr_warmup_steps",
    "lr_scheduler",
    "network_module",
    "network_dim",
    "network_alpha",
    "network_dropout",
    "mixed_precision",
    "full_fp16",
    "full_bf16",
    "cache_latents",
    "seed",
    "lowram",
    "training_comment",
    "max_grad_norm",
    "caption_dropout_rate",
    "caption_dropout_every_n_epochs",
    "caption_tag_dropout_rate",
    "face_crop_aug_range",
    "prior_loss_weight",
    "scale_weight_norms",
    "ip_noise_gamma",
    "ip_noise_gamma_random_strength",
    "loss_type",
    "huber_schedule",
    "huber_scale",
    "huber_c",
    "validation_seed",
    "validation_split",
    "max_validation_steps",
    "validate_every_n_epochs",
    "validate_every_n_steps",
    "resize_interpolation",
)
# The MOSS-Image keys of seed 001 §10 (besides ss_convrot_int8 / ss_convrot_int8_text_encoder).
MOSS_IMAGE_ARG_KEYS: tuple[str, ...] = (
    "weighting_scheme",
    "logit_mean",
    "logit_std",
    "mode_scale",
    "timestep_sampling",
    "sigmoid_scale",
    "discrete_flow_shift",
)
# What --no_metadata keeps (as sd-scripts does); modelspec and the hashes are still written.
MINIMAL_KEYS: tuple[str, ...] = (
    "ss_v2",
    "ss_base_model_version",
    "ss_network_module",
    "ss_network_dim",
    "ss_network_alpha",
    "ss_network_args",
)


# ----------------------------------------------------------------------------------------------------------------------
# ss_* training metadata


def stringify(metadata: Mapping[str, Any]) -> dict[str, str]:
    """Every key and value as str (sd-scripts style: True/False/None stay as their Python spelling)."""
    return {str(k): v if isinstance(v, str) else str(v) for k, v in metadata.items()}


def json_value(value: Any) -> str:
    """A JSON string for the structured keys (ss_datasets, ss_tag_frequency, ss_dataset_dirs, ss_network_args, ...)."""
    return json.dumps(value)


def new_session_id() -> int:
    return random.randint(0, 2**32 - 1)


def repository_commit() -> str:
    """The git commit of this checkout ("unknown" outside a git checkout)."""
    root = Path(__file__).resolve().parents[2]
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return result.stdout.strip() if result.returncode == 0 and result.stdout.strip() else "unknown"


def network_args_dict(network_args: Any) -> dict[str, str] | None:
    """`--network_args k=v ...` as the dict that ss_network_args records (None when none were given)."""
    if not network_args:
        return None
    if isinstance(network_args, Mapping):
        return {str(k): str(v) for k, v in network_args.items()}
    result = {}
    for item in network_args:
        key, _, value = str(item).partition("=")
        result[key.strip()] = value.strip()
    return result


def training_metadata(
    args: Any, dataset_metadata: Mapping[str, Any] | None = None, **run_values: Any
) -> dict[str, str]:
    """The `ss_*` keys of a training run: from `args` (TRAINING_ARG_KEYS) plus run values.

    Run values are keyword arguments with or without the `ss_` prefix, e.g. session_id, training_started_at,
    num_train_images, num_validation_images, num_reg_images, num_batches_per_epoch, num_epochs, optimizer,
    sd_model_name, ... They override the values taken from args. session_id and training_started_at are filled in
    when not given. `dataset_metadata` holds the structured dataset keys (datasets, tag_frequency, dataset_dirs,
    bucket_info, ...; with or without `ss_`): values that are not strings are written as JSON.
    """
    md: dict[str, Any] = {
        "ss_session_id": new_session_id(),
        "ss_training_started_at": time.time(),
        "ss_v2": False,
        "ss_base_model_version": BASE_MODEL_VERSION,
        "ss_sd_scripts_commit_hash": repository_commit(),
    }
    for name in TRAINING_ARG_KEYS:
        md[f"ss_{name}"] = getattr(args, name, None)
    if md["ss_network_dim"] is None:
        md["ss_network_dim"] = DEFAULT_NETWORK_DIM
    if md["ss_network_alpha"] is None:
        md["ss_network_alpha"] = 1.0
    net_args = network_args_dict(getattr(args, "network_args", None))
    if net_args is not None:
        md["ss_network_args"] = json_value(net_args)
    for key, value in (dataset_metadata or {}).items():
        md[key if key.startswith("ss_") else f"ss_{key}"] = value if isinstance(value, str) else json_value(value)
    for key, value in run_values.items():
        md[key if key.startswith("ss_") else f"ss_{key}"] = value
    return stringify(md)


def moss_image_metadata(args: Any, dit_convrot_int8: bool, text_encoder_convrot_int8: bool) -> dict[str, str]:
    """The MOSS-Image keys of seed 001 §10: timestep sampling / weighting settings and the ConvRot INT8 flags."""
    md: dict[str, Any] = {f"ss_{name}": getattr(args, name, None) for name in MOSS_IMAGE_ARG_KEYS}
    md["ss_convrot_int8"] = bool(dit_convrot_int8)
    md["ss_convrot_int8_text_encoder"] = bool(text_encoder_convrot_int8)
    return stringify(md)


def save_time_metadata(
    metadata: Mapping[str, Any], steps: int, epoch: int, finished_at: float | None = None
) -> dict[str, str]:
    """A copy of `metadata` with the keys written at each save: ss_training_finished_at, ss_steps, ss_epoch."""
    md = dict(metadata)
    md["ss_training_finished_at"] = time.time() if finished_at is None else finished_at
    md["ss_steps"] = steps
    md["ss_epoch"] = epoch
    return stringify(md)


def minimal_metadata(metadata: Mapping[str, Any]) -> dict[str, str]:
    """`--no_metadata`: only the keys that tell what the file is (plus any modelspec.* keys)."""
    return stringify({k: v for k, v in metadata.items() if k in MINIMAL_KEYS or k.startswith("modelspec.")})


# ----------------------------------------------------------------------------------------------------------------------
# modelspec.*


def format_resolution(resolution: Any) -> str:
    """`1024`, `"1024"`, `"1024,768"`, `"1024x768"`, `(1024, 768)` or None -> "WxH" (None: 1024x1024)."""
    if resolution is None:
        width, height = DEFAULT_RESOLUTION
    elif isinstance(resolution, (int, float)):
        width = height = int(resolution)
    elif isinstance(resolution, str):
        parts = [p for p in resolution.replace("x", ",").split(",") if p.strip()]
        values = [int(float(p)) for p in parts]
        width, height = (values[0], values[0]) if len(values) == 1 else (values[0], values[1])
    else:
        values = [int(v) for v in resolution]
        width, height = (values[0], values[0]) if len(values) == 1 else (values[0], values[1])
    return f"{width}x{height}"


def _thumbnail_data_url(value: str) -> str | None:
    if value.startswith("data:"):
        return value
    path = Path(value)
    if not path.is_file():
        logger.warning("metadata thumbnail '%s' is not a file: modelspec.thumbnail is left out", value)
        return None
    mime = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode('ascii')}"


def modelspec_metadata(
    title: str,
    timestamp: float | None = None,
    resolution: Any = None,
    lora: bool = True,
    timestep_range: tuple[int, int] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """`modelspec.*` keys (SAI ModelSpec 1.0.1). `extra` adds fields by name (author, description, license, tags,
    usage_hint, trigger_phrase, thumbnail (a file path or a data: URL), merged_from, ...); None values are left out."""
    ts = time.time() if timestamp is None else timestamp
    md: dict[str, Any] = {
        "sai_model_spec": MODELSPEC_VERSION,
        "architecture": ARCHITECTURE_LORA if lora else ARCHITECTURE,
        "implementation": IMPLEMENTATION,
        "title": title,
        "resolution": format_resolution(resolution),
        "date": datetime.datetime.fromtimestamp(int(ts)).isoformat(),
        "prediction_type": PREDICTION_TYPE,
        "implementation_version": f"{IMPLEMENTATION_NAME}/{repository_commit()}",
    }
    if timestep_range is not None:
        md["timestep_range"] = f"{int(timestep_range[0])},{int(timestep_range[1])}"
    for key, value in (extra or {}).items():
        if value is None:
            continue
        name = key[len("modelspec.") :] if key.startswith("modelspec.") else key
        if name == "thumbnail":
            value = _thumbnail_data_url(str(value))
            if value is None:
                continue
        md[name] = value
    return stringify({f"modelspec.{k}": v for k, v in md.items()})


def modelspec_from_args(args: Any, timestamp: float | None = None, lora: bool = True) -> dict[str, str]:
    """modelspec.* from the training args: title = --metadata_title, else --output_name, else "LoRA@<unix time>";
    resolution = --resolution; every other --metadata_<name> becomes modelspec.<name>."""
    ts = time.time() if timestamp is None else timestamp
    extra = {}
    for name, value in sorted(vars(args).items()):
        if name.startswith("metadata_") and name != "metadata_title" and value is not None:
            extra[name[len("metadata_") :]] = value
    title = getattr(args, "metadata_title", None) or getattr(args, "output_name", None) or f"LoRA@{int(ts)}"
    tmin, tmax = getattr(args, "min_timestep", None), getattr(args, "max_timestep", None)
    timestep_range = None
    if tmin is not None or tmax is not None:
        timestep_range = (tmin if tmin is not None else 0, tmax if tmax is not None else 1000)
    return modelspec_metadata(title, ts, getattr(args, "resolution", None), lora, timestep_range, extra)


# ----------------------------------------------------------------------------------------------------------------------
# hashes


def _data_offset(buffer: bytes) -> int:
    (header_len,) = struct.unpack("<Q", buffer[:8])
    return 8 + header_len


def model_hash_of_buffer(buffer: bytes) -> str:
    """sha256 (hex) of the tensor data of a serialised safetensors file (everything after the header)."""
    return hashlib.sha256(memoryview(buffer)[_data_offset(buffer) :]).hexdigest()


def legacy_hash_of_buffer(buffer: bytes) -> str:
    """First 8 hex digits of the sha256 of the 64 KiB at offset 0x100000 (empty input for files smaller than that)."""
    chunk = memoryview(buffer)[LEGACY_HASH_OFFSET : LEGACY_HASH_OFFSET + LEGACY_HASH_LENGTH]
    return hashlib.sha256(chunk).hexdigest()[:8]


def _serialise_for_hash(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any] | None) -> bytes:
    from safetensors.torch import save

    ss_only = {k: str(v) for k, v in (metadata or {}).items() if k.startswith("ss_")}
    contiguous = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    return save(contiguous, metadata=ss_only or None)


def precalculate_safetensors_hashes(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any] | None
) -> tuple[str, str]:
    """(sshs_model_hash, sshs_legacy_hash) of `tensors` serialised with only the ss_* part of `metadata`."""
    buffer = _serialise_for_hash(tensors, metadata)
    return model_hash_of_buffer(buffer), legacy_hash_of_buffer(buffer)


def add_hashes(tensors: Mapping[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Set sshs_model_hash / sshs_legacy_hash (and modelspec.hash_sha256 when modelspec keys exist) in `metadata`."""
    model_hash, legacy_hash = precalculate_safetensors_hashes(tensors, metadata)
    metadata["sshs_model_hash"] = model_hash
    metadata["sshs_legacy_hash"] = legacy_hash
    if any(k.startswith("modelspec.") for k in metadata):
        metadata["modelspec.hash_sha256"] = "0x" + model_hash


def file_model_hash(path: str | os.PathLike, block: int = 1 << 20) -> str:
    """sshs_model_hash of a safetensors file on disk, streamed (the tensor data does not depend on the metadata)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + header_len)
        for chunk in iter(lambda: f.read(block), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_legacy_hash(path: str | os.PathLike) -> str:
    """sshs_legacy_hash of a LoRA file: re-serialised with its own ss_* metadata, as at save time."""
    from library.files.safetensors_io import load_safetensors, read_metadata

    return precalculate_safetensors_hashes(load_safetensors(path), read_metadata(path))[1]


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a whole file (ss_new_sd_model_hash / ss_new_vae_hash of a single-file base model)."""
    return sha256_of_files([path])


def file_short_hash(path: str | os.PathLike) -> str:
    """The old 8-digit model hash of a whole file (ss_sd_model_hash / ss_vae_hash): 64 KiB at 0x100000."""
    return legacy_model_hash([path])
