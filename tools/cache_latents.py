"""Cache the FLUX.2 VAE latents of a MOSS-Image dataset to disk before training (or to share them between runs).

    python tools/cache_latents.py --moss_image --vae flux2-vae.safetensors \
        --dataset_config my_moss_dataset_config.toml --cache_latents_to_disk [--vae_batch_size 4]
    accelerate launch tools/cache_latents.py ...      # several GPUs: each process caches its share of the files

The datasets are built by the trainer's own code (`library.datasets.build_dataset_groups`, the same dataset
options) and the files are written by the trainer's caching driver, so `moss_image_train_network.py
--cache_latents_to_disk` finds them valid and encodes nothing. Files: `<stem>_<WWWW>x<HHHH>_moss.npz` beside each
image (the original image size in the name), holding the raw VAE output per bucket size. The VAE always runs in
fp32. Images whose file is already valid are skipped (`--skip_cache_check`: any existing file is trusted).
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass

from library.caching.tool_common import (
    add_cache_tool_arguments,
    check_tool_device,
    make_accelerator,
    tool_main,
    total_over_processes,
)
from library.datasets.args import add_dataset_arguments
from library.errors import UserError
from library.moss_image.loaders import fill_paths_from_snapshot
from library.options import groups

logger = logging.getLogger("cache_latents")


@dataclass(frozen=True)
class CacheSummary:
    """What a run found and did, over all processes."""

    images: int  # entries of the datasets (an image used at two bucket sizes counts twice)
    files: int  # cache files they use
    encoded: int  # entries encoded by this run
    processes: int

    def line(self) -> str:
        return (f"latents: {self.images} images in {self.files} cache files; {self.encoded} encoded now,"
                f" {self.images - self.encoded} already cached ({self.processes} process"
                f"{'es' if self.processes > 1 else ''})")


def setup_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Cache the FLUX.2 VAE latents of a MOSS-Image dataset to *_moss.npz files.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_cache_tool_arguments(parser)
    groups.add_model_file_arguments(parser, dit_dest=None, text_encoder=False, vae=True)
    groups.add_caching_arguments(parser, latents=True, text_encoder_outputs=False)
    add_dataset_arguments(parser)
    return parser


def resolve_args(args: argparse.Namespace) -> None:
    """--snapshot fills --vae when it is not given."""
    fill_paths_from_snapshot(args, vae_attr="vae")


def check_args(args: argparse.Namespace) -> None:
    """Refuse what this tool cannot do."""
    if not args.moss_image:
        raise UserError("This tool caches MOSS-Image latents only: add --moss_image to the command.")
    if not args.cache_latents_to_disk:
        raise UserError("Without --cache_latents_to_disk the latents would be thrown away at exit: add"
                        " --cache_latents_to_disk.")
    if args.vae_batch_size < 1:
        raise UserError(f"--vae_batch_size {args.vae_batch_size} must be at least 1.")
    check_tool_device(args.device)
    if not args.vae:
        raise UserError("--vae is required: give the FLUX.2 VAE file (flux2-vae.safetensors) or --snapshot.")


def cache_from_args(args: argparse.Namespace) -> CacheSummary | None:
    """Cache the latents of the datasets of `args` and print a summary (None with --debug_dataset, which only
    shows the batches)."""
    import torch

    from library.datasets import build_dataset_groups, debug_dataset
    from library.datasets.preflight import quick_check
    from library.moss_image.vae import load_flux2_vae
    from library.caching.strategies import MossImageLatentsCachingStrategy, cache_latents

    resolve_args(args)
    check_args(args)
    train, val = build_dataset_groups(args)
    quick_check([train, val])
    if args.debug_dataset:
        debug_dataset(train)
        return None
    blockers = train.latent_cache_blockers()
    if blockers:
        raise UserError(f"Latents cannot be cached with {', '.join(blockers)}: turn those off in the dataset config.")
    acc = make_accelerator(args.device)
    logger.info("loading the FLUX.2 VAE (fp32) on %s", acc.device)
    vae = load_flux2_vae(args.vae, dtype=torch.float32, device=acc.device,
                         disable_mmap=args.disable_mmap_load_safetensors)
    strategy = MossImageLatentsCachingStrategy(True, args.vae_batch_size, args.skip_cache_check)
    groups = [g for g in (train, val) if g is not None]
    encoded = cache_latents(groups, vae, strategy, acc.process_index, acc.num_processes, acc.is_local_main_process)
    acc.wait_for_everyone()
    infos = {id(i): i for g in groups for i in g.image_infos()}.values()
    summary = CacheSummary(len(infos), len({i.latents_npz for i in infos}), total_over_processes(acc, encoded),
                           acc.num_processes)
    if acc.is_main_process:
        print(summary.line())
    acc.wait_for_everyone()
    acc.end_training()  # an orderly end of the process group: no process exits while another still talks to it
    return summary


def run(argv: list[str] | None = None) -> CacheSummary | None:
    """Parse the command line and cache; UserError for bad input."""
    return cache_from_args(setup_parser().parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    return tool_main(run, argv, logger)


if __name__ == "__main__":
    sys.exit(main())
