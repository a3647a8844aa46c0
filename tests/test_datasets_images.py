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


def write_png16(path, pixels) -> None:
    """A 16-bit PNG written byte by byte (Pillow cannot write 16-bit RGB): `pixels` uint16 [H, W] or [H, W, 3]."""
    import struct
    import zlib

    import numpy as np

    pixels = np.asarray(pixels, dtype=">u2")
    h, w = pixels.shape[:2]
    colour_type = 2 if pixels.ndim == 3 else 0

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    rows = b"".join(b"\x00" + pixels[y].tobytes() for y in range(h))
    header = struct.pack(">IIBBBBB", w, h, 16, colour_type, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows))
                     + chunk(b"IEND", b""))


def test_16_bit_greyscale_png_trains_as_the_same_image_as_its_8_bit_copy(tmp_path) -> None:
    import numpy as np

    eight = np.tile(np.arange(0, 256, 4, dtype=np.uint8), (8, 1))  # [8, 64] dark-to-light ramp
    Image.fromarray(eight, "L").save(tmp_path / "g8.png")
    Image.fromarray(eight.astype(np.uint16) * 257).save(tmp_path / "g16.png")
    assert Image.open(tmp_path / "g16.png").mode == "I;16"
    a = prepare_image(str(tmp_path / "g8.png"), (64, 8), (64, 8)).image
    b = prepare_image(str(tmp_path / "g16.png"), (64, 8), (64, 8)).image
    assert torch.equal(a, b)
    assert b.mean() < 0.1  # a plain convert("RGB") clips 16-bit values: almost white, mean close to 1
    assert torch.equal(b[0], b[1]) and torch.equal(b[1], b[2])


def test_16_bit_variants_and_rgb_png(tmp_path) -> None:
    import numpy as np

    from library.datasets.images import to_rgb

    values = np.array([[0, 257 * 100, 65535, 70000]], dtype=np.int64)  # 70000: out of range in mode I, clipped
    out = np.asarray(to_rgb(Image.fromarray(values.astype(np.int32), "I"), False))
    assert out[0, :, 0].tolist() == [0, 100, 255, 255]
    big_endian = Image.frombytes("I;16B", (3, 1), np.array([0, 257 * 7, 65535], dtype=">u2").tobytes())
    assert np.asarray(to_rgb(big_endian, True))[0, :, :].tolist() == [[0, 0, 0, 255], [7, 7, 7, 255], [255] * 4]
    rgb16 = np.zeros((4, 4, 3), dtype=np.uint16)
    rgb16[..., 0], rgb16[..., 1], rgb16[..., 2] = 257 * 200, 257 * 10, 257 * 90
    write_png16(tmp_path / "rgb16.png", rgb16)
    grey16 = np.full((4, 4), 257 * 30, dtype=np.uint16)
    write_png16(tmp_path / "grey16.png", grey16)
    img = prepare_image(str(tmp_path / "rgb16.png"), (4, 4), (4, 4)).image
    assert torch.allclose(img[:, 0, 0], torch.tensor([200, 10, 90]) / 127.5 - 1)
    grey = prepare_image(str(tmp_path / "grey16.png"), (4, 4), (4, 4)).image
    assert torch.allclose(grey[:, 0, 0], torch.full((3,), 30 / 127.5 - 1))


@pytest.mark.parametrize("mode, colour", [("L", 77), ("LA", (77, 128)), ("1", 1), ("CMYK", (0, 255, 255, 0))])
def test_other_modes_become_rgb(tmp_path, mode, colour) -> None:
    ext = ".jpg" if mode == "CMYK" else ".png"
    path = make_image(tmp_path / f"m{ext}", (8, 8), colour, mode)
    p = prepare_image(str(path), (8, 8), (8, 8))
    assert p.image.shape == (3, 8, 8)
    pixel = ((p.image[:, 4, 4] + 1) * 127.5).round().tolist()
    expected = {"L": [77] * 3, "LA": [77] * 3, "1": [255] * 3, "CMYK": [255, 0, 0]}[mode]
    assert all(abs(a - b) <= 2 for a, b in zip(pixel, expected))  # CMYK goes through JPEG: a small error


def test_palette_transparency_is_the_alpha_mask(tmp_path) -> None:
    img = Image.new("P", (8, 4), 1)
    img.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)
    img.paste(0, (0, 0, 4, 4))
    img.save(tmp_path / "p.png", transparency=0)
    p = prepare_image(str(tmp_path / "p.png"), (8, 4), (8, 4), alpha_mask=True)
    assert p.alpha_mask[:, :4].max() == 0 and p.alpha_mask[:, 4:].min() == 1
    assert ((p.image[:, 0, 6] + 1) * 127.5).round().tolist() == [10, 200, 30]
    plain = prepare_image(str(tmp_path / "p.png"), (8, 4), (8, 4))
    assert torch.equal(plain.image, p.image)


def test_unsupported_mode_is_skipped_by_size_and_refused_by_loading(tmp_path) -> None:
    from library.datasets.images import read_image_header

    path = tmp_path / "float.png"  # a floating-point TIFF under a PNG name
    Image.new("F", (8, 8), 0.5).save(path, format="TIFF")
    assert read_image_header(str(path)) == ((8, 8), "F")
    with pytest.raises(UnreadableImage, match="float.png: colour mode F is not supported"):
        read_image_size(str(path))
    with pytest.raises(UserError, match="float.png.*colour mode F is not supported"):
        prepare_image(str(path), (8, 8), (8, 8))
