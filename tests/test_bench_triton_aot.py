"""bench/triton_aot.py: the new ConvRot INT8 kernels and the fused element-wise kernels compile for Hopper (sm_90) on
this GPU-less machine, through the ptxas that Triton's wheel ships, and their default tiles fit the register file
without spilling."""

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


def test_the_quarters_quantiser_runs_fewer_instructions_a_value_than_rows(tmp_path):
    """What the default quantiser was built for, read off its sm_90 machine code: fewer instructions per activation
    value held than the previous "rows" kernel at K = 3072 (which pads the row to 4096 slots), and no spills."""
    out = tmp_path / "aot.json"
    assert triton_aot.main(["--kernels", "rows,quarters", "--arch", "90", "--out", str(out)]) == 0
    rows = {r["kernel"]: r for r in json.loads(out.read_text())["kernels"]}
    quarters, old = rows["_rot_quant_quarters_kernel"], rows["_rot_quant_rows_kernel"]
    assert not quarters["spills"] and quarters["values_per_thread"] * 32 * quarters["num_warps"] == 3072
    assert old["values_per_thread"] * 32 * old["num_warps"] == 4096
    assert quarters["sass_per_value"] * 1.5 < old["sass_per_value"], (quarters, old)


def test_the_fused_elementwise_kernels_compile_for_sm90_without_spills(tmp_path):
    """The DiT block's fused element-wise kernels (library.runtime.fused_kernels), forward and backward, and the norm +
    modulation and SwiGLU with ConvRot INT8 codes, build for Hopper at full width and fit the register file."""
    out = tmp_path / "aot.json"
    assert triton_aot.main(["--kernels", "elementwise", "--arch", "90", "--out", str(out)]) == 0
    rows = {r["kernel"]: r for r in json.loads(out.read_text())["kernels"]}
    assert set(rows) == {f"_{name}_{way}_kernel" for name in ("norm_rope", "swiglu", "norm_modulate", "gated_residual")
                         for way in ("fwd", "bwd")} | {"_norm_modulate_quant_kernel", "_swiglu_quant_kernel"}
    for row in rows.values():
        assert "error" not in row and 0 < row["reg"] <= 128 and not row["spills"], row
