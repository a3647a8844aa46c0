"""Helpers shared by the tests/test_datasets_*.py files (tiny PIL images, config files, parsed args)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from PIL import Image

from library.datasets.args import add_dataset_arguments


def make_image(path: Path, size: tuple[int, int], color: tuple[int, ...] = (200, 100, 50), mode: str = "RGB") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, color).save(path)
    return path


def make_gradient(path: Path, size: tuple[int, int]) -> Path:
    """An image whose red channel grows left to right (so flips and crops are visible)."""
    w, h = size
    img = Image.new("RGB", size)
    img.putdata([(int(255 * x / max(w - 1, 1)), 0, 0) for _ in range(h) for x in range(w)])
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path


def write_caption(image: Path, text: str, ext: str = ".caption") -> None:
    image.with_suffix(ext).write_text(text, encoding="utf-8")


def toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return str(v)


def write_toml(path: Path, general: dict | None, datasets: list[tuple[dict, list[dict]]]) -> Path:
    lines = []
    if general:
        lines.append("[general]")
        lines += [f"{k} = {toml_value(v)}" for k, v in general.items()]
    for ds, subsets in datasets:
        lines.append("[[datasets]]")
        lines += [f"{k} = {toml_value(v)}" for k, v in ds.items()]
        for ss in subsets:
            lines.append("  [[datasets.subsets]]")
            lines += [f"  {k} = {toml_value(v)}" for k, v in ss.items()]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_dataset_arguments(parser)
    parser.add_argument("--seed", type=int, default=None)
    return parser.parse_args(argv)
