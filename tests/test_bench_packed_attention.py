"""bench.packed_attention on the CPU: packed calls equal to the parts alone, the kernels of each new graph recorded
(a specialised graph for the first pair of lengths, a dynamic one for the next)."""

from __future__ import annotations

import json

import pytest

from bench import packed_attention


def test_packed_attention_bench_runs_on_the_cpu(tmp_path):
    out = tmp_path / "p.json"
    argv = ["--device", "cpu", "--heads", "2", "--head_dim", "16", "--lengths", "40,24", "36,20", "30,12",
            "--iters", "2", "--warmup", "1", "--out", str(out)]
    assert packed_attention.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["lengths"] for r in rows] == [[40, 24], [36, 20], [30, 12]]
    assert all(r["same_values"] and r["packed_ms"] > 0 and r["alone_ms"] > 0 for r in rows)
    assert rows[0]["new_graph_kernels"] and rows[1]["new_graph_kernels"]  # specialised, then dynamic
    assert not rows[2]["new_graph_kernels"]  # the dynamic graph serves the third pair
    assert all(len(kernels) == 2 for r in rows for kernels in r["new_graph_kernels"])  # one SDPA a part


def test_lengths_are_checked():
    with pytest.raises(SystemExit):
        packed_attention.main(["--device", "cpu", "--lengths", "40"])
