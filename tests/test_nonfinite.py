"""NaN and infinity: the loss guard, no NaN save, damaged caches re-made or refused, and the inference script
refusing non-finite options and LoRA files."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest
import torch

import library.caching.strategies as sm
import moss_image_minimal_inference as inf
from library.errors import UserError
from library.files.safetensors_io import save_file_atomic
from library.training import nonfinite
from tests.test_caching import FakeTextEncoder, FakeVAE, build, cache_te, image_folder, te_groups


class TinyNetwork(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lora_down = torch.nn.Parameter(torch.ones(2, 3))
        self.register_buffer("alpha", torch.tensor(1.0))


# ------------------------------------------------------------------------------------------------ the loss guard
def test_the_first_nan_loss_stops_the_run_by_default():
    guard = nonfinite.NonFiniteLossGuard()
    guard.observe(0.5, 1, TinyNetwork())
    with pytest.raises(nonfinite.NonFiniteTrainingError, match="The loss was nan at step 2, so training stopped;"
                                                             " the files saved before are kept"):
        guard.observe(float("nan"), 2, TinyNetwork())


def test_consecutive_non_finite_steps_are_counted(caplog):
    guard, net = nonfinite.NonFiniteLossGuard(3), TinyNetwork()
    with caplog.at_level(logging.WARNING):
        guard.observe(float("inf"), 1, net)
        guard.observe(float("nan"), 2, net)
        guard.observe(0.3, 3, net)  # a finite loss resets the count
        guard.observe(float("nan"), 4, net)
        guard.observe(float("nan"), 5, net)
    assert "2 of --max_nan_loss_steps 3 in a row" in caplog.text
    with pytest.raises(nonfinite.NonFiniteTrainingError, match="at 3 consecutive steps \\(the last: step 6\\)"):
        guard.observe(float("nan"), 6, net)


def test_weights_that_are_no_longer_finite_stop_at_once():
    guard, net = nonfinite.NonFiniteLossGuard(5), TinyNetwork()
    with torch.no_grad():
        net.lora_down[1, 2] = float("nan")
    with pytest.raises(nonfinite.NonFiniteTrainingError, match="weights are no longer finite \\(first in 'lora_down'"):
        guard.observe(float("nan"), 1, net)
    with pytest.raises(nonfinite.NonFiniteTrainingError, match="'toy-step00000004.safetensors' was not saved"):
        nonfinite.check_network_finite(net, "toy-step00000004.safetensors", 4)
    nonfinite.check_network_finite(TinyNetwork(), "toy.safetensors", 4)


def test_all_processes_stop_together():
    class TwoProcesses:
        num_processes, device = 2, torch.device("cpu")

        def gather(self, flag):
            return torch.cat([flag, torch.tensor([0.0])])  # the other process had a NaN loss

    with pytest.raises(nonfinite.NonFiniteTrainingError, match="loss was NaN or infinite on another process at step"):
        nonfinite.NonFiniteLossGuard().observe(0.25, 9, TinyNetwork(), TwoProcesses())


def test_finite_options_and_files(tmp_path):
    nonfinite.check_finite_options({"--guidance_scale": 3.0, "--lora_multiplier": [1.0, 0.5]})
    with pytest.raises(UserError, match="--guidance_scale is nan: give a finite number"):
        nonfinite.check_finite_options({"--guidance_scale": float("nan")})
    with pytest.raises(UserError, match="--lora_multiplier is inf"):
        nonfinite.check_finite_options({"--lora_multiplier": [1.0, float("inf")]})
    good, bad = tmp_path / "good.safetensors", tmp_path / "bad.safetensors"
    save_file_atomic({"a.lora_up.weight": torch.ones(2, 2), "steps": torch.tensor([3])}, good)
    save_file_atomic({"a.lora_up.weight": torch.tensor([[1.0, float("nan")]])}, bad)
    nonfinite.check_file_finite(good, "LoRA file")
    with pytest.raises(UserError, match="LoRA file '.*bad.safetensors' holds NaN or infinite values .*a.lora_up"):
        nonfinite.check_file_finite(bad, "LoRA file")


# ------------------------------------------------------------------------------------------------------ caches
def _latent_group(tmp_path):
    folder = image_folder(tmp_path / "a", ["x", "y"])
    train, _ = build(tmp_path, [({}, [{"image_dir": str(folder)}])])
    return train


def _damage_latents(path: str, change) -> None:
    data = sm.load_npz(path)
    key = next(k for k in data if k.startswith("latents_"))
    data[key] = change(data[key])
    sm.save_npz_atomic(path, data)


@pytest.mark.parametrize("damage, reason", [
    (lambda a: np.where(np.arange(a.size).reshape(a.shape) == 5, np.nan, a), "holds NaN or infinite values"),
    (lambda a: np.full_like(a, np.inf), "holds NaN or infinite values"),
    (lambda a: a[:16], "has shape \\[16, .*\\] instead of \\[32, "),
    (lambda a: a.astype(np.int64), "is int64, not floating point"),
])
def test_a_latent_cache_with_bad_values_is_remade(tmp_path, caplog, damage, reason):
    train = _latent_group(tmp_path)
    vae, strategy = FakeVAE(), sm.MossImageLatentsCachingStrategy(True)
    assert sm.cache_latents([train], vae, strategy, show_progress=False) == 2
    info = next(train.image_infos())
    good = strategy.get_latents(info, flipped=False)[0]
    _damage_latents(info.latents_npz, damage)
    with caplog.at_level(logging.WARNING):
        assert sm.cache_latents([train], vae, strategy, show_progress=False) == 1  # only the damaged file
    assert any(re.search(reason, r.getMessage()) for r in caplog.records)
    assert torch.equal(strategy.get_latents(info, flipped=False)[0], good)


def test_a_damaged_latent_cache_read_with_skip_cache_check_is_a_sentence(tmp_path):
    train = _latent_group(tmp_path)
    sm.cache_latents([train], FakeVAE(), sm.MossImageLatentsCachingStrategy(True), show_progress=False)
    info = next(train.image_infos())
    _damage_latents(info.latents_npz, lambda a: a * np.nan)
    trusting = sm.MossImageLatentsCachingStrategy(True, skip_disk_cache_validity_check=True)
    assert sm.cache_latents([train], FakeVAE(), trusting, show_progress=False) == 0
    with pytest.raises(UserError, match="latent cache .* is damaged \\('latents_.*' holds NaN.*delete it"):
        trusting.get_latents(info, flipped=False)


def test_nan_outputs_of_the_models_are_never_cached(tmp_path):
    class NanVAE(FakeVAE):
        def encode(self, images):
            return super().encode(images) * float("nan")

    train = _latent_group(tmp_path)
    with pytest.raises(UserError, match="The VAE produced NaN or infinite values for the image '.*img0.png'"):
        sm.cache_latents([train], NanVAE(), sm.MossImageLatentsCachingStrategy(True), show_progress=False)
    assert not list((tmp_path / "a").glob("*.npz"))

    class NanEncoder(FakeTextEncoder):
        def __call__(self, captions):
            return [(e * float("nan") if c else e, m) for c, (e, m) in zip(captions, super().__call__(captions))]

    group = te_groups(tmp_path, image_folder(tmp_path / "t", ["a cat"]))
    with pytest.raises(UserError, match="The text encoder produced NaN or infinite values for the caption 'a cat'"):
        cache_te(group, NanEncoder())


def test_text_encoder_caches_with_bad_shapes_are_remade_and_nan_is_refused_at_reading(tmp_path, caplog):
    folder = image_folder(tmp_path / "t", ["a cat", "a dog"])
    group = te_groups(tmp_path, folder)
    encoder = FakeTextEncoder()
    assert cache_te(group, encoder)[0] == 2
    info = next(group.image_infos())
    data = sm.load_npz(info.te_outputs_npz)
    data["prompt_embeds_0"] = np.concatenate([data["prompt_embeds_0"]] * 2, axis=1)  # another width than uncond
    sm.save_npz_atomic(info.te_outputs_npz, data)
    with caplog.at_level(logging.WARNING):
        assert cache_te(group, encoder)[0] == 1
    assert "embeddings have different widths" in caplog.text

    data = sm.load_npz(info.te_outputs_npz)
    data["prompt_embeds_0"] = data["prompt_embeds_0"] * np.nan  # values: found when read
    sm.save_npz_atomic(info.te_outputs_npz, data)
    strategy = sm.MossImageTextEncoderOutputsCachingStrategy(True)
    with pytest.raises(UserError, match="text-encoder cache .* is damaged \\('prompt_embeds_0' holds NaN.*delete it"):
        strategy.get_outputs(info, 0, dropped=False)


# --------------------------------------------------------------------------------------------------- inference
def _inference_args(tiny_snapshot, tmp_path, *extra):
    return inf.setup_parser().parse_args(["--snapshot", str(tiny_snapshot), "--prompt", "a cat", "--image_size", "32",
                                          "32", "--save_path", str(tmp_path / "out"), *extra])


@pytest.mark.parametrize("extra, message", [
    (["--guidance_scale", "nan"], "--guidance_scale is nan: give a finite number"),
    (["--guidance_scale", "inf"], "--guidance_scale is inf"),
    (["--flow_shift", "nan"], "--flow_shift is nan"),
    (["--seed", "-1"], "--seed -1 is out of range"),
])
def test_inference_refuses_non_finite_options(tiny_snapshot, tmp_path, extra, message):
    with pytest.raises(UserError, match=message):
        inf.run(_inference_args(tiny_snapshot, tmp_path, *extra))


def test_inference_refuses_a_nan_lora_and_a_file_as_save_path(tiny_snapshot, tmp_path):
    lora = tmp_path / "nan_lora.safetensors"
    save_file_atomic({"lora_unet_layers_0_proj_q.lora_up.weight": torch.full((4, 4), float("nan")),
                      "lora_unet_layers_0_proj_q.lora_down.weight": torch.ones(4, 4)}, lora)
    with pytest.raises(UserError, match="LoRA file '.*nan_lora.safetensors' holds NaN or infinite values"):
        inf.run(_inference_args(tiny_snapshot, tmp_path, "--lora_weight", str(lora)))
    (tmp_path / "out").write_text("a file")
    with pytest.raises(UserError, match="--save_path '.*out' is a file, not a folder"):
        inf.run(_inference_args(tiny_snapshot, tmp_path))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat --l nan\n")
    with pytest.raises(UserError, match="must be a finite number"):
        inf.prompt_settings(_inference_args(tiny_snapshot, tmp_path, "--from_file", str(prompts)))


def test_an_invalid_vae_config_is_a_sentence(tiny_snapshot, tmp_path):
    import shutil

    from library.moss_image.vae import load_flux2_vae

    vae = tmp_path / "vae"
    shutil.copytree(tiny_snapshot / "vae", vae)
    for text, message in (("[1, 2]", "is not a JSON object"), ('{"norm_num_groups": "x"}', "sets norm_num_groups='x'"),
                          ("{broken", "Cannot read the diffusers VAE config")):
        (vae / "config.json").write_text(text)
        with pytest.raises(UserError, match=message):
            load_flux2_vae(vae)


def test_text_encoder_outputs_of_another_width_are_a_sentence():
    from types import SimpleNamespace

    import moss_image_train_network as trainer_script

    run = SimpleNamespace(accelerator=SimpleNamespace(device=torch.device("cpu")),
                          unet=SimpleNamespace(config=SimpleNamespace(text_dim=64)))
    batch = {"text_encoder_outputs": [(torch.zeros(5, 32), torch.ones(5, dtype=torch.bool))]}
    with pytest.raises(UserError, match="outputs are 32 wide, but the DiT takes 64: the \\*_moss_te.npz cache files"):
        trainer_script.MossImageNetworkTrainer().get_text_conds(run, batch, is_train=True)
    batch = {"text_encoder_outputs": [(torch.zeros(5, 64), torch.ones(5, dtype=torch.bool))]}
    embeds, mask = trainer_script.MossImageNetworkTrainer().get_text_conds(run, batch, is_train=True)
    assert embeds.shape == (1, 5, 64) and mask.shape == (1, 5)
