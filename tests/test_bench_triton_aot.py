"""bench/triton_aot.py: the new ConvRot INT8 kernels compile for Hopper (sm_90) on this GPU-less machine, through
the ptxas that Triton's wheel ships, and their default tiles fit the register file without spilling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
    pytest.skip("this Triton has no NVIDIA backend tools (ptxas, cuobjdump)", allow_module_level=True)

from bench import triton_aot  # after the skip checks


def test_default_tiles_compile_for_sm90_without_spills(tmp_path):
    out = tmp_path / "aot.json"
    assert triton_aot.main(["--kernels", "fused,tiles_mma", "--arch", "90", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    rows = {r["kernel"]: r for r in payload["kernels"]}
    assert set(rows) == {"_fused_quant_gemm_kernel", "_rot_quant_tiles_mma_kernel"}
    for row in rows.values():
        assert "error" not in row, row
        assert 0 < row["reg"] <= 255 and not row["spills"], row
    assert payload["arch"] == 90 and payload["triton"] == triton.__version__


def test_unknown_kernels_are_refused(capsys):
    assert triton_aot.main(["--kernels", "fused,nope"]) == 2
    assert "unknown --kernels ['nope']" in capsys.readouterr().err
