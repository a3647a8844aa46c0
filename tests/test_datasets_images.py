"""Image loading, resize/crop to a bucket, flip, color augmentation, alpha masks and unreadable files."""

from __future__ import annotations

import random

import pytest
import torch
from PIL import Image

from library.datasets.images import (
    UnreadableImage,
    color_augment,
    crop_offsets,
    interpolation_for,
    prepare_image,
    read_image_size,
)
from library.errors import UserError
from tests.test_datasets_support import make_gradient, make_image


def test_resize_and_centre_crop(tmp_path) -> None:
    path = make_gradient(tmp_path / "g.png", (80, 40))
    p = prepare_image(str(path), (32, 32), (64, 32))
    assert p.image.shape == (3, 32, 32) and p.image.dtype == torch.float32
    assert p.image.min() >= -1 and p.image.max() <= 1
    assert p.original_size == (80, 40) and p.crop_top_left == (0, 16) and not p.flipped
    red = p.image[0, 0]
    assert red[0] < red[-1]  # left-to-right gradient survives
    assert p.alpha_mask is None


def test_flip_mirrors_image_and_mask(tmp_path) -> None:
    path = make_gradient(tmp_path / "g.png", (32, 16))
    plain = prepare_image(str(path), (32, 16), (32, 16))
    flipped = prepare_image(str(path), (32, 16), (32, 16), flip=True)
    assert torch.equal(flipped.image, plain.image.flip(-1)) and flipped.flipped


def test_random_crop_uses_the_rng(tmp_path) -> None:
    path = make_gradient(tmp_path / "g.png", (96, 32))
    offsets = {prepare_image(str(path), (32, 32), (96, 32), crop_rng=random.Random(i)).crop_top_left for i in range(20)}
    assert len(offsets) > 3 and all(top == 0 and 0 <= left <= 64 for top, left in offsets)
    assert crop_offsets((96, 32), (32, 32), None) == (32, 0)


def test_alpha_mask(tmp_path) -> None:
    img = Image.new("RGBA", (16, 16), (10, 20, 30, 255))
    img.paste((10, 20, 30, 0), (0, 0, 8, 16))  # left half transparent
    img.save(tmp_path / "a.png")
    p = prepare_image(str(tmp_path / "a.png"), (16, 16), (16, 16), alpha_mask=True)
    assert p.alpha_mask.shape == (16, 16)
    assert p.alpha_mask[:, :8].max() == 0 and p.alpha_mask[:, 8:].min() == 1
    pf = prepare_image(str(tmp_path / "a.png"), (16, 16), (16, 16), alpha_mask=True, flip=True)
    assert torch.equal(pf.alpha_mask, p.alpha_mask.flip(-1))
    opaque = prepare_image(str(make_image(tmp_path / "o.jpg", (16, 16))), (16, 16), (16, 16), alpha_mask=True)
    assert torch.all(opaque.alpha_mask == 1)


def test_interpolation_choice(tmp_path) -> None:
    assert interpolation_for(None, (100, 100), (50, 50)) == Image.Resampling.BOX
    assert interpolation_for(None, (100, 100), (200, 200)) == Image.Resampling.LANCZOS
    assert interpolation_for("nearest", (100, 100), (50, 50)) == Image.Resampling.NEAREST
    path = make_gradient(tmp_path / "g.png", (64, 8))
    a = prepare_image(str(path), (16, 2), (16, 2), interpolation="nearest").image
    b = prepare_image(str(path), (16, 2), (16, 2), interpolation="bilinear").image
    assert not torch.equal(a, b)


def test_color_augment_changes_some_images(tmp_path) -> None:
    img = Image.new("RGB", (8, 8), (200, 80, 40))
    outs = [color_augment(img, random.Random(i)) for i in range(40)]
    changed = sum(o.tobytes() != img.tobytes() for o in outs)
    assert 3 <= changed <= 30  # applied with probability 0.33
    assert all(o.size == img.size and o.mode == "RGB" for o in outs)


def test_unreadable_and_corrupt_files_name_the_file(tmp_path) -> None:
    junk = tmp_path / "junk.png"
    junk.write_bytes(b"not an image")
    with pytest.raises(UnreadableImage, match="junk.png"):
        read_image_size(str(junk))
    good = make_image(tmp_path / "t.png", (64, 64))
    data = good.read_bytes()
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(data[: len(data) // 2])
    assert read_image_size(str(truncated)) == (64, 64)  # the header is fine
    with pytest.raises(UserError, match="truncated.png.*could not be decoded"):
        prepare_image(str(truncated), (64, 64), (64, 64))
