"""bench/te_profile.py --tiny: the text encoder read by the product's loader runs one padded batch in bf16, is
quantised in place to ConvRot INT8 and runs it again; the JSON names both with their timings and host profiles."""

from __future__ import annotations

import json

from bench import te_profile


def test_tiny_te_profile_measures_bf16_then_convrot_int8(tiny_snapshot, tmp_path):
    out = tmp_path / "te.json"
    argv = ["--tiny", "--snapshot", str(tiny_snapshot), "--batch", "2", "--tokens", "8", "--iters", "1",
            "--out", str(out)]
    assert te_profile.main(argv) == 0
    payload = json.loads(out.read_text())
    assert payload["device"] == "cpu" and payload["convrot_int8_layers"] > 0
    for name in ("bf16", "convrot_int8"):
        r = payload[name]
        assert r["batch"] == 2 and r["tokens"] == 8 and r["ms_per_batch"] > 0 and "gpu" not in r
        assert r["host"]["steps"] == 3 and r["host"]["by_total_time"]
    assert payload["int8_over_bf16_time"] > 0
    assert not list(tmp_path.glob(".*.tmp"))
