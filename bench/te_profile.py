#!/usr/bin/env python
"""Where a batch of the text encoder goes, bf16 against ConvRot INT8, in one process: the product's loader reads the
encoder from a snapshot, one padded batch runs through it (`--batch` captions of `--tokens` tokens, the mask of
`library.text_encoder.encoding`), timed (median of `--iters` after warm-up), its GPU kernels split by category
(`bench.gpu_profile`) and its host time by Python function (`bench.host_profile`); then the same model is quantised
in place with the trainer's ConvRot recipe and measured again.

    python -m bench.te_profile --snapshot /tmp/full --out te_profile.json [--batch 16] [--tokens 160]
    python -m bench.te_profile --tiny --out tiny.json        # the tiny snapshot on the CPU (timings only)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.gpu_profile import kernel_profile
from bench.host_profile import host_profile
from library.text_encoder import quant as te_quant
from library.text_encoder.loading import TextEncoderOptions, load_text_encoder


def _median_ms(fn: Callable[[], Any], cuda: bool, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def measure(model: torch.nn.Module, batch: int, tokens: int, iters: int, cuda: bool) -> dict[str, Any]:
    device = next(model.parameters()).device
    vocab = int(model.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, tokens), generator=gen).to(device)
    mask = torch.ones(batch, tokens, dtype=torch.long, device=device)
    mask[batch // 2 :, tokens - tokens // 8 :] = 0  # half the batch shorter: right padding, as length groups have

    def run() -> None:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, use_cache=False)

    ms = _median_ms(run, cuda, iters)
    result: dict[str, Any] = {"batch": batch, "tokens": tokens, "ms_per_batch": round(ms, 2),
                              "ms_per_caption": round(ms / batch, 3), "captions_per_s": round(1000 * batch / ms, 1)}
    if cuda:
        result["gpu"] = kernel_profile(run, steps=3)
    result["host"] = host_profile(run, steps=3, top=25)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.te_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--snapshot", type=Path, default=None, help="snapshot folder (bench/make_full_snapshot.py)")
    p.add_argument("--tiny", action="store_true", help="the tiny snapshot on the CPU (timings and host profile)")
    p.add_argument("--batch", type=int, default=16, help="captions per batch (--text_encoder_batch_size)")
    p.add_argument("--tokens", type=int, default=160, help="tokens per caption (the padded width)")
    p.add_argument("--iters", type=int, default=20, help="timed batches per variant (median)")
    p.add_argument("--out", type=Path, required=True, help="JSON results")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    with tempfile.TemporaryDirectory() as tmp:
        snapshot = args.snapshot
        if snapshot is None:
            if not args.tiny:
                print("give --snapshot (bench/make_full_snapshot.py writes one) or --tiny", file=sys.stderr)
                return 2
            from library.moss_image.tiny_snapshot import build_tiny_snapshot

            snapshot = build_tiny_snapshot(Path(tmp) / "moss-image-tiny")
        device = "cuda" if cuda else "cpu"
        t0 = time.perf_counter()
        model = load_text_encoder(TextEncoderOptions(path=snapshot), device).placed()
        payload: dict[str, Any] = {
            "command": " ".join(["python", "-m", "bench.te_profile", *(argv if argv is not None else sys.argv[1:])]),
            "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
            "load_s": round(time.perf_counter() - t0, 1)}
        payload["bf16"] = measure(model, args.batch, args.tokens, args.iters, cuda)
        t0 = time.perf_counter()
        payload["convrot_int8_layers"] = te_quant.quantize_text_encoder_convrot(model, calc_device=device)
        payload["quantise_s"] = round(time.perf_counter() - t0, 1)
        payload["convrot_int8"] = measure(model, args.batch, args.tokens, args.iters, cuda)
        payload["int8_over_bf16_time"] = round(payload["convrot_int8"]["ms_per_batch"]
                                               / payload["bf16"]["ms_per_batch"], 3)
    tmp_out = args.out.with_name(f".{args.out.name}.tmp")
    tmp_out.write_text(json.dumps(payload, indent=1))
    tmp_out.replace(args.out)
    print(json.dumps({k: v for k, v in payload.items() if k not in ("bf16", "convrot_int8")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
