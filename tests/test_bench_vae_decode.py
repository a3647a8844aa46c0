"""bench.vae_decode on the tiny snapshot (CPU): each form timed, the PSNR of the others against float32."""

from __future__ import annotations

import json

import pytest

from bench import vae_decode


def test_vae_decode_times_the_forms_against_float32(tiny_snapshot, tmp_path):
    out = tmp_path / "v.json"
    argv = ["--snapshot", str(tiny_snapshot), "--out", str(out), "--image_size", "32", "32", "--iters", "1",
            "--warmup", "1", "--device", "cpu", "--forms", "float32,float32_channels_last,bfloat16"]
    assert vae_decode.main(argv) == 0
    forms = json.loads(out.read_text())["forms"]
    assert forms["float32"]["median_ms"] > 0 and forms["float32"]["png_encode_ms"] > 0
    assert forms["float32_channels_last"]["psnr_db_vs_float32"] > 60  # the same arithmetic in another layout
    assert 20 < forms["bfloat16"]["psnr_db_vs_float32"] < 80


def test_float32_comes_first():
    with pytest.raises(SystemExit):
        vae_decode.main(["--snapshot", ".", "--forms", "bfloat16,float32"])
