"""moss_image_train_network.py with networks.loha / networks.lokr and with a LyCORIS-like third-party module, on the
tiny snapshot: train, save (keys, ss_* metadata), load back, merge = the network's forward, inference, resume."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import moss_image_minimal_inference as inf
from library.files.safetensors_io import load_safetensors, read_metadata
from library.lora.merge import LoraMergePlan, merge_into_module
from library.moss_image.loaders import load_moss_image_model
from networks import loha, lokr
from tests import fake_lycoris_kohya
from tests.test_trainer import base_args, make_toy_dataset, train

LAYERS = 24
BLOCK_LINEARS = ("q", "k", "v", "o", "ffn_up_gate", "ffn_down")
ALGOS = {
    "networks.loha": (loha, ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "alpha"), ()),
    "networks.lokr": (lokr, ("lokr_w1", "lokr_w2_a", "lokr_w2_b", "alpha"), ("--network_args", "factor=4")),
}


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory: pytest.TempPathFactory):
    return make_toy_dataset(tmp_path_factory.mktemp("toy"))


def _argv(tiny_snapshot, toy_data, out, module, *extra):
    argv = base_args(tiny_snapshot, toy_data, out, "--learning_rate", "1e-2", *ALGOS[module][2], *extra)
    argv[argv.index("networks.lora_generic")] = module
    return argv


def _latent(tiny_snapshot, out, *extra):
    argv = ["--snapshot", str(tiny_snapshot), "--image_size", "32", "32", "--infer_steps", "2", "--seed", "3",
            "--save_path", str(out), "--prompt", "cat", "--output_type", "latent", "--device", "cpu", *extra]
    return load_safetensors(inf.run(inf.setup_parser().parse_args(argv))[0])["latents"]


@pytest.mark.parametrize("module", list(ALGOS))
def test_train_save_load_merge_and_infer(tiny_snapshot, toy_data, tmp_path, module, caplog):
    mod, tensors, _ = ALGOS[module]
    run = train(_argv(tiny_snapshot, toy_data, tmp_path / "out", module, "--max_train_steps", "3"))
    path = tmp_path / "out" / "toy.safetensors"
    sd = load_safetensors(path)
    names = {f"lora_unet_layers_{i}_proj_{n}" for i in range(LAYERS) for n in BLOCK_LINEARS}
    assert set(sd) == {f"{n}.{t}" for n in names for t in tensors}  # LyCORIS key names, every block Linear
    closing = "hada_w2_a" if module == "networks.loha" else "lokr_w2_b"  # starts at zero: trained when non-zero
    assert all(sd[f"{n}.{closing}"].abs().max() > 0 for n in names)
    meta = read_metadata(path)
    assert meta["ss_network_module"] == module and meta["ss_network_dim"] == "4" and "sshs_model_hash" in meta
    if module == "networks.lokr":
        assert '"factor": "4"' in meta["ss_network_args"]

    # the file loads back (create_network_from_weights) and its forward equals the merge at load, in fp32
    plain = load_moss_image_model("cpu", tiny_snapshot, dtype=torch.float32).eval()
    net, _ = mod.create_network_from_weights(1.0, str(path), None, None, plain)
    net.apply_to(None, plain, False, True)
    net.load_weights(path)
    plan = LoraMergePlan([(sd, 1.0)], "lora_unet")  # into the fp32 weights (the snapshot's files are bf16)
    merged = load_moss_image_model("cpu", tiny_snapshot, dtype=torch.float32).eval()
    assert merge_into_module(merged, plan) == LAYERS * 6 and plan.finish() == []
    x, t, text = torch.randn(1, 128, 2, 2), torch.tensor([400.0]), torch.randn(1, 3, 64)
    run.unet.eval()
    with torch.no_grad():
        trained = run.unet(x, t, text)
        torch.testing.assert_close(plain(x, t, text), trained, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(merged(x, t, text), trained, atol=1e-4, rtol=1e-4)

    # the inference script merges the file: multiplier 0 gives the base exactly, 1 changes it
    caplog.set_level(logging.INFO)
    base = _latent(tiny_snapshot, tmp_path / "a")
    zero = _latent(tiny_snapshot, tmp_path / "b", "--lora_weight", str(path), "--lora_multiplier", "0")
    one = _latent(tiny_snapshot, tmp_path / "c", "--lora_weight", str(path))
    assert torch.equal(base, zero) and (one - base).abs().max() > 1e-4
    assert f"merged {LAYERS * 6} lora_unet LoRA modules" in caplog.text


def test_lokr_resumes_and_loha_base_weights(tiny_snapshot, toy_data, tmp_path, caplog):
    common = ("--max_train_steps", "4")
    out = tmp_path / "out"
    train(_argv(tiny_snapshot, toy_data, out, "networks.lokr", *common, "--save_every_n_steps", "2", "--save_state"))
    resumed = tmp_path / "resumed"
    run = train(_argv(tiny_snapshot, toy_data, resumed, "networks.lokr", *common, "--resume",
                      str(out / "toy-step00000002-state")))
    assert run.global_step == 4
    a, b = load_safetensors(out / "toy.safetensors"), load_safetensors(resumed / "toy.safetensors")
    assert a.keys() == b.keys() and all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in a)

    caplog.set_level(logging.INFO)
    run = train(_argv(tiny_snapshot, toy_data, tmp_path / "on_lokr", "networks.loha", "--max_train_steps", "1",
                      "--base_weights", str(out / "toy.safetensors")))
    assert f"merged {LAYERS * 6} lora_unet LoRA modules" in caplog.text
    plain = load_moss_image_model("cpu", tiny_snapshot, dtype=torch.float32)
    assert not torch.equal(plain.layers[0].proj.q.weight, run.unet.layers[0].proj.q.weight.float())


def test_third_party_network_with_the_lycoris_interface(tiny_snapshot, toy_data, tmp_path):
    """TE outputs cached (no text encoder loaded), --network_dropout, an output folder that does not exist yet."""
    out = tmp_path / "not" / "yet" / "there"
    argv = base_args(tiny_snapshot, toy_data, out, "--max_train_steps", "2", "--learning_rate", "1e-2",
                     "--network_dropout", "0.1", "--unet_lr", "5e-3")
    argv[argv.index("networks.lora_generic")] = "tests.fake_lycoris_kohya"
    fake_lycoris_kohya.CALLS.clear()
    run = train(argv)
    calls = fake_lycoris_kohya.CALLS
    assert calls["text_encoder"] is None  # not [None]
    assert calls["kwargs"]["dropout"] == 0.1
    assert calls["prepare_optimizer_params"] == (None, 5e-3, 1e-2)
    assert run.global_step == 2 and run.lr_descriptions == ["unet"]
    sd = load_safetensors(out / "toy.safetensors")
    assert len(sd) == 3 * LAYERS * 6 and any(v.abs().max() > 0 for k, v in sd.items() if "lora_up" in k)


def test_real_lycoris_with_the_moss_image_preset(tiny_snapshot, toy_data, tmp_path):
    """The LyCORIS package itself (optional test dependency: pip install lycoris-lora), text encoder trained too."""
    pytest.importorskip("lycoris.kohya")
    out = tmp_path / "new" / "out"
    argv = base_args(tiny_snapshot, toy_data, out, "--max_train_steps", "2", "--learning_rate", "1e-2",
                     "--text_encoder_lr", "1e-2", "--network_dropout", "0.1", "--network_args", "algo=lokr",
                     "preset=networks/lycoris_moss_image.toml")
    argv[argv.index("networks.lora_generic")] = "lycoris.kohya"
    argv.remove("--network_train_unet_only")
    argv.remove("--cache_text_encoder_outputs")
    run = train(argv)
    assert run.network.dropout == 0.1
    sd = load_safetensors(out / "toy.safetensors")
    names = {k.partition(".")[0] for k in sd}
    assert len([n for n in names if n.startswith("lora_unet_layers_")]) == LAYERS * 6 and len(names) == LAYERS * 6 + 25
    for prefix, count in (("lora_unet", LAYERS * 6), ("lora_te", 25)):
        plan = LoraMergePlan([(sd, 1.0)], prefix)
        assert len(plan) == count
