#!/usr/bin/env python
"""Attention of packed sequences (a CFG step's two passes side by side, `library.moss_image.cfg_packing`) as the
compiled DiT runs it: `Attention` given the parts' lengths, inside `torch.compile` with automatic dynamic shapes, for
several pairs of lengths in turn (the first pair compiles a specialised graph, the next ones a dynamic graph whose
later part starts at a symbolic offset). For each pair: the attention kernels the traced graph calls, and the time of
the packed call against the two parts run alone on tensors of their own (the two-pass form). One JSON.

    python -m bench.packed_attention --out OUT/packed_attention.json
    python -m bench.packed_attention --device cpu --heads 2 --head_dim 16 --lengths 40,24 36,20 --out smoke.json

Times are medians of `--iters` calls after `--warmup`, in ms a call (`bench.convrot_int8.time_ms`: CUDA events, L2
flushed between calls).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from bench.convrot_int8 import time_ms
from bench.report import write_report
from library.runtime.attention import Attention, segment_starts


def run(args: argparse.Namespace) -> dict[str, Any]:
    attention = Attention()
    traced: list[list[str]] = []

    def compiler(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        traced.append([str(n.target) for n in gm.graph.nodes
                       if n.op == "call_function" and "attention" in str(n.target)])
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    packed = torch.compile(lambda q, k, v, parts: attention(q, k, v, parts),
                           backend=aot_autograd(fw_compiler=compiler))
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    rows = []
    with torch.no_grad():
        for lengths in args.lengths:
            parts = tuple(lengths)
            q, k, v = (torch.randn(1, sum(parts), args.heads, args.head_dim, device=args.device, dtype=dtype)
                       for _ in range(3))
            alone = [tuple(t[:, a:a + n].clone() for t in (q, k, v)) for a, n in zip(segment_starts(parts), parts)]
            graphs_before = len(traced)
            packed_ms = time_ms(lambda: packed(q, k, v, parts), args.device, args.iters, args.warmup)["median_ms"]
            alone_ms = time_ms(lambda: [attention(*t, None) for t in alone], args.device, args.iters,
                               args.warmup)["median_ms"]
            same = torch.equal(packed(q, k, v, parts), torch.cat([attention(*t, None) for t in alone], dim=1))
            rows.append({"lengths": list(parts), "packed_ms": round(packed_ms, 4), "alone_ms": round(alone_ms, 4),
                         "packed_over_alone": round(packed_ms / alone_ms, 4), "same_values": same,
                         "new_graph_kernels": traced[graphs_before:]})
    torch._dynamo.reset()
    return {"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
            "torch": torch.__version__, "heads": args.heads, "head_dim": args.head_dim, "dtype": str(dtype),
            "iters": args.iters, "rows": rows}


def _lengths(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if len(values) < 2 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give two or more positive lengths, e.g. 4128,4104")
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="attention of packed sequences in compiled graphs, against the parts alone")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--lengths", type=_lengths, nargs="+", default=[[4128, 4104], [4136, 4110], [4150, 4100]],
                   help="pairs of part lengths in turn (text + 4,096 image tokens at 1024x1024), e.g. 4128,4104")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench.packed_attention needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    write_report(run(args), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
