"""Bucket generation and assignment against hand-computed examples (sd-scripts' rules)."""

from __future__ import annotations

import pytest

from library.datasets.buckets import (
    BucketManager,
    adjust_min_max_bucket_reso,
    crop_fraction,
    make_bucket_resolutions,
    upscale_factor,
    verify_bucket_reso_steps,
)
from library.errors import UserError

# 1024x1024, steps 64, 256..2048. For each width w: h = min(2048, floor((1048576 // w) / 64) * 64), e.g.
# w=576: 1048576 // 576 = 1820 -> 28 * 64 = 1792; w=1216: 862 -> 13 * 64 = 832; w=1984: 528 -> 8 * 64 = 512.
BUCKETS_1024_64 = sorted(
    {
        (256, 2048), (320, 2048), (384, 2048), (448, 2048), (512, 2048), (576, 1792), (640, 1600), (704, 1472),
        (768, 1344), (832, 1216), (896, 1152), (960, 1088), (1024, 1024), (1088, 960), (1152, 896), (1216, 832),
        (1280, 768), (1344, 768), (1408, 704), (1472, 704), (1536, 640), (1600, 640), (1664, 576), (1728, 576),
        (1792, 576), (1856, 512), (1920, 512), (1984, 512), (2048, 512),
        # transposes that are not in the list above
        (2048, 256), (2048, 320), (2048, 384), (2048, 448), (768, 1280), (704, 1408), (640, 1536), (576, 1664),
        (576, 1728), (512, 1856), (512, 1920), (512, 1984),
    }
)


def test_1024_steps_64_range_256_2048() -> None:
    buckets = make_bucket_resolutions((1024, 1024), 256, 2048, 64)
    assert len(BUCKETS_1024_64) == 41
    assert buckets == BUCKETS_1024_64


def test_512_steps_16_moss_minimum() -> None:
    buckets = make_bucket_resolutions((512, 512), 256, 1024, 16)
    # 32 landscape buckets (w = 528..1024), their 32 transposes, and the square
    assert len(buckets) == 65
    for b in [(512, 512), (528, 496), (544, 480), (672, 384), (688, 368), (1024, 256), (256, 1024), (368, 704)]:
        assert b in buckets
    assert (640, 384) not in buckets  # w=640: 262144 // 640 = 409 -> 25 * 16 = 400, so (640, 400)
    assert (640, 400) in buckets
    assert all(w % 16 == 0 and h % 16 == 0 and w * h <= 512 * 512 for w, h in buckets)


def test_select_nearest_aspect_ratio_and_cover() -> None:
    m = BucketManager.for_dataset((1024, 1024), True, 256, 2048, 64, False)
    a = m.select_bucket(1536, 1024)  # AR 1.5: 1216/832 = 1.4615 beats 1280/768 = 1.667
    assert a.bucket_reso == (1216, 832)
    assert a.resized_size == (1248, 832)  # scale 832/1024: the height fits, the width overflows by 32
    assert a.ar_error == pytest.approx(1216 / 832 - 1.5)
    exact = m.select_bucket(1344, 768)  # an exact bucket size wins
    assert exact.bucket_reso == (1344, 768) and exact.resized_size == (1344, 768)
    tall = m.select_bucket(500, 1000)  # AR 0.5: 704/1408 = 0.5 exactly
    assert tall.bucket_reso == (704, 1408) and tall.resized_size == (704, 1408)


def test_512_steps_16_assignment() -> None:
    m = BucketManager.for_dataset((512, 512), True, 256, 1024, 16, False)
    a = m.select_bucket(1920, 1080)  # 16:9 = 1.778: 672/384 = 1.75 is nearest
    assert a.bucket_reso == (672, 384)
    assert a.resized_size == (683, 384)  # 1920 * 384 / 1080 = 682.7


def test_small_images_are_detected() -> None:
    m = BucketManager.for_dataset((1024, 1024), True, 256, 2048, 64, False)
    assert not m.fits_without_upscale(600, 600)
    assert m.select_bucket(600, 600).resized_size == (1024, 1024)
    assert m.fits_without_upscale(1100, 1100)


def test_no_upscale_mode() -> None:
    m = BucketManager.for_dataset((1024, 1024), True, 256, 2048, 64, True)
    # 2000x1000 is larger than 1024^2: area-preserving size 1448.2 x 724.1, rounded to steps -> 1408 x 704
    big = m.select_bucket(2000, 1000)
    assert big.bucket_reso == (1408, 704) and big.resized_size == (1408, 704)
    small = m.select_bucket(300, 200)  # never enlarged: own bucket floored to steps
    assert small.resized_size == (300, 200) and small.bucket_reso == (256, 192)
    assert m.select_bucket(40, 20).bucket_reso == (0, 0)  # the dataset skips such images
    assert m.fits_without_upscale(300, 200)


def test_without_buckets_everything_goes_to_resolution() -> None:
    m = BucketManager.for_dataset((64, 48), False, 256, 1024, 64, False)
    a = m.select_bucket(100, 100)
    assert a.bucket_reso == (64, 48) and a.resized_size == (64, 64)
    assert m.select_bucket(32, 24).resized_size == (64, 48)


def test_min_max_snapping_and_range() -> None:
    assert adjust_min_max_bucket_reso((1024, 1024), 250, 1000, 64) == (192, 1024)
    with pytest.raises(UserError, match="smaller than min_bucket_reso 256"):
        adjust_min_max_bucket_reso((128, 128), 256, 1024, 64)
    with pytest.raises(UserError, match="larger than max_bucket_reso 1024"):
        adjust_min_max_bucket_reso((2048, 1024), 256, 1024, 64)


def test_verify_bucket_reso_steps() -> None:
    for ok in (16, 32, 64, 128):
        verify_bucket_reso_steps(ok, 16)
    for bad in (8, 24, 40, 100):
        with pytest.raises(UserError, match=f"bucket_reso_steps = {bad} .*not a multiple of 16"):
            verify_bucket_reso_steps(bad, 16)


def test_min_bucket_reso_below_steps_becomes_steps(caplog) -> None:
    """sd-scripts rounds 32 with steps 64 down to 0; it used to give 1, 65, 129, ... wide buckets (128x65 among
    them), which the VAE cache cannot encode. The smallest bucket side is the step itself."""
    with caplog.at_level("WARNING"):
        assert adjust_min_max_bucket_reso((128, 128), 32, 1024, 64) == (64, 1024)
    assert "min_bucket_reso 32 of the dataset is below bucket_reso_steps 64: using 64" in caplog.text
    m = BucketManager.for_dataset((128, 128), True, 32, 1024, 64, False)
    assert all(w % 64 == 0 and h % 64 == 0 for w, h in m.predefined)
    assert (64, 256) in m.predefined and (128, 128) in m.predefined
    assert m.select_bucket(128, 65).bucket_reso == (128, 128)  # nearest aspect ratio among the 64-multiples
    assert adjust_min_max_bucket_reso((1024, 1024), 0, 1024, 64)[0] == 64


def test_crop_and_upscale_measures() -> None:
    assert crop_fraction((1024, 1024), (1024, 1024)) == 0
    assert crop_fraction((1000, 100), (100, 100)) == pytest.approx(0.9)
    m = BucketManager.for_dataset((64, 64), False, 256, 1024, 64, False)
    a = m.select_bucket(2000, 60)  # an extreme aspect ratio without buckets: scaled to height 64, 97 % cropped
    assert a.resized_size == (2133, 64) and crop_fraction(a.resized_size, a.bucket_reso) == pytest.approx(0.97, abs=0.01)
    assert upscale_factor((16, 16), (64, 64)) == 4 and upscale_factor((2000, 60), a.resized_size) < 1.1
