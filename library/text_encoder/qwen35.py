"""The Qwen3.5-9B text encoder of MOSS-Image, through `transformers` (the model code is theirs, not re-implemented).

- Loading: the official multi-shard VL checkpoint (`text_encoder/model-00001-of-0000N.safetensors`, keys under
  `model.language_model.`) or a single file with the text keys under a known prefix. Only the text-model tensors are
  read: the vision tower (`model.visual.*`), `lm_head` and the MTP draft layer are filtered out before reading.
  A snapshot root (with a `text_encoder/` folder) is accepted too.
- Config: `config.json` beside the checkpoint when present, else the bundled `configs/moss_image_qwen35_9b/`.
- Tokenizer and prompt template: `load_tokenizer`, `format_prompt`, `tokenize` (the encoding itself is
  `library.text_encoder.encoding`'s). The tokenizer folder (`find_tokenizer_dir`): --tokenizer_cache_dir, the
  snapshot's own `tokenizer/`, a Hugging Face cache, else a download from the Hub that is tried only when the Hub
  answers within 3 s and never with HF_HUB_OFFLINE (`download_tokenizer`).
- `load_qwen35_text_model` reads the weights in a given dtype; the rules of a run (dtype, placement, quantisation,
  cache variant) are `library.text_encoder.loading`'s.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from library.errors import UserError
from library.files.safetensors_io import (
    TensorSource,
    check_safetensors_path,
    describe_key_mismatch,
    discover_shards,
    hooked_tensor,
    read_device,
)
from library.quant import convrot as cr
from library.text_encoder.kernels import route_linear_attention_kernels
from library.text_encoder.quant import quantize_text_encoder_convrot

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
BUNDLED_CONFIG_DIR = REPO_ROOT / "configs" / "moss_image_qwen35_9b"
TOKENIZER_REPO = "OpenMOSS-Team/MOSS-Image-Base"
TOKENIZER_SUBFOLDER = "tokenizer"
HUB_CONNECT_TIMEOUT = 3.0  # seconds for the Hub to answer before a tokenizer download is given up
DEFAULT_MAX_TOKEN_LENGTH = 4096
MAX_TOKEN_LENGTH = 4096

# The prompt template: Qwen3.5 ChatML with one user message, no generation prompt and no thinking block.
# Caches record PROMPT_TEMPLATE_ID, so a changed template invalidates them.
PROMPT_TEMPLATE_ID = "qwen35-chatml-user-v1"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# prefixes under which checkpoints store the text model (official VL layout first)
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.", "")
_SKIPPED_PREFIXES = ("model.visual.", "visual.", "lm_head.", "mtp.", "model.mtp.")


def format_prompt(caption: str) -> str:
    """The text the encoder sees for a caption (the one place the template lives)."""
    return f"<|im_start|>user\n{caption}<|im_end|>\n"


# ---------------------------------------------------------------------------------------------------- config
def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"Cannot read the text encoder config '{path}' ({e}): fix or remove the file.") from e


def load_text_config(checkpoint: Path) -> Any:
    """Qwen3_5TextConfig from config.json beside the checkpoint (VL or text-only form), else the bundled 9B one."""
    from transformers import Qwen3_5TextConfig  # heavy import (seconds): only a load needs it

    local = checkpoint.parent / "config.json"
    path = local if local.exists() else BUNDLED_CONFIG_DIR / "config.json"
    raw = _read_json(path)
    text = raw.get("text_config", raw)
    if text.get("model_type") not in (None, "qwen3_5_text", "qwen3_5"):
        raise UserError(
            f"'{path}' describes a '{text.get('model_type')}' model, not Qwen3.5: point --text_encoder at the"
            " Qwen3.5-9B text encoder of MOSS-Image."
        )
    text = {k: v for k, v in text.items() if k != "model_type"}
    logger.info("text encoder config: %s", path)
    return Qwen3_5TextConfig(**text)


# ------------------------------------------------------------------------------------------------- loading
def text_encoder_path(path: str | os.PathLike) -> Path:
    """A text encoder file or folder as given, or the text_encoder/ folder of a snapshot root."""
    p = Path(path)
    if p.is_dir() and (p / "text_encoder").is_dir():
        p = p / "text_encoder"
    if not p.is_dir():
        check_safetensors_path(p, "text encoder checkpoint")
    return p


def _find_checkpoint(path: str | os.PathLike) -> Path:
    p = text_encoder_path(path)
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        firsts = [f for f in files if "00001-of-" in f.name]
        if firsts or len(files) == 1:
            return (firsts or files)[0]
        raise UserError(
            f"The text encoder folder '{p}' holds {len(files)} .safetensors files and none is a first shard:"
            " give the path of the first shard (model-00001-of-0000N.safetensors) or of a single file."
        )
    return p


def _text_prefix(keys: list[str], path: Path) -> str:
    for prefix in _TEXT_PREFIXES:
        if f"{prefix}embed_tokens.weight" in keys:
            return prefix
    raise UserError(
        f"'{path}' holds no Qwen3.5 text model (no '*embed_tokens.weight' key): point --text_encoder at the"
        " first shard of the official text encoder or at a Qwen3.5 single file."
    )


def open_text_encoder_source(path: str | os.PathLike, disable_mmap: bool = False) -> tuple[TensorSource, Path]:
    """A lazy source over the text-model tensors only (prefix stripped), and the checkpoint path."""
    checkpoint = _find_checkpoint(path)
    shards = discover_shards(checkpoint)
    probe = TensorSource(shards, disable_mmap=disable_mmap)
    all_keys = probe.keys()
    probe.close()
    prefix = _text_prefix(all_keys, checkpoint)

    def keep(key: str) -> bool:
        return key.startswith(prefix) and not key.startswith(_SKIPPED_PREFIXES)

    def rename(key: str) -> str:
        return key[len(prefix) :]

    return TensorSource(shards, disable_mmap=disable_mmap, key_filter=keep, key_map=rename), checkpoint


def text_encoder_file_is_prequantised(path: str | os.PathLike) -> bool:
    """True when the text encoder checkpoint is a ComfyUI ConvRot INT8 file (`.comfy_quant` markers or the file's
    quantisation metadata), as `load_qwen35_text_model` detects it; only the safetensors headers are read."""
    source, _ = open_text_encoder_source(path)
    try:
        return cr.is_comfy_quantized_state_dict(source.keys(), source.metadata)
    finally:
        source.close()


def load_qwen35_text_model(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    disable_mmap: bool = False,
    tensor_hook: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    convrot_int8: bool = False,
    convrot_int8_bwd: str = "bf16",
    calc_device: str | torch.device | None = None,
) -> Any:
    """Build `transformers.Qwen3_5TextModel` without allocating weights, then fill it tensor by tensor; `path` is a
    checkpoint file, a text_encoder/ folder or a snapshot root.

    `tensor_hook(key, tensor)` may transform each tensor as it is read (LoRA merge at load); it sees a float tensor
    on the device it is read to, in the wider of the checkpoint's dtype and `dtype`, before the cast to `dtype` (one
    rounding: `library.files.safetensors_io.hooked_tensor`). `convrot_int8` quantises the ComfyUI scope (attention /
    GatedDeltaNet / MLP projections and embed_tokens) after loading; a ComfyUI ConvRot INT8 file (`.comfy_quant`
    markers) is loaded as it is.
    """
    # heavy imports (seconds): only a load needs them
    from accelerate import init_empty_weights
    from transformers import Qwen3_5TextModel

    source, checkpoint = open_text_encoder_source(path, disable_mmap)
    config = load_text_config(checkpoint)
    what = f"the text encoder checkpoint '{checkpoint}'"
    cr.check_quantization_format(source, source.metadata, what)
    with init_empty_weights(include_buffers=False):
        model = Qwen3_5TextModel(config)
    route_linear_attention_kernels()  # fla / causal-conv1d for CUDA tensors only
    if cr.is_comfy_quantized_state_dict(source.keys(), source.metadata):
        if tensor_hook is not None:
            raise UserError(
                f"Merging a LoRA into the pre-quantised ConvRot INT8 text encoder '{checkpoint}' is not possible: use"
                " the bf16 checkpoint with --convrot_int8_text_encoder instead (the LoRA is merged first, then quantised)."
            )
        specs = cr.comfy_int8_layer_specs(source, source.metadata, what)
        cr.prepare_model_for_comfy_int8(model, specs, convrot_int8_bwd, what, compute_dtype=dtype)
    expected_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.endswith(cr.COMFY_QUANT_SUFFIX)}
    expected = set(expected_shapes)
    found = {k for k in source.keys() if not k.endswith(cr.COMFY_QUANT_SUFFIX) and cr.comfy_key_filter(k)}
    if expected != found:
        raise UserError(
            describe_key_mismatch("text encoder checkpoint", checkpoint, sorted(expected - found), sorted(found - expected))
        )
    state: dict[str, torch.Tensor] = {}
    with source:  # read straight to a GPU `device` (staged, see library.files.safetensors_io); mmap for the CPU
        for key, t in source.iter_tensors(sorted(found), read_device(torch.device(device))):
            if not key.endswith(".weight_scale"):
                t = hooked_tensor(key, t, dtype, tensor_hook)
            if key.endswith(".weight_scale"):
                t = t.float().reshape(-1, 1) if t.numel() == expected_shapes[key][0] else t.float()
            if tuple(t.shape) != expected_shapes[key] and not key.endswith(".weight_scale"):
                raise UserError(
                    f"Tensor '{key}' of '{checkpoint}' has shape {tuple(t.shape)} but the config expects"
                    f" {expected_shapes[key]}:"
                    " the config.json beside the checkpoint does not match its weights."
                )
            state[key] = t.to(device)
    model.load_state_dict(state, strict=True, assign=True)
    del state
    if convrot_int8:
        quantize_text_encoder_convrot(model, convrot_int8_bwd, calc_device)
    model.to(device)
    model.requires_grad_(False)
    model.eval()
    n = sum(p.numel() for p in model.parameters())
    logger.info("loaded Qwen3.5 text model from %s: %d layers, %.2fB parameters, %s", checkpoint,
                config.num_hidden_layers, n / 1e9, dtype)
    return model


# ----------------------------------------------------------------------------------------------- tokenizer
def _has_tokenizer_files(folder: Path) -> bool:
    return any((folder / f).exists() for f in TOKENIZER_FILES)


def _local_tokenizer_dir(tokenizer_cache_dir: str | None, text_encoder_path: str | None) -> Path | None:
    if tokenizer_cache_dir:
        d = Path(tokenizer_cache_dir)
        for cand in (d, d / TOKENIZER_SUBFOLDER):
            if _has_tokenizer_files(cand):
                return cand
    if text_encoder_path:
        te = Path(text_encoder_path)
        folder = te if te.is_dir() else te.parent
        for cand in (folder / TOKENIZER_SUBFOLDER, folder.parent / TOKENIZER_SUBFOLDER):
            if _has_tokenizer_files(cand):
                return cand
    return None


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set now or when huggingface_hub was imported."""
    from huggingface_hub import constants  # lazy, as transformers: only a tokenizer lookup needs the hub client

    now = any(os.environ.get(k, "").strip().upper() in ("1", "ON", "YES", "TRUE")
              for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return now or bool(constants.HF_HUB_OFFLINE)


def _hub_endpoint() -> str:
    from huggingface_hub import constants  # lazy: see _hub_offline

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def reachable(url: str, timeout: float = HUB_CONNECT_TIMEOUT) -> bool:
    """Whether `url` gives any HTTP answer (an error status too) within `timeout` seconds, the name lookup and the
    connection included: the request runs in a thread that is given up after `timeout` (a name lookup has no timeout
    of its own). The environment's proxies are used, as the hub client uses them."""
    answered: list[bool] = []

    def ask() -> None:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout):
                answered.append(True)
        except urllib.error.HTTPError:  # an answer all the same
            answered.append(True)
        except (OSError, ValueError):
            pass

    thread = threading.Thread(target=ask, name="hub-reachable", daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(answered)


def _cached_tokenizer_dir(cache_dir: str | None) -> Path | None:
    """The tokenizer folder of MOSS-Image-Base in a Hugging Face cache (`cache_dir`, else the default one), found
    without any network access."""
    from huggingface_hub import try_to_load_from_cache  # lazy: see _hub_offline

    for name in TOKENIZER_FILES:
        found = try_to_load_from_cache(TOKENIZER_REPO, f"{TOKENIZER_SUBFOLDER}/{name}", cache_dir=cache_dir)
        if isinstance(found, str) and _has_tokenizer_files(Path(found).parent):
            return Path(found).parent
    return None


def _pass_tokenizer_dir() -> str:
    return (f"pass --tokenizer_cache_dir DIR with a folder holding {', '.join(TOKENIZER_FILES)} (the"
            f" '{TOKENIZER_SUBFOLDER}' folder of {TOKENIZER_REPO}) or a Hugging Face cache that has it")


def download_tokenizer(cache_dir: str | None) -> Path:
    """Download the tokenizer files (only them, about 20 MB) of MOSS-Image-Base into the Hugging Face cache
    (`cache_dir` when given) and return their folder. The hub is tried only when it answers within
    `HUB_CONNECT_TIMEOUT` seconds, so that a machine without a network gets its error at once, not after the client's
    retries; HF_HUB_OFFLINE forbids the download."""
    from huggingface_hub import snapshot_download  # heavy import: only a download needs it

    endpoint = _hub_endpoint()
    if _hub_offline():
        raise UserError("The Qwen3.5 tokenizer is not on this machine and HF_HUB_OFFLINE is set, so it is not"
                        f" downloaded: {_pass_tokenizer_dir()}.")
    if not reachable(endpoint):
        raise UserError(f"The Qwen3.5 tokenizer is not on this machine and the Hugging Face Hub ({endpoint}) does not"
                        f" answer within {HUB_CONNECT_TIMEOUT:.0f} s: {_pass_tokenizer_dir()}.")
    logger.info("tokenizer: downloading %s/%s from %s (cache: %s)", TOKENIZER_REPO, TOKENIZER_SUBFOLDER, endpoint,
                cache_dir or "the default Hugging Face cache")
    try:
        root = snapshot_download(TOKENIZER_REPO, allow_patterns=[f"{TOKENIZER_SUBFOLDER}/*"], cache_dir=cache_dir,
                                 endpoint=endpoint, etag_timeout=HUB_CONNECT_TIMEOUT)
    except Exception as e:  # the hub client raises HTTP, connection and OS errors of many kinds
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise UserError(f"Could not download the Qwen3.5 tokenizer from {endpoint} ({type(e).__name__}: {first}):"
                        f" {_pass_tokenizer_dir()}.") from e
    folder = Path(root) / TOKENIZER_SUBFOLDER
    if not _has_tokenizer_files(folder):
        raise UserError(f"The download of {TOKENIZER_REPO} from {endpoint} has no {TOKENIZER_SUBFOLDER}/ folder with"
                        f" {', '.join(TOKENIZER_FILES)}: {_pass_tokenizer_dir()}.")
    return folder


def find_tokenizer_dir(tokenizer_cache_dir: str | None = None, text_encoder_path: str | None = None,
                       local_files_only: bool = False) -> Path:
    """The folder the Qwen3.5 tokenizer is read from, in this order (the first that has the files):

    1. `tokenizer_cache_dir` holding the tokenizer files (or a `tokenizer/` folder in it);
    2. the `tokenizer/` folder of the snapshot the text encoder comes from (the official layout): a snapshot's own
       tokenizer is always used before any cache or download;
    3. a Hugging Face cache that holds MOSS-Image-Base's tokenizer: `tokenizer_cache_dir`, else the default cache;
    4. a download from the Hub (`OpenMOSS-Team/MOSS-Image-Base`, subfolder `tokenizer`) into that cache
       (`download_tokenizer`), unless `local_files_only` or HF_HUB_OFFLINE.
    Raises one UserError that says to pass --tokenizer_cache_dir when none has it."""
    local = _local_tokenizer_dir(tokenizer_cache_dir, text_encoder_path) or _cached_tokenizer_dir(tokenizer_cache_dir)
    if local is not None:
        return local
    if local_files_only:
        raise UserError("The Qwen3.5 tokenizer is not in local files (--tokenizer_cache_dir, the snapshot's"
                        f" {TOKENIZER_SUBFOLDER}/ folder, the Hugging Face cache): {_pass_tokenizer_dir()}.")
    return download_tokenizer(tokenizer_cache_dir)


def load_tokenizer(
    tokenizer_cache_dir: str | None = None, text_encoder_path: str | None = None, local_files_only: bool = False
) -> Any:
    """The Qwen3.5 tokenizer from the folder `find_tokenizer_dir` gives (a download is the one network access of
    a run, and HF_HUB_OFFLINE=1 or `local_files_only` turns it off)."""
    from transformers import AutoTokenizer  # heavy import (seconds): only a load needs it

    folder = find_tokenizer_dir(tokenizer_cache_dir, text_encoder_path, local_files_only)
    logger.info("tokenizer: %s", folder)
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise UserError(f"Could not load the Qwen3.5 tokenizer from {folder} ({type(e).__name__}):"
                        f" {_pass_tokenizer_dir()}.") from e


# -------------------------------------------------------------------------------------------------- tokens
def check_max_token_length(max_length: int | None) -> int:
    """Validate --moss_max_token_length (default and maximum 4096)."""
    if max_length is None:
        return DEFAULT_MAX_TOKEN_LENGTH
    if not 8 <= max_length <= MAX_TOKEN_LENGTH:
        raise UserError(
            f"--moss_max_token_length {max_length} is out of range: use 8 to {MAX_TOKEN_LENGTH} (the official limit)."
        )
    return max_length


def tokenize(tokenizer: Any, caption: str, max_length: int = DEFAULT_MAX_TOKEN_LENGTH) -> torch.Tensor:
    """Token ids [T] of the templated caption, truncated to `max_length` with a warning."""
    ids = tokenizer(format_prompt(caption), add_special_tokens=False)["input_ids"]
    if len(ids) > max_length:
        logger.warning(
            "caption of %d tokens (with the chat template) truncated to --moss_max_token_length %d: '%s...'",
            len(ids), max_length, caption[:60],
        )
        ids = ids[:max_length]
    return torch.tensor(ids, dtype=torch.long)
