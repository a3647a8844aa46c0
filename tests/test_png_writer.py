"""generation.PngWriter: images decoded on the caller's thread, PNGs written by writer threads, paths in the order
added, the first error raised by finish() and every added image written even then."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from library.errors import UserError
from library.moss_image.vae import make_tiny_vae
from library.sampling import generation
from library.sampling.generation import GenerationSettings, PngWriter


def _latents(seed: int) -> torch.Tensor:
    return torch.randn(1, 128, 2, 2, generator=torch.Generator().manual_seed(seed))


def test_paths_in_the_order_added_with_their_settings(tmp_path):
    vae = make_tiny_vae(0)
    with PngWriter(vae, workers=3) as writer:
        for i in range(4):
            writer.add(_latents(i), tmp_path / f"{i}.png", GenerationSettings(prompt=f"p{i}", seed=i), {"step": i})
        paths = writer.finish()
    assert [p.name for p in paths] == ["0.png", "1.png", "2.png", "3.png"]
    assert [Image.open(p).text["prompt"] for p in paths] == ["p0", "p1", "p2", "p3"]
    assert writer.decode_s > 0
    expected = generation.decode_to_pil(vae, _latents(2))[0]
    assert list(Image.open(paths[2]).getdata()) == list(expected.getdata())


def test_the_first_error_is_raised_and_the_other_images_are_written(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with PngWriter(make_tiny_vae(0)) as writer:
        writer.add(_latents(0), blocker / "a.png", GenerationSettings(prompt="a"))  # a file where a folder must be
        writer.add(_latents(1), tmp_path / "b.png", GenerationSettings(prompt="b"))
        with pytest.raises(UserError):
            writer.finish()
    assert (tmp_path / "b.png").exists() and not list(tmp_path.glob(".*.tmp"))


def test_pixels_are_the_decoded_images_rounded_to_bytes():
    vae = make_tiny_vae(0)
    latents = torch.cat([_latents(3), _latents(4)])
    images = generation.decode_to_pil(vae, latents)
    raw = generation.unpatchify_latents(generation.denormalize_latents(
        latents, vae.bn.running_mean.float(), vae.bn.running_var.float()))
    decoded = vae.decode(raw).clamp(-1, 1)
    for image, img in zip(images, decoded, strict=True):
        expected = ((img + 1) * 127.5).round().byte().permute(1, 2, 0)
        assert image.size == (img.shape[2], img.shape[1])
        assert torch.equal(torch.from_numpy(np.array(image)), expected)


def test_the_decoder_warm_up_runs_one_small_decode():
    vae = make_tiny_vae(0)
    shapes = []
    handle = vae.decoder.register_forward_hook(lambda module, args, out: shapes.append(tuple(out.shape)))
    vae.warm_up_decoder()
    handle.remove()
    side = vae.WARM_UP_LATENT * vae.config.downscale
    assert shapes == [(1, 3, side, side)]
