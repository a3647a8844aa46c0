"""Shared fixtures: the tiny MOSS-Image snapshot (built once per test session, in the official layouts)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the network
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # tiny models: threads only fight each other on a 2-core machine


def pytest_configure(config: pytest.Config) -> None:
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _model_hash_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The base-model hash cache of the runs lives in the session's temp folder, never in the user's cache."""
    os.environ["MOSS_IMAGE_SCRIPTS_CACHE"] = str(tmp_path_factory.mktemp("model_hash_cache"))


@pytest.fixture(scope="session")
def tiny_snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from library.moss_image.tiny_snapshot import build_tiny_snapshot

    return build_tiny_snapshot(tmp_path_factory.mktemp("snapshot") / "moss-image-tiny")
