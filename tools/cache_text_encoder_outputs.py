"""Cache the Qwen3.5 text-encoder outputs of a MOSS-Image dataset to disk before training.

    python tools/cache_text_encoder_outputs.py --moss_image \
        --text_encoder text_encoder/model-00001-of-00004.safetensors \
        --dataset_config my_moss_dataset_config.toml --cache_text_encoder_outputs_to_disk
    accelerate launch tools/cache_text_encoder_outputs.py ...   # several GPUs: each process caches its share

The datasets are built by the trainer's own code (`library.datasets.build_dataset_groups`, the same dataset
options) and the files are written by the trainer's caching driver, so `moss_image_train_network.py
--cache_text_encoder_outputs_to_disk` finds them valid and encodes nothing. Files: `<stem>_moss_te.npz` beside each
image with every caption candidate (after caption_prefix / caption_suffix; with caption_cache_variants N > 1, N
variants of each, drawn from --seed as the trainer draws them: give both the same --seed) and the unconditional
(empty-prompt) embedding. A file is re-made when its candidate count, texts or variant recipe differ from the current
ones, unless --skip_cache_check. When every file is valid the text encoder is not read at all (except with
--te_quant auto on a GPU, where its variant depends on the free VRAM). The text encoder is read and run by
`library.text_encoder`, as in the trainer: in bf16 (or ConvRot INT8) on the GPU or the CPU, so the files made here are
valid for training.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
import time
from dataclasses import dataclass
from typing import Any

from library.caching.strategies import (
    EncodingStats,
    MossImageTextEncoderOutputsCachingStrategy,
    cache_text_encoder_outputs,
)
from library.caching.tool_common import (
    add_cache_tool_arguments,
    check_tool_device,
    make_accelerator,
    tool_main,
    total_over_processes,
)
from library.datasets import build_dataset_groups, debug_dataset
from library.datasets.args import add_dataset_arguments
from library.datasets.preflight import quick_check
from library.errors import UserError
from library.moss_image.loaders import fill_paths_from_snapshot
from library.options import groups
from library.text_encoder.encoding import EncodeFn, LazyEncoder, encode_captions, text_encoder_batch_size
from library.text_encoder.loading import TextEncoderOptions, load_text_encoder, predict_text_encoder_variant
from library.text_encoder.quant import check_text_encoder_memory_args
from library.text_encoder.qwen35 import check_max_token_length, load_tokenizer
from library.text_encoder.variant import check_predicted_variant

logger = logging.getLogger("cache_text_encoder_outputs")


@dataclass(frozen=True)
class CacheSummary:
    """What a run found and did, over all processes."""

    files: int  # cache files of the datasets (one per image file)
    encoded: int  # files encoded by this run
    processes: int
    skipped: int = 0  # existing files trusted without a check (--skip_cache_check)
    captions: int = 0  # captions encoded (every candidate of the encoded files)
    seconds: float = 0.0  # the caching step, the text encoder's read included
    encode_seconds: float = 0.0  # the encoding of the captions (the main process)

    @property
    def valid(self) -> int:
        """Existing files checked and found valid."""
        return self.files - self.encoded - self.skipped

    def line(self) -> str:
        return (f"text encoder outputs: {self.files} cache files; {self.encoded} encoded now,"
                f" {self.files - self.encoded} already cached ({self.processes} process"
                f"{'es' if self.processes > 1 else ''})")

    def totals_line(self) -> str:
        rate = self.captions / self.encode_seconds if self.encode_seconds > 0 else 0.0
        return (f"text encoder outputs: {self.encoded} encoded, {self.valid} valid, {self.skipped} skipped"
                f" (--skip_cache_check); {self.captions} captions at {rate:.1f} captions/s; {self.seconds:.1f} s"
                " with the text encoder's read")


def setup_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Cache the Qwen3.5 text-encoder outputs of a MOSS-Image dataset to *_moss_te.npz files.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_cache_tool_arguments(parser)
    groups.add_model_file_arguments(parser, dit_dest=None, text_encoder=True, vae=False)
    groups.add_convrot_arguments(parser, dit=False, text_encoder=True, backward=False)
    groups.add_caching_arguments(parser, latents=False, text_encoder_outputs=True)
    groups.add_text_encoder_memory_arguments(parser)
    add_dataset_arguments(parser)
    return parser


def resolve_args(args: argparse.Namespace) -> None:
    """--snapshot fills --text_encoder and --tokenizer_cache_dir when they are not given."""
    fill_paths_from_snapshot(args, te_attr="text_encoder")


def check_args(args: argparse.Namespace) -> None:
    """Refuse what this tool cannot do."""
    if not args.moss_image:
        raise UserError("This tool caches MOSS-Image text-encoder outputs only: add --moss_image to the command.")
    if not args.cache_text_encoder_outputs_to_disk:
        raise UserError("Without --cache_text_encoder_outputs_to_disk the outputs would be thrown away at exit: add"
                        " --cache_text_encoder_outputs_to_disk.")
    text_encoder_batch_size(args.text_encoder_batch_size)
    check_max_token_length(args.moss_max_token_length)
    check_text_encoder_memory_args(args)
    check_tool_device(args.device)
    if not args.text_encoder:
        raise UserError("--text_encoder is required: give the first shard of the Qwen3.5-9B text encoder"
                        " (text_encoder/model-00001-of-00004.safetensors) or --snapshot.")


def load_encode_fn(args: argparse.Namespace, device: Any) -> tuple[EncodeFn, str]:
    """(captions -> outputs, cache variant) with the tokenizer and the text encoder of `args` (read now, placed on the
    device it runs on)."""
    tokenizer = load_tokenizer(args.tokenizer_cache_dir, args.text_encoder)
    loaded = load_text_encoder(TextEncoderOptions.from_args(args), device)
    encode = functools.partial(encode_captions, loaded.model, tokenizer, max_length=args.moss_max_token_length,
                               batch_size=text_encoder_batch_size(args.text_encoder_batch_size))
    return encode, loaded.variant


def encoder_for(args: argparse.Namespace, device: Any) -> tuple[EncodeFn, str]:
    """(captions -> outputs, cache variant). When the variant can be known without the model (see
    `library.text_encoder.loading.predict_text_encoder_variant`), the encoder is read on the first call only, so a run
    that finds every file valid never reads it; with --te_quant auto on a GPU it is read now (the variant depends on
    the free VRAM)."""
    predicted = predict_text_encoder_variant(TextEncoderOptions.from_args(args), device)
    if predicted is None:
        return load_encode_fn(args, device)

    def load() -> EncodeFn:
        encode, variant = load_encode_fn(args, device)
        check_predicted_variant(predicted, variant)
        return encode

    return LazyEncoder(load), predicted


def cache_from_args(args: argparse.Namespace) -> CacheSummary | None:
    """Cache the text-encoder outputs of the datasets of `args` and print a summary (None with --debug_dataset,
    which only shows the batches)."""
    resolve_args(args)
    check_args(args)
    train, val = build_dataset_groups(args)
    quick_check([train, val])
    if args.debug_dataset:
        debug_dataset(train)
        return None
    groups = [g for g in (train, val) if g is not None]
    blockers = [r for g in groups for r in g.text_encoder_output_cache_blockers(True, True)]
    if blockers:
        raise UserError(f"Text encoder outputs cannot be cached with {', '.join(blockers)}: turn those off in the"
                        " dataset config.")
    acc = make_accelerator(args.device)
    start = time.perf_counter()
    encode, variant = encoder_for(args, acc.device)
    strategy = MossImageTextEncoderOutputsCachingStrategy(True, args.text_encoder_batch_size, args.skip_cache_check,
                                                          max_token_length=args.moss_max_token_length,
                                                          encoder_variant=variant)
    stats = EncodingStats()
    encoded = cache_text_encoder_outputs(groups, encode, strategy, acc.process_index, acc.num_processes,
                                         acc.is_local_main_process, stats)
    acc.wait_for_everyone()
    summary = _summary(args, acc, groups, encoded, stats, time.perf_counter() - start)
    if acc.is_main_process:
        print(summary.line())
        print(summary.totals_line())
    acc.wait_for_everyone()
    acc.end_training()  # an orderly end of the process group: no process exits while another still talks to it
    return summary


def _summary(args: argparse.Namespace, acc: Any, groups: list[Any], encoded: int, stats: EncodingStats,
             seconds: float) -> CacheSummary:
    files = len({i.te_outputs_npz for g in groups for i in g.image_infos()})
    encoded = total_over_processes(acc, encoded)
    skipped = files - encoded if args.skip_cache_check else 0  # the files that existed were trusted
    return CacheSummary(files, encoded, acc.num_processes, skipped, total_over_processes(acc, stats.captions),
                        seconds, stats.seconds)


def run(argv: list[str] | None = None) -> CacheSummary | None:
    """Parse the command line and cache; UserError for bad input."""
    return cache_from_args(setup_parser().parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    return tool_main(run, argv, logger)


if __name__ == "__main__":
    sys.exit(main())
