"""Where the host (Python) time of a callable goes: cProfile over a few calls, per call.

    from bench.host_profile import host_profile
    report = host_profile(step, steps=3)        # milliseconds per call, the top functions by own and total time

One unrecorded call first (compiles, caches), then `steps` calls under cProfile, with a CUDA synchronisation after
them. cProfile slows Python down (each profiled call costs about a microsecond more), so the shares matter more than
the absolute figures; `wall_ms_per_call` is the profiled wall time. A row names `file:line(function)` with the file
shortened to its last two path parts; built-in functions (C code, torch ops) appear as ``~:0(<name>)``.
"""

from __future__ import annotations

import cProfile
import pstats
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _where(key: tuple[str, int, str]) -> str:
    file, line, func = key
    if file == "~":
        return f"~:0({func})"
    return f"{'/'.join(Path(file).parts[-2:])}:{line}({func})"


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def host_profile(fn: Callable[[], Any], steps: int = 3, top: int = 30) -> dict[str, Any]:
    """cProfile of `steps` calls of `fn` (after one unrecorded call): the `top` functions by own time and by total
    time (calls, own ms and total ms per call of `fn`), and the profiled wall time per call."""
    fn()
    _sync()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        fn()
    prof.disable()
    _sync()
    wall_ms = (time.perf_counter() - t0) * 1000 / steps
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]

    def rows(sort_index: int) -> list[dict[str, Any]]:
        ranked = sorted(stats.items(), key=lambda kv: -kv[1][sort_index])[:top]
        return [{"where": _where(key), "calls": round(nc / steps, 1), "own_ms": round(tt * 1000 / steps, 4),
                 "total_ms": round(ct * 1000 / steps, 4)} for key, (_, nc, tt, ct, _) in ranked]

    own_total = sum(v[2] for v in stats.values()) * 1000 / steps
    return {"steps": steps, "wall_ms_per_call": round(wall_ms, 2), "profiled_own_ms_per_call": round(own_total, 2),
            "by_own_time": rows(2), "by_total_time": rows(3)}
