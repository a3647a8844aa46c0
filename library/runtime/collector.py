"""Python's cyclic garbage collector kept out of the steps of a loop that queues GPU work (training steps, sampling
steps): `StepGarbageCollector`."""

from __future__ import annotations

import gc


class StepGarbageCollector:
    """On entry everything alive (models, datasets, compiled code, caches) is frozen, so no collection scans it again,
    and automatic collection is off; the young generations are collected at every step boundary (`step`), while the
    queued GPU work runs, and everything every FULL_EVERY steps. On exit the collector is as before: enabled if it
    was, and the objects frozen by an outer owner of the process (`library.runtime.startup.frozen_imports`, an outer
    collector) kept frozen."""

    FULL_EVERY = 100

    def __enter__(self) -> StepGarbageCollector:
        self._was_enabled = gc.isenabled()
        self._was_frozen = gc.get_freeze_count() > 0
        gc.collect()
        gc.freeze()
        gc.disable()
        return self

    def step(self, step: int) -> None:
        """Call after step `step` has queued its work."""
        gc.collect(2 if step % self.FULL_EVERY == 0 else 1)

    def __exit__(self, *exc: object) -> None:
        if not self._was_frozen:
            gc.unfreeze()  # an outer freeze is kept: gc.unfreeze() would release its objects too
        if self._was_enabled:
            gc.enable()
