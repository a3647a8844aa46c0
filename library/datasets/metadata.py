"""The dataset part of the `ss_*` metadata of a saved LoRA, in sd-scripts' shapes.

`dataset_metadata(group)` returns {"datasets": [...], "tag_frequency": {...}, "dataset_dirs": {...}}, ready for
`library.files.model_spec.training_metadata(args, dataset_metadata=...)` (which writes them as `ss_datasets`,
`ss_tag_frequency`, `ss_dataset_dirs`). Folder names are base names only, so no absolute path is stored.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

from library.datasets.config import SubsetParams
from library.datasets.dataset_group import DatasetGroup, ImageDataset


def subset_name(subset: SubsetParams) -> str:
    """The base name a subset is known by in the metadata (its folder, else its metadata file)."""
    path = subset.image_dir if subset.metadata_file is None else subset.metadata_file
    return os.path.basename(os.path.normpath(path or ""))


def tag_frequency(captions: list[str]) -> dict[str, int]:
    """{lower-cased tag: count}, tags split at "," whatever the caption separator (as sd-scripts counts them)."""
    counts: Counter[str] = Counter()
    for caption in captions:
        for tag in caption.split(","):
            tag = tag.strip().lower()
            if tag:
                counts[tag] += 1
    return dict(counts)


def _subset_metadata(dataset: ImageDataset, subset: SubsetParams) -> dict[str, Any]:
    infos = [i for i in dataset.image_infos if i.subset is subset]
    md: dict[str, Any] = {
        "img_count": len(infos),
        "num_repeats": subset.num_repeats,
        "color_aug": subset.color_aug,
        "flip_aug": subset.flip_aug,
        "random_crop": subset.random_crop,
        "shuffle_caption": subset.shuffle_caption,
        "keep_tokens": subset.keep_tokens,
        "keep_tokens_separator": subset.keep_tokens_separator,
        "secondary_separator": subset.secondary_separator,
        "enable_wildcard": subset.enable_wildcard,
        "enable_multiline_caption": subset.enable_multiline_caption,
        "caption_prefix": subset.caption_prefix,
        "caption_suffix": subset.caption_suffix,
        "caption_cache_variants": subset.caption_cache_variants,
        "resize_interpolation": subset.resize_interpolation,
    }
    if subset.metadata_file is not None:
        md["metadata_file"] = subset_name(subset)
    else:
        md.update(image_dir=subset_name(subset), class_tokens=subset.class_tokens, is_reg=subset.is_reg)
    return md


def _subset_tags(dataset: ImageDataset, subset: SubsetParams) -> dict[str, int]:
    return tag_frequency([c for i in dataset.image_infos if i.subset is subset for c in i.caption_candidates])


def _dataset_metadata(dataset: ImageDataset) -> dict[str, Any]:
    p = dataset.params
    by_dir: dict[str, dict[str, int]] = {}
    for s in dataset.subsets:
        by_dir[_unique(subset_name(s), by_dir)] = _subset_tags(dataset, s)
    return {
        "is_dreambooth": dataset.is_dreambooth,
        "batch_size_per_device": p.batch_size,
        "num_train_images": dataset.num_train_images,
        "num_reg_images": dataset.num_reg_images,
        "resolution": list(p.resolution),
        "enable_bucket": p.enable_bucket,
        "min_bucket_reso": p.min_bucket_reso,
        "max_bucket_reso": p.max_bucket_reso,
        "bucket_no_upscale": p.bucket_no_upscale,
        "tag_frequency": by_dir,
        "bucket_info": dataset.bucket_info(),
        "subsets": [_subset_metadata(dataset, s) for s in dataset.subsets],
    }


def _unique(name: str, taken: dict[str, Any]) -> str:
    if name not in taken:
        return name
    n = 2
    while f"{name} ({n})" in taken:
        n += 1
    return f"{name} ({n})"


def dataset_metadata(group: DatasetGroup) -> dict[str, Any]:
    """The structured dataset keys of a training group (see the module docstring)."""
    datasets = [_dataset_metadata(d) for d in group.datasets]
    frequency: dict[str, dict[str, int]] = {}
    dirs: dict[str, dict[str, int]] = {}
    for d in group.datasets:
        for s in d.subsets:
            name = subset_name(s)
            frequency[_unique(name, frequency)] = _subset_tags(d, s)
            if not s.is_reg:
                count = sum(1 for i in d.image_infos if i.subset is s)
                dirs[_unique(name, dirs)] = {"n_repeats": s.num_repeats, "img_count": count}
    return {"datasets": datasets, "tag_frequency": frequency, "dataset_dirs": dirs}


def train_data_dir_metadata(group: DatasetGroup, total_batch_size: int) -> dict[str, Any]:
    """The flat dataset keys sd-scripts' train_network.py writes for a run without a dataset config (one dataset from
    --train_data_dir / --reg_data_dir): ss_batch_size_per_device, ss_resolution "(w, h)", the augmentation flags, the
    bucket settings, ss_dataset_dirs / ss_reg_dataset_dirs and ss_bucket_info (the webui's LoRA browser reads the last
    one for its "Resolution" line). Keys without the `ss_` prefix, values as sd-scripts has them before str()."""
    dataset = group.datasets[0]
    p = dataset.params
    subsets = [s for s in dataset.subsets if not s.is_reg] or list(dataset.subsets)
    first = subsets[0]
    dirs: dict[str, dict[str, int]] = {}
    reg_dirs: dict[str, dict[str, int]] = {}
    for s in dataset.subsets:
        count = sum(1 for i in dataset.image_infos if i.subset is s)
        target = reg_dirs if s.is_reg else dirs
        target[_unique(subset_name(s), target)] = {"n_repeats": s.num_repeats, "img_count": count}
    return {
        "batch_size_per_device": p.batch_size,
        "total_batch_size": total_batch_size,
        "resolution": tuple(p.resolution),
        "color_aug": first.color_aug,
        "flip_aug": first.flip_aug,
        "random_crop": first.random_crop,
        "shuffle_caption": first.shuffle_caption,
        "enable_bucket": p.enable_bucket,
        "bucket_no_upscale": p.bucket_no_upscale,
        "min_bucket_reso": p.min_bucket_reso,
        "max_bucket_reso": p.max_bucket_reso,
        "keep_tokens": first.keep_tokens,
        "dataset_dirs": dirs,
        "reg_dataset_dirs": reg_dirs,
        "bucket_info": dataset.bucket_info(),
    }
