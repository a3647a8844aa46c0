"""moss_image_minimal_inference.py on the tiny snapshot: generation, LoRA merge at load, prompt files, latents."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

import moss_image_minimal_inference as inf
from library.errors import UserError
from library.files.safetensors_io import load_safetensors, save_file_atomic


def _run(tiny_snapshot, out, *extra):
    argv = ["--snapshot", str(tiny_snapshot), "--image_size", "32", "32", "--infer_steps", "3", "--seed", "11",
            "--save_path", str(out), *extra]
    return inf.run(inf.setup_parser().parse_args(argv))


def _latents(paths):
    return [load_safetensors(p)["latents"] for p in paths if p.suffix == ".safetensors"]


@pytest.fixture(scope="module")
def random_lora(tiny_snapshot, tmp_path_factory):
    """A LoRA with non-zero weights on every DiT block Linear (as trained, saved by lora_generic)."""
    from library.moss_image.loaders import load_moss_image_model
    from networks import lora_generic

    dit = load_moss_image_model("cpu", tiny_snapshot, dtype=torch.float32)
    net = lora_generic.create_network(1.0, 4, 2.0, None, [], dit)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("lora") / "random_lora.safetensors"
    net.save_weights(str(path), torch.float32, {"ss_network_module": "networks.lora_generic"})
    return path


def test_generate_png_with_metadata(tiny_snapshot, tmp_path):
    paths = _run(tiny_snapshot, tmp_path, "--prompt", "a red square\\nsecond line")
    assert len(paths) == 1 and paths[0].suffix == ".png"
    img = Image.open(paths[0])
    assert img.size == (32, 32)
    assert img.text["prompt"] == "a red square\nsecond line" and img.text["seed"] == "11"
    assert '"sample_steps": 3' in img.text["moss_image_settings"]


def test_lora_merge_changes_output_and_multiplier_zero_is_exact(tiny_snapshot, tmp_path, random_lora):
    cpu = ("--prompt", "cat", "--output_type", "latent", "--device", "cpu")  # fp32: the merge arithmetic, not bf16 rounding
    base = _latents(_run(tiny_snapshot, tmp_path / "a", *cpu))[0]
    zero = _latents(_run(tiny_snapshot, tmp_path / "b", *cpu, "--lora_weight", str(random_lora),
                         "--lora_multiplier", "0"))[0]
    merged = _latents(_run(tiny_snapshot, tmp_path / "c", *cpu, "--lora_weight", str(random_lora)))[0]
    twice = _latents(_run(tiny_snapshot, tmp_path / "d", *cpu, "--lora_weight", str(random_lora), str(random_lora),
                          "--lora_multiplier", "0.5", "0.5"))[0]
    assert torch.equal(base, zero)
    assert (merged - base).abs().max() > 1e-3
    torch.testing.assert_close(twice, merged, atol=1e-4, rtol=1e-4)  # two halves = one full LoRA


def test_unmatched_lora_keys_are_reported(tiny_snapshot, tmp_path, caplog):
    lora = tmp_path / "other.safetensors"
    save_file_atomic({"lora_unet_not_a_module.lora_down.weight": torch.zeros(2, 64),
                      "lora_unet_not_a_module.lora_up.weight": torch.zeros(64, 2)}, lora)
    _run(tiny_snapshot, tmp_path, "--prompt", "cat", "--output_type", "latent", "--lora_weight", str(lora))
    assert "1 DiT LoRA modules matched no weight" in caplog.text


def test_from_file_and_latent_then_decode(tiny_snapshot, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("first --w 48 --h 32 --d 1\n# comment\nsecond --l 1.0 --s 2 --d 2\n")
    latent_files = _run(tiny_snapshot, tmp_path / "lat", "--from_file", str(prompts), "--output_type", "latent")
    assert len(latent_files) == 2
    assert _latents(latent_files)[0].shape == (1, 128, 2, 3)  # 32 x 48 image -> 2 x 3 latent grid
    pngs = inf.run(inf.setup_parser().parse_args(
        ["--vae", str(tiny_snapshot / "flux2-vae.safetensors"), "--save_path", str(tmp_path / "png"),
         "--latent_path", *map(str, latent_files)]))
    assert [Image.open(p).size for p in pngs] == [(48, 32), (32, 32)]
    assert Image.open(pngs[0]).text["prompt"] == "first"


@pytest.mark.parametrize("extra, message", [
    (["--image_size", "30", "32"], "multiple of 16"),
    (["--lora_multiplier", "1", "2", "--lora_weight", "x.safetensors"], "one --lora_multiplier per --lora_weight"),
    (["--uncond_skip_layers", "a"], "not a block index"),
])
def test_bad_options(tiny_snapshot, tmp_path, extra, message):
    with pytest.raises(UserError, match=message):
        _run(tiny_snapshot, tmp_path, "--prompt", "x", *extra)


def test_main_exit_code_on_error(tmp_path):
    assert inf.main(["--prompt", "x", "--save_path", str(tmp_path)]) == 2


def test_interactive_reads_prompts_until_an_empty_line(tiny_snapshot, tmp_path, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("first prompt --w 48 --h 32\nsecond --s 2\n\nnever read\n"))
    loads = []
    real_load = inf.load_dit
    monkeypatch.setattr(inf, "load_dit", lambda *a: loads.append(1) or real_load(*a))
    paths = _run(tiny_snapshot, tmp_path, "--interactive", "--output_type", "both")
    assert sorted(p.suffix for p in paths) == [".png", ".png", ".safetensors", ".safetensors"]
    assert _latents(paths)[0].shape == (1, 128, 2, 3)
    assert len(loads) == 1  # the models stay loaded between prompts


def test_several_prompts_are_written_in_order_by_the_png_writer(tiny_snapshot, tmp_path):
    import gc

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first\nsecond --s 2\nthird\n")
    paths = _run(tiny_snapshot, tmp_path / "out", "--from_file", str(prompts))
    assert [Image.open(p).text["prompt"] for p in paths] == ["first", "second", "third"]
    assert [p.stem.split("_")[-2] for p in paths] == ["00", "01", "02"]
    assert gc.isenabled()  # the collector is Python's again after the denoising loop


def test_a_png_that_cannot_be_written_is_a_user_error(tiny_snapshot, tmp_path):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    with pytest.raises(UserError):
        _run(tiny_snapshot, blocker / "out", "--prompt", "x")
