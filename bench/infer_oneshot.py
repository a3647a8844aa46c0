#!/usr/bin/env python
"""One-shot inference from process start: the product's script run as a user runs it, each time in a fresh process,
on a snapshot folder; the wall time from process start to the saved PNG and where it went, as JSON. Run it from the
repository root:

    python -m bench.infer_oneshot --snapshot /tmp/full --out $OUT [--runs eager,eager,compile] [--steps 50]
        [--image_size 1024 1024] [--device cuda] [--extra "--attn_mode flash --split_attn"]

Runs (`--runs`, in order): `eager` makes one image; `compile` adds --compile and makes three (a three-line prompt
file of three text lengths), so that the last image's denoising is the steady state per image (`per_image_s` = its
denoising plus the encode and the decode per image; `per_image_rate_s` = the encode per image plus the last interval
between two denoised images, which holds the previous image's decode: the rate of a long list; prompts of several
text lengths compile the blocks with dynamic shapes during the first image,
`moss_image_minimal_inference.pass_shapes`); `compile_plain_kernels` is `compile` with the compiled blocks'
element-wise code left to inductor (`library.runtime.fused_compiled` off), and `compile_no_codes` is `compile` with
ConvRot INT8 blocks whose norms and SwiGLU write their outputs for the int8 Linears to quantise
(`set_compiled_kernels(inference_codes=False)`; the same as `compile` in bf16), and `compile_epilogues` is `compile`
with those blocks' int8 products taking the gated residual and the q/k head norm + RoPE into the GEMM's epilogue
(`set_compiled_kernels(inference_epilogues=True)`, off by default), and `compile_no_stack` is `compile` with ConvRot
INT8 q, k and v as three products, not one over their stacked weight
(`set_compiled_kernels(inference_stacked_qkv=False)`), and `compile_unpacked` is `compile` with each CFG step's two
passes run one after the other rather than packed into one (`library.moss_image.cfg_packing`), each for the ratio of
the two in one run. Before the first run the repository's Python files are compiled to bytecode (`compileall`, as pip
does when it installs a package), so the runs measure the imports a user's installed copy pays.

Per run, from the script's own log (`moss_image_minimal_inference`: the "timings (s)" and "start-up (s)" lines and
the per-prompt denoise lines): `to_png_s` (process start to the saved PNG, measured by the script from the process's
start time), `phases_s` (startup = process start to the run, text encoder import / load, encode, DiT load, VAE load,
DiT wait, denoise, DiT freed, decode + save), `denoise_per_prompt_s`, `interval_per_prompt_s` (from the second image
on), and from here `exit_s` (the spawn to the process's exit, the interpreter's shutdown included). Writes
OUT/infer_oneshot.json and the logs OUT/infer_oneshot_<i>_<run>.log (the images go to --work); prints the JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SCRIPT = "moss_image_minimal_inference.py"
PROMPTS = ("a red fox in the snow, morning light", "a lighthouse on a cliff at dusk, long exposure",
           "an old map of a harbour city with ships, a compass rose and sea monsters in its corners")
RUNS = ("eager", "compile", "compile_plain_kernels", "compile_no_codes", "compile_epilogues", "compile_no_stack",
        "compile_unpacked")
# bench-only: `compile` with settings of library.runtime.fused_compiled changed in the script's process, the forms
# before them, for a ratio measured in one run: the compiled blocks' element-wise code left to inductor (no fused
# kernels as ops), or ConvRot INT8 blocks whose producers write their outputs and the int8 Linears quantise them
_COMPILED_SETTINGS = {"compile_plain_kernels": "norm_rope=False, swiglu=False",
                      "compile_no_codes": "inference_codes=False",
                      "compile_epilogues": "inference_epilogues=True",
                      "compile_no_stack": "inference_stacked_qkv=False"}
# bench-only: `compile` with a CFG step's two passes run one after the other, not packed into one pass
# (library.moss_image.cfg_packing.set_cfg_packing(False))
_PROCESS_SETUP = {"compile_unpacked": "from library.moss_image.cfg_packing import set_cfg_packing; "
                                      "set_cfg_packing(False)"}


def _launcher(settings: str | None, setup: str | None = None) -> str:
    code = "import runpy, sys; "
    if settings:
        code += f"from library.runtime.fused_compiled import set_compiled_kernels; set_compiled_kernels({settings}); "
    if setup:
        code += setup + "; "
    return code + "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"

_NUM = r"([0-9]+(?:\.[0-9]+)?)"
_TIMINGS_RE = re.compile(
    rf"timings \(s\): text encoder load {_NUM}, encode {_NUM}, DiT load {_NUM}, denoise {_NUM}, VAE load {_NUM},"
    rf" decode {_NUM}; total after loading {_NUM}")
_STARTUP_RE = re.compile(
    rf"start-up \(s\): process start to run {_NUM}, text encoder import {_NUM} \+ load {_NUM}, encode {_NUM}, (.*),"
    rf" denoise {_NUM}, DiT freed {_NUM}, decode and save {_NUM}; {_NUM} since the process started")
_BESIDE_RE = re.compile(rf"DiT \+ VAE load {_NUM} beside it, waited {_NUM}")
_SEQUENTIAL_RE = re.compile(rf"DiT load {_NUM}, VAE load {_NUM}")
_DENOISED_RE = re.compile(rf"prompt (\d+) denoised in {_NUM} s")
_INTERVAL_RE = re.compile(rf"prompt \d+ denoised in .*; {_NUM} s after the previous image")


def parse_log(text: str) -> dict[str, Any]:
    """The figures of one run's log (empty dicts where a line is missing: the run failed before it)."""
    out: dict[str, Any] = {"phases_s": {}, "denoise_per_prompt_s": [float(m.group(2)) for m in
                                                                    _DENOISED_RE.finditer(text)],
                           "interval_per_prompt_s": [float(m.group(1)) for m in _INTERVAL_RE.finditer(text)]}
    m = _STARTUP_RE.search(text)
    if m is None:
        return out
    models = m.group(5)
    phases = {"startup": m.group(1), "text_encoder_import": m.group(2), "text_encoder_load": m.group(3),
              "encode": m.group(4), "denoise": m.group(6), "dit_free": m.group(7), "decode_and_save": m.group(8)}
    beside = _BESIDE_RE.search(models)
    if beside:
        phases.update(dit_and_vae_load_beside=beside.group(1), dit_wait=beside.group(2))
    else:
        seq = _SEQUENTIAL_RE.search(models)
        if seq:
            phases.update(dit_load=seq.group(1), vae_load=seq.group(2))
    out["phases_s"] = {k: float(v) for k, v in phases.items()}
    out["loads_overlapped"] = beside is not None
    out["to_png_s"] = float(m.group(9))
    return out


def compile_bytecode() -> float:
    """Seconds to byte-compile the repository's Python files (what `pip install` does for an installed copy)."""
    began = time.perf_counter()
    targets = [str(REPO / p) for p in ("library", "networks", SCRIPT)]
    subprocess.run([sys.executable, "-m", "compileall", "-q", *targets], check=True, cwd=REPO)
    return time.perf_counter() - began


def run_command(args: argparse.Namespace, run: str, save: Path, prompts_file: Path) -> list[str]:
    settings, setup = _COMPILED_SETTINGS.get(run), _PROCESS_SETUP.get(run)
    launcher = [sys.executable, "-c", _launcher(settings, setup)] if settings or setup else [sys.executable]
    cmd = [*launcher, SCRIPT, "--snapshot", str(args.snapshot), "--image_size", *map(str, args.image_size),
           "--infer_steps", str(args.steps), "--seed", "42", "--save_path", str(save)]
    if args.device:
        cmd += ["--device", args.device]
    if run != "eager":
        cmd += ["--compile", "--from_file", str(prompts_file)]
    else:
        cmd += ["--prompt", PROMPTS[0]]
    return cmd + shlex.split(args.extra)


def one_run(args: argparse.Namespace, index: int, run: str, prompts_file: Path) -> dict[str, Any]:
    save = Path(args.work) / f"{index}_{run}"
    shutil.rmtree(save, ignore_errors=True)  # a folder of an earlier invocation would add its images to `pngs`
    cmd = run_command(args, run, save, prompts_file)
    began = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout, check=False)
    exit_s = time.perf_counter() - began
    log = proc.stdout + proc.stderr
    (Path(args.out) / f"infer_oneshot_{index}_{run}.log").write_text(log)
    result: dict[str, Any] = {"run": run, "returncode": proc.returncode, "exit_s": round(exit_s, 3),
                              "command": " ".join(shlex.quote(c) for c in cmd[1:]), **parse_log(log),
                              "pngs": len(list(save.glob("*.png")))}
    per_prompt = result["denoise_per_prompt_s"]
    phases = result["phases_s"]
    if run != "eager" and len(per_prompt) >= 2 and phases:
        n = len(per_prompt)
        result["per_image_s"] = round(phases["encode"] / n + per_prompt[-1] + phases["decode_and_save"] / n, 3)
        if result["interval_per_prompt_s"]:
            # the rate of a long list of prompts: the last interval between two denoised images (its denoising and
            # the previous image's decode, the PNGs written beside) plus the encode's share
            result["per_image_rate_s"] = round(phases["encode"] / n + result["interval_per_prompt_s"][-1], 3)
    if proc.returncode != 0:
        result["error_tail"] = log[-2000:]
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--snapshot", required=True, help="snapshot folder (python -m bench.make_full_snapshot DIR)")
    p.add_argument("--out", required=True, help="folder for infer_oneshot.json and the logs")
    p.add_argument("--work", default="/tmp/infer_oneshot", help="folder for the images and the prompt file (not"
                   " under --out: only the JSON and the logs are meant to travel back)")
    p.add_argument("--runs", default="eager,eager,compile", help=f"comma-separated, in order, of {', '.join(RUNS)}")
    p.add_argument("--steps", type=int, default=50, help="--infer_steps of every run")
    p.add_argument("--image_size", type=int, nargs=2, default=[1024, 1024], metavar=("HEIGHT", "WIDTH"))
    p.add_argument("--device", default=None, help="--device of the runs (default: the script's)")
    p.add_argument("--extra", default="", help="more options for every run, one shell-quoted string")
    p.add_argument("--timeout", type=float, default=400.0, help="seconds per run")
    p.add_argument("--no_bytecode", action="store_true", help="skip the compileall step")
    args = p.parse_args(argv)
    runs = [r for r in args.runs.split(",") if r]
    unknown = sorted(set(runs) - set(RUNS))
    if unknown:
        p.error(f"unknown --runs {', '.join(unknown)}: use {', '.join(RUNS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    prompts_file = Path(args.work) / "prompts.txt"
    prompts_file.write_text("".join(f"{t}\n" for t in PROMPTS))
    report: dict[str, Any] = {"snapshot": str(args.snapshot), "steps": args.steps, "image_size": args.image_size,
                              "python": sys.version.split()[0]}
    if not args.no_bytecode:
        report["bytecode_compile_s"] = round(compile_bytecode(), 3)
    report["runs"] = []
    for index, run in enumerate(runs):
        report["runs"].append(one_run(args, index, run, prompts_file))
        (out / "infer_oneshot.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0 if all(r["returncode"] == 0 for r in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
