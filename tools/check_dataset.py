"""Check a MOSS-Image dataset before training: what trains and what is dropped (and why), the buckets, the captions,
the caches, and the disk space and time the caching will take. No model is read and nothing is written.

    python tools/check_dataset.py --dataset_config my_dataset.toml --snapshot MOSS-Image-Base \
        --cache_latents_to_disk --cache_text_encoder_outputs_to_disk
    python tools/check_dataset.py --dataset_config my_dataset.toml --json > report.json

The datasets are built by the trainer's own code with the trainer's dataset options (`--resolution`,
`--enable_bucket`, `--caption_extension`, ... as fallbacks of the dataset config), so the result is what training
gets. Options of a training command that the check does not use are accepted and listed in one line: a training
command can be checked by putting this script's name in front of its options. `--config_file` is read for the options
this tool knows. The tokenizer (for the `--moss_max_token_length` check) is read from local files only.

Exit status: 0 when nothing would make training fail (warnings may be listed), 1 when something would (the errors of
the report), 2 for bad input such as an invalid dataset config (the sentence says what to fix).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from library.datasets.args import add_dataset_arguments
from library.datasets.config import KEYS
from library.datasets.preflight import plural
from library.datasets.preflight_caches import CacheReport
from library.datasets.preflight_report import DatasetReport, Report, SubsetReport, inspect_datasets
from library.errors import UserError
from library.moss_image.loaders import fill_paths_from_snapshot
from library.options.groups import add_text_encoder_memory_arguments
from library.training.args import read_config_file

logger = logging.getLogger("check_dataset")

_LISTED = 10  # file names shown per list in the text report (--json has them all)


def setup_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Check a MOSS-Image dataset before training (no model is read, nothing is written).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,  # options of a pasted training command must not match ours by prefix
    )
    g = parser.add_argument_group("check")
    g.add_argument("--json", action="store_true", help="print the report as JSON (for scripts)")
    g.add_argument("--no_decode", action="store_true",
                   help="do not decode the images (faster; damaged pixel data is then not found)")
    g.add_argument("--config_file", type=str, default=None,
                   help="a training --config_file: the options this tool knows are read from it (command line wins)")
    g.add_argument("--seed", type=int, default=None, help="dataset seed (the validation split)")
    m = parser.add_argument_group("text encoder and tokenizer (token counts and the text-encoder caches)")
    m.add_argument("--snapshot", type=str, default=None,
                   help="a MOSS-Image snapshot folder: its text_encoder/ and tokenizer/ are used when not given")
    m.add_argument("--text_encoder", type=str, default=None, help="the Qwen3.5-9B text encoder (first shard)")
    m.add_argument("--tokenizer_cache_dir", type=str, default=None,
                   help="folder with the tokenizer files, or a Hugging Face cache folder (local files only)")
    m.add_argument("--moss_max_token_length", type=int, default=4096,
                   help="maximum text tokens including the chat template (as in training)")
    m.add_argument("--convrot_int8_text_encoder", action="store_true",
                   help="the text encoder is quantised at load time (recorded in the text-encoder caches)")
    m.add_argument("--base_weights", type=str, default=None, nargs="*",
                   help="LoRA files merged into the base first (their text-encoder part is recorded in the caches)")
    m.add_argument("--base_weights_multiplier", type=float, default=None, nargs="*",
                   help="multipliers of --base_weights (default 1.0 each)")
    c = parser.add_argument_group("caching (as in training)")
    c.add_argument("--cache_latents", action="store_true", help="the run caches the VAE outputs in memory")
    c.add_argument("--cache_latents_to_disk", action="store_true", help="the run caches them in *_moss.npz files")
    c.add_argument("--cache_text_encoder_outputs", action="store_true", help="the run caches the Qwen3.5 outputs")
    c.add_argument("--cache_text_encoder_outputs_to_disk", action="store_true",
                   help="the run caches them in *_moss_te.npz files")
    c.add_argument("--skip_cache_check", action="store_true", help="the run trusts existing cache files")
    add_text_encoder_memory_arguments(parser)
    add_dataset_arguments(parser)
    return parser


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """(the options, what the check does not use: options of a training command and config-file keys)."""
    parser = setup_parser()
    args, unused = parser.parse_known_args(argv)
    if args.config_file:
        values, ignored = read_config_file(args.config_file, parser)
        parser.set_defaults(**values)
        args, unused = parser.parse_known_args(argv)
        unused += [f"{k} (in --config_file)" for k in ignored]
    unused = [u for u in unused if u.startswith("--") or "(in --config_file)" in u]
    return args, unused


def run(argv: list[str] | None = None) -> Report:
    """Parse the options and check the datasets: the Report (UserError for bad input)."""
    args, unused = parse_args(argv)
    if unused:
        logger.info("not used by the check: %s", ", ".join(u.split("=")[0] for u in unused))
    fill_paths_from_snapshot(args, te_attr="text_encoder")
    return inspect_datasets(args, decode=not args.no_decode)


# ---------------------------------------------------------------------------------------------- the text
def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def _listed(items: list[str], indent: str) -> list[str]:
    lines = [f"{indent}{item}" for item in items[:_LISTED]]
    if len(items) > _LISTED:
        lines.append(f"{indent}... and {len(items) - _LISTED} more (--json lists all)")
    return lines


def _non_default(settings: dict[str, Any]) -> str:
    changed = [f"{k} {v!r}" for k, v in settings.items() if k in KEYS and v != KEYS[k].default]
    return ", ".join(changed) or "all defaults"


def _subset_lines(sub: SubsetReport) -> list[str]:
    cap = sub.captions
    lines = [(f"  {sub.where} ({sub.source}){' regularisation' if sub.is_reg else ''}: {sub.found} found,"
             f" {sub.used} used ({sub.validation} for validation), {len(sub.not_used)} not used,"
             f" {sub.num_repeats} repeats")]
    lines += _listed([f"{Path(d.file).name}: {d.reason}" for d in sub.not_used], "    not used: ")
    lines.append("    colour modes: " + (", ".join(f"{m} {n}" for m, n in sub.modes.items()) or "none"))
    tokens = "not checked" if cap.longest_tokens is None else f"longest {cap.longest_tokens}"
    lines.append(f"    captions: {len(cap.missing)} missing, {len(cap.empty)} empty, {cap.from_class_tokens} from"
                 f" class_tokens, {len(cap.extra_lines_dropped)} with lines dropped, {len(cap.too_long)} too long"
                 f" (tokens: {tokens}); candidates per image: up to {cap.max_candidates}"
                 f" ({cap.images_with_several_candidates} images with several)")
    lines += _listed([Path(f).name for f in cap.missing], "    no caption: ")
    lines += _listed([Path(f).name for f in cap.empty], "    empty caption: ")
    lines += _listed([f"{Path(t['file']).name} candidate {t['candidate']}: {t['tokens']} tokens" for t in cap.too_long],
                     "    too long: ")
    lines.append(f"    caption settings: {_non_default(cap.settings)}")
    return lines


def _dataset_lines(ds: DatasetReport) -> list[str]:
    buckets = (f"buckets {ds.min_bucket_reso}..{ds.max_bucket_reso} in steps of {ds.bucket_reso_steps}"
               f"{', no upscale' if ds.bucket_no_upscale else ''}" if ds.enable_bucket else "no buckets")
    lines = [(f"{ds.where}: resolution {ds.resolution[0]}x{ds.resolution[1]}, batch size {ds.batch_size}, {buckets},"
             f" {ds.batches_per_epoch} batches per epoch")]
    for sub in ds.subsets:
        lines += _subset_lines(sub)
    if ds.buckets:
        lines.append("  bucket        images   x repeats   enlarged")
        lines += [f"  {b.resolution[0]:>5}x{b.resolution[1]:<6} {b.images:>6}   {b.count:>9}   {b.upscaled_share:>7.0%}"
                  for b in ds.buckets]
    return lines


def _cache_lines(cache: CacheReport) -> list[str]:
    use = ("this run caches to these files" if cache.to_disk else
           "this run caches in memory at every start" if cache.in_memory else "not cached by this run")
    lines = [(f"{cache.kind} cache (*{cache.suffix}, {use}): {cache.files} files, {cache.valid} valid,"
             f" {len(cache.stale)} stale, {len(cache.missing)} missing")]
    if cache.to_disk:
        lines.append(f"  disk: {_size(cache.bytes_total)} in all, {_size(cache.bytes_to_write)} to write now;"
                     f" encoding: {_duration(cache.seconds_to_encode)} now ({_duration(cache.seconds_total)} for"
                     " all)")
    else:
        lines.append(f"  to disk it would take {_size(cache.bytes_total)}; encoding all:"
                     f" {_duration(cache.seconds_total)}")
    lines += _listed([f"{Path(s.file).name}: {s.reason}" for s in cache.stale], "  stale: ")
    lines += [f"  assumed: {a}" for a in cache.assumptions]
    return lines


def report_text(report: Report) -> str:
    """The report as the text the tool prints."""
    lines = [f"dataset check of {report.source}", ""]
    for ds in report.datasets:
        lines += _dataset_lines(ds) + [""]
    for cache in report.caches:
        lines += _cache_lines(cache)
    if report.duplicates:
        lines += ["", "same content under several names:"]
        lines += _listed([" = ".join(Path(p).name for p in group) for group in report.duplicates], "  ")
    if report.notes:
        lines += ["", "notes:"] + [f"  {n}" for n in report.notes]
    if report.problems:
        lines += ["", "problems:"]
        for p in report.problems:
            lines.append(f"  {p.level.upper()} {p.where}: {p.message}")
    errors, warnings = len(report.errors), len(report.warnings)
    verdict = "training would fail" if errors else "nothing would make training fail"
    lines += ["", f"result: {plural(errors, 'error')}, {plural(warnings, 'warning')}: {verdict}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    as_json = "--json" in (sys.argv[1:] if argv is None else argv)
    try:
        report = run(argv)
    except UserError as e:
        logger.error("%s", e)
        if as_json:
            print(json.dumps({"ok": False, "error": str(e)}))
        return 2
    print(json.dumps(report.to_dict(), indent=1) if as_json else report_text(report))
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
