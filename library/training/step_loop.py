"""What the training loop keeps around each step: the loss on its way to the host without a sync (`HostScalar`,
`StepLog`); Python's garbage collector is kept out of the steps by `library.runtime.collector`."""

from __future__ import annotations

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
