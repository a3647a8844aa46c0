"""`build_dataset_groups(args)`: the one place where datasets are built (trainer and cache tools alike)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

import torch

from library.datasets.args import check_unsupported_dataset_args
from library.datasets.config import DatasetBlueprint, load_config_file, resolve_config
from library.datasets.dataset_group import (
    DatasetGroup,
    ImageDataset,
    bucket_manager_for,
    create_data_loader,
    verify_bucket_sizes,
)
from library.datasets.image_info import ImageInfo
from library.datasets.subsets import (
    SubsetScan,
    balance_regularisation,
    cli_subset_tables,
    scan_subset,
    split_for_validation,
)
from library.errors import UserError

logger = logging.getLogger(__name__)

DEFAULT_SEED = 42
MOSS_IMAGE_BUCKET_MULTIPLE = 16


def load_blueprints(args: argparse.Namespace) -> tuple[list[DatasetBlueprint], str]:
    """The resolved datasets of a run, from --dataset_config or from the legacy command-line options."""
    if getattr(args, "dataset_config", None) is not None:
        source = f"'{args.dataset_config}'"
        return resolve_config(load_config_file(args.dataset_config), args, source), source
    tables = cli_subset_tables(
        getattr(args, "train_data_dir", None), getattr(args, "reg_data_dir", None), getattr(args, "in_json", None)
    )
    source = "the command line"
    return resolve_config({"datasets": [{"subsets": tables}]}, args, source), source


def _split_scans(
    scans: Sequence[SubsetScan], split: float, seed: int
) -> tuple[list[ImageInfo], list[ImageInfo], list[ImageInfo]]:
    train, val, reg = [], [], []
    for scan in scans:
        if scan.subset.is_reg:
            reg += scan.infos
            continue
        train += split_for_validation(scan.infos, split, seed, for_training=True)
        for info in split_for_validation(scan.infos, split, seed, for_training=False):
            info.num_repeats = 1
            val.append(info)
    return train, val, reg


def _build_datasets(
    blueprint: DatasetBlueprint, seed: int, source: str
) -> tuple[ImageDataset | None, ImageDataset | None]:
    params = blueprint.params
    where = f"datasets[{params.index}] of {source}"
    buckets = bucket_manager_for(params, where)
    scans = [scan_subset(s) for s in blueprint.subsets]
    split_seed = params.validation_seed if params.validation_seed is not None else seed
    train, val, reg = _split_scans(scans, params.validation_split, split_seed)
    if reg:
        train_count = sum(i.num_repeats for i in train)
        used = balance_regularisation(train_count, reg)
        if not used:
            logger.warning("datasets[%d]: regularisation images are not used because there are no training images",
                           params.index)
        train += used
    train_ds = ImageDataset(params, blueprint.subsets, train, source=source, bucket_manager=buckets) if train else None
    val_ds = (
        ImageDataset(params, blueprint.subsets, val, is_validation=True, source=source, bucket_manager=buckets)
        if val
        else None
    )
    if params.validation_split > 0 and val_ds is None:
        logger.warning("datasets[%d]: validation_split %.3f leaves no validation image", params.index,
                       params.validation_split)
    return train_ds, val_ds


def _seed_of(args: argparse.Namespace) -> int:
    seed = getattr(args, "seed", None)
    if seed is None:
        logger.info("no --seed given: the dataset uses seed %d for its batch order and augmentations", DEFAULT_SEED)
        return DEFAULT_SEED
    return int(seed)


def build_dataset_groups(
    args: argparse.Namespace, *, bucket_reso_multiple: int | None = MOSS_IMAGE_BUCKET_MULTIPLE
) -> tuple[DatasetGroup, DatasetGroup | None]:
    """(training group, validation group or None) from the dataset options of `args` (see `add_dataset_arguments`;
    `args.seed` seeds batch order and augmentations; `args.max_train_steps`, when present, serves fractional
    token_warmup_step). Bucket sizes are checked to be multiples of `bucket_reso_multiple` (None skips the check)."""
    check_unsupported_dataset_args(args)
    blueprints, source = load_blueprints(args)
    if bucket_reso_multiple is not None:
        for blueprint in blueprints:
            verify_bucket_sizes(blueprint.params, bucket_reso_multiple)
    seed = _seed_of(args)
    train_sets, val_sets = [], []
    for blueprint in blueprints:
        train_ds, val_ds = _build_datasets(blueprint, seed, source)
        if train_ds is None:
            logger.warning("datasets[%d] of %s has no usable training image and is left out",
                           blueprint.params.index, source)
        else:
            train_sets.append(train_ds)
        if val_ds is not None:
            val_sets.append(val_ds)
    if not train_sets:
        raise UserError(f"No training image was found in the datasets of {source}: check image_dir / metadata_file.")
    weight = float(getattr(args, "prior_loss_weight", 1.0))
    train = DatasetGroup(train_sets, seed=seed, prior_loss_weight=weight)
    val = DatasetGroup(val_sets, seed=seed, prior_loss_weight=weight, is_validation=True) if val_sets else None
    max_steps = getattr(args, "max_train_steps", None)
    if max_steps is not None:
        train.set_max_train_steps(int(max_steps))  # the trainer updates it when --max_train_epochs decides
    for group in (train, val):
        for d in group.datasets if group is not None else []:
            d.log_summary()
    return train, val


def create_data_loader_from_args(group: DatasetGroup, args: argparse.Namespace) -> torch.utils.data.DataLoader:
    """`create_data_loader` with `--max_data_loader_n_workers` and `--persistent_data_loader_workers`."""
    return create_data_loader(
        group,
        num_workers=int(getattr(args, "max_data_loader_n_workers", 8)),
        persistent_workers=bool(getattr(args, "persistent_data_loader_workers", False)),
    )
