"""The dataset command-line options: sd-scripts names and defaults, the misspelled alias, light imports."""

from __future__ import annotations

import argparse
import subprocess
import sys

from tests.test_datasets_support import parse

SD_SCRIPTS_DEFAULTS = {
    "dataset_config": None, "train_data_dir": None, "reg_data_dir": None, "in_json": None, "dataset_repeats": 1,
    "resolution": None, "enable_bucket": False, "min_bucket_reso": 256, "max_bucket_reso": 1024,
    "bucket_reso_steps": 64, "bucket_no_upscale": False, "caption_extension": ".caption", "caption_separator": ",",
    "shuffle_caption": False, "keep_tokens": 0, "keep_tokens_separator": "", "secondary_separator": None,
    "enable_wildcard": False, "caption_prefix": None, "caption_suffix": None, "caption_dropout_rate": 0.0,
    "caption_dropout_every_n_epochs": 0, "caption_tag_dropout_rate": 0.0, "token_warmup_min": 1,
    "token_warmup_step": 0, "color_aug": False, "flip_aug": False, "random_crop": False, "alpha_mask": False,
    "masked_loss": False, "prior_loss_weight": 1.0, "debug_dataset": False, "validation_split": 0.0,
    "validation_seed": None, "resize_interpolation": None, "train_batch_size": 1, "max_data_loader_n_workers": 8,
    "persistent_data_loader_workers": False, "face_crop_aug_range": None,
}


def test_defaults_match_sd_scripts() -> None:
    args = vars(parse([]))
    assert {k: args[k] for k in SD_SCRIPTS_DEFAULTS} == SD_SCRIPTS_DEFAULTS


def test_misspelled_caption_extension_alias() -> None:
    assert parse(["--caption_extention", ".txt"]).caption_extension == ".txt"
    assert parse(["--caption_extension", ".txt"]).caption_extension == ".txt"


def test_no_conflict_with_the_shared_training_options() -> None:
    from library.datasets.args import add_dataset_arguments
    from library.training.args import add_common_arguments

    parser = argparse.ArgumentParser()
    add_common_arguments(parser)
    add_dataset_arguments(parser)
    assert parser.parse_args(["--seed", "3", "--train_batch_size", "2"]).train_batch_size == 2


def test_args_module_does_not_import_torch() -> None:
    code = "import sys, library.datasets.args, library.datasets; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=".")
