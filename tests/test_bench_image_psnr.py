"""bench.image_psnr: the PSNR of paired PNGs of two folders."""

from __future__ import annotations

import math

import numpy as np
import pytest
from PIL import Image

from bench import image_psnr


def test_psnr_pairs_the_folders_pngs_in_name_order(tmp_path):
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
    noisy = img.copy()
    noisy[0, 0, 0] ^= 1  # one value one step off: mse 1 / 768
    for folder, (a, b) in (("x", (img, img)), ("y", (img, noisy))):
        (tmp_path / folder).mkdir()
        Image.fromarray(a).save(tmp_path / folder / "0.png")
        Image.fromarray(b).save(tmp_path / folder / "1.png")
    res = image_psnr.compare(tmp_path / "x", tmp_path / "y")
    assert [p["first"] for p in res["pairs"]] == ["0.png", "1.png"]
    assert math.isinf(res["pairs"][0]["psnr_db"])
    assert res["pairs"][1]["psnr_db"] == pytest.approx(10 * math.log10(255.0 ** 2 * 768), abs=0.01)
    (tmp_path / "z").mkdir()
    with pytest.raises(SystemExit, match="same prompts"):
        image_psnr.compare(tmp_path / "x", tmp_path / "z")
