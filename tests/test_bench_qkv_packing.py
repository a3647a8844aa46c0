"""bench/qkv_packing.py: a CPU smoke run of the same code the GPU figures come from (the stacked products give the
three products' values)."""

from __future__ import annotations

import json

from bench import qkv_packing


def test_smoke_run_on_the_cpu(tmp_path):
    out = tmp_path / "qkv.json"
    assert qkv_packing.main(["--device", "cpu", "--tokens", "32", "--width", "256", "--iters", "2", "--reps", "1",
                             "--out", str(out)]) == 0
    rows = {r["case"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"bf16 forward", "bf16 input gradient", "int8 forward (GEMMs)"}
    assert rows["bf16 forward"]["rel_diff"] == 0 and rows["int8 forward (GEMMs)"]["rel_diff"] == 0
    assert rows["bf16 input gradient"]["rel_diff"] < 1e-5  # the three sums in another order
    assert all(r["three_ms"] > 0 and r["one_ms"] > 0 for r in rows.values())
