#!/usr/bin/env python
"""Run one of the product's entry points in this process and measure it: wall time, the duration of every call of
chosen functions and of every training step (CUDA-synchronised), GPU memory (torch's peaks and the driver's figure
including the CUDA context, split at a phase boundary), host peak RSS, and optionally a torch.profiler breakdown of
one step. Run it from the repository root:

    python -m bench.measure --json out.json --phase library.training.network_trainer:NetworkTrainer.add_step_hook \\
        -- moss_image_train_network:main --snapshot ...
    accelerate launch --num_processes 2 -m bench.measure --json out.json ... -- moss_image_train_network:main ...

`--time MODULE:FUNC` wraps a public function (or a dotted method) before the entry module is imported, so modules
that import it by name see the wrapper. `--phase MODULE:REGISTER` names the product's step seam, a function that
takes a hook (`NetworkTrainer.add_step_hook`): every step is timed through it, and the first step ends the
"startup" phase (the seed 001 memory table's "startup" and "training" columns); torch's peak counters are reset
there. `--profile_call N` profiles the N-th step (1-based) and writes its GPU time by category. `--record
MODULE:ATTR` stores a JSON-able value after the run (a function is called: the inference script's
`library.runtime.phase_timer:last_run_timings`). Under several processes each rank writes `out.rankR.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import torch

GIB = 1024**3


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _resolve(spec: str) -> tuple[Any, str, Any]:
    """'pkg.mod:Class.method' -> (owner object, attribute name, current value)."""
    mod_name, _, attr = spec.partition(":")
    owner: Any = importlib.import_module(mod_name)
    parts = attr.split(".")
    for p in parts[:-1]:
        owner = getattr(owner, p)
    return owner, parts[-1], getattr(owner, parts[-1])


class GpuPoller:
    """The driver's used memory of this process's GPU (CUDA context included, as nvidia-smi shows it), sampled in a
    background thread; the peak is kept per phase."""

    def __init__(self, index: int, period_s: float = 0.1):
        self.index, self.period_s = index, period_s
        self.peaks: dict[str, float] = {}
        self.phase = "startup"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._read = self._reader()

    def _reader(self) -> Callable[[], float] | None:
        try:
            import pynvml  # type: ignore[import-not-found]

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(self.index)
            return lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used / GIB
        except Exception:  # noqa: BLE001 - fall back to nvidia-smi
            pass

        def smi() -> float:
            out = subprocess.run(["nvidia-smi", "-i", str(self.index), "--query-gpu=memory.used",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
            return float(out.stdout.strip().splitlines()[0]) / 1024

        try:
            smi()
        except Exception:  # noqa: BLE001 - no driver tool: no driver figure
            return None
        return smi

    def start(self) -> "GpuPoller":
        if self._read is not None:
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            used = self._read()
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0.0), used)
            self._stop.wait(self.period_s)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        return {k: round(v, 2) for k, v in self.peaks.items()}


class Recorder:
    def __init__(self, profile_call: int):
        self.calls: dict[str, list[dict[str, float]]] = {}
        self.phase_started_at: float | None = None
        self.torch_startup: dict[str, float] = {}
        self.profile_call = profile_call
        self.profile: dict[str, Any] | None = None
        self.poller: GpuPoller | None = None

    @contextlib.contextmanager
    def timing(self, calls: list[dict[str, float]], phase: bool) -> Iterator[None]:
        """Times the block as one call (CUDA-synchronised); in the phase's calls: starts the phase at the first one
        and profiles the `profile_call`-th."""
        if phase and self.phase_started_at is None:
            self._start_phase()
        _sync()
        t0 = time.perf_counter()
        if phase and self.profile_call and len(calls) + 1 == self.profile_call:
            with _profiling(self):
                yield
        else:
            yield
        _sync()
        calls.append({"start": round(t0, 4), "s": round(time.perf_counter() - t0, 5)})

    def wrap(self, spec: str) -> None:
        """Replace the function `spec` names with one that times every call."""
        owner, name, fn = _resolve(spec)
        calls = self.calls.setdefault(spec, [])

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.timing(calls, phase=False):
                return fn(*args, **kwargs)

        setattr(owner, name, timed)

    def hook_phase(self, spec: str) -> None:
        """Register a hook through the product's step seam `spec` (a function taking the hook): every step is timed
        and the first one starts the phase."""
        calls = self.calls.setdefault(spec, [])
        _resolve(spec)[2](lambda: self.timing(calls, phase=True))

    def _start_phase(self) -> None:
        self.phase_started_at = time.perf_counter()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            _sync()
            self.torch_startup = _torch_peaks()
            torch.cuda.reset_peak_memory_stats()
        if self.poller is not None:
            self.poller.phase = "training"


def _torch_peaks() -> dict[str, float]:
    return {"max_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 3),
            "max_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 3)}


CATEGORIES = (  # first match wins (lower-case kernel names)
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn", "scaled_dot")),
    ("int8_gemm_and_quantiser", ("_int8_", "int8_gemm", "convrot", "rot_quant", "scale_rotate", "dequant")),
    ("gemm", ("gemm", "cutlass", "nvjet", "sm90_xmma", "xmma", "ampere_", "cublas", "matmul", "mm_")),
    ("optimizer", ("multi_tensor", "adam", "foreach", "fused_adam")),
    ("memcpy", ("memcpy", "memset", "copy_")),
    ("norm_rope_modulation_elementwise", ("triton", "elementwise", "vectorized", "reduce", "norm", "unrolled",
                                          "cat", "index", "silu", "mul", "add")),
)


def categorise(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


@contextlib.contextmanager
def _profiling(rec: Recorder) -> Iterator[None]:
    """torch.profiler around the block; its GPU time by category (and the top kernels) goes to `rec.profile`."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        yield
        _sync()
    by_cat: dict[str, float] = {}
    top: list[tuple[float, str]] = []
    for ev in prof.key_averages():
        dev_us = float(getattr(ev, "device_time_total", 0.0) or getattr(ev, "cuda_time_total", 0.0) or 0.0)
        if dev_us <= 0 or ev.device_type.name != "CUDA":
            continue
        cat = categorise(ev.key)
        by_cat[cat] = by_cat.get(cat, 0.0) + dev_us / 1000
        top.append((dev_us / 1000, ev.key[:120]))
    top.sort(reverse=True)
    rec.profile = {"gpu_ms_by_category": {k: round(v, 2) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
                   "gpu_ms_total": round(sum(by_cat.values()), 2),
                   "top_kernels_ms": [[round(ms, 3), name] for ms, name in top[:25]]}


def _summary(calls: list[dict[str, float]], skip: int) -> dict[str, Any]:
    import statistics

    d = [c["s"] for c in calls]
    tail = d[skip:] if len(d) > skip else d
    gaps = [calls[i + 1]["start"] - (calls[i]["start"] + calls[i]["s"]) for i in range(len(calls) - 1)]
    out: dict[str, Any] = {"n": len(d), "total_s": round(sum(d), 3)}
    if d:
        out.update(first_s=round(d[0], 4), median_s=round(statistics.median(tail), 4), min_s=round(min(tail), 4),
                   median_skipped=len(d) - len(tail))
    if gaps:
        out["median_gap_s"] = round(statistics.median(gaps[skip:] or gaps), 4)  # host time between calls
    return out


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, str, list[str]]:
    i = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="python -m bench.measure [options] -- MODULE:FUNC [arguments of the entry point]")
    p.add_argument("--json", required=True, help="where the figures go (out.rankR.json under several processes)")
    p.add_argument("--time", action="append", default=[], help="MODULE:FUNC to time at every call (repeatable)")
    p.add_argument("--phase", default=None,
                   help="MODULE:REGISTER: the step seam taking a hook (steps timed; the first starts the phase)")
    p.add_argument("--skip", type=int, default=0, help="calls left out of the medians (warm-up, autotuning)")
    p.add_argument("--profile_call", type=int, default=0, help="profile this step of --phase (1-based; 0: none)")
    p.add_argument("--label", default="", help="free text stored in the JSON")
    p.add_argument("--setup", action="append", default=[], help="MODULE:FUNC called before the entry (repeatable)")
    p.add_argument("--record", action="append", default=[],
                   help="MODULE:ATTR whose value (JSON-able; a function is called) is stored after the run")
    args = p.parse_args(argv[:i])
    rest = argv[i + 1:]
    if not rest:
        p.error("give the entry point after --, e.g. -- moss_image_train_network:main --snapshot ...")
    return args, rest[0], rest[1:]


def main(argv: list[str] | None = None) -> int:
    args, entry, entry_argv = parse_args(sys.argv[1:] if argv is None else argv)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rec = Recorder(args.profile_call)
    for spec in args.setup:
        _resolve(spec)[2]()
    for spec in args.time:
        rec.wrap(spec)
    if args.phase:
        rec.hook_phase(args.phase)
    if torch.cuda.is_available():
        rec.poller = GpuPoller(int(os.environ.get("MEASURE_GPU_INDEX", os.environ.get("LOCAL_RANK", "0")))).start()
    mod_name, _, fn_name = entry.partition(":")
    t0 = time.perf_counter()
    error = None
    try:
        result = getattr(importlib.import_module(mod_name), fn_name or "main")(entry_argv)
        if isinstance(result, int) and result != 0:
            error = f"exit status {result}"
    except SystemExit as e:  # the entry's argparse / UserError path
        if e.code not in (0, None):
            error = f"SystemExit({e.code})"
    _sync()
    wall = time.perf_counter() - t0
    report: dict[str, Any] = {
        "label": args.label, "entry": entry, "argv": entry_argv, "rank": rank, "world_size": world,
        "wall_s": round(wall, 2), "error": error,
        "host_peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2, 2),
        "calls": {k: _summary(v, args.skip) for k, v in rec.calls.items()},
        "durations_s": {k: [c["s"] for c in v] for k, v in rec.calls.items()},
    }
    if rec.phase_started_at is not None:
        report["startup_s"] = round(rec.phase_started_at - t0, 2)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        peaks = _torch_peaks()
        report["torch_gpu"] = ({"startup": rec.torch_startup, "training": peaks} if rec.torch_startup
                               else {"whole": peaks})
    if rec.poller is not None:
        report["driver_gpu_used_peak_gib"] = rec.poller.stop()
    if rec.profile is not None:
        report["profile"] = rec.profile
    for spec in args.record:
        value = _resolve(spec)[2]
        report.setdefault("recorded", {})[spec] = value() if callable(value) else value
    out = Path(args.json)
    if world > 1:
        out = out.with_name(f"{out.stem}.rank{rank}{out.suffix}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, out)
    return 1 if error else 0


if __name__ == "__main__":
    sys.exit(main())
