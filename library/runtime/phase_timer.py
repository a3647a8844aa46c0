"""Wall-clock seconds of named phases (loading, encoding, sampling...), with the CUDA work finished before each
reading so that asynchronous kernels are counted in the phase that queued them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class PhaseTimer:
    """`with timer.phase("encode"): ...` adds the seconds of the block to `timer.seconds["encode"]`."""

    def __init__(self, device: Any = None):
        import torch

        device = torch.device(device) if device is not None else None
        self._cuda_device = device if device is not None and device.type == "cuda" else None
        self.seconds: dict[str, float] = {}

    def _now(self) -> float:
        if self._cuda_device is not None:
            import torch

            torch.cuda.synchronize(self._cuda_device)
        return time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = self._now()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + self._now() - start
