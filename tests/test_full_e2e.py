"""bench.full_e2e at --scale small on the CPU: every phase's product commands run and give sane figures, so the
full-size run on the GPU machine does not spend device time on a broken command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import full_e2e, measure, te_int8_depth


@pytest.fixture(scope="module")
def e2e(e2e_background):
    """`python -m bench.full_e2e` with every phase (conftest.E2E_OPTIONS), started in the background by conftest."""
    return e2e_background.wait(), e2e_background.root, e2e_background.out


def _load(out: Path, phase: str) -> dict:
    return json.loads((out / f"e2e_{phase}.json").read_text())


def test_every_phase_ran(e2e):
    code, _, out = e2e
    assert code == 0
    report = _load(out, "report")
    assert {"e2e_snapshot", "e2e_cache", "e2e_train", "e2e_infer", "e2e_quality", "e2e_ddp"} <= set(report)


def test_cache_and_training_figures(e2e):
    _, root, out = e2e
    cache = _load(out, "cache")
    for run in ("latents", "te_bf16", "te_int8_prequantised"):
        assert cache[run]["returncode"] == 0 and cache[run]["images_per_s"] > 0
    assert len(list((root / "data_int8te" / "1_e2e").glob("*_moss_te.npz"))) == 4
    train = _load(out, "train")
    for name, row in train.items():
        assert row["returncode"] == 0, (name, row.get("error_tail"))
        assert row["steps"] == 4 and row["step_median_s"] > 0 and row["startup_s"] > 0
    assert (root / "out" / "bf16_gc" / "bf16_gc.safetensors").exists()
    assert "gpu_ms_by_category" in train["bf16_gc"]["profile"]  # on the CPU: no CUDA kernels, an empty breakdown


def test_inference_quality_and_ddp(e2e):
    _, _, out = e2e
    infer = _load(out, "infer")
    assert infer["bf16"]["returncode"] == 0 and infer["bf16"]["timings_s"]["denoise"] > 0
    assert len(infer["int8_compile"]["denoise_per_image_s"]) == 2  # the compiled run's steady-state image
    quality = _load(out, "quality")
    assert 0 < quality["int8_compile_vs_bf16"]["latent_rel_err"] < 0.2
    assert 0 < quality["te_outputs_int8_vs_bf16"]["mean_rel_err"] < 0.3
    ddp = _load(out, "ddp")
    assert ddp["throughput_2proc"]["ranks"] == 2 and ddp["speedup"] > 0
    assert ddp["equivalence_fp32"]["rel_err"] < 1e-5  # one process x batch 2 == two processes x batch 1
    assert ddp["equivalence_bf16"]["rel_err"] < 0.05


def test_measure_profiles_categories():
    assert measure.categorise("void flash_fwd_kernel<...>") == "attention"
    assert measure.categorise("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert measure.categorise("_int8_gemm_kernel") == "int8_gemm_and_quantiser"
    assert measure.categorise("triton_poi_fused_add_mul_rms_norm_0") == "norm_rope_modulation_elementwise"
    assert measure.categorise("void at::native::multi_tensor_apply_kernel<adam>") == "optimizer"


def test_a_failed_run_anywhere_fails_the_phase():
    assert full_e2e.any_failed({"a": {"returncode": 0}, "b": [{"returncode": 2}]})
    assert not full_e2e.any_failed({"a": {"returncode": 0}, "speedup": 2.0})


def test_te_int8_depth_check_runs_and_the_error_grows_with_depth():
    shallow, deep = (te_int8_depth.int8_error(n, 128, 16) for n in (4, 8))
    assert 0 < shallow < deep < 1
