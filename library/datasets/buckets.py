"""Aspect-ratio buckets, computed the way sd-scripts does so that datasets keep their bucket layout.

Generation (`make_bucket_resolutions`): with A = width * height of `resolution` and d = `bucket_reso_steps`, the
square bucket of side floor(sqrt(A) / d) * d, plus, for every width w from `min_bucket_reso` to `max_bucket_reso`
in steps of d, the bucket (w, h) and its transpose where h = min(max, floor((A // w) / d) * d), kept when h >= min.

Assignment (`BucketManager.select_bucket`): a bucket of exactly the image size wins; otherwise the bucket with the
nearest aspect ratio. The image is scaled to cover the bucket and the overflow is cropped. With `bucket_no_upscale`
there is no bucket list: an image larger than A is scaled down to area A (the side rounded to d that keeps the
aspect ratio best), and the image's own size floored to multiples of d is its bucket. Without `enable_bucket`
the only bucket is `resolution` itself.

`min_bucket_reso` / `max_bucket_reso` are snapped to multiples of d first (min down, max up), as sd-scripts does,
except that a min below d becomes d: sd-scripts turns it into 0 and dies, and d is the smallest bucket side.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from library.errors import UserError

logger = logging.getLogger(__name__)

Size = tuple[int, int]  # (width, height)


def make_bucket_resolutions(max_reso: Size, min_size: int, max_size: int, divisible: int) -> list[Size]:
    """Every bucket (width, height) for a target resolution, sorted."""
    max_area = max_reso[0] * max_reso[1]
    side = int(math.sqrt(max_area) // divisible) * divisible
    resos = {(side, side)}
    width = min_size
    while width <= max_size:
        height = min(max_size, int((max_area // width) // divisible) * divisible)
        if height >= min_size:
            resos.add((width, height))
            resos.add((height, width))
        width += divisible
    return sorted(resos)


def adjust_min_max_bucket_reso(
    resolution: Size, min_reso: int, max_reso: int, steps: int, where: str = "the dataset"
) -> tuple[int, int]:
    """Snap min down and max up to multiples of `steps` and check that `resolution` lies inside [min, max]. A min
    below `steps` becomes `steps` (the smallest bucket side there is; sd-scripts rounds it to 0 and fails)."""
    if min_reso < steps:
        logger.warning("min_bucket_reso %d of %s is below bucket_reso_steps %d: using %d, the smallest bucket side",
                       min_reso, where, steps, steps)
        min_reso = steps
    elif min_reso % steps:
        snapped = min_reso - min_reso % steps
        logger.warning("min_bucket_reso %d of %s is not a multiple of %d: using %d", min_reso, where, steps, snapped)
        min_reso = snapped
    if max_reso % steps:
        snapped = max_reso + steps - max_reso % steps
        logger.warning("max_bucket_reso %d of %s is not a multiple of %d: using %d", max_reso, where, steps, snapped)
        max_reso = snapped
    if min(resolution) < min_reso:
        raise UserError(
            f"The resolution {resolution[0]}x{resolution[1]} of {where} is smaller than min_bucket_reso {min_reso};"
            " lower min_bucket_reso or raise the resolution."
        )
    if max(resolution) > max_reso:
        raise UserError(
            f"The resolution {resolution[0]}x{resolution[1]} of {where} is larger than max_bucket_reso {max_reso};"
            " raise max_bucket_reso or lower the resolution."
        )
    return min_reso, max_reso


def verify_bucket_reso_steps(steps: int, multiple: int = 16, where: str = "bucket_reso_steps") -> None:
    """Raise a UserError unless `steps` is a multiple of `multiple` (16 for MOSS-Image: VAE stride 8 x patch 2)."""
    if steps % multiple:
        raise UserError(
            f"bucket_reso_steps = {steps} ({where}) is not a multiple of {multiple}: the bucket sizes must be multiples"
            f" of {multiple} for this model (VAE stride 8 x patch 2); use {multiple}, {2 * multiple} or 64."
        )


def crop_fraction(resized_size: Size, bucket_reso: Size) -> float:
    """The share of the resized image's area that the crop to its bucket cuts away (0 = nothing)."""
    resized_area = resized_size[0] * resized_size[1]
    return 1.0 - (bucket_reso[0] * bucket_reso[1]) / resized_area if resized_area else 0.0


def upscale_factor(original_size: Size, resized_size: Size) -> float:
    """How much an image is enlarged before the crop (1.0 or below: not enlarged)."""
    return max(resized_size[0] / original_size[0], resized_size[1] / original_size[1])


@dataclass(frozen=True)
class BucketAssignment:
    """Where an image goes: its bucket, the size it is resized to before cropping, and the aspect-ratio error."""

    bucket_reso: Size
    resized_size: Size
    ar_error: float


class BucketManager:
    """Bucket resolutions of one dataset and the rule that assigns an image to one of them."""

    def __init__(self, resolution: Size, steps: int, no_upscale: bool, predefined: list[Size] | None) -> None:
        self.resolution = resolution
        self.max_area = resolution[0] * resolution[1]
        self.steps = steps
        self.no_upscale = no_upscale
        self.predefined: list[Size] = list(predefined or [])
        self._predefined_set = set(self.predefined)

    @classmethod
    def for_dataset(
        cls,
        resolution: Size,
        enable_bucket: bool,
        min_reso: int,
        max_reso: int,
        steps: int,
        no_upscale: bool,
        where: str = "the dataset",
    ) -> BucketManager:
        """The manager for a dataset's settings (the three modes of the module docstring)."""
        if not enable_bucket:
            return cls(resolution, steps, False, [resolution])
        min_reso, max_reso = adjust_min_max_bucket_reso(resolution, min_reso, max_reso, steps, where)
        if no_upscale:
            return cls(resolution, steps, True, None)
        return cls(resolution, steps, False, make_bucket_resolutions(resolution, min_reso, max_reso, steps))

    def round_to_steps(self, x: float) -> int:
        value = int(x + 0.5)
        return value - value % self.steps

    def _no_upscale_size(self, width: int, height: int) -> Size:
        if width * height <= self.max_area:
            return (width, height)
        aspect = width / height
        resized_w = math.sqrt(self.max_area * aspect)
        resized_h = self.max_area / resized_w
        w_rounded = self.round_to_steps(resized_w)
        h_for_w = self.round_to_steps(w_rounded / aspect)
        h_rounded = self.round_to_steps(resized_h)
        w_for_h = self.round_to_steps(h_rounded * aspect)
        err_w = abs(w_rounded / h_for_w - aspect) if h_for_w else math.inf
        err_h = abs(w_for_h / h_rounded - aspect) if h_rounded else math.inf
        if err_w < err_h:
            return (w_rounded, int(w_rounded / aspect + 0.5))
        return (int(h_rounded * aspect + 0.5), h_rounded)

    def select_bucket(self, width: int, height: int) -> BucketAssignment:
        """Assign an image of the given original size; the bucket may have a zero side only in no-upscale mode
        for an image narrower than `steps` (the caller reports and skips such images)."""
        aspect = width / height
        if self.no_upscale:
            resized = self._no_upscale_size(width, height)
            bucket = (resized[0] - resized[0] % self.steps, resized[1] - resized[1] % self.steps)
        else:
            if (width, height) in self._predefined_set:
                bucket = (width, height)
            else:
                bucket = min(self.predefined, key=lambda r: abs(r[0] / r[1] - aspect))
            scale = bucket[1] / height if aspect > bucket[0] / bucket[1] else bucket[0] / width
            resized = (int(width * scale + 0.5), int(height * scale + 0.5))
        ar_error = (bucket[0] / bucket[1] - aspect) if bucket[1] else math.inf
        return BucketAssignment(bucket, resized, ar_error)

    def fits_without_upscale(self, width: int, height: int) -> bool:
        """True when some bucket is no larger than the image on both sides (so it is never enlarged)."""
        if self.no_upscale:
            return True
        return any(bw <= width and bh <= height for bw, bh in self.predefined)
