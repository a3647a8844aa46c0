"""Subsets: finding the images and captions of one `[[datasets.subsets]]`, in either style.

- DreamBooth style (`image_dir`): the images directly inside the folder (not recursive, sorted). The caption of
  `name.png` is `name<caption_extension>` (UTF-8); without a caption file, `class_tokens`, else an empty caption.
  `cache_info = true` keeps `metadata_cache.json` in the folder with each image's size and caption text, so later
  starts need not open every file (delete it after editing images or captions).
- Fine-tuning style (`metadata_file`): a JSON object {image key: {caption, tags, image_size}} or JSONL lines
  {image_path, caption, tags, image_size}. A key is a path (absolute, or relative to `image_dir`, else to the current
  folder), with or without its image extension. `tags` are appended to each caption candidate after
  `caption_separator`; without `caption`, `tags` is the caption. `image_size` [w, h] spares opening the image.
- Command line (no `--dataset_config`): `--train_data_dir` holds DreamBooth folders named `<repeats>_<class tokens>`
  (`10_sks dog`), `--reg_data_dir` the same for regularisation images; `--in_json` makes `--train_data_dir` a
  fine-tuning image folder instead.

Also here: the validation split of a subset's image list and the repetition of regularisation images.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from library.datasets.captions import CaptionSettings, append_tags, has_extra_lines, split_candidates
from library.datasets.config import SubsetParams
from library.datasets.image_info import ImageInfo
from library.datasets.images import UnreadableImage, image_extensions, read_image_size
from library.errors import UserError

logger = logging.getLogger(__name__)

METADATA_CACHE_NAME = "metadata_cache.json"


def caption_settings_of(subset: SubsetParams) -> CaptionSettings:
    """The caption options of a subset."""
    return CaptionSettings(
        caption_prefix=subset.caption_prefix,
        caption_suffix=subset.caption_suffix,
        shuffle_caption=subset.shuffle_caption,
        caption_separator=subset.caption_separator,
        keep_tokens=subset.keep_tokens,
        keep_tokens_separator=subset.keep_tokens_separator,
        secondary_separator=subset.secondary_separator,
        enable_wildcard=subset.enable_wildcard,
        enable_multiline_caption=subset.enable_multiline_caption,
        caption_dropout_rate=subset.caption_dropout_rate,
        caption_dropout_every_n_epochs=subset.caption_dropout_every_n_epochs,
        caption_tag_dropout_rate=subset.caption_tag_dropout_rate,
        token_warmup_min=subset.token_warmup_min,
        token_warmup_step=subset.token_warmup_step,
    )


@dataclass
class SubsetScan:
    """The images found for one subset, with counts for the log."""

    subset: SubsetParams
    infos: list[ImageInfo] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # unreadable or missing images, with the reason
    from_class_tokens: int = 0
    empty_captions: int = 0
    dropped_extra_lines: int = 0


# ---------------------------------------------------------------- command line folders


def parse_dreambooth_folder_name(name: str) -> tuple[int, str] | None:
    """`10_sks dog` -> (10, "sks dog"); None when the name does not start with a repeat count."""
    head, _, tail = name.partition("_")
    try:
        repeats = int(head)
    except ValueError:
        return None
    return repeats, tail


def cli_subset_tables(train_data_dir: str | None, reg_data_dir: str | None, in_json: str | None) -> list[dict]:
    """The `[[datasets.subsets]]` tables that the legacy command-line options stand for."""
    if in_json is not None:
        table: dict[str, Any] = {"metadata_file": in_json}
        if train_data_dir is not None:
            table["image_dir"] = train_data_dir
        if reg_data_dir is not None:
            raise UserError(
                "--reg_data_dir cannot be used with --in_json: regularisation images need DreamBooth folders."
            )
        return [table]
    if train_data_dir is None:
        raise UserError(
            "No dataset was given: pass --dataset_config (a TOML file), or --train_data_dir with folders named"
            " like '10_sks dog', or --in_json with --train_data_dir."
        )
    tables = _folder_tables(train_data_dir, "--train_data_dir", is_reg=False)
    if reg_data_dir is not None:
        tables += _folder_tables(reg_data_dir, "--reg_data_dir", is_reg=True)
    return tables


def _folder_tables(root: str, option: str, is_reg: bool) -> list[dict]:
    if not os.path.isdir(root):
        raise UserError(f"{option} '{root}' is not a folder: check the path.")
    tables = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not os.path.isdir(path):
            continue
        parsed = parse_dreambooth_folder_name(name)
        if parsed is None:
            logger.warning("%s: folder '%s' does not start with '<repeats>_', so it is not used", option, name)
            continue
        repeats, tokens = parsed
        if repeats < 1:
            raise UserError(f"{option}: folder '{name}' has {repeats} repeats; name it '1_{tokens}' or more.")
        table: dict[str, Any] = {"image_dir": path, "num_repeats": repeats, "is_reg": is_reg}
        if tokens:
            table["class_tokens"] = tokens
        tables.append(table)
    if not tables:
        raise UserError(f"{option} '{root}' has no folder named '<repeats>_<class tokens>' (e.g. '10_sks dog').")
    return tables


# ---------------------------------------------------------------- scanning


def list_images(image_dir: str, where: str) -> list[str]:
    """Absolute paths of the images directly in a folder, sorted."""
    if not os.path.isdir(image_dir):
        raise UserError(f"image_dir '{image_dir}' of {where} is not a folder: check the path.")
    exts = image_extensions()
    paths = []
    for name in os.listdir(image_dir):
        path = os.path.join(image_dir, name)
        if os.path.splitext(name)[1].lower() in exts and os.path.isfile(path):
            paths.append(os.path.abspath(path))
    return sorted(paths)


def read_caption_file(path: str) -> str | None:
    """The text of a caption file (UTF-8, BOM allowed), or None when there is no such file."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8-sig") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise UserError(f"The caption file '{path}' is not UTF-8 text ({e}); save it as UTF-8.") from e


def _candidates(scan: SubsetScan, text: str | None, settings: CaptionSettings, tags: str | None = None) -> list[str]:
    subset = scan.subset
    if text is None or not text.strip():
        if tags:
            return append_tags([""], tags, subset.caption_separator)
        if text is None and subset.class_tokens:
            scan.from_class_tokens += 1
            return [subset.class_tokens]
        scan.empty_captions += 1
        return [""]
    if not settings.enable_multiline_caption and not settings.enable_wildcard and has_extra_lines(text):
        scan.dropped_extra_lines += 1
    return append_tags(split_candidates(text, settings), tags, subset.caption_separator)


def _load_metadata_cache(image_dir: str) -> dict[str, Any]:
    path = os.path.join(image_dir, METADATA_CACHE_NAME)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, json.JSONDecodeError) as e:
        logger.warning("%s could not be read (%s); it is rebuilt", path, e)
        return {}


def _save_metadata_cache(image_dir: str, entries: dict[str, Any]) -> None:
    from library.files.safetensors_io import write_text_atomic

    write_text_atomic(json.dumps(entries, ensure_ascii=False, indent=1), os.path.join(image_dir, METADATA_CACHE_NAME))


def _info(scan: SubsetScan, path: str, candidates: list[str], size: tuple[int, int] | None) -> ImageInfo:
    s = scan.subset
    return ImageInfo(path, path, s, candidates, s.num_repeats, s.is_reg, image_size=size)


def scan_dreambooth_subset(subset: SubsetParams) -> SubsetScan:
    scan = SubsetScan(subset)
    settings = caption_settings_of(subset)
    assert subset.image_dir is not None
    cache = _load_metadata_cache(subset.image_dir) if subset.cache_info else {}
    new_cache: dict[str, Any] = {}
    for path in list_images(subset.image_dir, subset.where):
        entry = cache.get(path)
        if entry is not None and isinstance(entry.get("resolution"), list) and len(entry["resolution"]) == 2:
            text, size = entry.get("caption"), (int(entry["resolution"][0]), int(entry["resolution"][1]))
        else:
            try:
                size = read_image_size(path)
            except UnreadableImage as e:
                scan.skipped.append(str(e))
                continue
            text = read_caption_file(os.path.splitext(path)[0] + subset.caption_extension)
        new_cache[path] = {"caption": text, "resolution": list(size)}
        scan.infos.append(_info(scan, path, _candidates(scan, text, settings), size))
    if subset.cache_info and new_cache != cache:
        _save_metadata_cache(subset.image_dir, new_cache)
    return scan


def read_metadata_entries(path: str, where: str) -> list[tuple[str, dict[str, Any]]]:
    """(image key, entry) pairs of a fine-tuning metadata file (JSON object or JSONL)."""
    if not os.path.isfile(path):
        raise UserError(f"metadata_file '{path}' of {where} does not exist: check the path.")
    try:
        with open(path, encoding="utf-8-sig") as f:
            if path.lower().endswith(".jsonl"):
                rows = [json.loads(line) for line in f if line.strip()]
                entries = [(r.get("image_path"), r) if isinstance(r, dict) else (None, r) for r in rows]
            else:
                data = json.load(f)
                if not isinstance(data, dict):
                    raise UserError(f"metadata_file '{path}' must hold a JSON object {{image: {{caption, tags}}}}.")
                entries = list(data.items())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"metadata_file '{path}' is not valid JSON/JSONL ({e}); fix the file.") from e
    for key, entry in entries:
        if not isinstance(key, str) or not isinstance(entry, dict):
            raise UserError(
                f"metadata_file '{path}' has an entry without an image path or that is not an object ({key!r});"
                " each entry needs an image path and an object with caption and/or tags."
            )
    return entries


def _resolve_metadata_image(key: str, image_dir: str | None) -> str | None:
    bases = [key] if os.path.isabs(key) else ([os.path.join(image_dir, key)] if image_dir else []) + [key]
    exts = image_extensions()
    for base in bases:
        if os.path.isfile(base) and os.path.splitext(base)[1].lower() in exts:
            return os.path.abspath(base)
        for ext in exts:
            for candidate in (base + ext, base + ext.upper()):
                if os.path.isfile(candidate):
                    return os.path.abspath(candidate)
    return None


def _metadata_text(entry: dict[str, Any], name: str, path: str, key: str) -> str | None:
    value = entry.get(name)
    if value is not None and not isinstance(value, str):
        raise UserError(f"'{name}' of '{key}' in metadata_file '{path}' must be a string.")
    return value


def _metadata_size(entry: dict[str, Any], path: str, key: str) -> tuple[int, int] | None:
    size = entry.get("image_size")
    if size is None:
        return None
    if not isinstance(size, list) or len(size) != 2 or not all(isinstance(x, int) and x > 0 for x in size):
        raise UserError(f"'image_size' of '{key}' in metadata_file '{path}' must be [width, height].")
    return (size[0], size[1])


def scan_fine_tuning_subset(subset: SubsetParams) -> SubsetScan:
    scan = SubsetScan(subset)
    settings = caption_settings_of(subset)
    assert subset.metadata_file is not None
    seen: set[str] = set()
    for key, entry in read_metadata_entries(subset.metadata_file, subset.where):
        path = _resolve_metadata_image(key, subset.image_dir)
        if path is None:
            scan.skipped.append(f"{key}: no image file found (listed in {subset.metadata_file})")
            continue
        if path in seen:
            continue
        caption = _metadata_text(entry, "caption", subset.metadata_file, key)
        tags = _metadata_text(entry, "tags", subset.metadata_file, key)
        if caption is None:
            caption, tags = tags, None
        size = _metadata_size(entry, subset.metadata_file, key)
        if size is None:
            try:
                size = read_image_size(path)
            except UnreadableImage as e:
                scan.skipped.append(str(e))
                continue
        seen.add(path)
        scan.infos.append(_info(scan, path, _candidates(scan, caption or "", settings, tags), size))
    return scan


def scan_subset(subset: SubsetParams) -> SubsetScan:
    """Find a subset's images and captions and log what was found."""
    scan = scan_fine_tuning_subset(subset) if subset.metadata_file else scan_dreambooth_subset(subset)
    log_scan(scan)
    return scan


def log_scan(scan: SubsetScan) -> None:
    s = scan.subset
    source = s.metadata_file or s.image_dir
    logger.info("%s (%s): %d images, %d repeats%s", s.where, source, len(scan.infos), s.num_repeats,
                ", regularisation" if s.is_reg else "")
    if scan.from_class_tokens:
        logger.info("%s: %d images have no caption file; their caption is class_tokens '%s'",
                    s.where, scan.from_class_tokens, s.class_tokens)
    if scan.empty_captions:
        logger.warning("%s: %d images have no caption (no caption file or an empty one, no class_tokens);"
                       " they are trained with an empty caption", s.where, scan.empty_captions)
    if scan.dropped_extra_lines:
        logger.warning("%s: %d captions have several lines and only the first is used; set"
                       " enable_multiline_caption = true to keep line breaks", s.where, scan.dropped_extra_lines)
    if scan.skipped:
        logger.warning("%s: %d images are skipped because they cannot be read: %s", s.where, len(scan.skipped),
                       "; ".join(scan.skipped[:5]) + (" ..." if len(scan.skipped) > 5 else ""))
    if not scan.infos:
        logger.warning("%s: no usable image was found in %s", s.where, source)


# ---------------------------------------------------------------- validation split and regularisation images


def split_for_validation(
    infos: Sequence[ImageInfo], split: float, seed: int, for_training: bool
) -> list[ImageInfo]:
    """The training part (the first ceil(n * (1 - split)) after a seeded shuffle) or the validation part (the
    rest) of a subset's images. The two parts never overlap and together hold every image."""
    if split <= 0:
        return list(infos) if for_training else []
    order = list(infos)
    random.Random(seed).shuffle(order)
    n_train = math.ceil(len(order) * (1 - split))
    return order[:n_train] if for_training else order[n_train:]


def balance_regularisation(train_count: int, reg_infos: Sequence[ImageInfo]) -> list[ImageInfo]:
    """Repeat regularisation images round-robin until they match `train_count` (images x repeats), the way
    sd-scripts does: the first pass uses each image's repeats, later passes add one repeat at a time. Returns the
    images actually used (all of them unless fewer suffice)."""
    used: list[ImageInfo] = []
    total = 0
    first_pass = True
    while total < train_count and reg_infos:
        for info in reg_infos:
            if first_pass:
                used.append(info)
                total += info.num_repeats
            else:
                info.num_repeats += 1
                total += 1
            if total >= train_count:
                break
        first_pass = False
    return used
