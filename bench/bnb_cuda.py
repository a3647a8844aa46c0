"""The bitsandbytes paths through the trainer on a CUDA GPU: `--te_quant int8/nf4` and the 8-bit optimizers.

    python -m bench.bnb_cuda --out bnb_cuda.json            # needs CUDA and bitsandbytes
    python -m bench.bnb_cuda --cases te_int8,adamw8bit --no_pytest

On the embedded tiny snapshot (the code paths, not the speed): for each case one training run of a few steps, the
text encoder quantised by bitsandbytes while it caches its outputs (or encoding every step: `*_uncached`, or also
encoding sample prompts: `*_sample`), with the optimizer under test. Reported per case: ok, the error and the end of
its traceback, the text-encoder cache variant the run recorded, where the encoder's weights were after caching, the
first and last training loss, whether the saved LoRA is finite and has changed from its start, the seconds of the
text-encoder caching and of each step, and the peak VRAM. Then the bitsandbytes-related test files run under pytest
with CUDA (their summary line and the end of their output). A case is ok when the run finished, its losses are finite
and its LoRA is finite and trained. The JSON goes to --out (and stdout); the exit status is 1 when something failed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

import moss_image_train_network as trainer
from library.moss_image.tiny_snapshot import build_tiny_snapshot
from tools.demo import write_dataset

REPO_ROOT = Path(__file__).resolve().parents[1]
STEPS = 6
# name -> (optimizer, --te_quant, tags): "uncached" encodes the captions every step (no TE output cache), "sample"
# adds a sample prompt (encoded at startup, an image every few steps), "resume" saves the state half-way and trains a
# second run from it (the optimizer's 8-bit state read back onto the GPU)
CASES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "te_int8": ("AdamW", "int8", ()),
    "te_nf4": ("AdamW", "nf4", ()),
    "adamw8bit": ("AdamW8bit", "none", ()),
    "paged_adamw8bit": ("PagedAdamW8bit", "none", ()),
    "adamw8bit_te_int8": ("AdamW8bit", "int8", ()),
    "paged_adamw8bit_te_nf4": ("PagedAdamW8bit", "nf4", ()),
    "lion8bit_te_none": ("Lion8bit", "none", ()),
    "te_int8_uncached": ("AdamW8bit", "int8", ("uncached",)),
    "te_nf4_sample": ("AdamW", "nf4", ("sample",)),
    "adamw8bit_resume": ("AdamW8bit", "none", ("resume",)),
    "paged_adamw8bit_resume": ("PagedAdamW8bit", "none", ("resume",)),
}
PYTEST_FILES = ("tests/test_te_quant.py", "tests/test_te_placement.py", "tests/test_optimizers.py")
LOGGED = ("bitsandbytes", "text encoder:", "use ", "tokenizer:")


class StepClock(trainer.MossImageNetworkTrainer):
    """The trainer, timing the text-encoder caching and each training step (after a CUDA sync), and noting where the
    encoder's weights are once its outputs are cached."""

    def __init__(self) -> None:
        super().__init__()
        self.step_ends: list[float] = []
        self.te_cache_seconds: float | None = None
        self.te_devices_after_caching: list[str] = []

    def cache_text_encoder_outputs_if_needed(self, run: Any) -> None:
        start = time.perf_counter()
        super().cache_text_encoder_outputs_if_needed(run)
        torch.cuda.synchronize()
        self.te_cache_seconds = round(time.perf_counter() - start, 3)
        te = run.text_encoders[0] if run.text_encoders else None
        if te is not None:
            self.te_devices_after_caching = sorted({str(p.device) for p in te.parameters()})

    def sample_images(self, run: Any, epoch: int | None, step: int) -> None:
        super().sample_images(run, epoch, step)
        if epoch is None and step > 0:  # called once after each step
            torch.cuda.synchronize()
            self.step_ends.append(time.perf_counter())


class LineCatcher(logging.Handler):
    """The log lines that say how the text encoder and the optimizer were set up."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if any(key in text for key in LOGGED) and len(self.lines) < 40:
            self.lines.append(text[:300])


def case_argv(name: str, optimizer: str, te_quant: str, tags: tuple[str, ...], snapshot: Path,
              work: Path) -> tuple[list[str], Path, Path]:
    config = write_dataset(work / f"data_{name}", n=4)  # images/ and dataset.toml
    out = work / f"out_{name}"
    argv = ["--snapshot", str(snapshot), "--dataset_config", str(config), "--output_dir", str(out),
            "--output_name", name, "--network_module", "networks.lora_generic", "--network_dim", "4",
            "--network_train_unet_only", "--optimizer_type", optimizer, "--learning_rate", "1e-3",
            "--max_train_steps", str(STEPS), "--seed", "1", "--mixed_precision", "bf16", "--te_quant", te_quant,
            "--cache_latents", "--max_data_loader_n_workers", "0"]
    if "uncached" not in tags:
        argv += ["--cache_text_encoder_outputs", "--cache_text_encoder_outputs_to_disk"]
    if "sample" in tags:
        prompts = work / f"prompts_{name}.txt"
        prompts.write_text("a red square --w 64 --h 64 --s 2\n")
        argv += ["--sample_prompts", str(prompts), "--sample_every_n_steps", str(STEPS // 2)]
    if "resume" in tags:
        argv += ["--save_every_n_steps", str(STEPS // 2), "--save_state"]
    return argv, config.parent / "images", out


def resumed_run(name: str, argv: list[str], out: Path) -> dict[str, Any]:
    """A second run from the state the first saved half-way: it must end at the same step, and its LoRA is compared
    with the first run's."""
    from accelerate.state import AcceleratorState

    state = out / f"{name}-step{STEPS // 2:08d}-state"
    again = out.parent / f"{out.name}_resumed"
    argv = [str(again) if a == str(out) else a for a in argv] + ["--resume", str(state)]
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        run = trainer.MossImageNetworkTrainer().train(trainer.setup_parser().parse_args(argv))
    except Exception as exc:  # noqa: BLE001  (reported with the case)
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:1000], "traceback": traceback.format_exc()[-4000:]}
    first, second = load_file(str(out / f"{name}.safetensors")), load_file(str(again / f"{name}.safetensors"))
    diff = max((first[k].float() - second[k].float()).abs().max().item() for k in first)
    return {"ok": run.global_step == STEPS and first.keys() == second.keys(), "global_step": run.global_step,
            "max_abs_diff_to_uninterrupted": diff}


def run_case(name: str, snapshot: Path, work: Path) -> dict[str, Any]:
    from accelerate.state import AcceleratorState

    optimizer, te_quant, tags = CASES[name]
    argv, data, out = case_argv(name, optimizer, te_quant, tags, snapshot, work)
    res: dict[str, Any] = {"optimizer": optimizer, "te_quant": te_quant, "tags": list(tags)}
    AcceleratorState._reset_state(reset_partial_state=True)  # several runs in one process
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    catcher = LineCatcher()
    logging.getLogger().addHandler(catcher)
    clock = StepClock()
    start = time.perf_counter()
    try:
        run = clock.train(trainer.setup_parser().parse_args(argv))
    except Exception as exc:  # noqa: BLE001  (reported; the next case still runs)
        return res | {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:1000], "log": catcher.lines,
                      "traceback": traceback.format_exc()[-4000:]}
    finally:
        logging.getLogger().removeHandler(catcher)
    res["seconds"] = round(time.perf_counter() - start, 1)
    res["log"] = catcher.lines
    res["te_cache_seconds"] = clock.te_cache_seconds
    res["te_devices_after_caching"] = clock.te_devices_after_caching
    te = run.text_encoders[0] if run.text_encoders else None
    res["te_devices_at_end"] = sorted({str(t.device) for t in te.parameters()}) if te is not None else []
    ends = clock.step_ends
    res["step_seconds"] = [round(b - a, 4) for a, b in itertools.pairwise(ends)]  # the steps after the first
    res["peak_vram_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    losses = [float(v) for v in run.loss_history]
    if losses:
        res["loss_first"], res["loss_last"] = losses[0], losses[-1]
    res["losses_finite"] = bool(losses) and all(np.isfinite(losses))
    lora = load_file(str(out / f"{name}.safetensors"))
    res["lora_finite"] = all(bool(torch.isfinite(t.float()).all()) for t in lora.values())
    ups = [t.float().abs().max().item() for k, t in lora.items() if k.endswith("lora_up.weight")]
    res["lora_up_max"] = max(ups) if ups else None  # lora_up starts at zero: non-zero means it trained
    te_files = sorted(data.glob("*_moss_te.npz"))
    if te_files:
        with np.load(te_files[0]) as z:
            res["te_variant"] = str(z["encoder"]) if "encoder" in z.files else None
    res["samples"] = len(list((out / "sample").glob("*.png"))) if (out / "sample").is_dir() else 0
    res["ok"] = res["losses_finite"] and res["lora_finite"] and bool(res["lora_up_max"])
    if "resume" in tags:
        res["resume"] = resumed_run(name, argv, out)
        res["ok"] = res["ok"] and res["resume"]["ok"]
    return res


def run_pytest(files: tuple[str, ...]) -> dict[str, Any]:
    """The bitsandbytes-related test files, in a child process (its own CUDA context), with this environment."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *files]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, check=False, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                              env=os.environ.copy())
    except subprocess.TimeoutExpired as exc:
        return {"ok": False, "files": list(files), "error": "timed out after 300 s",
                "tail": (exc.stdout or "")[-4000:] if isinstance(exc.stdout, str) else ""}
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    return {"ok": proc.returncode == 0, "rc": proc.returncode, "files": list(files),
            "seconds": round(time.perf_counter() - start, 1), "summary": lines[-1] if lines else "",
            "tail": (proc.stdout + proc.stderr)[-6000:]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bnb_cuda", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="JSON file to write (default: $OUT/bnb_cuda.json when $OUT"
                                                          " is set, else stdout only)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    p.add_argument("--no_pytest", action="store_true", help="skip the pytest run of the bitsandbytes test files")
    args = p.parse_args(argv)
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        p.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    if not torch.cuda.is_available():
        raise SystemExit("bench.bnb_cuda needs a CUDA GPU")
    import bitsandbytes  # optional dependency: the benchmark is about it

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    out = args.out or (Path(os.environ["OUT"]) / "bnb_cuda.json" if os.environ.get("OUT") else None)
    results: dict[str, Any] = {"bitsandbytes": bitsandbytes.__version__, "torch": torch.__version__,
                               "device": torch.cuda.get_device_name(0), "steps": STEPS, "cases": {}}

    def write() -> None:  # after every case: a run cut short still leaves what it measured
        if out:
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_suffix(out.suffix + ".tmp")
            tmp.write_text(json.dumps(results, indent=1))
            os.replace(tmp, out)

    with tempfile.TemporaryDirectory(prefix="bnb_cuda_") as tmp:
        work = Path(tmp)
        snapshot = build_tiny_snapshot(work / "snap")
        for name in args.cases.split(","):
            results["cases"][name] = run_case(name, snapshot, work)
            print("CASE", name, json.dumps(results["cases"][name])[:600], flush=True)
            write()
    if not args.no_pytest:
        results["pytest"] = run_pytest(PYTEST_FILES)
        print("PYTEST", results["pytest"]["summary"] if "summary" in results["pytest"] else results["pytest"],
              flush=True)
        write()
    results["ok"] = all(c.get("ok") for c in results["cases"].values()) and results.get("pytest", {}).get("ok", True)
    write()
    print(json.dumps({k: (v.get("ok") if isinstance(v, dict) else v) for k, v in results["cases"].items()}))
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
