"""MOSS-Image caching strategies: FLUX.2 latents and Qwen3.5 outputs, in memory or in npz files beside the images.

Latent cache `<stem>_<WWWW>x<HHHH>_moss.npz` (original image size in the name, as sd-scripts): the RAW VAE output
(32 channels, 1/8 resolution; patchify + BatchNorm normalisation happen at training time) for each bucket resolution
the image was cached at, under keys suffixed `_<h>x<w>` (latent size): `latents`, `latents_flipped`, `alpha_mask`,
`original_size`, `crop_ltrb`.

Text-encoder cache `<stem>_moss_te.npz`: `num_candidates`, and for each caption candidate k `prompt_embeds_{k}`,
`attn_mask_{k}`, `caption_{k}` (the text after prefix/suffix), plus the unconditional (empty-prompt) `uncond_embeds`,
`uncond_mask`, and the prompt template id. A file is re-made when its candidate count, caption texts or template
differ from the current ones (unless --skip_cache_check). Files of the older single-candidate format
(`prompt_embeds`, `attn_mask`) stay valid for images with one candidate.
Every cache file is written to a temp file and renamed: never half-written.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from library.datasets.image_info import ImageInfo
from library.errors import UserError
from library.qwen35_text_encoder import PROMPT_TEMPLATE_ID

logger = logging.getLogger(__name__)

LATENTS_SUFFIX = "_moss.npz"
TE_SUFFIX = "_moss_te.npz"
VAE_SCALE = 8
_SIZE_RE = re.compile(r"_(\d{4,})x(\d{4,})" + re.escape(LATENTS_SUFFIX) + "$")

TextOutputs = tuple[torch.Tensor, torch.Tensor]  # (embeds [T, D], mask [T] bool)


# ------------------------------------------------------------------------------------------------ npz files
def save_npz_atomic(path: str | os.PathLike, arrays: dict[str, np.ndarray]) -> None:
    p = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp.npz", dir=p.parent)
    os.close(fd)
    try:
        np.savez(tmp, **arrays)
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def load_npz(path: str | os.PathLike) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}
    except (OSError, ValueError, EOFError) as e:
        raise UserError(f"The cache file '{path}' cannot be read ({e}): delete it to re-create it.") from e


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
        key = _size_key(self.latent_hw(bucket_reso))
        try:
            with np.load(npz_path, allow_pickle=False) as data:
                names = set(data.files)
        except (OSError, ValueError, EOFError):
            logger.warning("unreadable latent cache %s: it will be re-created", npz_path)
            return False
        needed = {f"latents_{key}"} | ({f"latents_flipped_{key}"} if flip_aug else set())
        needed |= {f"alpha_mask_{key}"} if alpha_mask else set()
        return needed <= names

    # reading ----------------------------------------------------------------------------------------------
    def get_latents(self, info: ImageInfo, flipped: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        if info.latents is not None:
            lat = info.latents_flipped if flipped else info.latents
            if lat is None:
                raise UserError(f"No flipped latents cached for '{info.absolute_path}': re-cache with flip_aug enabled.")
            return lat, info.alpha_mask
        assert info.latents_npz is not None and info.bucket_reso is not None
        data = load_npz(info.latents_npz)
        key = _size_key(self.latent_hw(info.bucket_reso))
        name = f"latents_flipped_{key}" if flipped else f"latents_{key}"
        if name not in data:
            raise UserError(
                f"The latent cache '{info.latents_npz}' has no '{name}' entry: delete it (or drop --skip_cache_check)"
                " to re-create it."
            )
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
        if not self.cache_to_disk:
            info.latents, info.latents_flipped, info.alpha_mask = latents, latents_flipped, alpha_mask
            return
        assert info.latents_npz is not None and info.image_size is not None
        key = _size_key((latents.shape[-2], latents.shape[-1]))
        arrays = load_npz(info.latents_npz) if os.path.exists(info.latents_npz) else {}
        arrays[f"latents_{key}"] = latents.numpy()
        arrays[f"original_size_{key}"] = np.array(info.image_size, dtype=np.int64)
        arrays[f"crop_ltrb_{key}"] = np.array(crop_ltrb, dtype=np.int64)
        if latents_flipped is not None:
            arrays[f"latents_flipped_{key}"] = latents_flipped.numpy()
        if alpha_mask is not None:
            arrays[f"alpha_mask_{key}"] = alpha_mask.float().cpu().numpy()
        save_npz_atomic(info.latents_npz, arrays)


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
    ):
        self.cache_to_disk = cache_to_disk
        self.batch_size = max(1, int(batch_size or 1))
        self.skip_disk_cache_validity_check = skip_disk_cache_validity_check
        self.is_partial = is_partial
        self.uncond: TextOutputs | None = None  # the empty prompt's outputs, shared by every image

    def get_outputs_npz_path(self, absolute_path: str) -> str:
        return os.path.splitext(absolute_path)[0] + TE_SUFFIX

    # validity ---------------------------------------------------------------------------------------------
    def is_disk_cached_outputs_expected(self, npz_path: str, captions: Sequence[str]) -> bool:
        """True when the file exists and (unless the check is skipped) holds exactly these caption candidates."""
        if not os.path.exists(npz_path):
            return False
        if self.skip_disk_cache_validity_check:
            return True
        try:
            data = load_npz(npz_path)
        except UserError:
            logger.warning("unreadable text-encoder cache %s: it will be re-created", npz_path)
            return False
        if "num_candidates" not in data:  # older single-candidate format
            return len(captions) == 1 and "prompt_embeds" in data and "attn_mask" in data
        if str(data.get("template", "")) != PROMPT_TEMPLATE_ID:
            return False
        n = int(data["num_candidates"])
        if n != len(captions) or "uncond_embeds" not in data:
            return False
        return all(str(data.get(f"caption_{k}", "")) == c for k, c in enumerate(captions))

    # reading ----------------------------------------------------------------------------------------------
    def get_outputs(self, info: ImageInfo, candidate_index: int, dropped: bool) -> TextOutputs:
        cached = info.text_encoder_outputs
        if cached is None:
            assert info.te_outputs_npz is not None
            cached = self._read_file(info.te_outputs_npz)
        candidates, uncond = cached
        if dropped:
            if uncond is None:
                uncond = self.uncond
            if uncond is None:
                raise UserError(
                    f"The text-encoder cache '{info.te_outputs_npz}' has no unconditional embedding (older format),"
                    " so caption dropout cannot use it: delete the cache files to re-create them."
                )
            return uncond
        return candidates[candidate_index % len(candidates)]

    def _read_file(self, path: str) -> tuple[list[TextOutputs], TextOutputs | None]:
        data = load_npz(path)

        def pair(e: str, m: str) -> TextOutputs:
            return torch.from_numpy(data[e]), torch.from_numpy(data[m]).bool()

        if "num_candidates" not in data:
            return [pair("prompt_embeds", "attn_mask")], None
        n = int(data["num_candidates"])
        cands = [pair(f"prompt_embeds_{k}", f"attn_mask_{k}") for k in range(n)]
        return cands, pair("uncond_embeds", "uncond_mask")

    # writing ----------------------------------------------------------------------------------------------
    def store(self, info: ImageInfo, captions: Sequence[str], outputs: Sequence[TextOutputs]) -> None:
        assert self.uncond is not None, "encode the empty prompt (set_uncond) before caching"
        cands = [(e.float().cpu(), m.bool().cpu()) for e, m in outputs]
        if not self.cache_to_disk:
            info.text_encoder_outputs = (cands, self.uncond)
            return
        assert info.te_outputs_npz is not None
        arrays: dict[str, np.ndarray] = {
            "num_candidates": np.array(len(cands), dtype=np.int64),
            "template": np.array(PROMPT_TEMPLATE_ID),
            "uncond_embeds": self.uncond[0].numpy(),
            "uncond_mask": self.uncond[1].numpy(),
        }
        for k, (caption, (e, m)) in enumerate(zip(captions, cands)):
            arrays[f"prompt_embeds_{k}"] = e.numpy()
            arrays[f"attn_mask_{k}"] = m.numpy()
            arrays[f"caption_{k}"] = np.array(caption)
        save_npz_atomic(info.te_outputs_npz, arrays)

    def set_uncond(self, outputs: TextOutputs) -> None:
        self.uncond = (outputs[0].float().cpu(), outputs[1].bool().cpu())


# -------------------------------------------------------------------------------------- caching drivers
def my_share(items: Sequence[Any], process_index: int, num_processes: int) -> list[Any]:
    """The items process `process_index` caches in a multi-process run (every num_processes-th)."""
    return [it for i, it in enumerate(items) if i % num_processes == process_index]


def batched(items: Sequence[Any], size: int) -> list[list[Any]]:
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


def make_text_encode_fn(text_model: Any, tokenizer: Any, max_length: int) -> Callable[[Sequence[str]], list[TextOutputs]]:
    """captions -> outputs, one caption at a time without padding (as the official pipeline)."""
    from library.qwen35_text_encoder import encode_prompts

    def encode(captions: Sequence[str]) -> list[TextOutputs]:
        with torch.no_grad():
            return encode_prompts(text_model, tokenizer, list(captions), max_length)

    return encode


def _progress(items: Sequence[Any], desc: str, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, disable=not enabled, smoothing=0)


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
    processes each caches its share of the disk files. Returns the number of images this process encoded.
    """
    from library.datasets import prepare_image_for_cache

    todo: list[ImageInfo] = []
    for group in groups:
        if group is None:
            continue
        group.attach_latents_cache(strategy)
        for info in group.image_infos():
            flip, alpha = bool(info.subset.flip_aug), bool(info.subset.alpha_mask)
            if strategy.cache_to_disk and strategy.is_disk_cached_latents_expected(
                info.bucket_reso, info.latents_npz, flip, alpha
            ):
                continue
            todo.append(info)
    todo = list({id(i): i for i in todo}.values())
    if strategy.cache_to_disk:
        todo = my_share(sorted(todo, key=lambda i: i.absolute_path), process_index, num_processes)
    by_bucket: dict[tuple[int, int, bool], list[ImageInfo]] = {}
    for info in todo:
        by_bucket.setdefault((*info.bucket_reso, bool(info.subset.flip_aug)), []).append(info)
    batches = [b for infos in by_bucket.values() for b in batched(infos, strategy.batch_size)]
    done = 0
    for batch in _progress(batches, "caching latents", show_progress):
        prepared = [prepare_image_for_cache(i) for i in batch]
        images = torch.stack([p.image for p in prepared])
        with torch.no_grad():
            lat = vae.encode(images)
            lat_flipped = vae.encode(images.flip(-1)) if batch[0].subset.flip_aug else None
        for k, (info, p) in enumerate(zip(batch, prepared)):
            top, left = p.crop_top_left
            crop = (left, top, left + info.bucket_reso[0], top + info.bucket_reso[1])
            strategy.store(info, lat[k], None if lat_flipped is None else lat_flipped[k], p.alpha_mask, crop)
        done += len(batch)
    logger.info("latents: %d images encoded by this process", done)
    return done


def cache_text_encoder_outputs(
    groups: Sequence[Any],
    encode: Callable[[Sequence[str]], list[TextOutputs]],
    strategy: MossImageTextEncoderOutputsCachingStrategy,
    process_index: int = 0,
    num_processes: int = 1,
    show_progress: bool = True,
) -> int:
    """Attach `strategy` to the groups, encode the empty prompt, then every caption candidate whose cache is
    missing or stale (all candidates of an image in one file). Returns the number of images this process encoded."""
    strategy.set_uncond(encode([""])[0])
    todo: list[tuple[ImageInfo, list[str]]] = []
    seen: set[str] = set()
    for group in groups:
        if group is None:
            continue
        group.attach_text_encoder_outputs_cache(strategy, cache_supports_dropout=True,
                                                supports_multiple_caption_candidates=True)
        for info in group.image_infos():
            captions = group.captions_for_text_encoder_cache(info)
            key = f"{info.te_outputs_npz}|{len(captions)}" if strategy.cache_to_disk else str(id(info))
            if key in seen:
                continue
            seen.add(key)
            if strategy.cache_to_disk and strategy.is_disk_cached_outputs_expected(info.te_outputs_npz, captions):
                continue
            todo.append((info, captions))
    if strategy.cache_to_disk:
        todo = my_share(sorted(todo, key=lambda t: t[0].absolute_path), process_index, num_processes)
    for chunk in _progress(batched(todo, strategy.batch_size), "caching text encoder outputs", show_progress):
        flat = [c for _, caps in chunk for c in caps]
        outputs = encode(flat)
        pos = 0
        for info, caps in chunk:
            strategy.store(info, caps, outputs[pos : pos + len(caps)])
            pos += len(caps)
    logger.info("text encoder outputs: %d images encoded", len(todo))
    return len(todo)
