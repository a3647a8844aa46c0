"""Secrets and local paths stay out of the tracker config, the command line wandb records and --output_config."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import moss_image_train_network as trainer
from library.errors import UserError
from library.training import trackers
from library.training.args import write_config_file
from library.training.sensitive_options import (
    MASK,
    is_path_option,
    is_secret_option,
    mask_command_line,
    tracker_config,
)

# options whose help speaks of files or folders without naming one
NOT_PATHS = {
    "output_name", "output_config", "overwrite_config", "save_model_as", "no_metadata", "cache_latents_to_disk",
    "cache_text_encoder_outputs_to_disk", "skip_cache_check", "log_prefix", "cache_info", "caption_extension",
}
FILE_WORDS = re.compile(r"\b(file|files|folder|folders|path|paths|directory|TOML)\b", re.IGNORECASE)


def test_every_trainer_option_that_names_a_file_or_folder_is_a_path_option():
    parser = trainer.setup_parser()
    unclassified = [a.dest for a in parser._actions
                    if FILE_WORDS.search(a.help or "") and not is_path_option(a.dest) and a.dest not in NOT_PATHS]
    assert not unclassified, f"classify these options in library/training/sensitive_options.py: {unclassified}"
    dests = {a.dest for a in parser._actions}
    for name in ("pretrained_model_name_or_path", "text_encoder", "vae", "snapshot", "output_dir", "logging_dir",
                 "train_data_dir", "reg_data_dir", "dataset_config", "config_file", "network_weights", "resume"):
        assert name in dests and is_path_option(name), name


def test_secret_rule():
    for name in ("wandb_api_key", "huggingface_token", "token", "hf_token", "api_key", "s3_secret", "password"):
        assert is_secret_option(name), name
    for name in ("moss_max_token_length", "keep_tokens", "token_warmup_min", "token_warmup_step", "keep_tokens_separator",
                 "max_token_length", "wandb_run_name"):
        assert not is_secret_option(name), name
    secrets = [a.dest for a in trainer.setup_parser()._actions if is_secret_option(a.dest)]
    assert secrets == ["wandb_api_key", "huggingface_token"]  # sd-scripts' upload token: accepted, ignored


def _parsed(tmp_path: Path, *extra: str):
    return trainer.setup_parser().parse_args([
        "--pretrained_model_name_or_path", str(tmp_path / "dit.safetensors"), "--vae", str(tmp_path / "vae"),
        "--train_data_dir", str(tmp_path / "data"), "--output_dir", str(tmp_path / "out"),
        "--base_weights", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"),
        "--wandb_api_key", "sekrit-123", "--learning_rate", "3e-4", "--network_args", "conv_dim=4", *extra,
    ])


def test_tracker_config_has_no_secret_and_no_path(tmp_path):
    config = tracker_config(_parsed(tmp_path))
    text = repr(config)
    assert "sekrit" not in text and str(tmp_path) not in text
    for name in ("wandb_api_key", "pretrained_model_name_or_path", "vae", "train_data_dir", "output_dir", "base_weights"):
        assert name not in config
    assert config["learning_rate"] == 3e-4 and config["network_args"] == "['conv_dim=4']"
    assert config["seed"] == "None" and config["network_train_unet_only"] is False
    assert all(isinstance(v, (bool, int, float, str)) for v in config.values())


def test_mask_command_line():
    names = vars(trainer.setup_parser().parse_args([]))
    argv = ["--wandb_api_key", "k1", "--learning_rate", "1e-4", "--vae=/home/me/vae.safetensors", "--base_weights",
            "/x/a.safetensors", "/x/b.safetensors", "--network_dim", "-4", "--output_d", "/home/me/out",
            "--resolution", "512", "--wandb_api_key=k2", "--network_args", "a=1"]
    masked = mask_command_line(argv, names)
    assert masked == ["--wandb_api_key", MASK, "--learning_rate", "1e-4", f"--vae={MASK}", "--base_weights", MASK,
                      MASK, "--network_dim", "-4", "--output_d", MASK, "--resolution", "512", f"--wandb_api_key={MASK}",
                      "--network_args", "a=1"]
    assert mask_command_line(["--unknown", "/x"], names) == ["--unknown", "/x"]


def test_output_config_drops_secrets_keeps_paths_and_refuses_to_overwrite(tmp_path):
    parser = trainer.setup_parser()
    args = _parsed(tmp_path, "--output_config")
    out = tmp_path / "run.toml"
    write_config_file(args, parser, str(out))
    text = out.read_text()
    keys = re.findall(r"^(\w+) =", text, re.MULTILINE)
    assert "sekrit" not in text and "wandb_api_key" not in keys and "output_config" not in keys
    assert str(tmp_path / "dit.safetensors") in text and "learning_rate = 0.0003" in text  # re-runnable here
    out.write_text("# mine\n")
    with pytest.raises(UserError, match=r"would overwrite .*run\.toml.*--overwrite_config"):
        write_config_file(args, parser, str(out))
    assert out.read_text() == "# mine\n"
    args.overwrite_config = True
    write_config_file(args, parser, str(out))
    assert "learning_rate" in out.read_text()
    assert "overwrite_config" not in re.findall(r"^(\w+) =", out.read_text(), re.MULTILINE)
    # the written file reads back as the same run
    again = trainer.setup_parser()
    from library.training.args import parse_args_with_config

    back = parse_args_with_config(again, ["--config_file", str(out)])
    assert back.learning_rate == 3e-4 and back.base_weights == args.base_weights and back.wandb_api_key is None


def test_main_output_config_refuses_an_existing_file(tmp_path, caplog):
    out = tmp_path / "cfg.toml"
    out.write_text("x = 1\n")
    assert trainer.main(["--output_config", "--config_file", str(out), "--learning_rate", "1e-3"]) == 2
    assert "--overwrite_config" in caplog.text and out.read_text() == "x = 1\n"
    assert trainer.main(["--output_config", "--overwrite_config", "--config_file", str(out), "--learning_rate",
                         "1e-3"]) == 0
    assert "learning_rate = 0.001" in out.read_text()


def test_wandb_runs_see_a_masked_command_line(tmp_path, monkeypatch):
    argv = ["train.py", "--wandb_api_key", "sekrit", "--output_dir", str(tmp_path), "--learning_rate", "1e-4"]
    args = _parsed(tmp_path)
    monkeypatch.setattr(sys, "argv", list(argv))
    trackers.hide_private_values(args, "tensorboard")
    assert sys.argv == argv  # TensorBoard does not record the command line: left as it is
    for log_with in ("wandb", "all"):
        monkeypatch.setattr(sys, "argv", list(argv))
        trackers.hide_private_values(args, log_with)
        assert sys.argv == ["train.py", "--wandb_api_key", MASK, "--output_dir", MASK, "--learning_rate", "1e-4"]
