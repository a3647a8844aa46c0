"""The cache part of the dataset preflight: per cache kind the files that are valid, stale (with the reason the caching
strategy gives: its own checks, `latents_cache_problem` / `outputs_cache_problem`, among them "variant recipe
changed (...)" for caption variants drawn with other settings, N or seed) or missing, the disk space and the encoding
time the caching will take (every caption variant counted), and the caption token counts that the text-encoder files
depend on.

Estimates, stated in each report's `assumptions`:
- sizes: the arrays the strategies write (float32 latents with 32 channels at 1/8 of the bucket size, twice with
  flip_aug, plus a float32 alpha mask; float32 text-encoder states of the Qwen3.5 width for every token of every
  caption candidate and of the empty prompt), in uncompressed npz files, plus a few hundred bytes per array;
- times: the caching speeds measured on one H200 (docs/benchmarks.md, "Caching"), scaled by pixels for the VAE and
  by captions for the text encoder.
The tokenizer is read from local files only (never from the network); without one, tokens are estimated from
characters and the token-length check is skipped with a note.
"""

from __future__ import annotations

import argparse
import os
import shutil
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from library.caching.strategies import (
    CACHE_MISSING,
    VAE_SCALE,
    MossImageLatentsCachingStrategy,
    MossImageTextEncoderOutputsCachingStrategy,
)
from library.datasets.caption_variants import CacheCaptions
from library.datasets.dataset_group import DatasetGroup
from library.datasets.image_info import ImageInfo
from library.datasets.preflight import ERROR, WARNING, FileReason, Problem, plural
from library.errors import UserError
from library.moss_image.vae import Flux2VAEConfig
from library.text_encoder.base_weights import text_encoder_base_weights_identity
from library.text_encoder.loading import TextEncoderOptions, predict_text_encoder_variant
from library.text_encoder.qwen35 import (
    BUNDLED_CONFIG_DIR,
    check_max_token_length,
    load_text_config,
    load_tokenizer,
    tokenize,
)

# Caching speed on one H200 (docs/benchmarks.md, "Caching"): the FLUX.2 VAE in fp32 encoded 16 images of 1024x1024
# in 2.37 s; Qwen3.5-9B in bf16 encoded 17 captions of about 40 tokens (16 and the empty prompt) in 10.8 s.
VAE_SECONDS_PER_MEGAPIXEL = 2.37 / (16 * 1024 * 1024 / 1e6)
TE_SECONDS_PER_CAPTION = 10.8 / 17
CHARS_PER_TOKEN = 4  # without a tokenizer: a rough figure for English text
TEMPLATE_TOKENS = 5  # without a tokenizer: the chat template around a caption
_NPZ_ENTRY_BYTES = 250  # zip and .npy headers of one array in an uncompressed npz (about 128 + 2 x 40 + name)


# ------------------------------------------------------------------------------------------------- tokens
class TokenCounter:
    """Token counts of captions as the text encoder sees them (chat template included), without truncation."""

    def __init__(self, tokenizer: Any, max_length: int) -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length
        self._counts: dict[str, int] = {}

    def count(self, text: str) -> int:
        if text not in self._counts:
            self._counts[text] = len(tokenize(self.tokenizer, text, max_length=2**62))
        return self._counts[text]


def token_counter_for(args: argparse.Namespace, notes: list[str]) -> TokenCounter | None:
    """The project's tokenizer from local files only (--tokenizer_cache_dir, the tokenizer/ folder of the snapshot
    or beside --text_encoder, or a Hugging Face cache), or None with a note saying why."""
    cache_dir, te_path = getattr(args, "tokenizer_cache_dir", None), getattr(args, "text_encoder", None)
    max_length = check_max_token_length(getattr(args, "moss_max_token_length", None))
    if not cache_dir and not te_path:
        notes.append("caption token counts were not checked: give --tokenizer_cache_dir, --snapshot or"
                     " --text_encoder to find the tokenizer (it is read from local files only)")
        return None
    try:
        tokenizer = load_tokenizer(cache_dir, te_path, local_files_only=True)
    except UserError as e:
        notes.append(f"caption token counts were not checked: {e}")
        return None
    return TokenCounter(tokenizer, max_length)


# ------------------------------------------------------------------------------------------------ options
@dataclass
class CacheOptions:
    """What a run does with the caches (the trainer's options), and what the text-encoder files must record."""

    cache_latents: bool = False
    cache_latents_to_disk: bool = False
    cache_text_encoder_outputs: bool = False
    cache_text_encoder_outputs_to_disk: bool = False
    skip_cache_check: bool = False
    max_token_length: int = 4096
    encoder_variant: str | None = None  # None: not known without the text encoder (not checked)
    te_base_weights: str = ""
    te_hidden_size: int = 4096

    @classmethod
    def from_args(cls, args: argparse.Namespace, notes: list[str]) -> CacheOptions:
        latents_to_disk = bool(getattr(args, "cache_latents_to_disk", False))
        te_to_disk = bool(getattr(args, "cache_text_encoder_outputs_to_disk", False))
        te_path = getattr(args, "text_encoder", None)
        return cls(
            cache_latents=bool(getattr(args, "cache_latents", False)) or latents_to_disk,
            cache_latents_to_disk=latents_to_disk,
            cache_text_encoder_outputs=bool(getattr(args, "cache_text_encoder_outputs", False)) or te_to_disk,
            cache_text_encoder_outputs_to_disk=te_to_disk,
            skip_cache_check=bool(getattr(args, "skip_cache_check", False)),
            max_token_length=check_max_token_length(getattr(args, "moss_max_token_length", None)),
            encoder_variant=_encoder_variant(args, notes),
            te_base_weights=text_encoder_base_weights_identity(getattr(args, "base_weights", None),
                                                               getattr(args, "base_weights_multiplier", None)),
            te_hidden_size=_text_encoder_width(te_path),
        )


def _text_encoder_width(te_path: str | None) -> int:
    """The hidden size of the text encoder (config.json beside it, else the bundled 9B config)."""
    checkpoint = Path(te_path) if te_path else BUNDLED_CONFIG_DIR / "model.safetensors"
    if checkpoint.is_dir():  # a folder of shards (--snapshot gives one): its config.json is inside
        checkpoint = checkpoint / "model.safetensors"
    return int(load_text_config(checkpoint).hidden_size)


def _encoder_variant(args: argparse.Namespace, notes: list[str]) -> str | None:
    """The text-encoder variant the caches must record, as the trainer predicts it without reading the encoder."""
    if not getattr(args, "text_encoder", None):
        notes.append("the text-encoder variant recorded in the TE caches was not checked: give --text_encoder or"
                     " --snapshot")
        return None
    variant = predict_text_encoder_variant(TextEncoderOptions.from_args(args),
                                           "cuda" if torch.cuda.is_available() else "cpu")
    if variant is None:
        notes.append("the text-encoder variant recorded in the TE caches was not checked: --te_quant auto decides"
                     " it from the free VRAM when the encoder is loaded")
    return variant


# ------------------------------------------------------------------------------------------------ reports
@dataclass
class CacheReport:
    kind: str  # "latents" or "text_encoder"
    suffix: str
    to_disk: bool  # this run caches to (and reads) these files
    in_memory: bool  # this run caches in memory (encoded at every start)
    files: int = 0
    valid: int = 0
    stale: list[FileReason] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    bytes_total: int = 0  # all files of the run
    bytes_to_write: int = 0  # the files caching makes now (missing or stale); 0 in memory
    seconds_total: float = 0.0  # encoding everything
    seconds_to_encode: float = 0.0  # encoding what this run must (missing or stale; everything in memory)
    assumptions: list[str] = field(default_factory=list)


def _count(report: CacheReport, path: str, problems: list[str], size: int, seconds: float) -> None:
    report.files += 1
    report.bytes_total += size
    report.seconds_total += seconds
    if not problems:
        report.valid += 1
        return
    if CACHE_MISSING in problems:
        report.missing.append(path)
    else:
        report.stale.append(FileReason(path, "; ".join(sorted(set(problems)))))
    report.bytes_to_write += size
    report.seconds_to_encode += seconds


def _finish(report: CacheReport, once_per_run: float = 0.0) -> None:
    """In memory everything is encoded at every start and nothing is written; `once_per_run`: seconds paid once
    whenever something is encoded (the empty prompt of the TE cache)."""
    if report.in_memory:
        report.seconds_to_encode, report.bytes_to_write = report.seconds_total, 0
    if report.seconds_to_encode:
        report.seconds_to_encode += once_per_run
    report.seconds_total += once_per_run


def _latents_entry_bytes(info: ImageInfo, channels: int) -> int:
    """One bucket size's entries in a latent cache file: latents (and flipped), alpha mask, original size, crop."""
    assert info.bucket_reso is not None
    w, h = info.bucket_reso
    latent = channels * (h // VAE_SCALE) * (w // VAE_SCALE) * 4
    size = (latent + _NPZ_ENTRY_BYTES) * (2 if info.subset.flip_aug else 1) + 2 * _NPZ_ENTRY_BYTES + 48
    return size + (w * h * 4 + _NPZ_ENTRY_BYTES if info.subset.alpha_mask else 0)


def latents_cache_report(infos: Sequence[ImageInfo], options: CacheOptions) -> CacheReport:
    """Status, size and encoding time of the latent caches of these images (the strategy's own checks)."""
    strategy = MossImageLatentsCachingStrategy(True)
    channels = Flux2VAEConfig.z_channels
    report = CacheReport("latents", strategy.cache_suffix, options.cache_latents_to_disk,
                         options.cache_latents and not options.cache_latents_to_disk)
    files: dict[str, list[ImageInfo]] = defaultdict(list)
    for info in {id(i): i for i in infos}.values():
        assert info.image_size is not None
        files[strategy.get_latents_npz_path(info.absolute_path, info.image_size)].append(info)
    for path, entries in sorted(files.items()):
        pixels = sum(i.bucket_reso[0] * i.bucket_reso[1] * (2 if i.subset.flip_aug else 1)  # type: ignore[index]
                     for i in entries)
        problems = [strategy.latents_cache_problem(i.bucket_reso, path, bool(i.subset.flip_aug),  # type: ignore
                                                   bool(i.subset.alpha_mask)) for i in entries]
        _count(report, path, [p for p in problems if p is not None],
               sum(_latents_entry_bytes(i, channels) for i in entries), pixels / 1e6 * VAE_SECONDS_PER_MEGAPIXEL)
    _finish(report)
    report.assumptions = [
        (f"{channels} float32 latent channels at 1/{VAE_SCALE} of the bucket size, twice with flip_aug, plus a full"
        " size float32 alpha mask with alpha_mask; uncompressed npz"),
        (f"{VAE_SECONDS_PER_MEGAPIXEL:.3f} s per megapixel, twice with flip_aug (the FLUX.2 VAE in fp32 on one H200,"
        " docs/benchmarks.md)"),
    ]
    return report


def _te_file_bytes(texts: Sequence[str], options: CacheOptions, tokens: TokenCounter | None) -> int:
    def count(text: str) -> int:
        n = tokens.count(text) if tokens is not None else len(text) // CHARS_PER_TOKEN + 1 + TEMPLATE_TOKENS
        return min(n, options.max_token_length)

    per_token = options.te_hidden_size * 4 + 1  # a float32 state and a bool mask entry
    size = count("") * per_token + 8 * _NPZ_ENTRY_BYTES  # the empty prompt and the small entries
    return size + sum(count(t) * per_token + 4 * len(t) + 3 * _NPZ_ENTRY_BYTES for t in texts)


def _te_files(groups: Sequence[DatasetGroup], strategy: Any) -> tuple[dict[str, CacheCaptions], list[str]]:
    """({cache file: the caption texts it must hold, variants included}, images whose one file would need two
    different lists)."""
    files: dict[str, CacheCaptions] = {}
    conflicts: set[str] = set()
    for group in groups:
        for info in group.image_infos():
            texts = group.text_encoder_cache_captions(info)
            if files.setdefault(strategy.get_outputs_npz_path(info.absolute_path), texts) != texts:
                conflicts.add(info.absolute_path)
    return files, sorted(conflicts)


def text_encoder_cache_report(groups: Sequence[DatasetGroup], options: CacheOptions, tokens: TokenCounter | None,
                              problems: list[Problem]) -> CacheReport:
    """Status, size and encoding time of the TE output caches (the strategy's own checks); adds an error to
    `problems` when one image's cache file would need two different caption lists (a disk cache cannot hold both)."""
    strategy = MossImageTextEncoderOutputsCachingStrategy(
        True, max_token_length=options.max_token_length, encoder_variant=options.encoder_variant,
        te_base_weights=options.te_base_weights)
    report = CacheReport("text_encoder", strategy.cache_suffix, options.cache_text_encoder_outputs_to_disk,
                         options.cache_text_encoder_outputs and not options.cache_text_encoder_outputs_to_disk)
    files, conflicts = _te_files(groups, strategy)
    if conflicts and options.cache_text_encoder_outputs_to_disk:
        problems.append(Problem(ERROR, "text-encoder cache", "one cache file per image cannot hold two caption lists,"
                                f" and {plural(len(conflicts), 'image')} of two subsets with different captions need"
                                " them: give both subsets the same caption settings, or cache in memory"
                                " (--cache_text_encoder_outputs only)", conflicts))
    for path, captions in sorted(files.items()):
        problem = strategy.outputs_cache_problem(path, captions.texts, captions.recipe)
        _count(report, path, [] if problem is None else [problem], _te_file_bytes(captions.texts, options, tokens),
               TE_SECONDS_PER_CAPTION * len(captions.texts))
    _finish(report, once_per_run=TE_SECONDS_PER_CAPTION)
    counted = ("token counts from the tokenizer" if tokens is not None else
               f"about {CHARS_PER_TOKEN} characters per token plus {TEMPLATE_TOKENS} template tokens (no tokenizer)")
    report.assumptions = [
        (f"{options.te_hidden_size} float32 values per token of every caption candidate (each of its variants with"
        f" caption_cache_variants) and of the empty prompt;"
        f" {counted}; uncompressed npz"),
        (f"{TE_SECONDS_PER_CAPTION:.2f} s per caption (Qwen3.5-9B in bf16 on one H200, captions of about 40 tokens,"
        " docs/benchmarks.md); longer captions, ConvRot INT8 or the CPU take longer"),
    ]
    return report


# ----------------------------------------------------------------------------------------------- problems
def cache_problems(report: CacheReport, options: CacheOptions) -> list[Problem]:
    """Stale files that --skip_cache_check trusts are errors; stale files that will be re-made are warnings."""
    if not report.to_disk or not report.stale:
        return []
    where = "latents cache" if report.kind == "latents" else "text-encoder cache"
    files = [s.file for s in report.stale]
    first = f"{os.path.basename(files[0])}: {report.stale[0].reason}"
    if options.skip_cache_check:
        return [Problem(ERROR, where, f"stale: {plural(len(files), 'cache file')} ({first}), which"
                        " --skip_cache_check trusts: training would read wrong or missing entries; drop"
                        " --skip_cache_check so that they are re-made", files)]
    return [Problem(WARNING, where, f"stale, so re-made by the caching: {plural(len(files), 'cache file')} ({first})",
                    files)]


def disk_problems(reports: Sequence[CacheReport]) -> list[Problem]:
    """An error when the cache files to write (beside their images; each kind's average file size) do not fit on
    the disks that hold them."""
    need: dict[int, float] = defaultdict(float)
    folder_of: dict[int, str] = {}
    for report in reports:
        paths = report.missing + [s.file for s in report.stale]
        if not report.to_disk or not paths:
            continue
        for path in paths:
            folder = os.path.dirname(path) or "."
            device = os.stat(folder).st_dev
            need[device] += report.bytes_to_write / len(paths)
            folder_of.setdefault(device, folder)
    problems = []
    for device, size in need.items():
        free = shutil.disk_usage(folder_of[device]).free
        if size > free:
            problems.append(Problem(ERROR, "caches", f"the cache files need about {size / 1e9:.2f} GB on the disk of"
                                    f" {folder_of[device]} but {free / 1e9:.2f} GB are free: make room first"))
    return problems


def blocker_problems(groups: Sequence[DatasetGroup], options: CacheOptions) -> list[Problem]:
    """Dataset settings that make the requested caching fail (the datasets' own rules, as the trainer asks them)."""
    problems = []
    if options.cache_latents:
        blockers = [b for g in groups for b in g.latent_cache_blockers()]
        if blockers:
            problems.append(Problem(ERROR, "latents cache", f"latents cannot be cached with {', '.join(blockers)}:"
                                    " turn those off or drop --cache_latents / --cache_latents_to_disk"))
    if options.cache_text_encoder_outputs:
        blockers = [b for g in groups for b in g.text_encoder_output_cache_blockers(True, True)]
        if blockers:
            problems.append(Problem(ERROR, "text-encoder cache", "text encoder outputs cannot be cached with"
                                    f" {', '.join(blockers)}: turn those off or drop --cache_text_encoder_outputs"))
    return problems


def cache_reports(groups: Sequence[DatasetGroup], options: CacheOptions, tokens: TokenCounter | None,
                  problems: list[Problem]) -> list[CacheReport]:
    """Both cache kinds of the groups, with their problems added to `problems`."""
    problems += blocker_problems(groups, options)
    infos = [i for g in groups for i in g.image_infos()]
    reports = [latents_cache_report(infos, options), text_encoder_cache_report(groups, options, tokens, problems)]
    for report in reports:
        problems += cache_problems(report, options)
    problems += disk_problems(reports)
    return reports
