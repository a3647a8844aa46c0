"""The dataset config schema: `[general]`, `[[datasets]]`, `[[datasets.subsets]]` (TOML or JSON), validated once.

Every key is declared once in `KEYS` with its type, the levels where it may appear, its command-line fallback and
its default. A value is looked up in the subset, then the dataset, then `[general]`, then the command line, then
the default; a level that does not set the key (or sets it to nothing) falls through, while `false` or `0` count as
set. Unknown keys, keys at the wrong level and wrong types are rejected with the key's name and where it was
(`datasets[0].subsets[1]`, `[general]`, `--caption_dropout_rate`). The result is a list of `DatasetBlueprint`s
(frozen dataclasses) that the rest of the package reads; nothing downstream looks at `args` again.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import math
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from library.errors import UserError

logger = logging.getLogger(__name__)

GENERAL = "general"
DATASET = "dataset"
SUBSET = "subset"
ALL_LEVELS = frozenset({GENERAL, DATASET, SUBSET})
DATASET_LEVELS = frozenset({GENERAL, DATASET})
SUBSET_ONLY = frozenset({SUBSET})

DREAMBOOTH = "dreambooth"
FINE_TUNING = "fine_tuning"

# The largest image side (resolution, max_bucket_reso): 4096 pixels are 256 DiT patches, and a 4096x4096 image is
# 65,536 image tokens, 16 times the 1024x1024 sequence; larger values only make a run grow until it is killed.
MAX_RESOLUTION_SIDE = 4096

# Caption variants cached per caption candidate (caption_cache_variants): each is a whole text-encoder output.
MAX_CAPTION_CACHE_VARIANTS = 64

RESIZE_INTERPOLATIONS = ("lanczos", "nearest", "bilinear", "linear", "bicubic", "cubic", "area", "box")

# Keys of sd-scripts' dataset config that cannot apply to this trainer: rejected with a reason, never ignored.
REJECTED_KEYS: dict[str, str] = {
    "face_crop_aug_range": "is a Stable Diffusion face-crop augmentation that moss-image-scripts does not support",
    "conditioning_data_dir": "belongs to ControlNet-style datasets, which moss-image-scripts does not support",
    "caption_extention": "is the misspelled command-line alias; in a dataset config write caption_extension",
}


class _Invalid(ValueError):
    """A value does not fit its key; the message says what is expected."""


def _check_bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise _Invalid("must be true or false")
    return v


def _int_checker(minimum: int) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise _Invalid(f"must be a whole number >= {minimum}")
        if v < minimum:
            raise _Invalid(f"must be >= {minimum}")
        return v

    return check


def _float_checker(lo: float, hi: float | None, hi_open: bool = False) -> Callable[[Any], float]:
    def check(v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise _Invalid("must be a number")
        too_high = hi is not None and (v >= hi if hi_open else v > hi)
        if v < lo or too_high:
            upper = "" if hi is None else (f" and below {hi}" if hi_open else f" and at most {hi}")
            raise _Invalid(f"must be at least {lo}{upper}")
        return float(v)

    return check


def _check_str(v: Any) -> str:
    if not isinstance(v, str):
        raise _Invalid("must be a string")
    return v


def _check_nonempty_str(v: Any) -> str:
    if not isinstance(v, str) or v == "":
        raise _Invalid("must be a non-empty string")
    return v


def _check_table(v: Any) -> dict[str, Any]:
    if not isinstance(v, Mapping):
        raise _Invalid("must be a table, e.g. { timestep_sampling = { offset = 0.1 } }")
    return dict(v)


def _check_interpolation(v: Any) -> str:
    if not isinstance(v, str) or v not in RESIZE_INTERPOLATIONS:
        raise _Invalid(f"must be one of {', '.join(RESIZE_INTERPOLATIONS)}")
    return v


def _check_resolution(v: Any) -> tuple[int, int]:
    if isinstance(v, int) and not isinstance(v, bool):
        v = [v, v]
    if (
        not isinstance(v, (list, tuple))
        or len(v) != 2
        or any(isinstance(x, bool) or not isinstance(x, int) or x <= 0 for x in v)
    ):
        raise _Invalid("must be a positive whole number or a [width, height] pair")
    if max(v) > MAX_RESOLUTION_SIDE:
        raise _Invalid(f"is too large: each side may be at most {MAX_RESOLUTION_SIDE} pixels for MOSS-Image"
                       f" ({MAX_RESOLUTION_SIDE}x{MAX_RESOLUTION_SIDE} is 65,536 image tokens); use e.g. 1024")
    return (int(v[0]), int(v[1]))


def _check_max_bucket_reso(v: Any) -> int:
    value = _int_checker(1)(v)
    if value > MAX_RESOLUTION_SIDE:
        raise _Invalid(f"is too large: a bucket side may be at most {MAX_RESOLUTION_SIDE} pixels for MOSS-Image")
    return value


def _check_caption_cache_variants(v: Any) -> int:
    value = _int_checker(1)(v)
    if value > MAX_CAPTION_CACHE_VARIANTS:
        raise _Invalid(f"is too large: at most {MAX_CAPTION_CACHE_VARIANTS} variants per caption are cached (each"
                       " one is a full text-encoder output on disk); use e.g. 8")
    return value


def _check_network_multiplier(v: Any) -> float:
    value = _float_checker(0.0, None)(v)
    if value != 1.0:
        raise _Invalid(
            "is not supported: per-dataset network multipliers are not implemented by moss-image-scripts"
            " (only the no-op value 1.0 is accepted); remove the key"
        )
    return value


def parse_resolution_arg(text: str | None) -> tuple[int, int] | None:
    """Parse `--resolution` ("SIZE" or "WIDTH,HEIGHT"); None stays None."""
    if text is None:
        return None
    parts = [p.strip() for p in str(text).split(",")]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or any(x <= 0 for x in values):
        raise UserError(f"--resolution '{text}' is not valid: write one size (1024) or width,height (1024,768).")
    return (values[0], values[0]) if len(values) == 1 else (values[0], values[1])


@dataclass(frozen=True)
class KeySpec:
    """One key of the schema: where it may appear, how it is checked, its command-line fallback and default."""

    name: str
    check: Callable[[Any], Any]
    levels: frozenset[str]
    default: Any = None
    cli: str | None = None  # attribute of the argparse namespace used as the fallback
    style: str | None = None  # DREAMBOOTH / FINE_TUNING when the key only makes sense for that subset style
    describe: str = ""


_KEY_LIST: tuple[KeySpec, ...] = (
    # dataset level (may also be set in [general])
    KeySpec("resolution", _check_resolution, DATASET_LEVELS, None, "resolution"),
    KeySpec("batch_size", _int_checker(1), DATASET_LEVELS, 1, "train_batch_size"),
    KeySpec("enable_bucket", _check_bool, DATASET_LEVELS, False, "enable_bucket"),
    KeySpec("min_bucket_reso", _int_checker(1), DATASET_LEVELS, 256, "min_bucket_reso"),
    KeySpec("max_bucket_reso", _check_max_bucket_reso, DATASET_LEVELS, 1024, "max_bucket_reso"),
    KeySpec("bucket_reso_steps", _int_checker(1), DATASET_LEVELS, 64, "bucket_reso_steps"),
    KeySpec("bucket_no_upscale", _check_bool, DATASET_LEVELS, False, "bucket_no_upscale"),
    KeySpec("validation_split", _float_checker(0.0, 1.0, hi_open=True), DATASET_LEVELS, 0.0, "validation_split"),
    KeySpec("validation_seed", _int_checker(0), DATASET_LEVELS, None, "validation_seed"),
    KeySpec("network_multiplier", _check_network_multiplier, DATASET_LEVELS, 1.0, None),
    # subset level (may also be set in [[datasets]] or [general])
    KeySpec("num_repeats", _int_checker(1), ALL_LEVELS, 1, "dataset_repeats"),
    KeySpec("shuffle_caption", _check_bool, ALL_LEVELS, False, "shuffle_caption"),
    KeySpec("caption_separator", _check_nonempty_str, ALL_LEVELS, ",", "caption_separator"),
    KeySpec("keep_tokens", _int_checker(0), ALL_LEVELS, 0, "keep_tokens"),
    KeySpec("keep_tokens_separator", _check_str, ALL_LEVELS, "", "keep_tokens_separator"),
    KeySpec("secondary_separator", _check_str, ALL_LEVELS, None, "secondary_separator"),
    KeySpec("enable_wildcard", _check_bool, ALL_LEVELS, False, "enable_wildcard"),
    KeySpec("enable_multiline_caption", _check_bool, ALL_LEVELS, False, "enable_multiline_caption"),
    KeySpec("caption_prefix", _check_str, ALL_LEVELS, None, "caption_prefix"),
    KeySpec("caption_suffix", _check_str, ALL_LEVELS, None, "caption_suffix"),
    KeySpec("caption_dropout_rate", _float_checker(0.0, 1.0), ALL_LEVELS, 0.0, "caption_dropout_rate"),
    KeySpec("caption_dropout_every_n_epochs", _int_checker(0), ALL_LEVELS, 0, "caption_dropout_every_n_epochs"),
    KeySpec("caption_tag_dropout_rate", _float_checker(0.0, 1.0), ALL_LEVELS, 0.0, "caption_tag_dropout_rate"),
    KeySpec("token_warmup_min", _int_checker(0), ALL_LEVELS, 1, "token_warmup_min"),
    KeySpec("token_warmup_step", _float_checker(0.0, None), ALL_LEVELS, 0.0, "token_warmup_step"),
    KeySpec("caption_cache_variants", _check_caption_cache_variants, ALL_LEVELS, 1, "caption_cache_variants"),
    KeySpec("color_aug", _check_bool, ALL_LEVELS, False, "color_aug"),
    KeySpec("flip_aug", _check_bool, ALL_LEVELS, False, "flip_aug"),
    KeySpec("random_crop", _check_bool, ALL_LEVELS, False, "random_crop"),
    KeySpec("resize_interpolation", _check_interpolation, ALL_LEVELS, None, "resize_interpolation"),
    KeySpec("custom_attributes", _check_table, ALL_LEVELS, None, None),
    KeySpec("caption_extension", _check_str, ALL_LEVELS, ".caption", "caption_extension", DREAMBOOTH),
    KeySpec("class_tokens", _check_str, ALL_LEVELS, None, None, DREAMBOOTH),
    KeySpec("cache_info", _check_bool, ALL_LEVELS, False, "cache_info", DREAMBOOTH),
    # subset only
    KeySpec("image_dir", _check_nonempty_str, SUBSET_ONLY, None, None),
    KeySpec("metadata_file", _check_nonempty_str, SUBSET_ONLY, None, None),
    KeySpec("is_reg", _check_bool, SUBSET_ONLY, False, None, DREAMBOOTH),
    KeySpec("alpha_mask", _check_bool, SUBSET_ONLY, False, "alpha_mask"),
)

KEYS: dict[str, KeySpec] = {k.name: k for k in _KEY_LIST}
DATASET_KEYS = tuple(k.name for k in _KEY_LIST if DATASET in k.levels and SUBSET not in k.levels)
SUBSET_KEYS = tuple(k.name for k in _KEY_LIST if SUBSET in k.levels)


@dataclass(frozen=True)
class DatasetParams:
    """Resolved dataset-level settings of one `[[datasets]]` entry."""

    index: int
    resolution: tuple[int, int]
    batch_size: int
    enable_bucket: bool
    min_bucket_reso: int
    max_bucket_reso: int
    bucket_reso_steps: int
    bucket_no_upscale: bool
    validation_split: float
    validation_seed: int | None
    network_multiplier: float
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    def source_of(self, key: str) -> str:
        """Where the value of `key` came from, for error messages."""
        return self.sources.get(key, "the default")


@dataclass(frozen=True)
class SubsetParams:
    """Resolved settings of one `[[datasets.subsets]]` entry (the precedence chain already applied)."""

    dataset_index: int
    index: int
    image_dir: str | None
    metadata_file: str | None
    is_reg: bool
    alpha_mask: bool
    num_repeats: int
    shuffle_caption: bool
    caption_separator: str
    keep_tokens: int
    keep_tokens_separator: str
    secondary_separator: str | None
    enable_wildcard: bool
    enable_multiline_caption: bool
    caption_prefix: str | None
    caption_suffix: str | None
    caption_dropout_rate: float
    caption_dropout_every_n_epochs: int
    caption_tag_dropout_rate: float
    token_warmup_min: int
    token_warmup_step: float
    caption_cache_variants: int
    color_aug: bool
    flip_aug: bool
    random_crop: bool
    resize_interpolation: str | None
    custom_attributes: Mapping[str, Any] | None
    caption_extension: str
    class_tokens: str | None
    cache_info: bool
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    @property
    def style(self) -> str:
        return FINE_TUNING if self.metadata_file is not None else DREAMBOOTH

    @property
    def where(self) -> str:
        return f"datasets[{self.dataset_index}].subsets[{self.index}]"

    def source_of(self, key: str) -> str:
        return self.sources.get(key, "the default")


@dataclass(frozen=True)
class DatasetBlueprint:
    """One dataset: its resolved parameters and its subsets."""

    params: DatasetParams
    subsets: tuple[SubsetParams, ...]


def load_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Read a dataset config file: `.json` as JSON, anything else as TOML."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise UserError(f"The dataset config '{path}' does not exist: check --dataset_config.")
    try:
        with open(path, "rb") as f:
            data = f.read()
        if path.lower().endswith(".json"):
            raw = json.loads(data.decode("utf-8-sig"))
        else:
            raw = tomllib.loads(data.decode("utf-8-sig"))
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"The dataset config '{path}' could not be parsed ({e}); fix its syntax.") from e
    if not isinstance(raw, dict):
        raise UserError(f"The dataset config '{path}' must hold a table with [general] and [[datasets]] at the top.")
    return raw


def _suggest(key: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _level_name(level: str) -> str:
    return {GENERAL: "[general]", DATASET: "[[datasets]]", SUBSET: "[[datasets.subsets]]"}[level]


def _check_table_keys(table: Mapping[str, Any], level: str, where: str, source: str, extra: tuple[str, ...]) -> None:
    allowed = [k.name for k in _KEY_LIST if level in k.levels] + list(extra)
    for key in table:
        if key in allowed:
            continue
        if key in REJECTED_KEYS:
            raise UserError(f"'{key}' in {where} of {source} {REJECTED_KEYS[key]}; remove it.")
        if key in KEYS:
            homes = " or ".join(_level_name(lv) for lv in sorted(KEYS[key].levels))
            raise UserError(f"'{key}' is not allowed in {where} of {source}: it belongs in {homes}.")
        raise UserError(
            f"Unknown key '{key}' in {where} of {source}{_suggest(key, allowed)}; see docs/dataset_config.md."
        )


def _checked(table: Mapping[str, Any], where: str, source: str) -> dict[str, tuple[Any, str]]:
    """Type-check every value of a table; returns {key: (value, location)} without None values."""
    out: dict[str, tuple[Any, str]] = {}
    location = f"{where} of {source}"
    for key, value in table.items():
        if key not in KEYS or value is None:
            continue
        try:
            out[key] = (KEYS[key].check(value), location)
        except _Invalid as e:
            raise UserError(f"{key} = {value!r} in {location} {e}.") from None
    return out


def _cli_values(args: argparse.Namespace | None) -> dict[str, tuple[Any, str]]:
    """The command-line fallbacks, checked like config values (named by their option)."""
    out: dict[str, tuple[Any, str]] = {}
    if args is None:
        return out
    for spec in _KEY_LIST:
        if spec.cli is None:
            continue
        value = raw = getattr(args, spec.cli, None)
        if spec.name == "resolution" and isinstance(value, str):
            value = parse_resolution_arg(value)
        if spec.name == "alpha_mask" and getattr(args, "masked_loss", False):
            value = True  # --masked_loss trains with the alpha channels as loss masks
        if value is None:
            continue
        try:
            out[spec.name] = (spec.check(value), f"--{spec.cli}")
        except _Invalid as e:
            raise UserError(f"--{spec.cli} {raw!r} {e}.") from None
    return out


def _resolve(
    names: tuple[str, ...], chain: list[dict[str, tuple[Any, str]]]
) -> tuple[dict[str, Any], dict[str, str]]:
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name in names:
        for level in chain:
            if name in level:
                values[name], sources[name] = level[name]
                break
        else:
            values[name] = KEYS[name].default
    return values, sources


def _as_table(value: Any, where: str, source: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise UserError(f"{where} in {source} must be a table.")
    return value


def _as_table_list(value: Any, where: str, source: str) -> list[Mapping[str, Any]]:
    if not isinstance(value, list) or not value:
        raise UserError(f"{where} in {source} must be a non-empty list of tables ([[{where}]]).")
    for i, item in enumerate(value):
        _as_table(item, f"{where}[{i}]", source)
    return value


def _check_subset_style(raw: Mapping[str, Any], params: SubsetParams, source: str) -> None:
    if params.image_dir is None and params.metadata_file is None:
        raise UserError(
            f"{params.where} of {source} has neither image_dir nor metadata_file: give image_dir (DreamBooth style,"
            " captions from files) or metadata_file (fine-tuning style, captions from a JSON/JSONL file)."
        )
    if params.style == FINE_TUNING:
        for key in raw:
            spec = KEYS.get(key)
            if spec is not None and spec.style == DREAMBOOTH:
                raise UserError(
                    f"'{key}' in {params.where} of {source} only applies to DreamBooth-style subsets (image_dir"
                    " without metadata_file); remove it from this metadata_file subset."
                )


def _check_dataset(params: DatasetParams, source: str) -> None:
    where = f"datasets[{params.index}] of {source}"
    if params.min_bucket_reso > params.max_bucket_reso:
        raise UserError(
            f"min_bucket_reso {params.min_bucket_reso} is larger than max_bucket_reso {params.max_bucket_reso}"
            f" in {where}; fix one of them."
        )


def _dataset_params(index: int, chain: list[dict[str, tuple[Any, str]]], source: str) -> DatasetParams:
    values, sources = _resolve(DATASET_KEYS, chain)
    if values["resolution"] is None:
        raise UserError(
            f"No resolution is set for datasets[{index}] of {source}: add resolution = 1024 (or [width, height])"
            " to the dataset config or pass --resolution."
        )
    params = DatasetParams(index=index, sources=sources, **values)
    _check_dataset(params, source)
    return params


def _duplicate_check(subsets: list[SubsetParams], source: str) -> None:
    seen: dict[tuple[str, str], SubsetParams] = {}
    for s in subsets:
        key = ("metadata_file", os.path.abspath(s.metadata_file)) if s.metadata_file else None
        if key is None and s.image_dir is not None:
            key = ("image_dir", os.path.abspath(s.image_dir))
        if key is None:
            continue
        if key in seen:
            raise UserError(
                f"{s.where} of {source} uses the same {key[0]} '{key[1]}' as {seen[key].where}: an image can be"
                " in a dataset only once; merge the two subsets or put them in separate [[datasets]]."
            )
        seen[key] = s


def resolve_config(
    raw: Mapping[str, Any], args: argparse.Namespace | None = None, source: str = "the dataset config"
) -> list[DatasetBlueprint]:
    """Validate a parsed dataset config and resolve every setting through the precedence chain."""
    for key in raw:
        if key not in ("general", "datasets"):
            raise UserError(
                f"Unknown top-level key '{key}' in {source}{_suggest(key, ['general', 'datasets'])}: only"
                " [general] and [[datasets]] may appear at the top."
            )
    general = _as_table(raw.get("general", {}), "[general]", source)
    _check_table_keys(general, GENERAL, "[general]", source, ())
    if "datasets" not in raw:
        raise UserError(f"{source} has no [[datasets]]: add at least one [[datasets]] with a [[datasets.subsets]].")
    datasets = _as_table_list(raw["datasets"], "datasets", source)
    cli = _cli_values(args)
    general_values = _checked(general, "[general]", source)
    blueprints = []
    for di, ds in enumerate(datasets):
        where = f"datasets[{di}]"
        _check_table_keys(ds, DATASET, where, source, ("subsets",))
        ds_values = _checked(ds, where, source)
        params = _dataset_params(di, [ds_values, general_values, cli], source)
        if "subsets" not in ds:
            raise UserError(
                f"{where} of {source} has no [[datasets.subsets]]: add one with image_dir or metadata_file."
            )
        subsets = []
        for si, ss in enumerate(_as_table_list(ds["subsets"], f"{where}.subsets", source)):
            swhere = f"{where}.subsets[{si}]"
            _check_table_keys(ss, SUBSET, swhere, source, ())
            values, sources = _resolve(SUBSET_KEYS, [_checked(ss, swhere, source), ds_values, general_values, cli])
            sp = SubsetParams(dataset_index=di, index=si, sources=sources, **values)
            _check_subset_style(ss, sp, source)
            subsets.append(sp)
        _duplicate_check(subsets, source)
        blueprints.append(DatasetBlueprint(params, tuple(subsets)))
    return blueprints
