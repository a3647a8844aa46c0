"""The collector kept out of the steps (library.runtime.collector): automatic passes off inside, young passes at
each step boundary, and the collector as before on exit, an outer freeze included."""

from __future__ import annotations

import gc

from library.runtime.collector import StepGarbageCollector


def test_automatic_passes_are_off_inside_and_back_after():
    assert gc.isenabled()
    with StepGarbageCollector() as collector:
        assert not gc.isenabled() and gc.get_freeze_count() > 0
        before = gc.get_stats()[1]["collections"]
        collector.step(1)
        assert gc.get_stats()[1]["collections"] == before + 1
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_an_outer_freeze_stays_and_a_disabled_collector_stays_off():
    gc.disable()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with StepGarbageCollector() as collector:
            collector.step(1)
            assert gc.get_freeze_count() >= frozen
        assert gc.get_freeze_count() >= frozen and not gc.isenabled()
    finally:
        gc.unfreeze()
        gc.enable()
