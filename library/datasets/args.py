"""The dataset command-line options, with sd-scripts' names and defaults (imports nothing heavy: `--help` is fast).

Options of sd-scripts that cannot apply to MOSS-Image (Stable Diffusion face crops, ControlNet conditioning folders,
custom dataset classes) are still declared, so that a pasted command does not fail with a bare "unrecognized
arguments", but `check_unsupported_dataset_args` rejects them with a sentence when they are set.
`--weighted_captions` is declared and rejected with the other Stable Diffusion options in `library.training.args`.
"""

from __future__ import annotations

import argparse

from library.errors import UserError

# option -> why it is rejected
UNSUPPORTED_DATASET_OPTIONS: dict[str, str] = {
    "face_crop_aug_range": "is a Stable Diffusion face-crop augmentation that moss-image-scripts does not support",
    "conditioning_data_dir": "belongs to ControlNet / mask datasets, which moss-image-scripts does not support"
    " (use alpha_mask for masked loss)",
    "dataset_class": "loads a custom dataset class, which moss-image-scripts does not support (use --dataset_config)",
}


def add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the dataset, caption, bucket, augmentation and data-loader options to a parser."""
    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset_config", type=str, default=None, help="dataset config file (.toml or .json)")
    g.add_argument("--train_data_dir", type=str, default=None,
                   help="folder of DreamBooth subfolders named '<repeats>_<class tokens>' (or images with --in_json)")
    g.add_argument("--reg_data_dir", type=str, default=None, help="folder of regularisation image subfolders")
    g.add_argument("--in_json", type=str, default=None, help="fine-tuning metadata file (JSON or JSONL)")
    g.add_argument("--dataset_repeats", type=int, default=1, help="repeats of the images (num_repeats fallback)")
    g.add_argument("--resolution", type=str, default=None, help="training resolution: 'SIZE' or 'WIDTH,HEIGHT'")
    g.add_argument("--enable_bucket", action="store_true", help="aspect-ratio buckets")
    g.add_argument("--min_bucket_reso", type=int, default=256, help="smallest bucket side")
    g.add_argument("--max_bucket_reso", type=int, default=1024, help="largest bucket side")
    g.add_argument("--bucket_reso_steps", type=int, default=64,
                   help="bucket size step; a multiple of 16 for MOSS-Image")
    g.add_argument("--bucket_no_upscale", action="store_true", help="never enlarge images to fill a bucket")
    g.add_argument("--resize_interpolation", type=str, default=None,
                   choices=["lanczos", "nearest", "bilinear", "linear", "bicubic", "cubic", "area", "box"],
                   help="resize filter (default: area when shrinking, lanczos when enlarging)")
    g.add_argument("--cache_info", action="store_true",
                   help="keep image sizes and captions of DreamBooth folders in metadata_cache.json")
    g.add_argument("--validation_split", type=float, default=0.0, help="fraction of the images held out for validation")
    g.add_argument("--validation_seed", type=int, default=None, help="seed of the validation split (default: --seed)")

    c = parser.add_argument_group("captions")
    c.add_argument("--caption_extension", "--caption_extention", dest="caption_extension", type=str,
                   default=".caption", help="extension of caption files (--caption_extention is accepted too)")
    c.add_argument("--caption_separator", type=str, default=",", help="separator of the tags of a caption")
    c.add_argument("--shuffle_caption", action="store_true", help="shuffle the tags of each caption at each step")
    c.add_argument("--keep_tokens", type=int, default=0, help="number of leading tags kept in place when shuffling")
    c.add_argument("--keep_tokens_separator", type=str, default="",
                   help="tags before this separator are kept in place (a second one also fixes the tail)")
    c.add_argument("--secondary_separator", type=str, default=None,
                   help="separator replaced by caption_separator after shuffling (keeps groups of words together)")
    c.add_argument("--enable_wildcard", action="store_true",
                   help="one random caption line per step and {a|b} wildcards")
    c.add_argument("--enable_multiline_caption", action="store_true",
                   help="keep line breaks in captions; lines holding only '---' separate caption candidates")
    c.add_argument("--caption_prefix", type=str, default=None, help="text put before every caption")
    c.add_argument("--caption_suffix", type=str, default=None, help="text put after every caption")
    c.add_argument("--caption_dropout_rate", type=float, default=0.0, help="probability of an empty caption")
    c.add_argument("--caption_dropout_every_n_epochs", type=int, default=0,
                   help="drop every caption in epochs n, 2n, ... (0 = never)")
    c.add_argument("--caption_tag_dropout_rate", type=float, default=0.0, help="probability of dropping each tag")
    c.add_argument("--token_warmup_min", type=int, default=1, help="tags used at the first step of token warmup")
    c.add_argument("--token_warmup_step", type=float, default=0,
                   help="steps until all tags are used (below 1: a fraction of the training steps)")
    c.add_argument("--caption_cache_variants", type=int, default=1,
                   help="with --cache_text_encoder_outputs: variants of each caption cached (shuffle, tag dropout and"
                   " {a|b} drawn per variant from the seed), one picked per step; 1 caches the caption only")

    a = parser.add_argument_group("augmentation and masks")
    a.add_argument("--color_aug", action="store_true", help="small random hue/gamma changes")
    a.add_argument("--flip_aug", action="store_true", help="random horizontal flips")
    a.add_argument("--random_crop", action="store_true", help="random instead of centred crops")
    a.add_argument("--alpha_mask", action="store_true", help="use the alpha channel as the loss mask")
    a.add_argument("--masked_loss", action="store_true",
                   help="masked loss from the alpha channels (implies --alpha_mask)")
    a.add_argument("--face_crop_aug_range", type=str, default=None, help="not supported (Stable Diffusion only)")
    a.add_argument("--conditioning_data_dir", type=str, default=None, help="not supported (ControlNet datasets)")
    a.add_argument("--dataset_class", type=str, default=None, help="not supported (custom dataset classes)")

    t = parser.add_argument_group("batches and loading")
    t.add_argument("--prior_loss_weight", type=float, default=1.0, help="loss weight of regularisation images")
    t.add_argument("--train_batch_size", type=int, default=1, help="batch size (batch_size fallback)")
    t.add_argument("--max_data_loader_n_workers", type=int, default=8,
                   help="DataLoader worker processes (capped by the CPU count)")
    t.add_argument("--persistent_data_loader_workers", action="store_true",
                   help="keep DataLoader workers between epochs (needs at least one worker)")
    t.add_argument("--debug_dataset", action="store_true", help="log the batches of the dataset and exit")


def check_unsupported_dataset_args(args: argparse.Namespace) -> None:
    """Raise a UserError for a set option that cannot apply to this trainer (the options of
    `add_dataset_arguments`; nothing is changed)."""
    for name, why in UNSUPPORTED_DATASET_OPTIONS.items():
        if getattr(args, name) not in (None, False):
            raise UserError(f"--{name} {why}; remove it from the command.")
    if args.dataset_config is not None:
        given = [f"--{n}" for n in ("train_data_dir", "reg_data_dir", "in_json") if getattr(args, n) is not None]
        if given:
            raise UserError(
                f"{', '.join(given)} cannot be combined with --dataset_config: put the folders in the dataset config"
                " as [[datasets.subsets]] image_dir / metadata_file, or drop --dataset_config."
            )
    if args.prior_loss_weight < 0:
        raise UserError("--prior_loss_weight must not be negative.")
