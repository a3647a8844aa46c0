"""The int8 GEMM with the gated residual or the head norm + RoPE in its epilogue (library.quant.int8_epilogue_kernels):
under Triton's interpreter (in a subprocess: the interpreter is chosen when the kernels are defined) and on a CUDA
GPU, against the plain product followed by the step in fp32 with one rounding; and where it applies.

Running this file as a script prints the checks as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_convrot_int8_triton import _interpreter_runs_int8_dots

ROOT = Path(__file__).resolve().parents[1]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def run_checks(device: str) -> dict:
    """Ragged and whole tiles, one sample and two, bf16 and fp16: each kernel against the plain product (the
    forward GEMM's own epilogue, in torch) followed by its step in fp32, rounded once."""
    from library.quant import convrot_kernels as K
    from library.quant import int8_epilogue_kernels as E
    from library.runtime.fused_compiled import _norm_rope_math

    out: dict = {"cases": []}
    g = torch.Generator().manual_seed(0)
    for bsz, seq, k, n, head in ((2, 21, 64, 96, 32), (1, 64, 128, 256, 64)):
        for dtype in (torch.bfloat16, torch.float16):
            xq = torch.randint(-128, 128, (bsz * seq, k), generator=g, dtype=torch.int8).to(device)
            w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8).to(device)
            sa = (torch.rand(bsz * seq, generator=g) * 1e-2).to(device)
            sw = (torch.rand(n, generator=g) * 1e-2).to(device)
            y = K._epilogue_eager(K.int8_mm(xq, w), sa, sw, dtype)
            res = torch.randn(bsz, seq, n, generator=g).to(device, dtype)
            gate = torch.randn(bsz, n, generator=g).to(device, dtype)
            hw = (1 + 0.1 * torch.randn(head, generator=g)).to(device, dtype)
            angles = torch.rand(bsz, seq, head // 2, generator=g).to(device) * 6  # a table per sample
            cos, sin = angles.cos(), angles.sin()
            usable = [E.epilogue_gemm_usable(xq, w, dtype), E.epilogue_gemm_usable(xq, w, dtype, head)]
            got_res = E.gemm_gated_residual(xq, sa, w, sw, res, gate)
            ref_res = (res.float() + gate.float()[:, None] * y.view(bsz, seq, n).float()).to(dtype)
            got_rope = E.gemm_norm_rope(xq, sa, w, sw, hw, cos, sin, 1e-6, seq, dtype)
            ref_rope = _norm_rope_math(y.view(bsz, seq, n // head, head), hw, cos, sin, 1e-6)
            out["cases"].append({
                "shape": [bsz, seq, k, n, head], "dtype": str(dtype), "usable": usable,
                "residual_rel": _rel(got_res, ref_res), "residual_equal": bool(torch.equal(got_res, ref_res)),
                "rope_rel": _rel(got_rope.view_as(ref_rope), ref_rope),
                "rope_equal": bool(torch.equal(got_rope.view_as(ref_rope), ref_rope))})
    return out


def _assert_checks(res: dict, interpreted: bool) -> None:
    assert len(res["cases"]) == 4
    for c in res["cases"]:
        assert c["usable"] == [True, True], c
        if interpreted:  # numpy's fp32 arithmetic: the same bits, but for the head's sum of squares, whose order
            # may differ from torch's (a last-bit flip here and there)
            assert c["residual_equal"] and c["rope_rel"] < 1e-5, c
        else:  # a GPU may contract the products into FMAs or sum the head in another order: the last bit
            assert c["residual_rel"] < 2e-3 and c["rope_rel"] < 2e-3, c


@pytest.mark.skipif(not _interpreter_runs_int8_dots(), reason="needs triton >= 3.9 for the CPU interpreter")
def test_epilogue_kernels_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "tests.test_int8_epilogue_kernels"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_checks(json.loads(proc.stdout.strip().splitlines()[-1]), interpreted=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_epilogue_kernels_on_cuda():
    from library.quant import int8_epilogue_kernels as E

    if not E.epilogue_gemm_usable(torch.zeros(16, 16, dtype=torch.int8, device="cuda"),
                                  torch.zeros(16, 16, dtype=torch.int8, device="cuda"), torch.bfloat16):
        pytest.skip("needs a Hopper or newer GPU and Triton's tensor descriptors")
    _assert_checks(run_checks("cuda"), interpreted=False)


def test_where_the_epilogue_kernel_applies():
    """Not on the CPU without the interpreter, not for fp32 outputs, N-major weights, K not a multiple of 16, or a
    head size that is not a power of two dividing N."""
    from library.quant import int8_epilogue_kernels as E

    xq, w = torch.zeros(8, 64, dtype=torch.int8), torch.zeros(32, 64, dtype=torch.int8)
    if not E._INTERPRET:
        assert not E.epilogue_gemm_usable(xq, w, torch.bfloat16)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(E, "_INTERPRET", True)
        if E._TRITON_IMPORTED and E.G._TensorDescriptor is not None:
            assert E.epilogue_gemm_usable(xq, w, torch.bfloat16) and E.epilogue_gemm_usable(xq, w, torch.float16, 16)
        assert not E.epilogue_gemm_usable(xq, w, torch.float32)
        assert not E.epilogue_gemm_usable(xq, w.t().contiguous().t(), torch.bfloat16)
        assert not E.epilogue_gemm_usable(xq[:, :40], w[:, :40], torch.bfloat16)
        assert not E.epilogue_gemm_usable(xq, w, torch.bfloat16, 24)
        assert not E.epilogue_gemm_usable(xq, w, torch.bfloat16, 64)


if __name__ == "__main__":
    print(json.dumps(run_checks("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
                                else "cpu")))
