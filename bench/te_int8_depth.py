#!/usr/bin/env python
"""How the ConvRot INT8 error of a random-weight Qwen3.5 text encoder grows with depth (CPU, a minute or two).

    python -m bench.te_int8_depth [--layers 4,8,16,32] [--hidden 256] [--tokens 60]

The full-size snapshot's INT8 text encoder differs from its bf16 one by 46 % (docs/benchmarks.md). This script
checks whether depth alone explains that. It builds the small snapshot's text config with more layers (3 Gated
DeltaNet + 1 full attention per group of 4), draws the weights with the snapshot's own initialisation
(`make_full_snapshot.te_init`), quantises a copy with the trainer's ConvRot recipe, and prints the relative error of
the last hidden state over one random token sequence, in bf16, as JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys

import torch

from bench.make_full_snapshot import small_scale, te_init
from bench.stream_safetensors import draw
from library.quant import convrot as cr


def build(layers: int, hidden: int, seed: int = 1) -> torch.nn.Module:
    from transformers import Qwen3_5TextConfig, Qwen3_5TextModel

    cfg = dict(small_scale().te["text_config"])
    cfg.update(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
               layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4))
    model = Qwen3_5TextModel(Qwen3_5TextConfig(**cfg))
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            p.copy_(draw(te_init("model.language_model." + name, tuple(p.shape)), tuple(p.shape), seed * 100003 + i,
                          torch.device("cpu"), torch.float32))
    return model.to(torch.bfloat16).eval()


def int8_error(layers: int, hidden: int, tokens: int, group_size: int = 64) -> float:
    base = build(layers, hidden)
    quant = copy.deepcopy(base)
    cr.convert_model_to_convrot_int8(quant, cr.text_encoder_convrot_filter, None, group_size, "bf16")
    ids = torch.randint(0, 2000, (1, tokens), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a = base(input_ids=ids).last_hidden_state.float()
        b = quant(input_ids=ids).last_hidden_state.float()
    return float((b - a).norm() / a.norm())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.te_int8_depth", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default="4,8,16,32", help="comma-separated depths (multiples of 4)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--tokens", type=int, default=60)
    args = p.parse_args(argv)
    result = {int(n): round(int8_error(int(n), args.hidden, args.tokens), 4) for n in args.layers.split(",")}
    print(json.dumps({"hidden": args.hidden, "tokens": args.tokens, "relative_error_by_layers": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
