"""Dataset preflight: what a run will train on, and what would go wrong, before any model is read.

Two forms, both over the datasets exactly as the trainer builds them (`build_dataset_groups`):

- `quick_check(groups)` (this module): the trainer and the cache tools call it right after the datasets are built.
  It opens no file: images whose crop to their bucket cuts away more than `CROP_WARN_FRACTION` of their area, and
  images enlarged more than `UPSCALE_WARN_FACTOR` times, as one warning per dataset that names the worst cases with
  their percentage or factor.
- `library.datasets.preflight_report.inspect_datasets(args)` (`tools/check_dataset.py`): the full report, with the
  cache status and estimates of `library.datasets.preflight_caches`.

A `Problem` of level "error" is something that makes training fail (or train on stale cache files); "warning" is
something the run survives but the user probably did not intend.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from library.datasets.buckets import crop_fraction, upscale_factor
from library.datasets.dataset_group import DatasetGroup, ImageDataset

logger = logging.getLogger(__name__)

ERROR = "error"
WARNING = "warning"
CROP_WARN_FRACTION = 0.25  # warn when a crop cuts away more than this share of an image
UPSCALE_WARN_FACTOR = 2.0  # warn when an image is enlarged more than this
_SHOWN = 5  # file names in one message


@dataclass
class Problem:
    level: str  # ERROR or WARNING
    where: str  # "datasets[0].subsets[1]", "datasets[0] of 'x.toml' (training)", "latents cache", ...
    message: str
    files: list[str] = field(default_factory=list)


@dataclass
class FileReason:
    """A file and why it is listed (not used, stale, ...)."""

    file: str
    reason: str


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """'1 image', '3 images' (`nouns` for irregular plurals)."""
    return f"{count} {noun if count == 1 else (nouns or noun + 's')}"


def _examples(items: Sequence[tuple[str, str]]) -> str:
    shown = ", ".join(f"{os.path.basename(path)} {what}" for path, what in items[:_SHOWN])
    return shown + (f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else "")


def crop_and_upscale_problems(dataset: ImageDataset) -> list[Problem]:
    """The warnings of one dataset about images mostly cropped away or much enlarged (opens no file)."""
    where = f"{dataset.where} ({'validation' if dataset.is_validation else 'training'})"
    crops, enlarged = [], []
    for info in dataset.image_infos:
        assert info.bucket_reso is not None and info.resized_size is not None and info.image_size is not None
        fraction = crop_fraction(info.resized_size, info.bucket_reso)
        if fraction > CROP_WARN_FRACTION:
            crops.append((fraction, info.absolute_path))
        factor = upscale_factor(info.image_size, info.resized_size)
        if factor > UPSCALE_WARN_FACTOR:
            enlarged.append((factor, info.absolute_path))
    problems = []
    if crops:
        crops.sort(key=lambda c: (-c[0], c[1]))
        problems.append(Problem(
            WARNING, where,
            f"the crop to the bucket cuts away more than {CROP_WARN_FRACTION:.0%} of the area of"
            f" {plural(len(crops), 'image')} (up to {crops[0][0]:.0%}:"
            f" {_examples([(p, f'{f:.0%}') for f, p in crops])});"
            " enable_bucket, a wider min_bucket_reso / max_bucket_reso range or cropping the files yourself keeps"
            " more of each image",
            [p for _, p in crops]))
    if enlarged:
        enlarged.sort(key=lambda e: (-e[0], e[1]))
        problems.append(Problem(
            WARNING, where,
            f"enlarged more than {UPSCALE_WARN_FACTOR:g} times, so trained blurry: {plural(len(enlarged), 'image')}"
            f" (up to {enlarged[0][0]:.1f}x: {_examples([(p, f'{f:.1f}x') for f, p in enlarged])}); use larger"
            " files, a lower resolution or bucket_no_upscale",
            [p for _, p in enlarged]))
    return problems


def log_problems(problems: Iterable[Problem]) -> None:
    for p in problems:
        logger.log(logging.ERROR if p.level == ERROR else logging.WARNING, "%s: %s", p.where, p.message)


def quick_check(groups: Sequence[DatasetGroup | None]) -> list[Problem]:
    """The checks that need no file (crops and enlargements), logged as warnings; returns them. Run it right after
    `build_dataset_groups`; `tools/check_dataset.py` runs the full preflight."""
    problems = [p for g in groups if g is not None for d in g.datasets for p in crop_and_upscale_problems(d)]
    log_problems(problems)
    return problems
