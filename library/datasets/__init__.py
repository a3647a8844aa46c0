"""Datasets for moss-image-scripts: the sd-scripts dataset config, captions, buckets, images and batches.

Entry points (the trainer and the cache tools use the same ones):
    add_dataset_arguments(parser)          library.datasets.args
    build_dataset_groups(args)             -> (train DatasetGroup, validation DatasetGroup or None)
    create_data_loader(group, ...)         / create_data_loader_from_args(group, args)
    debug_dataset(group)                   for --debug_dataset

Names are imported lazily so that `import library.datasets.args` (for --help) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "add_dataset_arguments": "library.datasets.args",
    "check_unsupported_dataset_args": "library.datasets.args",
    "build_dataset_groups": "library.datasets.build",
    "create_data_loader_from_args": "library.datasets.build",
    "load_blueprints": "library.datasets.build",
    "BatchKey": "library.datasets.dataset_group",
    "DatasetGroup": "library.datasets.dataset_group",
    "ImageDataset": "library.datasets.dataset_group",
    "create_data_loader": "library.datasets.dataset_group",
    "ImageInfo": "library.datasets.image_info",
    "LatentsCacheHook": "library.datasets.image_info",
    "TextEncoderOutputsCacheHook": "library.datasets.image_info",
    "PreparedImage": "library.datasets.images",
    "prepare_image": "library.datasets.images",
    "prepare_image_for_cache": "library.datasets.dataset_group",
    "debug_dataset": "library.datasets.debug",
    "dataset_metadata": "library.datasets.metadata",
    "verify_bucket_reso_steps": "library.datasets.buckets",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'library.datasets' has no attribute '{name}'")
    return getattr(importlib.import_module(module), name)
