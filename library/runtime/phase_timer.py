"""Wall-clock seconds of named phases (loading, encoding, sampling...), with the CUDA work finished before each
reading so that asynchronous kernels are counted in the phase that queued them.

The timings of the last finished run of an entry point in this process (the inference script's prompt runs) are kept
here too: `last_run_timings()` is the seam through which a benchmark that calls an entry point in-process reads
them (`bench/measure.py --record library.runtime.phase_timer:last_run_timings`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

_LAST_RUN_TIMINGS: dict[str, float] = {}


class PhaseTimer:
    """`with timer.phase("encode"): ...` adds the seconds of the block to `timer.seconds["encode"]`."""

    def __init__(self, device: Any = None):
        device = torch.device(device) if device is not None else None
        self._cuda_device = device if device is not None and device.type == "cuda" else None
        self.seconds: dict[str, float] = {}

    def _now(self) -> float:
        if self._cuda_device is not None:
            torch.cuda.synchronize(self._cuda_device)
        return time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = self._now()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + self._now() - start


def set_last_run_timings(timings: Mapping[str, float]) -> None:
    """Replace the recorded timings of the last run (an empty mapping clears them when a run starts)."""
    _LAST_RUN_TIMINGS.clear()
    _LAST_RUN_TIMINGS.update(timings)


def last_run_timings() -> dict[str, float]:
    """A copy of the phase seconds of the last finished run in this process; empty before any, or when the last run
    recorded none."""
    return dict(_LAST_RUN_TIMINGS)
