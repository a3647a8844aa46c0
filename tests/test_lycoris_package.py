"""`--network_module lycoris.kohya` with the LyCORIS package itself (a test-only dependency, requirements-test.txt;
skipped when it is not installed), algo lokr and loha, on the tiny snapshot: training with sample images and saves,
an exact resume, the file merged by the inference script (multiplier 0 gives the base image, 1 changes it), and the
file read back by LyCORIS' own reader, whose network computes what the trained one and our merge compute."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import moss_image_minimal_inference as inference
from library.files.safetensors_io import load_safetensors, read_metadata
from library.lora.merge import LoraMergePlan, merge_into_module
from library.moss_image.loaders import load_moss_image_model
from tests.test_trainer import REPO, base_args, make_toy_dataset, train

lycoris_kohya = pytest.importorskip("lycoris.kohya")

LAYERS = 24  # blocks of the tiny DiT
MODULES = LAYERS * 6  # q, k, v, o, ffn_up_gate, ffn_down of each block
TENSORS = {"lokr": ("lokr_w1",), "loha": ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")}


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_toy_dataset(tmp_path_factory.mktemp("toy"), n=2)


def lycoris_argv(tiny_snapshot: Path, data: Path, out: Path, algo: str, *extra: str) -> list[str]:
    argv = base_args(tiny_snapshot, data, out, "--learning_rate", "1e-2", "--max_train_steps", "2", "--network_args",
                     f"algo={algo}", f"preset={REPO / 'networks' / 'lycoris_moss_image.toml'}", *extra)
    argv[argv.index("networks.lora_generic")] = "lycoris.kohya"
    return argv


def latent(tiny_snapshot: Path, out: Path, *extra: str) -> torch.Tensor:
    argv = ["--snapshot", str(tiny_snapshot), "--image_size", "32", "32", "--infer_steps", "2", "--seed", "3",
            "--save_path", str(out), "--prompt", "a red square", "--output_type", "latent", "--device", "cpu", *extra]
    return load_safetensors(inference.run(inference.setup_parser().parse_args(argv))[0])["latents"]


@pytest.fixture(scope="module")
def base_latent(tiny_snapshot: Path, tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    return latent(tiny_snapshot, tmp_path_factory.mktemp("base"))


@pytest.mark.parametrize("algo", ["lokr", "loha"])
def test_lycoris_trains_samples_resumes_infers_and_reads_back(tiny_snapshot, toy_data, base_latent, tmp_path, algo):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square --w 32 --h 32 --s 2 --d 1\n", encoding="utf-8")
    out = tmp_path / "out"
    run = train(lycoris_argv(tiny_snapshot, toy_data, out, algo, "--save_every_n_steps", "1", "--save_state",
                             "--sample_prompts", str(prompts), "--sample_every_n_steps", "2"))
    path = out / "toy.safetensors"
    sd = load_safetensors(path)
    names = {k.partition(".")[0] for k in sd}
    assert len(names) == MODULES and all(n.startswith("lora_unet_layers_") for n in names)  # the preset's blocks
    assert {f"{n}.{t}" for n in names for t in TENSORS[algo]} <= set(sd)
    assert read_metadata(path)["ss_network_module"] == "lycoris.kohya"
    assert len(list((out / "sample").glob("*.png"))) == 1  # at step 2

    # exact resume from the step-1 state
    resumed = train(lycoris_argv(tiny_snapshot, toy_data, tmp_path / "resumed", algo, "--resume",
                                 str(out / "toy-step00000001-state")))
    assert resumed.global_step == 2
    again = load_safetensors(tmp_path / "resumed" / "toy.safetensors")
    assert again.keys() == sd.keys() and all(np.array_equal(sd[k].numpy(), again[k].numpy()) for k in sd)

    # the inference script merges the file: multiplier 0 is the base exactly, 1 changes the image
    zero = latent(tiny_snapshot, tmp_path / "zero", "--lora_weight", str(path), "--lora_multiplier", "0")
    one = latent(tiny_snapshot, tmp_path / "one", "--lora_weight", str(path))
    assert torch.equal(zero, base_latent) and (one - base_latent).abs().max() > 1e-4

    # LyCORIS' reader: its network over a fresh DiT = the trained network = our merge of the file
    theirs_model = load_moss_image_model("cpu", tiny_snapshot, dtype=torch.float32).eval()
    theirs, _ = lycoris_kohya.create_network_from_weights(1.0, str(path), None, None, theirs_model)
    theirs.apply_to(None, theirs_model, False, True)
    assert len(theirs.unet_loras) == MODULES
    merged = load_moss_image_model("cpu", tiny_snapshot, dtype=torch.float32).eval()
    plan = LoraMergePlan([(sd, 1.0)], "lora_unet")
    assert merge_into_module(merged, plan) == MODULES and plan.finish() == []
    x, t, text = torch.randn(1, 128, 2, 2), torch.tensor([400.0]), torch.randn(1, 3, 64)
    run.unet.eval()
    with torch.no_grad():
        trained = run.unet(x, t, text)
        torch.testing.assert_close(theirs_model(x, t, text), trained, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(merged(x, t, text), trained, atol=1e-4, rtol=1e-4)
