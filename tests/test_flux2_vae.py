"""FLUX.2 VAE: parity with diffusers' AutoencoderKLFlux2 (the oracle), latent helpers, key conversion, loader errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from library.moss_image import vae as fv
from library.errors import UserError
from library.files.safetensors_io import load_safetensors, save_file_atomic

diffusers = pytest.importorskip("diffusers")
AutoencoderKLFlux2 = diffusers.AutoencoderKLFlux2

SMALL_DECODER_TINY = fv.Flux2VAEConfig(ch=32, ch_mult=(1, 1, 2, 2), decoder_block_out_channels=(32, 32, 32, 32))
REL_TOL = 1e-5


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def random_diffusers_vae(cfg: fv.Flux2VAEConfig, seed: int) -> "AutoencoderKLFlux2":
    """The oracle with every parameter ~ randn*0.05 (norm weights around 1) and random BN statistics."""
    model = AutoencoderKLFlux2(
        block_out_channels=cfg.encoder_widths,
        decoder_block_out_channels=cfg.decoder_block_out_channels,
        layers_per_block=cfg.num_res_blocks,
        latent_channels=cfg.z_channels,
        norm_num_groups=cfg.norm_num_groups,
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen) * 0.05
            is_norm = "norm" in name and name.endswith("weight")
            p.copy_(noise + 1.0 if is_norm else noise)
        model.bn.running_mean.copy_(torch.randn(model.bn.running_mean.shape, generator=gen) * 0.3)
        model.bn.running_var.copy_(torch.rand(model.bn.running_var.shape, generator=gen) * 2.0 + 0.1)
    return model.eval()


def oracle_encode_decode(oracle, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        latents = oracle.encode(images).latent_dist.mode()
        return latents, oracle.decode(latents).sample


def assert_parity(model: fv.AutoEncoder, oracle, images: torch.Tensor) -> dict[str, float]:
    ref_z, ref_img = oracle_encode_decode(oracle, images)
    z = model.encode(images)
    img = model.decode(ref_z)
    assert z.dtype == torch.float32 and z.shape == ref_z.shape
    assert img.shape == images.shape
    figures = {"encode": rel_diff(z, ref_z), "decode": rel_diff(img, ref_img)}
    assert figures["encode"] < REL_TOL and figures["decode"] < REL_TOL, figures
    # the DiT-side path: patchify + BN formula, and back
    bn = oracle.bn
    dit = model.encode_to_dit_latents(images)
    ref_dit = (fv.patchify_latents(ref_z) - bn.running_mean[None, :, None, None]) / torch.sqrt(
        bn.running_var[None, :, None, None] + 1e-4
    )
    assert rel_diff(dit, ref_dit) < REL_TOL
    assert rel_diff(model.decode_from_dit_latents(ref_dit), ref_img) < REL_TOL
    return figures


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.rand(2, 3, 64, 48, generator=gen) * 2 - 1


@pytest.fixture(scope="module")
def oracle_folder(tmp_path_factory):
    oracle = random_diffusers_vae(fv.TINY_VAE_CONFIG, seed=3)
    folder = tmp_path_factory.mktemp("diffusers_vae") / "vae"
    oracle.save_pretrained(folder, safe_serialization=True)
    return oracle, folder


@pytest.fixture(scope="module")
def bfl_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bfl") / "flux2-vae-tiny.safetensors"
    fv.save_flux2_vae_bfl(fv.make_tiny_vae(5), path)
    return path


# ---------------------------------------------------------------------------------------------------- parity


def test_parity_diffusers_folder_saved_by_diffusers(oracle_folder, images):
    oracle, folder = oracle_folder
    for path in (folder, folder / fv.DIFFUSERS_WEIGHTS_NAME):
        model = fv.load_flux2_vae(path)
        assert model.config == fv.TINY_VAE_CONFIG
        assert_parity(model, oracle, images)


def test_parity_with_the_parallel_group_norm_statistics(oracle_folder, images, monkeypatch):
    """The CUDA form of the GroupNorms (`group_norm_parallel`), run here on the CPU, against the diffusers oracle."""
    oracle, folder = oracle_folder
    model = fv.load_flux2_vae(folder)
    plain = model.decode(oracle_encode_decode(oracle, images)[0])
    calls = []
    monkeypatch.setattr(fv, "_parallel_statistics", lambda x: calls.append(1) or True)
    assert_parity(model, oracle, images)
    parallel = model.decode(oracle_encode_decode(oracle, images)[0])
    assert calls and isinstance(model.decoder.norm_out, torch.nn.GroupNorm)
    assert rel_diff(parallel, plain) < 1e-5
    assert set(model.state_dict()) == set(fv.load_flux2_vae(folder).state_dict())


def test_group_norm_parallel_matches_torch_in_float32_and_bfloat16():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 64, 6, 10, generator=g) * 3 + 1
    w, b = torch.randn(64, generator=g), torch.randn(64, generator=g)
    reference = torch.nn.functional.group_norm(x, 32, w, b, 1e-6)
    torch.testing.assert_close(fv.group_norm_parallel(x, 32, w, b, 1e-6), reference)
    xb, wb, bb = x.bfloat16(), w.bfloat16(), b.bfloat16()
    out = fv.group_norm_parallel(xb, 32, wb, bb, 1e-6)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, torch.nn.functional.group_norm(xb, 32, wb, bb, 1e-6), atol=0.07, rtol=0.02)


def test_parity_bfl_file(oracle_folder, images, tmp_path):
    oracle, _ = oracle_folder
    path = tmp_path / "ae.safetensors"
    save_file_atomic(fv.diffusers_to_bfl_state_dict(oracle.state_dict()), path)
    model = fv.load_flux2_vae(path)
    assert_parity(model, oracle, images)


@pytest.mark.parametrize("cfg", [fv.TINY_VAE_CONFIG, SMALL_DECODER_TINY], ids=["tiny", "small_decoder"])
def test_parity_own_diffusers_folder_loads_in_diffusers(cfg, tmp_path):
    model = fv.make_tiny_vae(7, cfg)
    fv.save_flux2_vae_diffusers(model, tmp_path / "vae")
    config = json.loads((tmp_path / "vae" / "config.json").read_text())
    assert config["decoder_block_out_channels"] == (list(cfg.decoder_widths) if cfg.has_small_decoder else None)
    oracle = AutoencoderKLFlux2.from_pretrained(tmp_path / "vae").eval()
    assert oracle.decoder.conv_in.weight.shape[0] == cfg.decoder_widths[-1]
    images = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(2)) * 2 - 1
    assert_parity(model, oracle, images)
    reloaded = fv.load_flux2_vae(tmp_path / "vae")
    assert reloaded.config == cfg
    for key, value in model.state_dict().items():
        assert torch.equal(value, reloaded.state_dict()[key]), key


def test_small_decoder_bfl_file_round_trip(tmp_path):
    model = fv.make_tiny_vae(8, SMALL_DECODER_TINY)
    fv.save_flux2_vae_bfl(model, tmp_path / "full_encoder_small_decoder.safetensors")
    loaded = fv.load_flux2_vae(tmp_path / "full_encoder_small_decoder.safetensors")
    assert loaded.config.has_small_decoder and loaded.config.decoder_widths == (32, 32, 32, 32)
    z = torch.randn(1, 32, 4, 4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(loaded.decode(z), model.decode(z))


# ---------------------------------------------------------------------------------------------------- structure


def test_full_size_structure_matches_spec_and_diffusers():
    with torch.device("meta"):
        full = fv.AutoEncoder(fv.Flux2VAEConfig())
        small = fv.AutoEncoder(fv.Flux2VAEConfig(decoder_block_out_channels=(96, 192, 384, 384)))
        ref_full = AutoencoderKLFlux2()
        ref_small = AutoencoderKLFlux2(decoder_block_out_channels=(96, 192, 384, 384))
    assert sum(p.numel() for p in full.parameters()) == 84_046_115
    assert sum(p.numel() for p in small.parameters()) == 62_373_091
    assert len(full.state_dict()) == 251
    shortcuts = sorted(k.rsplit(".", 2)[0] for k in full.state_dict() if "nin_shortcut.weight" in k)
    assert shortcuts == [
        "decoder.up.0.block.0",
        "decoder.up.1.block.0",
        "encoder.down.1.block.0",
        "encoder.down.2.block.0",
    ]
    for ours, ref in ((full, ref_full), (small, ref_small)):
        converted = fv.bfl_to_diffusers_state_dict(ours.state_dict())
        ref_sd = ref.state_dict()
        assert set(converted) == set(ref_sd)
        assert all(converted[k].shape == ref_sd[k].shape for k in ref_sd)
        assert fv.Flux2VAEConfig.from_state_dict(ours.state_dict()) == ours.config


def test_config_inference_and_validation():
    assert fv.Flux2VAEConfig.from_state_dict(fv.make_tiny_vae(0).state_dict()) == fv.TINY_VAE_CONFIG
    inferred = fv.Flux2VAEConfig.from_state_dict(fv.make_tiny_vae(0, SMALL_DECODER_TINY).state_dict())
    assert inferred == SMALL_DECODER_TINY
    assert fv.Flux2VAEConfig(decoder_block_out_channels=(128, 256, 512, 512)).decoder_block_out_channels is None
    with pytest.raises(ValueError):
        fv.Flux2VAEConfig(ch=48)
    with pytest.raises(ValueError):
        fv.Flux2VAEConfig(decoder_block_out_channels=(96, 192, 384))


# ---------------------------------------------------------------------------------------------------- key conversion


def test_key_conversion_is_a_bijection():
    tiny = fv.make_tiny_vae(1).state_dict()
    to_diffusers = fv.bfl_to_diffusers_state_dict(tiny)
    assert len(to_diffusers) == len(tiny)
    assert to_diffusers["encoder.mid_block.attentions.0.to_q.weight"].shape == (64, 64)
    assert "decoder.up_blocks.0.upsamplers.0.conv.weight" in to_diffusers  # BFL up.3 = lowest resolution
    full_res = to_diffusers["decoder.up_blocks.3.resnets.2.conv1.bias"]
    assert torch.equal(full_res, tiny["decoder.up.0.block.2.conv1.bias"])
    back = fv.diffusers_to_bfl_state_dict(to_diffusers)
    assert list(back) == list(tiny)
    assert all(torch.equal(back[k], tiny[k]) and back[k].shape == tiny[k].shape for k in tiny)
    no_counter = {k: v for k, v in tiny.items() if k != "bn.num_batches_tracked"}
    assert set(fv.bfl_to_diffusers_state_dict(no_counter)) == set(to_diffusers) - {"bn.num_batches_tracked"}


# ---------------------------------------------------------------------------------------------------- latents


def test_patchify_channel_order_and_round_trip():
    x = torch.randn(2, 32, 6, 4)
    out = fv.patchify_latents(x)
    assert out.shape == (2, 128, 3, 2)
    for c in (0, 5, 31):
        for i in (0, 1):
            for j in (0, 1):
                assert torch.equal(out[:, c * 4 + i * 2 + j], x[:, c, i::2, j::2])
    assert torch.equal(fv.unpatchify_latents(out), x)
    with pytest.raises(ValueError):
        fv.patchify_latents(torch.randn(1, 32, 5, 4))


def test_normalize_matches_batchnorm_eval_and_inverts():
    vae = fv.make_tiny_vae(2)
    z = torch.randn(2, 128, 3, 5)
    expected = vae.bn.eval()(z)
    got = fv.normalize_latents(z, vae.bn.running_mean, vae.bn.running_var)
    assert torch.allclose(got, expected, atol=1e-6, rtol=1e-6)
    assert torch.allclose(fv.denormalize_latents(got, vae.bn.running_mean, vae.bn.running_var), z, atol=1e-5)
    assert torch.equal(vae.normalize(z), got)
    bf16 = fv.normalize_latents(z.bfloat16(), vae.bn.running_mean, vae.bn.running_var)
    assert bf16.dtype == torch.bfloat16
    with pytest.raises(ValueError):
        fv.normalize_latents(torch.randn(1, 32, 4, 4), vae.bn.running_mean, vae.bn.running_var)


def test_train_mode_never_touches_running_stats():
    vae = fv.make_tiny_vae(4)
    mean, var = vae.bn.running_mean.clone(), vae.bn.running_var.clone()
    vae.train()
    images = torch.rand(2, 3, 32, 32) * 2 - 1
    dit = vae.encode_to_dit_latents(images)
    vae.normalize(fv.patchify_latents(vae.encode(images)))
    vae.decode_from_dit_latents(dit)
    assert torch.equal(vae.bn.running_mean, mean) and torch.equal(vae.bn.running_var, var)
    assert vae.bn.num_batches_tracked.item() == 0


# ---------------------------------------------------------------------------------------------------- tiny VAE


def test_make_tiny_vae_is_deterministic_and_leaves_global_rng_alone(tmp_path):
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a, b = fv.make_tiny_vae(0), fv.make_tiny_vae(0)
    assert torch.equal(torch.random.get_rng_state(), before)
    fv.save_flux2_vae_bfl(a, tmp_path / "a.safetensors")
    fv.save_flux2_vae_bfl(b, tmp_path / "b.safetensors")
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    c = fv.make_tiny_vae(1)
    assert not torch.equal(a.encoder.conv_in.weight, c.encoder.conv_in.weight)
    var = a.bn.running_var
    assert a.bn.running_mean.abs().max() < 2.0 and var.min() >= 0.1 and var.max() <= 2.1
    assert not a.training and not any(p.requires_grad for p in a.parameters())


# ---------------------------------------------------------------------------------------------------- loader


def test_loader_prefix_dtype_and_optional_counter(bfl_file, tmp_path):
    sd = load_safetensors(bfl_file)
    del sd["bn.num_batches_tracked"]
    path = tmp_path / "checkpoint.safetensors"
    save_file_atomic({"first_stage_model." + k: v for k, v in sd.items()}, path)
    model = fv.load_flux2_vae(path, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and model.device == torch.device("cpu")
    assert model.bn.running_mean.dtype == torch.float32
    assert torch.equal(model.bn.running_var, sd["bn.running_var"])
    assert model.bn.num_batches_tracked.item() == 0 and not model.bn.num_batches_tracked.is_meta
    assert not any(p.is_meta for p in model.parameters())
    assert model.encode(torch.zeros(1, 3, 32, 32)).dtype == torch.float32


def test_loader_logs_what_was_loaded(bfl_file, caplog):
    with caplog.at_level("INFO", logger="library.moss_image.vae"):
        fv.load_flux2_vae(bfl_file)
    assert "flux2-vae-tiny.safetensors" in caplog.text and "bfl layout" in caplog.text


def _expect_user_error(path, *fragments: str) -> str:
    with pytest.raises(UserError) as info:
        fv.load_flux2_vae(path)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_loader_errors_name_the_file(bfl_file, oracle_folder, tmp_path):
    sd = load_safetensors(bfl_file)
    missing = dict(sd)
    del missing["decoder.mid.attn_1.q.bias"]
    save_file_atomic(missing, tmp_path / "missing.safetensors")
    _expect_user_error(
        tmp_path / "missing.safetensors", "missing.safetensors", "1 missing", "decoder.mid.attn_1.q.bias"
    )

    extra = dict(sd, **{"encoder.extra.weight": torch.zeros(2), "decoder.bogus": torch.zeros(1)})
    save_file_atomic(extra, tmp_path / "extra.safetensors")
    _expect_user_error(tmp_path / "extra.safetensors", "extra.safetensors", "2 unexpected", "encoder.extra.weight")

    _, folder = oracle_folder
    dsd = load_safetensors(folder / fv.DIFFUSERS_WEIGHTS_NAME)
    del dsd["decoder.up_blocks.0.resnets.1.conv2.weight"]
    broken = tmp_path / "broken_vae"
    broken.mkdir()
    save_file_atomic(dsd, broken / fv.DIFFUSERS_WEIGHTS_NAME)
    (broken / "config.json").write_text((folder / "config.json").read_text())
    _expect_user_error(broken, fv.DIFFUSERS_WEIGHTS_NAME, "decoder.up_blocks.0.resnets.1.conv2.weight")

    for name in ("ae.ckpt", "ae.pt", "ae.bin"):
        (tmp_path / name).write_bytes(b"not a checkpoint")
        _expect_user_error(tmp_path / name, name, "safetensors")
    _expect_user_error(tmp_path / "nowhere" / "flux2-vae.safetensors", "flux2-vae.safetensors", "does not exist")
    (tmp_path / "empty_dir").mkdir()
    _expect_user_error(tmp_path / "empty_dir", "empty_dir", fv.DIFFUSERS_WEIGHTS_NAME)


def test_loader_rejects_other_checkpoints(bfl_file, tmp_path):
    sd = load_safetensors(bfl_file)
    save_file_atomic({"lora_unet_x.lora_down.weight": torch.zeros(2, 2)}, tmp_path / "lora.safetensors")
    _expect_user_error(tmp_path / "lora.safetensors", "lora.safetensors", "not a FLUX.2 VAE")

    decoder_only = {k[len("decoder.") :]: v for k, v in sd.items() if k.startswith("decoder.")}
    save_file_atomic(decoder_only, tmp_path / "small_decoder.safetensors")
    _expect_user_error(tmp_path / "small_decoder.safetensors", "small_decoder.safetensors", "decoder-only")

    wrong_shape = dict(sd, **{"encoder.mid.attn_1.q.bias": torch.zeros(3)})
    save_file_atomic(wrong_shape, tmp_path / "shape.safetensors")
    _expect_user_error(tmp_path / "shape.safetensors", "shape.safetensors", "encoder.mid.attn_1.q.bias")

    no_bn = {k: v for k, v in sd.items() if not k.startswith("bn.")}
    save_file_atomic(no_bn, tmp_path / "no_bn.safetensors")
    _expect_user_error(tmp_path / "no_bn.safetensors", "no_bn.safetensors", "bn.running_mean")
