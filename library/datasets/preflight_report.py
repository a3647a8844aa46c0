"""The full dataset preflight (`tools/check_dataset.py`): `inspect_datasets(args) -> Report`.

The datasets are built by the trainer's code (`build_dataset_groups(args)`), then, per subset: the images found,
used (training and validation) and not used, each with the reason the build had (unreadable or an unsupported
colour mode, a side below bucket_reso_steps, a regularisation image not needed for balancing); the colour modes;
the captions (missing, empty, several lines of which only the first is used, longer than --moss_max_token_length
tokens) with the caption candidates and the caption settings. Per dataset the bucket table (images, images x
repeats, the share of enlarged images). Over all images: every file decoded as training decodes it (a file whose
pixels cannot be decoded stops a run when it is first loaded, hours in), files with the same content under two
names, the crop and enlargement warnings of `quick_check`, and the caches (`library.datasets.preflight_caches`).
"""

from __future__ import annotations

import argparse
import hashlib
import os
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from library.datasets.buckets import BucketManager, upscale_factor
from library.datasets.build import build_dataset_groups, load_blueprints
from library.datasets.captions import has_extra_lines
from library.datasets.config import DatasetBlueprint, SubsetParams
from library.datasets.dataset_group import DatasetGroup, ImageDataset, bucket_manager_for
from library.datasets.image_info import ImageInfo
from library.datasets.images import (
    SIXTEEN_BIT_MODES,
    UnreadableImage,
    load_image,
    read_image_header,
    read_image_size,
)
from library.datasets.preflight import ERROR, WARNING, FileReason, Problem, crop_and_upscale_problems, plural
from library.datasets.preflight_caches import CacheOptions, CacheReport, TokenCounter, cache_reports, token_counter_for
from library.datasets.subsets import list_images, read_caption_file, scan_fine_tuning_subset
from library.errors import UserError


@dataclass
class CaptionReport:
    missing: list[str] = field(default_factory=list)  # no caption file / no caption in the metadata
    empty: list[str] = field(default_factory=list)  # a caption file holding only blanks
    from_class_tokens: int = 0  # no caption file: class_tokens is the caption
    extra_lines_dropped: list[str] = field(default_factory=list)  # several lines, only the first is used
    too_long: list[dict[str, Any]] = field(default_factory=list)  # {"file", "candidate", "tokens"}
    longest_tokens: int | None = None  # chat template included; None without a tokenizer
    images_with_several_candidates: int = 0
    max_candidates: int = 0
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class SubsetReport:
    where: str
    source: str  # image_dir or metadata_file
    is_reg: bool
    num_repeats: int
    found: int = 0
    used: int = 0  # training and validation
    validation: int = 0
    not_used: list[FileReason] = field(default_factory=list)
    modes: dict[str, int] = field(default_factory=dict)
    captions: CaptionReport = field(default_factory=CaptionReport)


@dataclass
class BucketRow:
    resolution: tuple[int, int]
    images: int
    count: int  # images x repeats
    upscaled: int
    upscaled_share: float


@dataclass
class DatasetReport:
    where: str
    resolution: tuple[int, int]
    batch_size: int
    enable_bucket: bool
    min_bucket_reso: int
    max_bucket_reso: int
    bucket_reso_steps: int
    bucket_no_upscale: bool
    batches_per_epoch: int = 0
    buckets: list[BucketRow] = field(default_factory=list)
    subsets: list[SubsetReport] = field(default_factory=list)


@dataclass
class Report:
    source: str
    datasets: list[DatasetReport] = field(default_factory=list)
    caches: list[CacheReport] = field(default_factory=list)
    duplicates: list[list[str]] = field(default_factory=list)  # groups of files with the same content
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.level == ERROR]

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.problems if p.level == WARNING]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = not self.errors
        return out


# ------------------------------------------------------------------------------------------ images found
@dataclass
class _LeftOut:
    """A dataset that the build left out (it has no training image): only its bucket manager."""

    bucket_manager: BucketManager


def _strip_path(path: str, message: str) -> str:
    return message[len(path) + 2:] if message.startswith(f"{path}: ") else message


def _why_not_used(path: str, subset: SubsetParams, dataset: ImageDataset | _LeftOut) -> str:
    """The reason the trainer's build left out an image of a subset (its checks, in its order)."""
    try:
        w, h = read_image_size(path)
    except UnreadableImage as e:
        return f"unreadable: {_strip_path(path, str(e))}"
    bucket = dataset.bucket_manager.select_bucket(w, h).bucket_reso
    if bucket[0] <= 0 or bucket[1] <= 0:
        return f"too small: {w}x{h} has a side below bucket_reso_steps {dataset.bucket_manager.steps}"
    if isinstance(dataset, _LeftOut):
        return "its dataset has no usable training image" + (" to balance" if subset.is_reg else "")
    return "not needed: the other regularisation images already balance the training images"


def _split_skipped(text: str) -> FileReason:
    """A skipped entry of a metadata scan, "<image>: <reason>"."""
    name, _, reason = text.partition(": ")
    return FileReason(name, reason or text)


def _found_and_not_used(
    subset: SubsetParams, used: set[str], dataset: ImageDataset | _LeftOut
) -> tuple[int, list[FileReason]]:
    """(images found, the images not used with the reason) of one subset."""
    if subset.metadata_file is not None:
        scan = scan_fine_tuning_subset(subset)
        paths = [i.absolute_path for i in scan.infos]
        skipped = [_split_skipped(s) for s in scan.skipped]
        return len(paths) + len(skipped), skipped + [
            FileReason(p, _why_not_used(p, subset, dataset)) for p in paths if p not in used]
    assert subset.image_dir is not None
    paths = list_images(subset.image_dir, subset.where)
    return len(paths), [FileReason(p, _why_not_used(p, subset, dataset)) for p in paths if p not in used]


def _modes(paths: Iterable[str]) -> dict[str, int]:
    counts: Counter[str] = Counter()
    for path in paths:
        try:
            counts[read_image_header(path)[1]] += 1
        except UnreadableImage:
            counts["unreadable"] += 1
    return dict(sorted(counts.items()))


def _decode_problem(path: str, with_alpha: bool) -> str | None:
    try:
        load_image(path, with_alpha)
    except UserError as e:
        return str(e)
    return None


def decode_problems(infos: Sequence[ImageInfo], workers: int) -> list[Problem]:
    """Decode every image as training does; a file that fails would stop the run (or the latent caching)."""
    unique = {i.absolute_path: bool(i.subset.alpha_mask) for i in infos}
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        results = list(pool.map(lambda item: (item[0], _decode_problem(*item)), unique.items()))
    bad = [(path, message) for path, message in results if message is not None]
    if not bad:
        return []
    more = f" (and {plural(len(bad) - 1, 'other')})" if len(bad) > 1 else ""
    return [Problem(ERROR, "images", f"training would stop when it first loads {plural(len(bad), 'image')} that"
                    f" cannot be decoded: {bad[0][1]}{more}", [p for p, _ in bad])]


def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def find_duplicates(paths: Iterable[str]) -> list[list[str]]:
    """Groups of distinct files with the same content (only files of equal size are read)."""
    by_size: dict[int, list[str]] = defaultdict(list)
    for path in sorted(set(paths)):
        by_size[os.path.getsize(path)].append(path)
    groups = []
    for same_size in by_size.values():
        if len(same_size) < 2:
            continue
        by_digest: dict[str, list[str]] = defaultdict(list)
        for path in same_size:
            by_digest[_file_digest(path)].append(path)
        groups += [g for g in by_digest.values() if len(g) > 1]
    return sorted(groups)


def _duplicate_problems(duplicates: list[list[str]]) -> list[Problem]:
    if not duplicates:
        return []
    first = " = ".join(os.path.basename(p) for p in duplicates[0])
    more = f" and {plural(len(duplicates) - 1, 'other')}" if len(duplicates) > 1 else ""
    return [Problem(WARNING, "images", "the same content under different names, so trained more often than the"
                    f" other images: {first}{more}", [p for g in duplicates for p in g])]


# ---------------------------------------------------------------------------------------------- captions
_CAPTION_SETTINGS = ("caption_extension", "class_tokens", "caption_prefix", "caption_suffix", "caption_dropout_rate",
                     "caption_dropout_every_n_epochs", "caption_tag_dropout_rate", "shuffle_caption", "keep_tokens",
                     "keep_tokens_separator", "caption_separator", "secondary_separator", "enable_wildcard",
                     "enable_multiline_caption", "token_warmup_min", "token_warmup_step",
                     "caption_cache_variants")


def _caption_settings(subset: SubsetParams) -> dict[str, Any]:
    skip = {"caption_extension", "class_tokens"} if subset.metadata_file is not None else set()
    return {n: getattr(subset, n) for n in _CAPTION_SETTINGS if n not in skip}


def _caption_files(report: CaptionReport, subset: SubsetParams, infos: Sequence[ImageInfo]) -> None:
    """Missing, empty and multi-line caption files of a DreamBooth subset."""
    keeps_lines = subset.enable_multiline_caption or subset.enable_wildcard
    for info in infos:
        text = read_caption_file(os.path.splitext(info.absolute_path)[0] + subset.caption_extension)
        if text is None:
            if subset.class_tokens:
                report.from_class_tokens += 1
            else:
                report.missing.append(info.absolute_path)
        elif not text.strip():
            report.empty.append(info.absolute_path)
        elif not keeps_lines and has_extra_lines(text):
            report.extra_lines_dropped.append(info.absolute_path)


def _token_lengths(report: CaptionReport, infos: Sequence[ImageInfo], tokens: TokenCounter,
                   group_of: dict[int, DatasetGroup]) -> None:
    """Token counts of the texts the text encoder gets (prefix and suffix added; wildcards before expansion)."""
    longest = 0
    for info in infos:
        for k, text in enumerate(group_of[id(info)].captions_for_text_encoder_cache(info)):
            n = tokens.count(text)
            longest = max(longest, n)
            if n > tokens.max_length:
                report.too_long.append({"file": info.absolute_path, "candidate": k, "tokens": n})
    report.longest_tokens = longest


def _caption_report(subset: SubsetParams, infos: Sequence[ImageInfo], tokens: TokenCounter | None,
                    group_of: dict[int, DatasetGroup]) -> CaptionReport:
    report = CaptionReport(settings=_caption_settings(subset))
    if subset.metadata_file is None:
        _caption_files(report, subset, infos)
    else:
        report.missing = [i.absolute_path for i in infos if i.caption_candidates == [""]]
    report.max_candidates = max((len(i.caption_candidates) for i in infos), default=0)
    report.images_with_several_candidates = sum(len(i.caption_candidates) > 1 for i in infos)
    if tokens is not None:
        _token_lengths(report, infos, tokens, group_of)
    return report


def _caption_problems(where: str, report: CaptionReport, max_length: int) -> list[Problem]:
    problems = []
    if report.missing:
        problems.append(Problem(WARNING, where, f"no caption, so trained with an empty one:"
                                f" {plural(len(report.missing), 'image')} (add caption files, class_tokens or a"
                                " caption in the metadata)", report.missing))
    if report.empty:
        problems.append(Problem(WARNING, where, f"empty caption files, so trained with an empty caption:"
                                f" {plural(len(report.empty), 'image')}", report.empty))
    if report.extra_lines_dropped:
        problems.append(Problem(WARNING, where, "several lines of which only the first is used:"
                                f" {plural(len(report.extra_lines_dropped), 'caption')} (set enable_multiline_caption"
                                " = true to keep them)", report.extra_lines_dropped))
    if report.too_long:
        worst = max(t["tokens"] for t in report.too_long)
        problems.append(Problem(WARNING, where, f"longer than --moss_max_token_length {max_length} tokens with the"
                                f" chat template, so cut at that length: {plural(len(report.too_long), 'caption')}"
                                f" (up to {worst} tokens)", sorted({t["file"] for t in report.too_long})))
    return problems


# -------------------------------------------------------------------------------------------- the report
def _bucket_rows(dataset: ImageDataset) -> list[BucketRow]:
    rows = []
    for reso in sorted(dataset.buckets):
        infos = dataset.buckets[reso]
        upscaled = sum(upscale_factor(i.image_size, i.resized_size) > 1.0 for i in infos)  # type: ignore[arg-type]
        rows.append(BucketRow(reso, len(infos), sum(i.num_repeats for i in infos), upscaled, upscaled / len(infos)))
    return rows


def _dataset_report(blueprint: DatasetBlueprint, train: ImageDataset | None, source: str) -> DatasetReport:
    p = blueprint.params
    return DatasetReport(f"datasets[{p.index}] of {source}", p.resolution, p.batch_size, p.enable_bucket,
                         p.min_bucket_reso, p.max_bucket_reso, p.bucket_reso_steps, p.bucket_no_upscale,
                         train.num_batches if train else 0, _bucket_rows(train) if train else [])


def _subset_report(subset: SubsetParams, parts: dict[str, list[ImageInfo]], dataset: ImageDataset | _LeftOut,
                   tokens: TokenCounter | None, group_of: dict[int, DatasetGroup]) -> SubsetReport:
    unique = list({i.absolute_path: i for i in parts["train"] + parts["validation"]}.values())
    found, not_used = _found_and_not_used(subset, {i.absolute_path for i in unique}, dataset)
    return SubsetReport(
        where=subset.where, source=subset.metadata_file or subset.image_dir or "", is_reg=subset.is_reg,
        num_repeats=subset.num_repeats, found=found, used=len(unique),
        validation=len({i.absolute_path for i in parts["validation"]}), not_used=not_used,
        modes=_modes(i.absolute_path for i in unique), captions=_caption_report(subset, unique, tokens, group_of),
    )


def _subset_problems(sub: SubsetReport, max_length: int) -> list[Problem]:
    dropped = [d for d in sub.not_used if not d.reason.startswith("not needed")]
    problems = []
    if dropped:
        more = f" and {plural(len(dropped) - 1, 'other')}" if len(dropped) > 1 else ""
        problems.append(Problem(WARNING, sub.where, f"not used: {plural(len(dropped), 'image')}"
                                f" ({os.path.basename(dropped[0].file)}: {dropped[0].reason}{more})",
                                [d.file for d in dropped]))
    return problems + _caption_problems(sub.where, sub.captions, max_length)


def _infos_by_subset(groups: Sequence[DatasetGroup]) -> dict[tuple[int, int], dict[str, list[ImageInfo]]]:
    """{(dataset index, subset index): {"train": infos, "validation": infos}} of the built groups."""
    out: dict[tuple[int, int], dict[str, list[ImageInfo]]] = defaultdict(lambda: {"train": [], "validation": []})
    for group in groups:
        for info in group.image_infos():
            out[(info.subset.dataset_index, info.subset.index)]["validation" if group.is_validation else "train"] \
                .append(info)
    return out


def _dataset_reports(report: Report, blueprints: Sequence[DatasetBlueprint], groups: Sequence[DatasetGroup],
                     tokens: TokenCounter | None, max_length: int) -> None:
    by_subset = _infos_by_subset(groups)
    group_of = {id(i): g for g in groups for i in g.image_infos()}
    built = {d.params.index: d for d in groups[0].datasets}
    for blueprint in blueprints:
        dataset = built.get(blueprint.params.index)
        ds_report = _dataset_report(blueprint, dataset, report.source)
        holder = dataset or _LeftOut(bucket_manager_for(blueprint.params, ds_report.where))
        for subset in blueprint.subsets:
            sub = _subset_report(subset, by_subset[(subset.dataset_index, subset.index)], holder, tokens, group_of)
            ds_report.subsets.append(sub)
            report.problems += _subset_problems(sub, max_length)
            sixteen = sum(n for mode, n in sub.modes.items() if mode in SIXTEEN_BIT_MODES)
            if sixteen:
                report.notes.append(f"{sub.where}: {plural(sixteen, '16-bit greyscale image')} scaled to 8 bits")
        report.datasets.append(ds_report)


def inspect_datasets(args: argparse.Namespace, *, decode: bool = True) -> Report:
    """The full preflight of the datasets of `args`: the trainer's dataset options, and, when present,
    --tokenizer_cache_dir / --text_encoder / --moss_max_token_length, the caching options, --base_weights and
    --max_data_loader_n_workers (threads that decode). Opens no model, writes nothing. UserError for bad input."""
    blueprints, source = load_blueprints(args)
    train, val = build_dataset_groups(args)
    groups = [g for g in (train, val) if g is not None]
    report = Report(source)
    tokens = token_counter_for(args, report.notes)
    options = CacheOptions.from_args(args, report.notes)
    _dataset_reports(report, blueprints, groups, tokens, options.max_token_length)
    infos = [i for g in groups for i in g.image_infos()]
    report.problems += [p for g in groups for d in g.datasets for p in crop_and_upscale_problems(d)]
    if decode:
        workers = min(int(getattr(args, "max_data_loader_n_workers", 1) or 1), os.cpu_count() or 1)
        report.problems += decode_problems(infos, workers)
    else:
        report.notes.append("the images were not decoded (--no_decode): damaged pixel data was not looked for")
    report.duplicates = find_duplicates(i.absolute_path for i in infos)
    report.problems += _duplicate_problems(report.duplicates)
    report.caches = cache_reports(groups, options, tokens, report.problems)
    return report
