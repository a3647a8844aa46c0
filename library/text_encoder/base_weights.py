"""The identity of the text-encoder part of `--base_weights`, recorded in the text-encoder output caches.

`--base_weights` merges LoRA files into the base weights while they are read (`library.lora.merge`). The text-encoder
modules of those files (`lora_te_*` keys, `text_encoder.*` in the PEFT naming) change the encoder's outputs, so a
`*_moss_te.npz` made with other ones, other multipliers or none is stale. The identity is computed from the options
and the files alone, before the text encoder is read (the caches are checked first; the encoder may never be read).

- It is "" when no file contributes to the text encoder: no `--base_weights`, no text-encoder key in any of them (told
  from the safetensors headers alone, no tensor is read), or every file that has some is merged with multiplier 0
  (the merge skips those). The encoder is then the plain one, and cache files of older versions, which have no
  record of base weights, stay valid.
- Otherwise it is 16 hex digits of a SHA-256 over, for each contributing file in the order given, its multiplier and
  its text-encoder tensors: each key (sorted) with its dtype, shape and raw bytes, read with the header's offsets.
  These are exactly the inputs of the text-encoder merge: a file whose DiT part or metadata changes keeps its
  identity, a renamed copy of the same file has the same one, and any change to what is merged into the encoder
  changes it. Hashing the whole file would be as cheap but would re-make the caches for DiT-only edits.
  Only the text-encoder tensors of files that have some are read (a few MB to some hundred MB for a LoRA).
- The order of the files is kept: the merge adds the files' products one after the other in fp32, a sum in exact
  arithmetic whose last bits still depend on the order. Giving the same files in another order re-makes the caches
  (never a reuse of outputs of a different sum), which keeps the rule simple.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence

from library.errors import UserError
from library.lora.conventions import TEXT_ENCODER_KEY_PREFIXES

logger = logging.getLogger(__name__)

TE_KEY_PREFIXES = TEXT_ENCODER_KEY_PREFIXES  # sd-scripts and PEFT naming of a text-encoder LoRA module
_CHUNK = 1 << 24


def _text_encoder_keys(path: str | os.PathLike) -> list[str]:
    from library.files.safetensors_io import check_safetensors_path, read_safetensors_header

    infos, _, _ = read_safetensors_header(check_safetensors_path(path, "--base_weights file"))
    return sorted(k for k in infos if k.startswith(TE_KEY_PREFIXES))


def _text_encoder_digest(path: str | os.PathLike, keys: Sequence[str]) -> str:
    """SHA-256 of the named tensors of a safetensors file: name, dtype, shape and bytes of each, in the given order."""
    from library.files.safetensors_io import read_safetensors_header

    infos, _, data_start = read_safetensors_header(path)
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for key in keys:
                info = infos[key]
                h.update(f"{key}\0{info.dtype}\0{list(info.shape)}\0{info.end - info.start}\0".encode())
                f.seek(data_start + info.start)
                left = info.end - info.start
                while left > 0:
                    chunk = f.read(min(left, _CHUNK))
                    if not chunk:
                        raise OSError(f"the file ends inside the tensor '{key}'")
                    h.update(chunk)
                    left -= len(chunk)
    except OSError as e:
        raise UserError(f"The --base_weights file '{path}' cannot be read ({e}): re-download or re-create it.") from e
    return h.hexdigest()


def text_encoder_base_weights_identity(
    paths: Sequence[str | os.PathLike] | None, multipliers: Sequence[float] | None = None
) -> str:
    """The identity of what `--base_weights` `paths` with `--base_weights_multiplier` `multipliers` (None: 1.0 each)
    merge into the text encoder: "" when nothing, else 16 hex digits (see the module docstring)."""
    paths = list(paths or [])
    multipliers = list(multipliers or [])
    if multipliers and len(multipliers) != len(paths):
        raise UserError(f"{len(paths)} --base_weights files but {len(multipliers)} multipliers: give one"
                        " --base_weights_multiplier per file (or none for 1.0 each).")
    values = [float(m) for m in multipliers] or [1.0] * len(paths)
    parts: list[str] = []
    for path, multiplier in zip(paths, values):
        keys = _text_encoder_keys(path)
        if keys and multiplier != 0:
            parts.append(f"{multiplier!r}:{_text_encoder_digest(path, keys)}")
    if not parts:
        return ""
    identity = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    logger.info("--base_weights change the text encoder (%d of %d files): its output caches are tied to them (%s)",
                len(parts), len(paths), identity)
    return identity
