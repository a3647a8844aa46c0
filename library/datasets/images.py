"""Image files: size probing, loading, resize + crop to a bucket, flip / color augmentation, alpha masks.

Bad files, the rule of this project:
- while the dataset is built, each image's header is read to learn its size; a file that cannot be opened as an
  image is *skipped with a warning* that names it (the run goes on with the other images, and the log gives the
  count);
- a file whose header was fine but whose pixels cannot be decoded later (truncated or corrupt data) *stops the run*
  with a UserError naming the file, because dropping a sample in the middle of an epoch would silently change the
  batches.

Images are read as stored (no EXIF rotation, as in sd-scripts, so sizes match existing cache file names).
Interpolation: `resize_interpolation` if set, else area (box) filtering when shrinking and Lanczos when enlarging.

Colour modes (`to_rgb`): every mode that PNG, JPEG, WebP, BMP and AVIF files open as becomes RGB (RGBA with
alpha_mask). 16-bit greyscale (`I;16*`, and `I`, which older Pillow versions give for the same files) is scaled from
0..65535 to 0..255 (a plain `convert` would clip it to an almost white image); 16-bit RGB(A) files already open as
8-bit RGB(A). Palette images with a transparent colour go through RGBA (their alpha is the mask). CMYK and YCbCr use
Pillow's conversion (colour profiles are not applied, as in sd-scripts). Any other mode (floating point `F`, Lab,
packed BGR, ...: a TIFF under an image extension, say) is refused: `read_image_size` raises UnreadableImage, so the
file is skipped while the dataset is built.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from library.errors import UserError

logger = logging.getLogger(__name__)

_BASE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
_INTERPOLATIONS = {
    "lanczos": Image.Resampling.LANCZOS,
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "linear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "cubic": Image.Resampling.BICUBIC,
    "area": Image.Resampling.BOX,
    "box": Image.Resampling.BOX,
}
_HUE_SHIFT_LIMIT = 8 / 180  # fraction of the hue circle (sd-scripts: 8 of OpenCV's 180 hue units)


@lru_cache(maxsize=1)
def image_extensions() -> tuple[str, ...]:
    """Lower-case extensions of the image files a subset folder contributes."""
    from PIL import features

    extra = (".avif",) if features.check("avif") else ()
    return _BASE_EXTENSIONS + extra


class UnreadableImage(Exception):
    """An image file that cannot be opened; the message names the file and the reason."""


_OPEN_ERRORS = (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError)
SIXTEEN_BIT_MODES = frozenset({"I", "I;16", "I;16L", "I;16B", "I;16N"})  # greyscale, 0..65535
SUPPORTED_MODES = frozenset({"1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr"}) | SIXTEEN_BIT_MODES


def unsupported_mode_reason(mode: str) -> str | None:
    """Why images of a Pillow mode cannot be trained on (None when they can)."""
    if mode in SUPPORTED_MODES:
        return None
    return (f"colour mode {mode} is not supported (use 8- or 16-bit greyscale, palette, RGB, RGBA, CMYK or YCbCr"
            " images: save it as an 8-bit PNG or a JPEG)")


def read_image_header(path: str) -> tuple[tuple[int, int], str]:
    """((width, height), Pillow mode) from the file header, without decoding the pixels."""
    try:
        with Image.open(path) as img:
            return img.size, img.mode
    except _OPEN_ERRORS as e:
        raise UnreadableImage(f"{path}: {e}") from e


def read_image_size(path: str) -> tuple[int, int]:
    """(width, height) from the file header; UnreadableImage also for a colour mode that cannot be trained on."""
    size, mode = read_image_header(path)
    reason = unsupported_mode_reason(mode)
    if reason is not None:
        raise UnreadableImage(f"{path}: {reason}")
    return size


def _sixteen_bit_to_l(img: Image.Image) -> Image.Image:
    """A 16-bit greyscale image scaled to 8 bits (65535 -> 255, rounded), not clipped."""
    values = np.asarray(img).astype(np.int64).clip(0, 65535)
    return Image.fromarray(((values * 255 + 32767) // 65535).astype(np.uint8), "L")


def to_rgb(img: Image.Image, with_alpha: bool) -> Image.Image:
    """A decoded image as RGB, or RGBA when the alpha channel is needed (see the module docstring for the modes)."""
    reason = unsupported_mode_reason(img.mode)
    if reason is not None:
        raise ValueError(reason)
    if img.mode in SIXTEEN_BIT_MODES:
        img = _sixteen_bit_to_l(img)
    elif img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    mode = "RGBA" if with_alpha else "RGB"
    return img if img.mode == mode else img.convert(mode)


def load_image(path: str, with_alpha: bool) -> Image.Image:
    """Decode an image as RGB, or RGBA when the alpha channel is needed."""
    try:
        with Image.open(path) as img:
            img.load()
            return to_rgb(img, with_alpha)
    except _OPEN_ERRORS as e:
        raise UserError(
            f"The image '{path}' could not be decoded ({e}); replace or remove the file and start again."
        ) from e


def interpolation_for(name: str | None, src: tuple[int, int], dst: tuple[int, int]) -> Image.Resampling:
    """The PIL filter for a `resize_interpolation` value (None = area when shrinking, Lanczos when enlarging)."""
    if name is not None:
        return _INTERPOLATIONS[name]
    shrinking = dst[0] <= src[0] and dst[1] <= src[1]
    return Image.Resampling.BOX if shrinking else Image.Resampling.LANCZOS


def crop_offsets(size: tuple[int, int], bucket: tuple[int, int], rng: random.Random | None) -> tuple[int, int]:
    """(left, top) of the crop: centred, or uniform at random when `rng` is given (random_crop)."""
    spare_w, spare_h = size[0] - bucket[0], size[1] - bucket[1]
    if rng is None:
        return spare_w // 2, spare_h // 2
    return rng.randint(0, spare_w), rng.randint(0, spare_h)


def color_augment(img: Image.Image, rng: random.Random) -> Image.Image:
    """sd-scripts' light color augmentation: with probability 0.33, a small hue shift or a small gamma change."""
    if rng.random() > 0.33:
        return img
    if rng.random() > 0.5:
        shift = int(round(rng.uniform(-_HUE_SHIFT_LIMIT, _HUE_SHIFT_LIMIT) * 256)) % 256
        hsv = np.array(img.convert("HSV"))
        hsv[..., 0] = (hsv[..., 0].astype(np.int16) + shift) % 256
        return Image.fromarray(hsv, "HSV").convert("RGB")
    gamma = rng.uniform(0.95, 1.05)
    table = [min(255, int(round(255 * (i / 255) ** gamma))) for i in range(256)]
    return img.point(table * 3)


def to_tensor(img: Image.Image) -> torch.Tensor:
    """RGB image -> float32 [3, H, W] in [-1, 1]."""
    arr = np.asarray(img, dtype=np.uint8)
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).float().div_(127.5).sub_(1.0)


def _alpha_to_mask(alpha: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(alpha, dtype=np.uint8).copy()).float().div_(255.0)


@dataclass
class PreparedImage:
    """An image ready for a batch (or for the VAE when caching latents)."""

    image: torch.Tensor  # [3, H, W] float32 in [-1, 1]
    alpha_mask: torch.Tensor | None  # [H, W] float32 in [0, 1], 1 = train on this pixel
    original_size: tuple[int, int]  # (width, height) of the file
    crop_top_left: tuple[int, int]  # (top, left) of the crop in the resized image
    flipped: bool


def prepare_image(
    path: str,
    bucket_reso: tuple[int, int],
    resized_size: tuple[int, int],
    *,
    interpolation: str | None = None,
    alpha_mask: bool = False,
    flip: bool = False,
    color_aug: bool = False,
    crop_rng: random.Random | None = None,
    color_rng: random.Random | None = None,
) -> PreparedImage:
    """Load an image, resize it to `resized_size`, crop it to `bucket_reso` (centred unless `crop_rng` is given),
    then apply the color augmentation and the horizontal flip."""
    img = load_image(path, with_alpha=alpha_mask)
    original = img.size
    if img.size != tuple(resized_size):
        img = img.resize(resized_size, interpolation_for(interpolation, img.size, resized_size))
    left, top = crop_offsets(img.size, bucket_reso, crop_rng)
    img = img.crop((left, top, left + bucket_reso[0], top + bucket_reso[1]))
    mask = None
    if alpha_mask:
        mask = _alpha_to_mask(img.getchannel("A"))
        img = img.convert("RGB")
    if color_aug and color_rng is not None:
        img = color_augment(img, color_rng)
    tensor = to_tensor(img)
    if flip:
        tensor = tensor.flip(-1)
        mask = None if mask is None else mask.flip(-1)
    return PreparedImage(tensor, mask, original, (top, left), flip)
