"""Datasets of ImageInfos grouped into bucket batches, and the torch Dataset that serves them.

An `ImageDataset` is one `[[datasets]]`: its images, their buckets and its batch size. A `DatasetGroup` holds all
datasets of a run and is the torch `Dataset`: item i is the i-th *whole batch* of the current epoch (a batch
never mixes buckets or datasets). The batch plan of an epoch is a pure function of (seed, epoch): the images of each
bucket, repeated `num_repeats` times, are shuffled and cut into batches, and the list of all batches is shuffled.
All per-sample randomness (caption candidate, dropout, shuffle, flip, crop, color) comes from a generator seeded
by (seed, epoch, batch index), so a batch is the same whatever the number of DataLoader workers. With cached
text-encoder outputs and `caption_cache_variants`, the caption variant of a sample is picked from the image's uses
in the epoch plan (`library.datasets.caption_variants`), which are as independent of the workers.

Epoch and step reach the workers inside the index: `DatasetGroup.sampler()` yields `BatchKey(index, epoch, step)`
read from the group when each key is drawn in the main process, so persistent workers need no shared state. A
plain integer index uses the group's own `current_epoch` / `current_step`. Use `create_data_loader` (batch size 1:
the dataset already returns batches).

A validation group (`is_validation=True`) always serves the same batches: fixed plan, no caption dropout, no tag
shuffle/dropout, no token warmup, no flip, no color augmentation, centred crops.

Batch dict (one per item):
    images                [B, 3, H, W] float32 in [-1, 1], or None when latents are cached
    latents               [B, C, h, w] from the latents cache, or None
    alpha_masks           [B, H, W] float32 in [0, 1] when a subset of the batch has alpha_mask, else None
    captions              list[str], the caption of this step ("" when dropped)
    caption_candidate_indices  list[int], which candidate of each image was used
    caption_variant_indices    list[int], which cached caption variant was used (0 without variants)
    captions_dropped      [B] bool; caption dropout is ALREADY applied (empty caption / unconditional outputs)
    caption_dropout_rates [B] float32, the subsets' caption_dropout_rate (for information; do not drop again)
    text_encoder_outputs  list (one per sample) from the TE-output cache, or None
    loss_weights          [B] float32: prior_loss_weight for regularisation images, else 1.0
    is_reg                [B] bool
    custom_attributes     list[dict], the subset's custom_attributes ({} when none)
    image_keys            list[str], absolute image paths
    bucket_reso           (width, height) of the batch's bucket
    original_sizes_hw, crop_top_lefts, target_sizes_hw   [B, 2] int64
    flippeds              list[bool]
"""

from __future__ import annotations

import logging
import math
import os
import random
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from library.datasets.buckets import BucketManager, verify_bucket_reso_steps
from library.datasets.caption_variants import (
    CacheCaptions,
    draw_variants,
    occurrence_of,
    pick_variant,
    recipe_for,
    variant_name,
    variant_settings,
)
from library.datasets.captions import (
    CaptionResult,
    CaptionSettings,
    cacheable_caption,
    has_wildcards,
    process_caption,
)
from library.datasets.config import DatasetParams, SubsetParams
from library.datasets.image_info import ImageInfo, LatentsCacheHook, TextEncoderOutputsCacheHook
from library.datasets.images import PreparedImage, prepare_image
from library.datasets.subsets import caption_settings_of
from library.errors import UserError

logger = logging.getLogger(__name__)

_MAX_EXAMPLES = 5
_VARIANTS_HINT = " (or set caption_cache_variants to e.g. 8 to cache that many variants per caption)"


@dataclass(frozen=True)
class BatchKey:
    """An index of `DatasetGroup` that carries the epoch and step it was drawn for."""

    index: int
    epoch: int
    step: int


def _examples(paths: Sequence[str]) -> str:
    shown = ", ".join(os.path.basename(p) for p in paths[:_MAX_EXAMPLES])
    return shown + (" ..." if len(paths) > _MAX_EXAMPLES else "")


def bucket_manager_for(params: DatasetParams, where: str) -> BucketManager:
    """The bucket manager of a dataset's settings (checks min/max_bucket_reso against the resolution)."""
    if params.bucket_no_upscale and not params.enable_bucket:
        logger.warning("bucket_no_upscale (%s) has no effect without enable_bucket in %s: every image is scaled to"
                       " the resolution", params.source_of("bucket_no_upscale"), where)
    return BucketManager.for_dataset(
        params.resolution,
        params.enable_bucket,
        params.min_bucket_reso,
        params.max_bucket_reso,
        params.bucket_reso_steps,
        params.bucket_no_upscale,
        where,
    )


def verify_bucket_sizes(params: DatasetParams, multiple: int) -> None:
    """UserError unless every bucket of a dataset is a multiple of `multiple` (16 for MOSS-Image)."""
    if params.enable_bucket:
        verify_bucket_reso_steps(params.bucket_reso_steps, multiple, params.source_of("bucket_reso_steps"))
    elif params.resolution[0] % multiple or params.resolution[1] % multiple:
        raise UserError(
            f"The resolution {params.resolution[0]}x{params.resolution[1]} ({params.source_of('resolution')}) is"
            f" not a multiple of {multiple}, which this model needs when enable_bucket is off; use e.g. 1024 or"
            " 1024,768."
        )


class ImageDataset:
    """One `[[datasets]]` entry: images assigned to buckets, cut into batches of `batch_size`."""

    def __init__(
        self,
        params: DatasetParams,
        subsets: Sequence[SubsetParams],
        infos: Sequence[ImageInfo],
        *,
        is_validation: bool = False,
        source: str = "the dataset config",
        bucket_manager: BucketManager | None = None,
    ) -> None:
        self.params = params
        self.subsets = tuple(subsets)
        self.is_validation = is_validation
        self.where = f"datasets[{params.index}] of {source}"
        self.bucket_manager = bucket_manager or bucket_manager_for(params, self.where)
        self._settings: dict[tuple[int, int], CaptionSettings] = {
            (s.dataset_index, s.index): caption_settings_of(s) for s in self.subsets
        }
        self.image_infos: list[ImageInfo] = self._assign_buckets(infos)
        self.buckets: dict[tuple[int, int], list[ImageInfo]] = defaultdict(list)
        for info in self.image_infos:
            assert info.bucket_reso is not None
            self.buckets[info.bucket_reso].append(info)
        self.num_batches = sum(math.ceil(self._bucket_len(b) / params.batch_size) for b in self.buckets.values())

    # -- construction

    def _assign_buckets(self, infos: Sequence[ImageInfo]) -> list[ImageInfo]:
        kept, too_small, unusable = [], [], []
        manager = self.bucket_manager
        for info in infos:
            assert info.image_size is not None
            w, h = info.image_size
            assignment = manager.select_bucket(w, h)
            if assignment.bucket_reso[0] <= 0 or assignment.bucket_reso[1] <= 0:
                unusable.append(info.absolute_path)
                continue
            info.bucket_reso, info.resized_size = assignment.bucket_reso, assignment.resized_size
            below_min = manager.no_upscale and min(w, h) < self.params.min_bucket_reso
            if below_min or not manager.fits_without_upscale(w, h):
                too_small.append(info.absolute_path)
            kept.append(info)
        if unusable:
            logger.warning("%s: %d images are skipped because a side is below bucket_reso_steps %d: %s",
                           self.where, len(unusable), self.params.bucket_reso_steps, _examples(unusable))
        if too_small:
            what = ("are smaller than min_bucket_reso and train at their own small size" if manager.no_upscale
                    else "are smaller than the smallest bucket and are enlarged")
            logger.warning("%s: %d images %s: %s", self.where, len(too_small), what, _examples(too_small))
        return kept

    @staticmethod
    def _bucket_len(infos: Sequence[ImageInfo]) -> int:
        return sum(i.num_repeats for i in infos)

    # -- facts

    @property
    def num_train_images(self) -> int:
        """Images x repeats of the non-regularisation images."""
        return sum(i.num_repeats for i in self.image_infos if not i.is_reg)

    @property
    def num_reg_images(self) -> int:
        return sum(1 for i in self.image_infos if i.is_reg)

    @property
    def is_dreambooth(self) -> bool:
        return all(s.metadata_file is None for s in self.subsets)

    def caption_settings(self, info: ImageInfo) -> CaptionSettings:
        return self._settings[(info.subset.dataset_index, info.subset.index)]

    def bucket_info(self) -> dict[str, Any]:
        """{"buckets": {i: {"resolution": (w, h), "count": images x repeats}}, "mean_img_ar_error": float}."""
        buckets = {
            i: {"resolution": reso, "count": self._bucket_len(self.buckets[reso])}
            for i, reso in enumerate(sorted(self.buckets))
        }
        errors = [
            abs(i.bucket_reso[0] / i.bucket_reso[1] - i.image_size[0] / i.image_size[1])
            for i in self.image_infos
            if i.bucket_reso and i.image_size
        ]
        return {"buckets": buckets, "mean_img_ar_error": sum(errors) / len(errors) if errors else 0.0}

    def log_summary(self) -> None:
        kind = "validation" if self.is_validation else "training"
        p = self.params
        logger.info("%s %s: %d images (%d regularisation), batch size %d, resolution %dx%d, %d batches per epoch",
                    self.where, kind, len(self.image_infos), self.num_reg_images, p.batch_size, p.resolution[0],
                    p.resolution[1], self.num_batches)
        for i, b in self.bucket_info()["buckets"].items():
            logger.info("  bucket %d: %dx%d, count %d", i, b["resolution"][0], b["resolution"][1], b["count"])

    # -- batches

    def batches_for_epoch(self, seed: int, epoch: int) -> list[list[ImageInfo]]:
        """The batches of one epoch, bucket by bucket (each bucket's repeated images shuffled with the seed)."""
        batches: list[list[ImageInfo]] = []
        size = self.params.batch_size
        for reso in sorted(self.buckets):
            items = [info for info in self.buckets[reso] for _ in range(info.num_repeats)]
            random.Random(f"{seed}/{epoch}/{self.params.index}/{reso}").shuffle(items)
            batches += [items[i : i + size] for i in range(0, len(items), size)]
        return batches


class DatasetGroup(torch.utils.data.Dataset):
    """All datasets of a run, served as whole batches (see the module docstring for the batch keys)."""

    def __init__(
        self,
        datasets: Sequence[ImageDataset],
        *,
        seed: int,
        prior_loss_weight: float = 1.0,
        is_validation: bool = False,
    ) -> None:
        self.datasets = list(datasets)
        self.seed = seed
        self.prior_loss_weight = prior_loss_weight
        self.is_validation = is_validation
        self.current_epoch = 1
        self.current_step = 0
        self.max_train_steps: int | None = None
        self.latents_cache: LatentsCacheHook | None = None
        self.text_encoder_outputs_cache: TextEncoderOutputsCacheHook | None = None
        self._plan_cache: tuple[int, list[tuple[int, list[ImageInfo]]], list[list[int]]] | None = None
        self._cache_captions: dict[tuple[int, str], CacheCaptions] = {}  # (dataset index, image key): texts

    # -- state set by the trainer

    def set_current_epoch(self, epoch: int) -> None:
        """Epochs count from 1 (caption_dropout_every_n_epochs drops the captions of epochs n, 2n, ...)."""
        if epoch < 1:
            raise ValueError(f"epochs count from 1, got {epoch}")
        self.current_epoch = epoch

    def set_current_step(self, step: int) -> None:
        """The global optimisation step, used by token warmup."""
        self.current_step = step

    def set_max_train_steps(self, max_train_steps: int) -> None:
        """Needed when a subset gives token_warmup_step as a fraction of the run."""
        self.max_train_steps = max_train_steps

    # -- facts

    def __len__(self) -> int:
        return sum(d.num_batches for d in self.datasets)

    @property
    def num_train_images(self) -> int:
        return sum(d.num_train_images for d in self.datasets)

    @property
    def num_reg_images(self) -> int:
        return sum(d.num_reg_images for d in self.datasets)

    def image_infos(self) -> Iterator[ImageInfo]:
        """Every ImageInfo of every dataset (an image used by two datasets appears twice, with its two buckets)."""
        for d in self.datasets:
            yield from d.image_infos

    def dataset_of(self, info: ImageInfo) -> ImageDataset:
        return self.datasets[[d.params.index for d in self.datasets].index(info.subset.dataset_index)]

    def verify_bucket_reso_steps(self, multiple: int) -> None:
        """UserError unless every bucket size is a multiple of `multiple` (16 for MOSS-Image)."""
        for d in self.datasets:
            verify_bucket_sizes(d.params, multiple)

    # -- caching hooks

    def captions_for_text_encoder_cache(self, info: ImageInfo) -> list[str]:
        """The texts a text-encoder cache must hold for an image: each candidate with its prefix/suffix (and the
        other fixed processing), in candidate order."""
        settings = self.dataset_of(info).caption_settings(info)
        return [cacheable_caption(c, settings) for c in info.caption_candidates]

    def text_encoder_cache_captions(self, info: ImageInfo) -> CacheCaptions:
        """The texts a text-encoder cache file holds for an image: `captions_for_text_encoder_cache`, or with
        caption_cache_variants > 1 (and something random to draw) every candidate's variants with their recipe
        (`library.datasets.caption_variants`). Drawn once per image and kept."""
        key = (info.subset.dataset_index, info.image_key)
        if key not in self._cache_captions:
            settings = variant_settings(self.dataset_of(info).caption_settings(info), self.is_validation)
            recipe = recipe_for(settings, info.subset.caption_cache_variants, self.seed, info.caption_candidates)
            if recipe is None:
                texts = tuple(self.captions_for_text_encoder_cache(info))
            else:
                texts = draw_variants(info.caption_candidates, settings, recipe, variant_name(info.absolute_path))
            self._cache_captions[key] = CacheCaptions(texts, recipe)
        return self._cache_captions[key]

    def cached_caption(self, info: ImageInfo, caption: CaptionResult, epoch: int, ordinal: int) -> CaptionResult:
        """The caption of a step with cached text-encoder outputs: the chosen candidate's variant for this use of
        the image (`ordinal`: its earlier uses in the epoch's plan), unchanged without variants or when dropped."""
        entry = self.text_encoder_cache_captions(info)
        if entry.recipe is None or caption.dropped:
            return caption
        occurrence = occurrence_of(epoch, info.num_repeats, ordinal)
        v = pick_variant(entry.recipe.seed, variant_name(info.absolute_path), occurrence, entry.count)
        return CaptionResult(entry.text(caption.candidate_index, v), caption.candidate_index, False, v)

    def text_encoder_output_cache_blockers(
        self, cache_supports_dropout: bool = True, supports_multiple_caption_candidates: bool = True
    ) -> list[str]:
        """Why text-encoder outputs cannot be cached (empty when they can)."""
        reasons: list[str] = []
        for d in self.datasets:
            for s in d.subsets:
                settings = caption_settings_of(s)
                variants = s.caption_cache_variants > 1  # shuffle, tag dropout and wildcards are drawn per variant
                if not self.is_validation:
                    if s.shuffle_caption and not variants:
                        reasons.append(f"shuffle_caption in {s.where}{_VARIANTS_HINT}")
                    if s.caption_tag_dropout_rate > 0 and not variants:
                        reasons.append(f"caption_tag_dropout_rate in {s.where}{_VARIANTS_HINT}")
                    if s.token_warmup_step > 0:
                        why = " (its tags change with the step: cached variants cannot follow)" if variants else ""
                        reasons.append(f"token_warmup_step in {s.where}{why}")
                    if settings.uses_dropout and not cache_supports_dropout:
                        reasons.append(f"caption dropout in {s.where}")
                infos = [i for i in d.image_infos if i.subset is s]
                if s.enable_wildcard and not variants and any(
                        has_wildcards(c) for i in infos for c in i.caption_candidates):
                    reasons.append(f"{{a|b}} wildcards in the captions of {s.where}{_VARIANTS_HINT}")
                if not supports_multiple_caption_candidates and any(len(i.caption_candidates) > 1 for i in infos):
                    reasons.append(f"several caption candidates per image in {s.where}")
        return reasons

    def is_text_encoder_output_cacheable(
        self, cache_supports_dropout: bool = True, supports_multiple_caption_candidates: bool = True
    ) -> bool:
        return not self.text_encoder_output_cache_blockers(cache_supports_dropout, supports_multiple_caption_candidates)

    def latent_cache_blockers(self) -> list[str]:
        """Why latents cannot be cached (random_crop and color_aug change the pixels at every step)."""
        if self.is_validation:
            return []
        reasons = []
        for d in self.datasets:
            for s in d.subsets:
                reasons += [f"{key} in {s.where}" for key in ("random_crop", "color_aug") if getattr(s, key)]
        return reasons

    def is_latent_cacheable(self) -> bool:
        return not self.latent_cache_blockers()

    def attach_latents_cache(self, hook: LatentsCacheHook) -> None:
        """From now on batches carry cached latents instead of images; sets each ImageInfo.latents_npz."""
        blockers = self.latent_cache_blockers()
        if blockers:
            raise UserError(
                f"Latents cannot be cached with {', '.join(blockers)}; turn those off or do not cache latents."
            )
        for info in self.image_infos():
            assert info.image_size is not None
            info.latents_npz = hook.get_latents_npz_path(info.absolute_path, info.image_size)
        self.latents_cache = hook

    def attach_text_encoder_outputs_cache(
        self, hook: TextEncoderOutputsCacheHook, cache_supports_dropout: bool = True,
        supports_multiple_caption_candidates: bool = True,
    ) -> None:
        """From now on batches carry cached text-encoder outputs; sets each ImageInfo.te_outputs_npz."""
        blockers = self.text_encoder_output_cache_blockers(cache_supports_dropout, supports_multiple_caption_candidates)
        if blockers:
            raise UserError(
                f"Text encoder outputs cannot be cached with {', '.join(blockers)}; turn those off or do not use"
                " --cache_text_encoder_outputs."
            )
        for info in self.image_infos():
            info.te_outputs_npz = hook.get_outputs_npz_path(info.absolute_path)
        self.text_encoder_outputs_cache = hook

    # -- serving batches

    def sampler(self) -> EpochBatchSampler:
        return EpochBatchSampler(self)

    def _epoch_plan(self, epoch: int) -> tuple[int, list[tuple[int, list[ImageInfo]]], list[list[int]]]:
        """(epoch, its batches in order, for each batch and sample the image's earlier uses in the epoch)."""
        if self._plan_cache is None or self._plan_cache[0] != epoch:
            plan = [(di, b) for di, d in enumerate(self.datasets) for b in d.batches_for_epoch(self.seed, epoch)]
            random.Random(f"{self.seed}/{epoch}").shuffle(plan)
            uses: dict[tuple[int, str], int] = defaultdict(int)
            ordinals = []
            for _, batch in plan:
                row = []
                for info in batch:
                    key = (info.subset.dataset_index, info.image_key)
                    row.append(uses[key])
                    uses[key] += 1
                ordinals.append(row)
            self._plan_cache = (epoch, plan, ordinals)
        return self._plan_cache

    def _request(self, key: int | BatchKey) -> tuple[int, int, int]:
        if isinstance(key, BatchKey):
            index, epoch, step = key.index, key.epoch, key.step
        else:
            index, epoch, step = int(key), self.current_epoch, self.current_step
        if not 0 <= index < len(self):
            raise IndexError(f"batch index {index} out of range (0..{len(self) - 1})")
        return index, (0 if self.is_validation else epoch), step

    def __getitem__(self, key: int | BatchKey) -> dict[str, Any]:
        index, epoch, step = self._request(key)
        _, plan, ordinals = self._epoch_plan(epoch)
        dataset_index, infos = plan[index]
        rng = random.Random(f"{self.seed}/{epoch}/{index}")
        return _BatchBuilder(self, self.datasets[dataset_index], rng, epoch, step).build(infos, ordinals[index])


class _BatchBuilder:
    """Builds one batch dict; holds the per-batch state so the steps stay small."""

    def __init__(self, group: DatasetGroup, dataset: ImageDataset, rng: random.Random, epoch: int, step: int) -> None:
        self.group, self.dataset, self.rng, self.epoch, self.step = group, dataset, rng, epoch, step
        self.augment = not group.is_validation

    def build(self, infos: Sequence[ImageInfo], ordinals: Sequence[int]) -> dict[str, Any]:
        samples = [self._sample(info, ordinal) for info, ordinal in zip(infos, ordinals)]
        bucket = infos[0].bucket_reso
        assert bucket is not None
        use_masks = any(i.subset.alpha_mask for i in infos)
        batch: dict[str, Any] = {
            "images": None if self.group.latents_cache else torch.stack([s["image"] for s in samples]),
            "latents": torch.stack([s["latents"] for s in samples]) if self.group.latents_cache else None,
            "alpha_masks": torch.stack([self._mask(s, bucket) for s in samples]) if use_masks else None,
            "captions": [s["caption"].text for s in samples],
            "caption_candidate_indices": [s["caption"].candidate_index for s in samples],
            "caption_variant_indices": [s["caption"].variant_index for s in samples],
            "captions_dropped": torch.tensor([s["caption"].dropped for s in samples], dtype=torch.bool),
            "caption_dropout_rates": torch.tensor(
                [i.subset.caption_dropout_rate if self.augment else 0.0 for i in infos], dtype=torch.float32
            ),
            "text_encoder_outputs": [s["te"] for s in samples] if self.group.text_encoder_outputs_cache else None,
            "loss_weights": torch.tensor(
                [self.group.prior_loss_weight if i.is_reg else 1.0 for i in infos], dtype=torch.float32
            ),
            "is_reg": torch.tensor([i.is_reg for i in infos], dtype=torch.bool),
            "custom_attributes": [dict(i.subset.custom_attributes or {}) for i in infos],
            "image_keys": [i.image_key for i in infos],
            "bucket_reso": bucket,
            "original_sizes_hw": torch.tensor([[i.image_size[1], i.image_size[0]] for i in infos], dtype=torch.int64),
            "crop_top_lefts": torch.tensor([s["crop_top_left"] for s in samples], dtype=torch.int64),
            "target_sizes_hw": torch.tensor([[bucket[1], bucket[0]]] * len(infos), dtype=torch.int64),
            "flippeds": [s["flipped"] for s in samples],
        }
        return batch

    @staticmethod
    def _mask(sample: dict[str, Any], bucket: tuple[int, int]) -> torch.Tensor:
        mask = sample["alpha_mask"]
        return torch.ones(bucket[1], bucket[0]) if mask is None else mask

    def _sample(self, info: ImageInfo, ordinal: int) -> dict[str, Any]:
        subset = info.subset
        caption = process_caption(
            info.caption_candidates,
            self.dataset.caption_settings(info),
            self.rng,
            epoch=self.epoch,
            step=self.step,
            max_train_steps=self.group.max_train_steps,
            augment=self.augment,
        )
        te_cache = self.group.text_encoder_outputs_cache
        if te_cache is not None:  # the caption that was encoded: with variants, this use's variant
            caption = self.group.cached_caption(info, caption, self.epoch, ordinal)
        flip = self.augment and subset.flip_aug and self.rng.random() < 0.5
        sample: dict[str, Any] = {"caption": caption, "flipped": flip}
        if self.group.latents_cache is not None:
            latents, mask = self.group.latents_cache.get_latents(info, flip)
            sample["latents"] = latents
            sample["alpha_mask"] = None if mask is None or not subset.alpha_mask else (mask.flip(-1) if flip else mask)
            sample["crop_top_left"] = _centre_crop(info)
        else:
            prepared = prepare_image(
                info.absolute_path,
                info.bucket_reso,
                info.resized_size,
                interpolation=subset.resize_interpolation,
                alpha_mask=subset.alpha_mask,
                flip=flip,
                color_aug=self.augment and subset.color_aug,
                crop_rng=self.rng if self.augment and subset.random_crop else None,
                color_rng=self.rng,
            )
            sample.update(image=prepared.image, alpha_mask=prepared.alpha_mask, crop_top_left=prepared.crop_top_left)
        if te_cache is not None:
            sample["te"] = te_cache.get_outputs(info, caption.candidate_index, caption.dropped,
                                                variant_index=caption.variant_index)
        return sample


def _centre_crop(info: ImageInfo) -> tuple[int, int]:
    assert info.resized_size is not None and info.bucket_reso is not None
    return (info.resized_size[1] - info.bucket_reso[1]) // 2, (info.resized_size[0] - info.bucket_reso[0]) // 2


class EpochBatchSampler(torch.utils.data.Sampler):
    """Yields `BatchKey(i, epoch, step)` for every batch of the group's current epoch, in plan order."""

    def __init__(self, group: DatasetGroup) -> None:
        self.group = group

    def __len__(self) -> int:
        return len(self.group)

    def __iter__(self) -> Iterator[BatchKey]:
        for i in range(len(self.group)):
            yield BatchKey(i, self.group.current_epoch, self.group.current_step)


def _unwrap(items: list[dict[str, Any]]) -> dict[str, Any]:
    return items[0]


def create_data_loader(
    group: DatasetGroup, num_workers: int = 8, persistent_workers: bool = False
) -> torch.utils.data.DataLoader:
    """The DataLoader of a group (batch size 1: each item is already a batch). `num_workers` is capped by the
    number of CPUs, as `--max_data_loader_n_workers` is in sd-scripts."""
    if persistent_workers and num_workers == 0:
        raise UserError(
            "--persistent_data_loader_workers needs at least one worker: raise --max_data_loader_n_workers above 0"
            " or drop --persistent_data_loader_workers."
        )
    workers = min(num_workers, os.cpu_count() or 1)
    return torch.utils.data.DataLoader(
        group,
        batch_size=1,
        sampler=group.sampler(),
        collate_fn=_unwrap,
        num_workers=workers,
        persistent_workers=persistent_workers and workers > 0,
    )


def prepare_image_for_cache(info: ImageInfo) -> PreparedImage:
    """An image as the latents cache must encode it: resized and centre-cropped to its bucket, not flipped, with
    its alpha mask when the subset uses alpha_mask (flipped latents are made by flipping this image)."""
    assert info.bucket_reso is not None and info.resized_size is not None
    return prepare_image(
        info.absolute_path,
        info.bucket_reso,
        info.resized_size,
        interpolation=info.subset.resize_interpolation,
        alpha_mask=info.subset.alpha_mask,
    )
