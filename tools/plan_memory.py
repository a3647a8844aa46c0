"""Print the memory plan of `--vram_budget` without training (or generating): the candidates with their predicted
peak and relative step time, the one chosen, why, and the options it sets. No model is loaded (only the safetensors
headers are read, when the model paths are given; without them the full-size models are assumed).

    python tools/plan_memory.py --vram_budget 16 --dataset_config my.toml --network_dim 16 \
        --mixed_precision bf16 --cache_latents_to_disk --cache_text_encoder_outputs_to_disk --network_train_unet_only
    python tools/plan_memory.py --vram_budget 12 --resolution 1024 --train_batch_size 2 --gradient_checkpointing
    python tools/plan_memory.py --inference --vram_budget 8 --image_size 1024 1024 [--dit ...]

Training takes the trainer's options (`moss_image_train_network.setup_parser`), `--inference` the inference script's
(`moss_image_minimal_inference.setup_parser`); options given explicitly are kept, as in those scripts. `--json`
prints the plan as JSON. Exit status 2 (with one sentence) when nothing fits.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import replace

import moss_image_minimal_inference
import moss_image_train_network
from library.errors import UserError
from library.planning.planner import Plan
from library.planning.run_options import (
    explicit_options,
    make_inference_plan,
    make_training_plan,
    option_words,
    parser_defaults,
)

logger = logging.getLogger("plan_memory")


def _with_tool_options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("plan_memory")
    g.add_argument("--inference", action="store_true", help="plan moss_image_minimal_inference.py instead of training")
    g.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


def training_parser() -> argparse.ArgumentParser:
    return _with_tool_options(moss_image_train_network.setup_parser())


def inference_parser() -> argparse.ArgumentParser:
    return _with_tool_options(moss_image_minimal_inference.setup_parser())


def plan(argv: list[str]) -> tuple[Plan, argparse.Namespace]:
    """The plan of the command line `argv` and its parsed options (raises UserError when nothing fits)."""
    inference = "--inference" in argv
    factory = inference_parser if inference else training_parser
    parser = factory()
    args = parser.parse_args(argv)
    if args.vram_budget is None:
        raise UserError("tools/plan_memory.py needs --vram_budget GIB: give the GPU memory to plan for, e.g. 16.")
    explicit = explicit_options(parser, args, argv, parser_defaults(factory()))
    if inference:
        sizes = moss_image_minimal_inference.planned_image_sizes(args)
        result, values = make_inference_plan(args, explicit, sizes)
    else:
        result, values = make_training_plan(args, explicit)
    return replace(result, options=option_words(values, parser_defaults(factory()))), args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        result, args = plan(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict(), indent=1) if args.json else "\n".join(result.lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
