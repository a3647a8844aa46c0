"""What the training loop keeps around each step: the loss on its way to the host without a sync (`HostScalar`,
`StepLog`) and Python's garbage collector kept out of the steps (`StepGarbageCollector`)."""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch


class HostScalar:
    """A device scalar on its way to the host: the copy is queued behind the step's work (into pinned memory) and
    read later, so reading it does not drain the queue. On other devices it is read when asked for."""

    def __init__(self, value: torch.Tensor):
        self._event = None
        self._value = value
        if value.device.type == "cuda":
            self._value = value.to("cpu", non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def get(self) -> float:
        if self._event is not None:
            self._event.synchronize()  # the step that made the value, not the steps queued after it
        return float(self._value)


@dataclass
class StepLog:
    step: int
    loss: HostScalar
    learning_rates: dict[str, float]


class StepGarbageCollector:
    """Python's cyclic garbage collector kept out of the steps: on entry everything alive (models, datasets, caches)
    is frozen, so no collection scans it again, and automatic collection is off; the young generations are collected
    at every step boundary, while the queued GPU work runs, and everything every FULL_EVERY steps. On exit the
    collector is as before."""

    FULL_EVERY = 100

    def __enter__(self) -> StepGarbageCollector:
        self._was_enabled = gc.isenabled()
        gc.collect()
        gc.freeze()
        gc.disable()
        return self

    def step(self, step: int) -> None:
        gc.collect(2 if step % self.FULL_EVERY == 0 else 1)

    def __exit__(self, *exc: object) -> None:
        gc.unfreeze()
        if self._was_enabled:
            gc.enable()
