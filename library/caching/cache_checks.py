"""The values and shapes of cache arrays: what makes a cache file damaged beyond its entry names.

A latent cache entry must be a floating-point [32, H/8, W/8] array of the image's bucket, with finite values; a
text-encoder entry a floating-point [tokens, width] array with a [tokens] mask, every embedding of a file of one width,
with finite values. The strategies call these where a file is checked (a damaged file is then re-made by the caching
drivers), where an entry is read (a sentence naming the file, for `--skip_cache_check` runs), and before anything
freshly encoded is stored (a VAE or text encoder that produced NaN is an error, never a cache file).
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from library.errors import UserError

LATENT_CHANNELS = 32  # the FLUX.2 VAE's latent channels


def latents_problem(arrays: Mapping[str, np.ndarray], latent_hw: tuple[int, int]) -> str | None:
    """Why latent arrays cannot be the latents of a bucket with latent size `latent_hw` (None when they can)."""
    expected = (LATENT_CHANNELS, *latent_hw)
    for name, a in arrays.items():
        if not np.issubdtype(a.dtype, np.floating):
            return f"'{name}' is {a.dtype}, not floating point"
        if tuple(a.shape) != expected:
            return f"'{name}' has shape {list(a.shape)} instead of {list(expected)}"
        if not np.isfinite(a).all():
            return f"'{name}' holds NaN or infinite values"
    return None


def text_outputs_problem(name: str, embeds: np.ndarray, mask: np.ndarray) -> str | None:
    """Why an embedding and its mask cannot be text-encoder outputs (None when they can)."""
    if not np.issubdtype(embeds.dtype, np.floating):
        return f"'{name}' is {embeds.dtype}, not floating point"
    if embeds.ndim != 2 or mask.ndim != 1 or mask.shape[0] != embeds.shape[0]:
        return f"'{name}' has shape {list(embeds.shape)} with a mask of shape {list(mask.shape)}"
    if not np.isfinite(embeds).all():
        return f"'{name}' holds NaN or infinite values"
    return None


def npy_shapes(path: str | os.PathLike, names: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """The shapes of arrays of an npz, read from their headers only (no values); names not in the file are left
    out. Raises OSError / ValueError / zipfile.BadZipFile for a damaged file."""
    shapes: dict[str, tuple[int, ...]] = {}
    with zipfile.ZipFile(path) as archive:
        members = set(archive.namelist())
        for name in names:
            if f"{name}.npy" not in members:
                continue
            with archive.open(f"{name}.npy") as f:
                version = np.lib.format.read_magic(f)
                if version == (1, 0):
                    shape, _, _ = np.lib.format.read_array_header_1_0(f)
                else:
                    shape, _, _ = np.lib.format.read_array_header_2_0(f)
            shapes[name] = tuple(shape)
    return shapes


def text_cache_shapes_problem(path: str | os.PathLike, names: Sequence[str]) -> str | None:
    """Why the embeddings of a text-encoder cache file cannot be used, from the array headers only: each embedding
    [tokens, width] with a [tokens] mask, all of one width (None when they are fine)."""
    pairs = [("uncond_embeds", "uncond_mask"), ("prompt_embeds", "attn_mask")]
    pairs += [(n, "attn_mask_" + n[len("prompt_embeds_"):]) for n in names if n.startswith("prompt_embeds_")]
    pairs = [(e, m) for e, m in pairs if e in names]
    shapes = npy_shapes(path, [n for pair in pairs for n in pair])
    widths = set()
    for embeds, mask in pairs:
        e, m = shapes.get(embeds), shapes.get(mask)
        if e is None or m is None or len(e) != 2 or len(m) != 1 or m[0] != e[0]:
            return f"'{embeds}' has shape {list(e or ())} with a mask of shape {list(m or ())}"
        widths.add(e[1])
    if len(widths) > 1:
        return f"its embeddings have different widths {sorted(widths)}"
    return None


def check_encoded_finite(values: torch.Tensor, what: str, source: str) -> None:
    """Refuse to cache the outputs of a model that produced NaN or infinity (`what`: the image or caption)."""
    if values.numel() and not bool(torch.isfinite(values).all()):
        raise UserError(f"The {source} produced NaN or infinite values for {what}, so nothing was cached for it: check"
                        f" that file and the {source} weights (--mixed_precision fp16 can overflow; use bf16).")
