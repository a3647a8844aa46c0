"""MOSS-Image caching strategies: FLUX.2 latents and Qwen3.5 outputs, in memory or in npz files beside the images.

Latent cache `<stem>_<WWWW>x<HHHH>_moss.npz` (original image size in the name, as sd-scripts): the RAW VAE output
(32 channels, 1/8 resolution; patchify + BatchNorm normalisation happen at training time) for each bucket resolution
the image was cached at, under keys suffixed `_<h>x<w>` (latent size): `latents`, `latents_flipped`, `alpha_mask`,
`original_size`, `crop_ltrb`.

Text-encoder cache `<stem>_moss_te.npz`: `num_candidates`, and for each caption candidate k `prompt_embeds_{k}`,
`attn_mask_{k}`, `caption_{k}` (the text after prefix/suffix), plus the unconditional (empty-prompt) `uncond_embeds`,
`uncond_mask`, the prompt template id, the token limit, the encoder's cache variant (`encoder`, with its compute dtype
in `encoder_dtype`; `library.text_encoder.variant`) and `te_base_weights` (the identity of what --base_weights merge
into the text encoder, `library.text_encoder.base_weights`; "" for none). A file is re-made when its candidate count,
caption texts, template, token limit, variant or base-weights identity differ from the current ones (unless
--skip_cache_check); a file without `te_base_weights` (older versions) counts as made without base weights.
Files of earlier versions have no `encoder_dtype`: they were made in bf16 or (the cache tool on the CPU) in fp32, and
the values tell which (bf16 outputs widened to fp32 have 16 zero low bits; fp32 outputs practically never all do), so
their variant is known without a record and only those whose numbers match the current encoder's stay valid.
Files of the older single-candidate format (`prompt_embeds`, `attn_mask`) stay valid for images with one candidate.
Caption variants (`caption_cache_variants` N > 1, `library.datasets.caption_variants`): the file holds N texts per
candidate k, variant v as `prompt_embeds_{k}_{v}`, `attn_mask_{k}_{v}`, `caption_{k}_{v}`, with `num_candidates`,
`num_variants` (N) and `variant_recipe` (the JSON of the `VariantRecipe`: N, the transform settings, the seed and the
drawing method); a recipe that differs from the current one makes the file stale ("variant recipe changed (...)"),
and so does a recipe where none is expected or the reverse. Files without variants are exactly the format above.
Every cache file is written to a temp file and renamed: never half-written. Checks and per-step reads open only the
entries they need (an npz member is read lazily), and a damaged file is re-made by the caching drivers.

Drivers (`cache_latents`, `cache_text_encoder_outputs`, used by the trainer and by tools/cache_*.py): with several
processes, the run's cache files (all of them, valid or not) are sorted and dealt out with `my_share`, so every
process agrees on who writes what whatever the others have written already, and no file has two writers. The TE
driver checks its share before it encodes anything: with every file valid it never calls the encode function, so a
`LazyEncoder` never reads the text encoder (dropout reads the unconditional embedding from the files).
"""

from __future__ import annotations

import logging
import os
import re
import time
import zipfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from library.caching import cache_checks
from library.datasets import prepare_image_for_cache
from library.datasets.caption_variants import CacheCaptions, VariantRecipe
from library.datasets.image_info import ImageInfo
from library.errors import UserError
from library.files.safetensors_io import remove_stale_temp_files, write_atomic
from library.runtime.compile import exact_fp32_matmul
from library.text_encoder.encoding import EncodeFn, LazyEncoder, TextOutputs
from library.text_encoder.qwen35 import PROMPT_TEMPLATE_ID
from library.text_encoder.variant import BF16, cache_variant, variant_dtype

logger = logging.getLogger(__name__)

LATENTS_SUFFIX = "_moss.npz"
TE_SUFFIX = "_moss_te.npz"
VAE_SCALE = 8
_SIZE_RE = re.compile(r"_(\d{4,})x(\d{4,})" + re.escape(LATENTS_SUFFIX) + "$")
_CANDIDATE_RE = re.compile(r"prompt_embeds_\d+")
_VARIANT_RE = re.compile(r"prompt_embeds_(\d+)_(\d+)")
CACHE_MISSING = "missing"  # the reasons `*_cache_problem` give for a file that is not there or cannot be read
CACHE_UNREADABLE = "unreadable (a damaged file)"
CACHE_DAMAGED = "damaged"  # the start of the reason for arrays of the wrong shape or with NaN / infinite values
VARIANT_RECIPE_CHANGED = "variant recipe changed"  # the start of the reason for caption variants drawn otherwise
_DTYPE_PROBE_VALUES = 4096  # values read to tell a bf16-made file of an earlier version from an fp32-made one


# ------------------------------------------------------------------------------------------------ npz files
# what a damaged npz raises: a truncated zip, a bad member, garbage instead of a zip
_NPZ_ERRORS = (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error)


def save_npz_atomic(path: str | os.PathLike, arrays: dict[str, np.ndarray]) -> None:
    """Write an npz atomically (never half-written; the usual file permissions, so caches can be shared)."""

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:  # a file object: np.savez would append ".npz" to a name
            np.savez(f, **arrays)

    write_atomic(path, write, suffix=".tmp.npz")


def read_npz(
    path: str | os.PathLike, keys: Callable[[list[str]], Sequence[str]] | None = None
) -> dict[str, np.ndarray]:
    """The arrays of an npz, or only those named by `keys(names in the file)`: members are read lazily, so a check
    of a few small keys does not read the embeddings. A damaged file is a UserError naming it."""
    try:
        with np.load(path, allow_pickle=False) as data:
            wanted = data.files if keys is None else keys(list(data.files))
            return {k: data[k] for k in wanted}
    except _NPZ_ERRORS as e:
        raise UserError(f"The cache file '{path}' cannot be read ({e}): delete it to re-create it.") from e


def load_npz(path: str | os.PathLike) -> dict[str, np.ndarray]:
    return read_npz(path)


def npz_names(path: str | os.PathLike) -> list[str] | None:
    """The array names of an npz (reads only the zip directory), or None when the file is damaged."""
    try:
        with np.load(path, allow_pickle=False) as data:
            return list(data.files)
    except _NPZ_ERRORS:
        return None


def _size_key(latent_hw: tuple[int, int]) -> str:
    return f"{latent_hw[0]}x{latent_hw[1]}"


# ------------------------------------------------------------------------------------------------- latents
class MossImageLatentsCachingStrategy:
    """Raw FLUX.2 latents [32, H/8, W/8] per image and bucket, in memory or in `<stem>_<WWWW>x<HHHH>_moss.npz`."""

    cache_suffix = LATENTS_SUFFIX

    def __init__(self, cache_to_disk: bool, batch_size: int = 1, skip_disk_cache_validity_check: bool = False):
        self.cache_to_disk = cache_to_disk
        self.batch_size = max(1, int(batch_size or 1))
        self.skip_disk_cache_validity_check = skip_disk_cache_validity_check

    # names ------------------------------------------------------------------------------------------------
    def get_latents_npz_path(self, absolute_path: str, image_size: tuple[int, int]) -> str:
        stem = os.path.splitext(absolute_path)[0]
        return f"{stem}_{image_size[0]:04d}x{image_size[1]:04d}{LATENTS_SUFFIX}"

    @staticmethod
    def get_image_size_from_disk_cache_path(npz_path: str) -> tuple[int, int] | None:
        m = _SIZE_RE.search(os.path.basename(npz_path))
        return (int(m.group(1)), int(m.group(2))) if m else None

    @staticmethod
    def latent_hw(bucket_reso: tuple[int, int]) -> tuple[int, int]:
        return bucket_reso[1] // VAE_SCALE, bucket_reso[0] // VAE_SCALE

    # validity ---------------------------------------------------------------------------------------------
    def is_disk_cached_latents_expected(
        self, bucket_reso: tuple[int, int], npz_path: str, flip_aug: bool, alpha_mask: bool
    ) -> bool:
        if not os.path.exists(npz_path):
            return False
        if self.skip_disk_cache_validity_check:
            return True
        problem = self.latents_cache_problem(bucket_reso, npz_path, flip_aug, alpha_mask)
        if problem == CACHE_UNREADABLE:
            logger.warning("unreadable latent cache %s: it will be re-created", npz_path)
        elif problem is not None and problem.startswith(CACHE_DAMAGED):
            logger.warning("latent cache %s is %s: it will be re-created", npz_path, problem)
        return problem is None

    def latents_cache_problem(
        self, bucket_reso: tuple[int, int], npz_path: str, flip_aug: bool, alpha_mask: bool
    ) -> str | None:
        """Why a latent cache file is not valid for an image at `bucket_reso` (None when it is); ignores
        --skip_cache_check and reads the zip directory and the latent arrays (their shape and values)."""
        if not os.path.exists(npz_path):
            return CACHE_MISSING
        key = _size_key(self.latent_hw(bucket_reso))
        found = npz_names(npz_path)
        if found is None:
            return CACHE_UNREADABLE
        needed = [f"latents_{key}"] + ([f"latents_flipped_{key}"] if flip_aug else [])
        needed += [f"alpha_mask_{key}"] if alpha_mask else []
        absent = [n for n in needed if n not in found]
        if absent:
            return f"no {', '.join(absent)} (bucket {bucket_reso[0]}x{bucket_reso[1]})"
        return self._latent_values_problem(npz_path, [n for n in needed if n.startswith("latents")], bucket_reso)

    def _latent_values_problem(self, npz_path: str, names: list[str], bucket_reso: tuple[int, int]) -> str | None:
        """Latents that are not the bucket's [32, H/8, W/8] floating-point array or are not finite make the file
        damaged (`CACHE_DAMAGED`); it is re-made."""
        try:
            arrays = read_npz(npz_path, lambda found: [n for n in names if n in found])
        except UserError:
            return CACHE_UNREADABLE
        problem = cache_checks.latents_problem(arrays, self.latent_hw(bucket_reso))
        return None if problem is None else f"{CACHE_DAMAGED} ({problem})"

    # reading ----------------------------------------------------------------------------------------------
    def get_latents(self, info: ImageInfo, flipped: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        if info.latents is not None:
            lat = info.latents_flipped if flipped else info.latents
            if lat is None:
                raise UserError(
                    f"No flipped latents cached for '{info.absolute_path}': re-cache with flip_aug enabled."
                )
            return lat, info.alpha_mask
        assert info.latents_npz is not None and info.bucket_reso is not None
        key = _size_key(self.latent_hw(info.bucket_reso))
        name = f"latents_flipped_{key}" if flipped else f"latents_{key}"
        data = read_npz(info.latents_npz, lambda names: [n for n in (name, f"alpha_mask_{key}") if n in names])
        if name not in data:
            raise UserError(
                f"The latent cache '{info.latents_npz}' has no '{name}' entry: delete it (or drop --skip_cache_check)"
                " to re-create it."
            )
        problem = cache_checks.latents_problem({name: data[name]}, self.latent_hw(info.bucket_reso))
        if problem:
            raise UserError(f"The latent cache '{info.latents_npz}' is damaged ({problem}): delete it (or drop"
                            " --skip_cache_check) to re-create it.")
        mask = data.get(f"alpha_mask_{key}")
        return torch.from_numpy(data[name]), None if mask is None else torch.from_numpy(mask)

    # writing ----------------------------------------------------------------------------------------------
    def store(
        self,
        info: ImageInfo,
        latents: torch.Tensor,
        latents_flipped: torch.Tensor | None,
        alpha_mask: torch.Tensor | None,
        crop_ltrb: tuple[int, int, int, int],
    ) -> None:
        """Keep one image's latents in memory or add them to its npz (other bucket sizes in the file are kept)."""
        latents = latents.float().cpu()
        latents_flipped = None if latents_flipped is None else latents_flipped.float().cpu()
        for values in (latents, latents_flipped):
            if values is not None:
                cache_checks.check_encoded_finite(values, f"the image '{info.absolute_path}'", "VAE")
        if not self.cache_to_disk:
            info.latents, info.latents_flipped, info.alpha_mask = latents, latents_flipped, alpha_mask
            return
        assert info.latents_npz is not None and info.image_size is not None
        key = _size_key((latents.shape[-2], latents.shape[-1]))
        arrays = self._existing_entries(info.latents_npz)
        arrays[f"latents_{key}"] = latents.numpy()
        arrays[f"original_size_{key}"] = np.array(info.image_size, dtype=np.int64)
        arrays[f"crop_ltrb_{key}"] = np.array(crop_ltrb, dtype=np.int64)
        if latents_flipped is not None:
            arrays[f"latents_flipped_{key}"] = latents_flipped.numpy()
        if alpha_mask is not None:
            arrays[f"alpha_mask_{key}"] = alpha_mask.float().cpu().numpy()
        save_npz_atomic(info.latents_npz, arrays)

    @staticmethod
    def _existing_entries(npz_path: str) -> dict[str, np.ndarray]:
        """The arrays of an existing cache file (other bucket sizes are kept); a damaged file is replaced."""
        if not os.path.exists(npz_path):
            return {}
        try:
            return read_npz(npz_path)
        except UserError:
            logger.warning("unreadable latent cache %s: it is replaced", npz_path)
            return {}


# ------------------------------------------------------------------------------------- text-encoder outputs
class MossImageTextEncoderOutputsCachingStrategy:
    """Qwen3.5 outputs of every caption candidate plus the unconditional embedding, per image."""

    cache_suffix = TE_SUFFIX

    def __init__(
        self,
        cache_to_disk: bool,
        batch_size: int | None = None,
        skip_disk_cache_validity_check: bool = False,
        is_partial: bool = False,
        max_token_length: int | None = None,
        encoder_variant: str | None = None,
        te_base_weights: str = "",
    ):
        self.cache_to_disk = cache_to_disk
        self.batch_size = max(1, int(batch_size or 1))
        self.skip_disk_cache_validity_check = skip_disk_cache_validity_check
        self.is_partial = is_partial
        self.max_token_length = max_token_length  # recorded in the files: a different limit re-makes them
        self.encoder_variant = encoder_variant  # "none" / "convrot_int8" / "bnb_int8" / "bnb_nf4", recorded too
        self.te_base_weights = te_base_weights  # identity of the --base_weights text-encoder part, recorded too
        self.uncond: TextOutputs | None = None  # the empty prompt's outputs, shared by every image

    def get_outputs_npz_path(self, absolute_path: str) -> str:
        return os.path.splitext(absolute_path)[0] + TE_SUFFIX

    # validity ---------------------------------------------------------------------------------------------
    def is_disk_cached_outputs_expected(self, npz_path: str, captions: Sequence[str],
                                        recipe: VariantRecipe | None = None) -> bool:
        """True when the file exists and (unless the check is skipped) holds exactly these caption texts (one per
        candidate, or with `recipe` the variants of each). Only the small entries (counts, template, caption texts,
        recipe) are read, never the embeddings."""
        return self.disk_outputs_problem(npz_path, captions, recipe) is None

    def disk_outputs_problem(self, npz_path: str, captions: Sequence[str],
                             recipe: VariantRecipe | None = None) -> str | None:
        """Why the caching driver must (re-)make a file (None when it is valid or, with --skip_cache_check, exists);
        warns about damaged files."""
        if not os.path.exists(npz_path):
            return CACHE_MISSING
        if self.skip_disk_cache_validity_check:
            return None
        problem = self.outputs_cache_problem(npz_path, captions, recipe)
        if problem == CACHE_UNREADABLE:
            logger.warning("unreadable text-encoder cache %s: it will be re-created", npz_path)
        elif problem is not None and problem.startswith(CACHE_DAMAGED):
            logger.warning("text-encoder cache %s is %s: it will be re-created", npz_path, problem)
        return problem

    def outputs_cache_problem(self, npz_path: str, captions: Sequence[str],
                              recipe: VariantRecipe | None = None) -> str | None:
        """Why a text-encoder cache file does not hold these caption texts as this strategy would make them (None
        when it does): one text per candidate, or with `recipe` candidate k's variant v at k * recipe.count + v.
        Ignores --skip_cache_check and reads only the small entries and the array headers."""
        if not os.path.exists(npz_path):
            return CACHE_MISSING
        count = 1 if recipe is None else recipe.count
        suffixes = _entry_suffixes(len(captions), recipe)
        small = {"num_candidates", "num_variants", "variant_recipe", "template", "max_token_length", "encoder",
                 "encoder_dtype", "te_base_weights"}
        small |= {f"caption_{x}" for x in suffixes}
        names: list[str] = []

        def select(found: list[str]) -> list[str]:
            names.extend(found)
            return [n for n in found if n in small]

        try:
            data = read_npz(npz_path, select)
        except UserError:
            return CACHE_UNREADABLE
        if str(data.get("te_base_weights", "")) != self.te_base_weights:
            return "made with other --base_weights text-encoder LoRAs"  # no key: made without any
        recipe_problem = _recipe_problem(data, recipe)
        if recipe_problem is not None:
            return recipe_problem
        if "num_candidates" not in data:  # older single-candidate format (never with variants: checked above)
            if len(captions) != 1:
                return f"older single-caption format, but the image has {len(captions)} caption candidates"
            if "prompt_embeds" not in names or "attn_mask" not in names:
                return "no prompt_embeds entry"
            return self._shapes_problem(npz_path, names) or self._variant_problem(npz_path, data, names)
        if str(data.get("template", "")) != PROMPT_TEMPLATE_ID:
            return f"prompt template '{data.get('template', '')}' (now '{PROMPT_TEMPLATE_ID}')"
        if int(data["num_candidates"]) != len(captions) // count:
            return f"caption candidates: {int(data['num_candidates'])} in the file, {len(captions) // count} now"
        if self.max_token_length is not None and "max_token_length" in data \
                and int(data["max_token_length"]) != self.max_token_length:
            return f"--moss_max_token_length {int(data['max_token_length'])} (now {self.max_token_length})"
        arrays = ["uncond_embeds", "uncond_mask"]
        arrays += [f"{kind}_{x}" for x in suffixes for kind in ("prompt_embeds", "attn_mask")]
        absent = [n for n in arrays if n not in names]
        if absent:
            return f"no {absent[0]} entry"
        for x, caption in zip(suffixes, captions):
            if f"caption_{x}" not in data or str(data[f"caption_{x}"]) != caption:
                return f"caption {x} changed (now '{caption[:60]}{'...' if len(caption) > 60 else ''}')"
        # the headers, then (last: a file of an earlier version reads a few values) the variant
        return self._shapes_problem(npz_path, names) or self._variant_problem(npz_path, data, names)

    def _variant_problem(self, npz_path: str, data: dict[str, np.ndarray], names: list[str]) -> str | None:
        """Why the file was not made by an encoder of the current cache variant (None when it was, or when the
        current variant is unknown)."""
        if self.encoder_variant is None:
            return None
        if "encoder_dtype" in data:
            made = str(data["encoder"])
        elif "encoder" in data:  # an earlier version: bf16 or fp32, as its values tell
            made = cache_variant(str(data["encoder"]), _dtype_made_in(npz_path, names))
        else:  # older still: no record of the weights either, only the dtype can be told
            dtype = _dtype_made_in(npz_path, names)
            if dtype == variant_dtype(self.encoder_variant):
                return None
            made = f"made in {dtype}"
        if made != self.encoder_variant:
            return f"text encoder variant {made} (now {self.encoder_variant})"  # another quantisation or dtype
        return None

    @staticmethod
    def _shapes_problem(npz_path: str, names: list[str]) -> str | None:
        """Embeddings and masks that do not fit together (from the array headers only) make the file damaged
        (`CACHE_DAMAGED`); it is re-made."""
        try:
            problem = cache_checks.text_cache_shapes_problem(npz_path, names)
        except _NPZ_ERRORS + (KeyError,):
            return CACHE_UNREADABLE
        return None if problem is None else f"{CACHE_DAMAGED} ({problem})"

    # reading ----------------------------------------------------------------------------------------------
    def get_outputs(self, info: ImageInfo, candidate_index: int, dropped: bool, variant_index: int = 0) -> TextOutputs:
        """Candidate `candidate_index` (modulo the number cached; its variant `variant_index`, modulo the number
        cached, when the cache holds variants), or the unconditional outputs when `dropped` (from the file, or the
        strategy's own empty-prompt outputs for files of the older format)."""
        if info.text_encoder_outputs is not None:
            outputs, uncond, count = info.text_encoder_outputs
            if dropped:
                return self._uncond_or_error(uncond, info)
            k = candidate_index % (len(outputs) // count)
            return outputs[k * count + variant_index % count]
        assert info.te_outputs_npz is not None
        read = self._read_file(info.te_outputs_npz, None if dropped else candidate_index, variant_index)
        return self._uncond_or_error(read, info) if dropped else read

    def _uncond_or_error(self, uncond: TextOutputs | None, info: ImageInfo) -> TextOutputs:
        uncond = uncond if uncond is not None else self.uncond
        if uncond is None:
            raise UserError(
                f"The text-encoder cache '{info.te_outputs_npz}' has no unconditional embedding (older format),"
                " so caption dropout cannot use it: delete the cache files to re-create them."
            )
        return uncond

    @staticmethod
    def _read_file(path: str, candidate_index: int | None, variant_index: int = 0) -> TextOutputs | None:
        """One candidate's outputs (index modulo the count in the file; with variants, its variant modulo theirs),
        or with None the unconditional outputs (None for a file of the older format, which has none). Reads only
        the two entries it returns."""
        keys: list[str] = []

        def select(names: list[str]) -> list[str]:
            variants = [m for m in map(_VARIANT_RE.fullmatch, names) if m]
            if candidate_index is None:
                keys.extend(["uncond_embeds", "uncond_mask"])
            elif "num_candidates" not in names:  # older single-candidate format
                keys.extend(["prompt_embeds", "attn_mask"])
            elif variants:
                k = candidate_index % (1 + max(int(m[1]) for m in variants))
                v = variant_index % (1 + max(int(m[2]) for m in variants))
                keys.extend([f"prompt_embeds_{k}_{v}", f"attn_mask_{k}_{v}"])
            else:
                count = sum(1 for n in names if _CANDIDATE_RE.fullmatch(n))
                k = candidate_index % max(1, count)
                keys.extend([f"prompt_embeds_{k}", f"attn_mask_{k}"])
            return [n for n in keys if n in names]

        data = read_npz(path, select)
        if candidate_index is None and not data:
            return None
        missing = [n for n in keys if n not in data]
        if missing:
            raise UserError(f"The text-encoder cache '{path}' has no '{missing[0]}' entry: delete it (or drop"
                            " --skip_cache_check) to re-create it.")
        problem = cache_checks.text_outputs_problem(keys[0], data[keys[0]], data[keys[1]])
        if problem:
            raise UserError(f"The text-encoder cache '{path}' is damaged ({problem}): delete it (or drop"
                            " --skip_cache_check) to re-create it.")
        return torch.from_numpy(data[keys[0]]), torch.from_numpy(data[keys[1]]).bool()

    # writing ----------------------------------------------------------------------------------------------
    def store(self, info: ImageInfo, captions: Sequence[str], outputs: Sequence[TextOutputs],
              recipe: VariantRecipe | None = None) -> None:
        """Keep one image's outputs in memory or write its file: one text per candidate, or with `recipe`
        candidate k's variant v at k * recipe.count + v (see the module docstring for the entries)."""
        assert self.uncond is not None, "encode the empty prompt (set_uncond) before caching"
        count = 1 if recipe is None else recipe.count
        cands = [(e.float().cpu(), m.bool().cpu()) for e, m in outputs]
        for caption, (e, _) in zip(captions, cands):
            what = f"the caption '{caption[:60]}' of '{info.absolute_path}'"
            cache_checks.check_encoded_finite(e, what, "text encoder")
        if not self.cache_to_disk:
            info.text_encoder_outputs = (cands, self.uncond, count)
            return
        assert info.te_outputs_npz is not None
        arrays: dict[str, np.ndarray] = {
            "num_candidates": np.array(len(cands) // count, dtype=np.int64),
            "template": np.array(PROMPT_TEMPLATE_ID),
            "max_token_length": np.array(self.max_token_length or -1, dtype=np.int64),
            "encoder": np.array(self.encoder_variant or "unknown"),
            **({} if self.encoder_variant is None else {"encoder_dtype": np.array(variant_dtype(self.encoder_variant))}),
            "te_base_weights": np.array(self.te_base_weights),
            "uncond_embeds": self.uncond[0].numpy(),
            "uncond_mask": self.uncond[1].numpy(),
        }
        if recipe is not None:
            arrays["num_variants"] = np.array(count, dtype=np.int64)
            arrays["variant_recipe"] = np.array(recipe.to_json())
        for x, caption, (e, m) in zip(_entry_suffixes(len(cands), recipe), captions, cands):
            arrays[f"prompt_embeds_{x}"] = e.numpy()
            arrays[f"attn_mask_{x}"] = m.numpy()
            arrays[f"caption_{x}"] = np.array(caption)
        save_npz_atomic(info.te_outputs_npz, arrays)

    def set_uncond(self, outputs: TextOutputs) -> None:
        self.uncond = (outputs[0].float().cpu(), outputs[1].bool().cpu())


def _entry_suffixes(texts: int, recipe: VariantRecipe | None) -> list[str]:
    """The entry name suffixes of a file's texts: "k" per candidate, or "k_v" per candidate and variant."""
    if recipe is None:
        return [str(k) for k in range(texts)]
    return [f"{k}_{v}" for k in range(texts // recipe.count) for v in range(recipe.count)]


def _recipe_problem(data: dict[str, np.ndarray], recipe: VariantRecipe | None) -> str | None:
    """Why the file's caption variants were not drawn with `recipe` (None when they were, or neither has any)."""
    recorded = str(data["variant_recipe"]) if "variant_recipe" in data else None
    if recipe is None and recorded is None:
        return None
    if recipe is None:
        held = int(data["num_variants"]) if "num_variants" in data else "several"
        return f"{VARIANT_RECIPE_CHANGED} (the file holds {held} variants per caption, now one text per caption)"
    if recorded is None:
        return f"{VARIANT_RECIPE_CHANGED} (the file holds one text per caption, now {recipe.count} variants)"
    change = recipe.change_from(recorded)
    return None if change is None else f"{VARIANT_RECIPE_CHANGED} ({change})"


def _first_values(path: str, name: str, count: int) -> np.ndarray:
    """The first `count` values of the array `name` of an npz, reading only those (np.savez members are stored)."""
    with zipfile.ZipFile(path) as archive, archive.open(f"{name}.npy") as f:
        version = np.lib.format.read_magic(f)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read_header(f)
        n = min(count, int(np.prod(shape)))
        return np.frombuffer(f.read(n * dtype.itemsize), dtype=dtype, count=n)


def _dtype_made_in(path: str, names: list[str]) -> str:
    """bf16 or fp32: the dtype a text-encoder cache file of an earlier version was made in, from its embeddings
    (stored as fp32; those of a bf16 encoder are bf16 values, whose 16 low bits are zero)."""
    for member in (n for n in ("uncond_embeds", "prompt_embeds_0", "prompt_embeds") if n in names):
        try:
            values = _first_values(path, member, _DTYPE_PROBE_VALUES)
        except _NPZ_ERRORS + (KeyError,):
            return "unreadable"  # matches no variant: the file is re-made
        if values.dtype != np.float32 or np.any(values.view(np.uint32) & 0xFFFF):
            return "fp32"
    return BF16


# -------------------------------------------------------------------------------------- caching drivers
def my_share(items: Sequence[Any], process_index: int, num_processes: int) -> list[Any]:
    """The items process `process_index` caches in a multi-process run (every num_processes-th)."""
    return [it for i, it in enumerate(items) if i % num_processes == process_index]


def batched(items: Sequence[Any], size: int) -> list[list[Any]]:
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


def _progress(items: Sequence[Any], desc: str, enabled: bool) -> Any:
    return tqdm(items, desc=desc, disable=not enabled, smoothing=0)


@dataclass
class EncodingStats:
    """What `cache_text_encoder_outputs` encoded in this process: captions (the empty prompt not counted) and the
    seconds of their encoding (not of reading the encoder, which happens with the empty prompt)."""

    captions: int = 0
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        return self.captions / self.seconds if self.seconds > 0 else 0.0


def _unique(infos: Any) -> list[ImageInfo]:
    return list({id(i): i for i in infos}.values())


def _files_of_this_process(paths: Any, process_index: int, num_processes: int) -> set[str]:
    """The cache files one process writes: every file of the run (cached or not, so that all processes agree
    whatever the others have already written), sorted, dealt out with `my_share`. All entries of one file go to
    one process, so no two processes ever write the same file."""
    return set(my_share(sorted(set(paths)), process_index, num_processes))


def cache_latents(
    groups: Sequence[Any],
    vae: Any,
    strategy: MossImageLatentsCachingStrategy,
    process_index: int = 0,
    num_processes: int = 1,
    show_progress: bool = True,
) -> int:
    """Attach `strategy` to the groups and encode every image whose cache is missing or stale.

    Images are grouped by bucket (one VAE call per `strategy.batch_size` images of one bucket); with several
    processes each caches the images of its share of the disk files. Returns the number of images (entries of
    the groups) this process encoded.
    """
    infos: list[ImageInfo] = []
    for group in groups:
        if group is not None:
            group.attach_latents_cache(strategy)
            infos += list(group.image_infos())
    todo = _unique(infos)
    if strategy.cache_to_disk:
        mine = _files_of_this_process((i.latents_npz for i in todo), process_index, num_processes)
        remove_stale_temp_files(mine)
        todo = [
            i for i in todo
            if i.latents_npz in mine and not strategy.is_disk_cached_latents_expected(
                i.bucket_reso, i.latents_npz, bool(i.subset.flip_aug), bool(i.subset.alpha_mask))
        ]
    by_bucket: dict[tuple[int, int, bool], list[ImageInfo]] = {}
    for info in sorted(todo, key=lambda i: i.absolute_path):
        by_bucket.setdefault((*info.bucket_reso, bool(info.subset.flip_aug)), []).append(info)
    batches = [b for infos in by_bucket.values() for b in batched(infos, strategy.batch_size)]
    done = 0
    for batch in _progress(batches, "caching latents", show_progress):
        prepared = [prepare_image_for_cache(i) for i in batch]
        images = torch.stack([p.image for p in prepared])
        with torch.no_grad(), exact_fp32_matmul():  # the same latents whatever the process set before
            lat = vae.encode(images)
            lat_flipped = vae.encode(images.flip(-1)) if batch[0].subset.flip_aug else None
        for k, (info, p) in enumerate(zip(batch, prepared)):
            top, left = p.crop_top_left
            crop = (left, top, left + info.bucket_reso[0], top + info.bucket_reso[1])
            strategy.store(info, lat[k], None if lat_flipped is None else lat_flipped[k], p.alpha_mask, crop)
        done += len(batch)
    logger.info("latents: %d images encoded by this process", done)
    return done


def _captions_per_file(groups: Sequence[Any]) -> dict[str, tuple[ImageInfo, CacheCaptions]]:
    """The caption texts (candidates or their variants) each disk cache file must hold; one image file with two
    different caption lists (the same image in two subsets with different prefixes, say) cannot share one file."""
    files: dict[str, tuple[ImageInfo, CacheCaptions]] = {}
    for group in groups:
        for info in group.image_infos():
            captions = group.text_encoder_cache_captions(info)
            seen = files.setdefault(info.te_outputs_npz, (info, captions))
            if seen[1] != captions:
                raise UserError(
                    f"The image '{info.absolute_path}' is used by {seen[0].subset.where} and {info.subset.where}"
                    " with different captions, but its text-encoder outputs have one cache file: give both the same"
                    " caption settings, or drop --cache_text_encoder_outputs_to_disk (caching in memory works)."
                )
    return files


def cache_text_encoder_outputs(
    groups: Sequence[Any],
    encode: EncodeFn,
    strategy: MossImageTextEncoderOutputsCachingStrategy,
    process_index: int = 0,
    num_processes: int = 1,
    show_progress: bool = True,
    stats: EncodingStats | None = None,
) -> int:
    """Attach `strategy` to the groups, find every caption candidate whose cache is missing or stale (all
    candidates of an image, and their variants with caption_cache_variants, in one file; with several processes
    each checks and caches its share of the files), then encode the empty prompt and those texts. `encode` is called
    only when something is to be encoded (a `LazyEncoder` then reads the text encoder only in that case), with the
    texts of `strategy.batch_size` images at a time (every candidate and variant of each), the images sorted by
    caption length so that each call holds captions of similar lengths. The progress
    bar counts captions (captions/s, ETA). Returns the number of images (files, or entries when caching in memory)
    this process encoded; `stats`, when given, receives the captions and the seconds of their encoding."""
    groups = [g for g in groups if g is not None]
    for group in groups:
        group.attach_text_encoder_outputs_cache(strategy, cache_supports_dropout=True,
                                                supports_multiple_caption_candidates=True)
    if strategy.cache_to_disk:
        files = _captions_per_file(groups)
        mine = _files_of_this_process(files, process_index, num_processes)
        remove_stale_temp_files(mine)
        problems = {p: strategy.disk_outputs_problem(p, files[p][1].texts, files[p][1].recipe) for p in sorted(mine)}
        _log_recipe_changes(problems)
        todo = [files[p] for p, problem in problems.items() if problem is not None]
    else:
        files, mine = {}, set()
        todo = [(i, g.text_encoder_cache_captions(i)) for g in groups for i in _unique(g.image_infos())]
    with exact_fp32_matmul():  # the same outputs whatever the process set before (fp32 encoders)
        if todo or _files_without_uncond(files):
            strategy.set_uncond(encode([""])[0])  # stored in every file; dropout reads it from there
        elif strategy.cache_to_disk:
            _log_all_valid(encode, len(mine), num_processes)
        todo.sort(key=lambda item: max((len(c) for c in item[1].texts), default=0))
        done = _encode_and_store(todo, encode, strategy, show_progress)
    logger.info("text encoder outputs: %d images encoded by this process", len(todo))
    if done.captions:
        logger.info("text encoder outputs: %d captions in %.1f s (%.1f captions/s)", done.captions, done.seconds,
                    done.rate)
    if stats is not None:
        stats.captions, stats.seconds = done.captions, done.seconds
    return len(todo)


def _encode_and_store(todo: list[tuple[ImageInfo, CacheCaptions]], encode: EncodeFn,
                      strategy: MossImageTextEncoderOutputsCachingStrategy, show_progress: bool) -> EncodingStats:
    """Encode the texts of `strategy.batch_size` images per call (every candidate and variant of each; the encode
    function cuts them into its own --text_encoder_batch_size forwards) and store each image's outputs."""
    done = EncodingStats()
    total = sum(len(caps.texts) for _, caps in todo)
    start = time.perf_counter()
    with tqdm(total=total, desc="caching text encoder outputs", unit=" captions", disable=not show_progress,
              smoothing=0) as bar:
        for chunk in batched(todo, strategy.batch_size):
            flat = [c for _, caps in chunk for c in caps.texts]
            outputs = encode(flat)
            pos = 0
            for info, caps in chunk:
                strategy.store(info, caps.texts, outputs[pos : pos + len(caps.texts)], caps.recipe)
                pos += len(caps.texts)
            done.captions += len(flat)
            bar.update(len(flat))
    done.seconds = time.perf_counter() - start
    return done


def _log_recipe_changes(problems: dict[str, str | None]) -> None:
    """One line for the files re-made because their caption variants were drawn with another recipe (a new
    --seed, say: the trainer picks a random one when none is given)."""
    changed = [(p, r) for p, r in problems.items() if r is not None and r.startswith(VARIANT_RECIPE_CHANGED)]
    if changed:
        path, reason = changed[0]
        logger.info("%d text-encoder cache files are re-made because their caption variants were drawn otherwise"
                    " (%s: %s)", len(changed), os.path.basename(path), reason)


def _files_without_uncond(files: Any) -> int:
    """How many existing cache files of the run (every process's share: any process may read any file) have no
    unconditional embedding (the older format): caption dropout then takes the strategy's own, so it is encoded."""
    missing = 0
    for path in files:
        names = npz_names(path) if os.path.exists(path) else None
        missing += names is not None and "uncond_embeds" not in names
    if missing:
        logger.info("%d text-encoder cache files of the older format have no unconditional embedding: the empty"
                    " prompt is encoded for caption dropout", missing)
    return missing


def _log_all_valid(encode: Any, count: int, num_processes: int) -> None:
    where = " of this process" if num_processes > 1 else ""
    if isinstance(encode, LazyEncoder) and encode.loads_model and not encode.loaded:
        logger.info("all %d text-encoder cache files%s are valid: the text encoder is not loaded", count, where)
    else:
        logger.info("all %d text-encoder cache files%s are valid: nothing to encode", count, where)
