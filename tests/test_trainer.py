"""moss_image_train_network.py end to end on the tiny snapshot: training, saving, metadata, samples, resume, checks."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import pytest
from PIL import Image

from library.errors import UserError
from library.files.safetensors_io import load_safetensors, read_metadata

REPO = Path(__file__).resolve().parent.parent


def make_toy_dataset(root: Path, n: int = 8, size: int = 64) -> Path:
    """A learnable toy set: the same red square on grey, the same caption."""
    folder = root / "4_toy"
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        arr = np.full((size, size, 3), 128, np.uint8)
        arr[size // 4 : 3 * size // 4, size // 4 : 3 * size // 4] = (220, 30, 30)
        Image.fromarray(arr).save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text("a red square on a grey background")
    return root


def base_args(snapshot: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--snapshot", str(snapshot), "--train_data_dir", str(data), "--resolution", "64",
        "--output_dir", str(out), "--output_name", "toy", "--network_module", "networks.lora_generic",
        "--network_dim", "4", "--network_train_unet_only", "--seed", "7", "--max_data_loader_n_workers", "0",
        "--cache_latents", "--cache_text_encoder_outputs", *extra,
    ]


def train(argv: list[str]):
    import moss_image_train_network as m
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # one process, several runs with other precisions
    args = m.setup_parser().parse_args(argv)
    return m.MossImageNetworkTrainer().train(args)


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_toy_dataset(tmp_path_factory.mktemp("toy"))


def test_training_learns_saves_metadata_and_samples(tiny_snapshot, tmp_path):
    data = make_toy_dataset(tmp_path / "data")
    cfg = tmp_path / "dataset.toml"
    cfg.write_text(
        f'[general]\nresolution = 64\ncaption_extension = ".txt"\n[[datasets]]\nvalidation_split = 0.25\n'
        f'[[datasets.subsets]]\nimage_dir = "{(data / "4_toy").as_posix()}"\nnum_repeats = 2\n'
    )
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square on a grey background --w 64 --h 64 --s 3 --d 5\n")
    argv = base_args(tiny_snapshot, data, tmp_path / "out", "--learning_rate", "1e-2", "--max_train_steps", "24",
                     "--validate_every_n_steps", "12", "--sample_prompts", str(prompts), "--sample_every_n_steps", "24",
                     "--timestep_sampling", "sigma", "--weighting_scheme", "logit_normal", "--logit_mean", "-1.09",
                     "--logit_std", "0.95")
    argv[argv.index("--train_data_dir"): argv.index("--train_data_dir") + 2] = ["--dataset_config", str(cfg)]
    run = train(argv)
    first, last = run.validation_history[0][1], run.validation_history[-1][1]
    assert last < first * 0.9, run.validation_history  # the LoRA learned the toy set

    final = tmp_path / "out" / "toy.safetensors"
    sd = load_safetensors(final)
    assert "lora_unet_layers_0_proj_q.lora_down.weight" in sd and "lora_unet_layers_23_proj_ffn_down.alpha" in sd
    assert len([k for k in sd if k.endswith(".lora_up.weight")]) == 24 * 6
    meta = read_metadata(final)
    for key in ("ss_weighting_scheme", "ss_logit_mean", "ss_logit_std", "ss_mode_scale", "ss_timestep_sampling",
                "ss_sigmoid_scale", "ss_discrete_flow_shift", "ss_convrot_int8", "ss_convrot_int8_text_encoder",
                "ss_network_module", "ss_network_dim", "ss_steps", "sshs_model_hash", "sshs_legacy_hash"):
        assert key in meta, key
    assert meta["ss_timestep_sampling"] == "sigma" and meta["ss_logit_mean"] == "-1.09" and meta["ss_steps"] == "24"
    assert meta["ss_convrot_int8"] == "False" and meta["ss_validation_split"] == "0.25"
    assert meta["modelspec.architecture"].startswith("moss-image-base")
    from library.files.model_spec import file_model_hash

    assert file_model_hash(final) == meta["sshs_model_hash"]

    samples = sorted((tmp_path / "out" / "sample").glob("toy_000024_00_*.png"))
    assert len(samples) == 1
    info = Image.open(samples[0]).text
    assert info["prompt"] == "a red square on a grey background" and info["seed"] == "5"


def test_resume_continues_at_the_same_step_with_the_same_result(tiny_snapshot, toy_data, tmp_path):
    common = ["--learning_rate", "1e-3", "--max_train_steps", "6"]
    out = tmp_path / "out"
    train(base_args(tiny_snapshot, toy_data, out, *common, "--save_every_n_steps", "3", "--save_state"))
    state = out / "toy-step00000003-state"
    assert json.loads((state / "train_state.json").read_text())["current_step"] == 3
    argv = base_args(tiny_snapshot, toy_data, tmp_path / "resumed", *common, "--resume", str(state))
    run = train(argv)
    assert run.global_step == 6
    a = load_safetensors(out / "toy.safetensors")
    b = load_safetensors(tmp_path / "resumed" / "toy.safetensors")
    assert all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in a)


def test_save_rotation_keeps_last_n(tiny_snapshot, toy_data, tmp_path):
    out = tmp_path / "out"
    train(base_args(tiny_snapshot, toy_data, out, "--max_train_steps", "8", "--save_every_n_steps", "2",
                    "--save_last_n_steps", "3"))
    names = sorted(p.name for p in out.glob("toy-step*.safetensors"))
    assert names == ["toy-step00000004.safetensors", "toy-step00000006.safetensors"]
    assert (out / "toy.safetensors").exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--noise_offset", "0.1"], "cannot honour --noise_offset 0.1 (a DDPM noise trick"),  # --v2 etc.: ignored
        (["--min_snr_gamma", "5"], "--min_snr_gamma"),
        (["--attn_mode", "sageattn"], "inference only"),
        (["--attn_mode", "xformers"], "requires --split_attn"),
        (["--compile", "--torch_compile"], "cannot be used together"),
        (["--unsloth_offload_checkpointing", "--cpu_offload_checkpointing"], "Cannot use both"),
        (["--moss_max_token_length", "8192"], "out of range"),
    ],
)
def test_argument_checks(tiny_snapshot, toy_data, tmp_path, extra, message):
    with pytest.raises(UserError, match=re.escape(message)):
        train(base_args(tiny_snapshot, toy_data, tmp_path, "--max_train_steps", "1", *extra))


def test_cache_te_outputs_needs_unet_only(tiny_snapshot, toy_data, tmp_path):
    argv = base_args(tiny_snapshot, toy_data, tmp_path, "--max_train_steps", "1")
    argv.remove("--network_train_unet_only")
    with pytest.raises(UserError, match="needs --network_train_unet_only"):
        train(argv)


def test_fp8_options_disabled_with_warning(tiny_snapshot, toy_data, tmp_path, caplog):
    run = train(base_args(tiny_snapshot, toy_data, tmp_path, "--max_train_steps", "1", "--fp8_base"))
    assert run.args.fp8_base is False and "not supported for MOSS-Image" in caplog.text


# Options seed 001 names for moss_image_train_network.py (sections 4 to 10).
SEED_OPTIONS = """
pretrained_model_name_or_path text_encoder vae dataset_config output_dir output_name save_model_as network_module
network_dim network_train_unet_only learning_rate optimizer_type lr_scheduler timestep_sampling weighting_scheme
logit_mean logit_std discrete_flow_shift max_train_epochs save_every_n_epochs mixed_precision gradient_checkpointing
cache_latents cache_latents_to_disk cache_text_encoder_outputs cache_text_encoder_outputs_to_disk
max_data_loader_n_workers persistent_data_loader_workers network_alpha tokenizer_cache_dir moss_max_token_length
sigmoid_scale attn_mode split_attn xformers sample_uncond_skip_layers convrot_int8 convrot_int8_text_encoder
convrot_int8_bwd blocks_to_swap block_swap_h2d_only unsloth_offload_checkpointing cpu_offload_checkpointing
text_encoder_batch_size skip_cache_check compile v2 v_parameterization clip_skip fp8_base fp8_base_unet
optimizer_args max_grad_norm show_timesteps show_timesteps_resolution text_encoder_lr network_args sample_prompts
sample_every_n_epochs sample_every_n_steps sample_at_first loss_type huber_schedule huber_c huber_scale
ip_noise_gamma ip_noise_gamma_random_strength fused_backward_pass mode_scale network_weights vae_batch_size
""".split()


def test_help_lists_every_seed_option():
    out = subprocess.run([sys.executable, str(REPO / "moss_image_train_network.py"), "--help"], capture_output=True,
                         text=True, check=True).stdout
    listed = set(re.findall(r"--([a-z0-9_]+)", out))
    missing = [o for o in SEED_OPTIONS if o not in listed]  # --v2 etc. too: listed as ignored
    assert not missing, missing


def test_show_timesteps_console(capsys):
    import moss_image_train_network as m

    assert m.main(["--show_timesteps", "console", "--timestep_sampling", "shift", "--discrete_flow_shift", "3"]) == 0


def test_ddp_two_cpu_processes_stay_in_sync(tiny_snapshot, toy_data, tmp_path):
    out = tmp_path / "ddp"
    # torchrun on a machine without CUDA: the trainer's Accelerator runs DDP over gloo
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "tests.ddp_worker",
           *base_args(tiny_snapshot, toy_data, out, "--max_train_steps", "3", "--learning_rate", "1e-2")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in reports] == [2, 2] and [r["steps"] for r in reports] == [3, 3]
    assert reports[0]["batches"] == 16  # 32 batches (8 images x 4 repeats) sharded over 2 processes
    assert reports[0]["sha"] == reports[1]["sha"]  # averaged gradients: identical LoRA on both ranks
    assert (out / "toy.safetensors").exists()


def test_text_encoder_lora_trains_and_merges_at_inference(tiny_snapshot, toy_data, tmp_path, caplog):
    argv = base_args(tiny_snapshot, toy_data, tmp_path / "out", "--max_train_steps", "2", "--learning_rate", "1e-2",
                     "--text_encoder_lr", "1e-2", "--gradient_checkpointing")
    argv.remove("--network_train_unet_only")
    argv.remove("--cache_text_encoder_outputs")
    train(argv)
    lora = tmp_path / "out" / "toy.safetensors"
    sd = load_safetensors(lora)
    te_up = [k for k in sd if k.startswith("lora_te_") and k.endswith("lora_up.weight")]
    assert len(te_up) == 25  # q/k/v/o, in_proj_qkv/z, out_proj, mlp: in_proj_a/b excluded by default
    assert not any("in_proj_a" in k or "in_proj_b" in k for k in sd)
    assert all(sd[k].abs().max() > 0 for k in te_up)  # the text encoder LoRA was trained

    import logging

    import moss_image_minimal_inference as inf

    caplog.set_level(logging.INFO)
    inf.run(inf.setup_parser().parse_args(["--snapshot", str(tiny_snapshot), "--prompt", "x", "--image_size", "32", "32",
                                           "--infer_steps", "1", "--save_path", str(tmp_path / "i"),
                                           "--output_type", "latent", "--lora_weight", str(lora)]))
    assert "merged 25 lora_te LoRA modules" in caplog.text and "merged 144 lora_unet LoRA modules" in caplog.text


def test_config_file_tensorboard_and_output_config(tiny_snapshot, toy_data, tmp_path, caplog):
    import logging

    import moss_image_train_network as m

    cfg = tmp_path / "args.toml"
    cfg.write_text('[training]\nmax_train_steps = 2\nlearning_rate = 1e-3\n[logging]\nlog_with = "tensorboard"\n')
    argv = base_args(tiny_snapshot, toy_data, tmp_path / "out", "--config_file", str(cfg),
                     "--logging_dir", str(tmp_path / "logs"), "--log_prefix", "toy_")
    assert m.main(argv) == 0
    assert list((tmp_path / "logs").glob("toy_*/**/events.out.tfevents.*"))  # tensorboard wrote its log
    assert read_metadata(tmp_path / "out" / "toy.safetensors")["ss_steps"] == "2"  # from the config file

    bad = tmp_path / "bad.toml"  # a misspelt key: named in a warning (kohya_ss configs carry keys of their own)
    bad.write_text("max_train_stepz = 3\nmax_train_steps = 1\n")
    with caplog.at_level(logging.WARNING):
        assert m.main(base_args(tiny_snapshot, toy_data, tmp_path / "o2", "--config_file", str(bad))) == 0
    assert "keys that are not options of this script are ignored: max_train_stepz" in caplog.text

    written = tmp_path / "written.toml"
    assert m.main([*base_args(tiny_snapshot, toy_data, tmp_path / "o3", "--max_train_steps", "5"),
                   "--output_config", "--config_file", str(written)]) == 0
    assert "max_train_steps = 5" in written.read_text()


def test_base_weights_are_merged_before_training(tiny_snapshot, toy_data, tmp_path, caplog):
    import logging

    first = tmp_path / "first"
    train(base_args(tiny_snapshot, toy_data, first, "--max_train_steps", "2", "--learning_rate", "1e-2"))
    caplog.set_level(logging.INFO)
    run = train(base_args(tiny_snapshot, toy_data, tmp_path / "second", "--max_train_steps", "1",
                          "--base_weights", str(first / "toy.safetensors"), "--base_weights_multiplier", "0.5"))
    assert "merged 144 lora_unet LoRA modules" in caplog.text
    from library.moss_image.loaders import load_moss_image_model

    plain = load_moss_image_model("cpu", tiny_snapshot, dtype=torch.float32)
    assert not torch.equal(plain.layers[0].proj.q.weight, run.unet.layers[0].proj.q.weight.float())


def test_initial_step_and_skip(tiny_snapshot, toy_data, tmp_path):
    run = train(base_args(tiny_snapshot, toy_data, tmp_path / "a", "--max_train_steps", "6", "--initial_step", "4",
                          "--skip_until_initial_step"))
    assert run.global_step == 6 and len(run.loss_history) == 2
    with pytest.raises(UserError, match="needs --initial_step"):
        train(base_args(tiny_snapshot, toy_data, tmp_path / "b", "--skip_until_initial_step"))
    with pytest.raises(UserError, match="do not apply here"):
        train(base_args(tiny_snapshot, toy_data, tmp_path / "c", "--ddp_static_graph"))


def test_lora_saved_in_fp32_by_default_and_no_metadata_keeps_the_basics(tiny_snapshot, toy_data, tmp_path):
    out = tmp_path / "out"
    train(base_args(tiny_snapshot, toy_data, out, "--max_train_steps", "1", "--mixed_precision", "bf16",
                    "--no_metadata"))
    sd = load_safetensors(out / "toy.safetensors")
    assert all(v.dtype == torch.float32 for v in sd.values())
    meta = read_metadata(out / "toy.safetensors")
    assert meta["ss_network_module"] == "networks.lora_generic" and "ss_datasets" not in meta
    assert meta["modelspec.resolution"] == "64x64"


def test_tf32_is_set_before_anything_is_cached_or_trained(tiny_snapshot, toy_data, tmp_path, monkeypatch):
    """The trainer's TF32 setting (`apply_cuda_optimizations`, which stays set for the process) comes at the start
    of a run, before caching and the steps, so that no run computes anything before it (a process's first run would
    then differ from its later ones); caching itself takes full fp32 (tests/test_caching.py)."""
    import moss_image_train_network as m
    from library.training import network_trainer

    order: list[str] = []
    real_optimizations = network_trainer.apply_cuda_optimizations
    real_cache = m.MossImageNetworkTrainer.cache_latents
    monkeypatch.setattr(network_trainer, "apply_cuda_optimizations",
                        lambda args: (order.append("tf32"), real_optimizations(args))[1])
    monkeypatch.setattr(m.MossImageNetworkTrainer, "cache_latents",
                        lambda self, run: (order.append("cache_latents"), real_cache(self, run))[1])
    train(base_args(tiny_snapshot, toy_data, tmp_path / "out", "--max_train_steps", "1"))
    assert order == ["tf32", "cache_latents"], order
