"""Process start-up: the seconds since the process started, and the cyclic garbage collector kept out of the
imports of a one-shot run.

Importing torch, transformers' model code and their dependencies makes hundreds of thousands of long-lived objects;
the collector's automatic passes over them cost about a sixth of the import time, and every later `gc.collect()`
(the inference script frees each model with one) walks them all again. `imports_without_gc()` pauses the collector
for an import, and an entry point that owns its process runs under `frozen_imports()` once its imports are done:
the objects alive then move to the collector's permanent generation (`gc.freeze`), so later passes skip them. Only
an entry point does that (`main()` of a script), never a function that a test or a benchmark may call in-process.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

_IMPORTED_AT = time.perf_counter()  # the fallback origin where /proc cannot tell the process's start


def seconds_since_process_start() -> float:
    """Wall seconds since this process started (Linux: from /proc, at the clock tick's resolution); elsewhere since
    this module was imported."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            stat = f.read()
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, counted after the command name
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED_AT


def gc_frozen() -> bool:
    """True while the entry point keeps the objects of its imports frozen (`frozen_imports`)."""
    return gc.get_freeze_count() > 0


@contextmanager
def frozen_imports() -> Iterator[None]:
    """For an entry point, after its imports: every object alive now goes to the collector's permanent generation for
    the block, and back at its end (so that the interpreter's shutdown frees them: extension modules such as Triton's
    report the objects still alive then as leaks)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextmanager
def imports_without_gc() -> Iterator[None]:
    """The collector paused for the block (an import of a large package); the objects it made are frozen too when the
    entry point froze the earlier ones (`gc_frozen()`)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if gc_frozen():
            gc.freeze()
        if was_enabled:
            gc.enable()
