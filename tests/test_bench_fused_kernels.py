"""bench/fused_kernels.py: a smoke run under Triton's interpreter (the GPU figures come from the same code on CUDA),
and its refusal where the kernels do not run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import fused_kernels

ROOT = Path(__file__).resolve().parent.parent


def test_smoke_run_under_the_interpreter(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "fk.json"
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "bench.fused_kernels", "--device", "cpu", "--tokens", "16",
                           "--width", "256", "--ffn", "256", "--iters", "1", "--reps", "1", "--sweep", "--out",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = json.loads(out.read_text())
    rows = {r["chain"]: r for r in payload["results"]}
    assert set(rows) == {"norm_modulate", "norm_rope", "swiglu", "gated_residual"}
    for r in rows.values():
        # the same math in both forms (the interpreter rounds to bf16 towards zero: a little more than one ulp)
        assert r["out_rel_diff"] < 2e-2 and r["grad_rel_diff"] < 2e-2, r
        assert r["eager_train_ms"] > 0 and r["kernels_train_ms"] > 0 and r["kernels_forward_gbps"] > 0, r
    swept = [(r["chain"], next(k for k in r if k in fused_kernels.SWEEP)) for r in payload["sweep"]]
    assert len(swept) == sum(len(fused_kernels.SWEEP[p]) for ps in fused_kernels.TUNED_BY.values() for p in ps)
    assert all("error" not in r and r["train_ms"] > 0 for r in payload["sweep"]), payload["sweep"]
    assert "python -m bench.fused_kernels --device cpu" in payload["command"]
    codes = {r["chain"]: r for r in payload["codes"]}
    assert set(codes) == {"norm_modulate", "swiglu"}
    for r in codes.values():  # the kernels that write codes give the quantiser's bits
        assert r["codes_equal"] and r["scales_equal"] and r["fused_ms"] > 0 and r["separate_ms"] > 0, r


def test_refused_where_the_kernels_do_not_run(tmp_path, capsys):
    assert fused_kernels.main(["--device", "cpu", "--out", str(tmp_path / "x.json")]) == 2
    assert "the fused kernels do not run on cpu" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
