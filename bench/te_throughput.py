"""Text-encoder caching throughput through the product's own tool (`tools/cache_text_encoder_outputs.py`).

    python -m bench.te_throughput --snapshot SNAP --captions 1000 --runs bf16_b1,bf16_b16,int8_b16 --out OUT.json
    python -m bench.te_throughput --tiny --captions 24 --runs bf16_b1,bf16_b8      # CPU, the embedded tiny snapshot

Each run is one process of the cache tool, started afresh on a fresh dataset folder of `--captions` tiny images whose
captions are 20-300 tokens long (seeded; the byte-level tokenizer of the benchmark snapshots makes about one token per
character), so that every caption is encoded. A run is `<variant>_b<batch>`: variant `bf16` (the text encoder as it
is) or `int8` (`--convrot_int8_text_encoder`, quantised at load), batch = `--text_encoder_batch_size`; `<run>@N` encodes N captions instead of `--captions` (for slow runs). Reported per
run: wall seconds from process start to exit, and the tool's own steady-state figure (captions per second of the
encoding loop, the summary line it prints). Add `--fla_path DIR` to put an installed flash-linear-attention on the
path of the tool's process (the runs are then repeated with it, named `<run>_fla`). A run named twice is run twice
(the second as `<run>_again`): the first pays Triton's compilation and the int8 tuners, the second finds their
disk caches warm.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from PIL import Image

from library.moss_image.tiny_snapshot import build_tiny_snapshot

REPO = Path(__file__).resolve().parent.parent  # the tool runs as a module from here (no install needed)
TOOL = "tools.cache_text_encoder_outputs"
WORDS = ("red", "square", "grey", "background", "a", "cat", "on", "the", "window", "sill", "light", "soft", "shadow",
         "painting", "of", "river", "mountain", "detailed", "portrait", "woman", "hat", "blue", "sky", "clouds")
_RATE_RE = re.compile(r"(\d+) captions at ([\d.]+) captions/s")


def caption(rng: random.Random, low: int = 20, high: int = 300) -> str:
    """A caption of about `n` characters (about n tokens with a byte-level tokenizer), n drawn in [low, high]."""
    n = rng.randint(low, high)
    out: list[str] = []
    while sum(len(w) + 1 for w in out) < n:
        out.append(rng.choice(WORDS))
    return " ".join(out)[:n]


def write_dataset(root: Path, count: int, seed: int) -> Path:
    """`count` 64x64 images with one caption file each, in a DreamBooth folder `1_bench`."""
    folder = root / "1_bench"
    folder.mkdir(parents=True)
    rng = random.Random(seed)
    img = Image.new("RGB", (64, 64), (120, 120, 120))
    for i in range(count):
        img.save(folder / f"{i:05d}.png")
        (folder / f"{i:05d}.txt").write_text(caption(rng), encoding="utf-8")
    return root


def parse_run(name: str, default_count: int) -> tuple[str, str, int, int]:
    """`bf16_b16` or `bf16_b1@200` -> (name, variant, batch, captions)."""
    m = re.fullmatch(r"((bf16|int8)_b(\d+))(?:@(\d+))?", name)
    if not m:
        raise SystemExit(f"run {name!r} is not <bf16|int8>_b<batch>[@captions], e.g. bf16_b16 or bf16_b1@200")
    return m.group(1), m.group(2), int(m.group(3)), int(m.group(4) or default_count)


def run_tool(snapshot: Path, data: Path, variant: str, batch: int, device: str, env: dict[str, str]) -> dict[str, Any]:
    argv = [sys.executable, "-m", TOOL, "--moss_image", "--snapshot", str(snapshot), "--train_data_dir", str(data),
            "--resolution", "64", "--cache_text_encoder_outputs_to_disk", "--text_encoder_batch_size", str(batch),
            "--device", device]
    if variant == "int8":
        argv.append("--convrot_int8_text_encoder")
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    text = proc.stdout + proc.stderr
    m = _RATE_RE.search(text)
    res: dict[str, Any] = {"returncode": proc.returncode, "wall_s": round(wall, 2)}
    if m:
        res |= {"captions": int(m.group(1)), "captions_per_s": float(m.group(2))}
    if proc.returncode:
        res["error_tail"] = text[-2000:]
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.te_throughput", description=__doc__.split("\n\n")[0])
    p.add_argument("--snapshot", type=Path, help="snapshot root (python -m bench.make_full_snapshot writes one)")
    p.add_argument("--tiny", action="store_true", help="build and use the embedded tiny snapshot (CPU)")
    p.add_argument("--captions", type=int, default=1000)
    p.add_argument("--runs", default="bf16_b1,bf16_b16,int8_b16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fla_path", default="", help="a folder holding flash-linear-attention (fla-core), for _fla runs")
    p.add_argument("--out", type=Path, default=None, help="JSON file for the results (also printed)")
    args = p.parse_args(argv)
    if not args.tiny and args.snapshot is None:
        p.error("give --snapshot DIR or --tiny")
    results: dict[str, Any] = {"captions": args.captions, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="te_bench_") as tmp:
        work = Path(tmp)
        snapshot = build_tiny_snapshot(work / "snap") if args.tiny else args.snapshot
        device = "cpu" if args.tiny else args.device
        base_env = dict(os.environ)
        envs = {"": base_env}
        if args.fla_path:
            envs["_fla"] = base_env | {"PYTHONPATH": os.pathsep.join(
                x for x in (args.fla_path, base_env.get("PYTHONPATH", "")) if x)}
        for suffix, env in envs.items():
            for spec in [r for r in args.runs.split(",") if r]:
                name, variant, batch, count = parse_run(spec, args.captions)
                while name + suffix in results["runs"]:  # a repeated run (Triton's and the tuners' disk caches warm)
                    name += "_again"
                data = write_dataset(work / f"data_{name}{suffix}", count, args.seed)
                results["runs"][name + suffix] = res = run_tool(snapshot, data, variant, batch, device, env)
                print(f"{name + suffix}: {json.dumps(res)[:300]}", flush=True)
    text = json.dumps(results, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)
    failed = [k for k, v in results["runs"].items() if v["returncode"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
