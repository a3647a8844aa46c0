"""bench/host_profile.py: cProfile per call of a callable, with its functions named and counted per call."""

from __future__ import annotations

from bench.host_profile import host_profile


def _leaf(n: int) -> int:
    return sum(i * i for i in range(n))


def _work() -> int:
    return _leaf(2000) + _leaf(2000) + len(sorted(range(500)))


def test_host_profile_counts_calls_per_call_and_names_functions():
    report = host_profile(_work, steps=4, top=40)
    assert report["steps"] == 4 and report["wall_ms_per_call"] > 0
    by_total = {row["where"]: row for row in report["by_total_time"]}
    leaf = next(row for where, row in by_total.items() if where.endswith("(_leaf)"))
    work = next(row for where, row in by_total.items() if where.endswith("(_work)"))
    assert leaf["calls"] == 2 and work["calls"] == 1  # per call of the profiled callable
    assert work["total_ms"] >= leaf["total_ms"] > 0
    assert "tests/test_bench_host_profile.py" in next(w for w in by_total if w.endswith("(_leaf)"))
    assert any(row["where"].startswith("~:0(") for row in report["by_own_time"])  # built-ins are named too
    assert report["profiled_own_ms_per_call"] > 0
