"""bench.infer_profile on the tiny snapshot (CPU, eager and compiled): the product's loading path, CFG steps timed,
the settings applied while the DiT compiles and restored after."""

from __future__ import annotations

import json

import pytest

from bench import infer_profile
from library.runtime import fused_compiled


@pytest.mark.parametrize("compiled", [False, True])
def test_infer_profile_times_cfg_steps_on_the_tiny_snapshot(tiny_snapshot, tmp_path, compiled):
    out = tmp_path / "p.json"
    argv = ["--snapshot", str(tiny_snapshot), "--out", str(out), "--image_size", "64", "64", "--steps", "2",
            "--warmup", "1", "--settings", "inference_codes=False", "--extra=--device cpu"]
    before = dict(fused_compiled._SETTINGS)
    assert infer_profile.main(argv + ([] if compiled else ["--no_compile"])) == 0
    res = json.loads(out.read_text())
    assert res["device"] == "cpu" and len(res["step_ms"]) == 2 and res["step_ms_median"] > 0
    assert res["tokens"] == {"image": 16, "cond_text": 32, "uncond_text": 8}
    assert res["compiled_settings"] == {"inference_codes": False} and "profile" not in res
    assert res["packed"]  # a CFG step as the sampler runs it: one pass over both texts
    assert fused_compiled._SETTINGS == before


def test_infer_profile_runs_the_two_passes_when_asked(tiny_snapshot, tmp_path):
    out = tmp_path / "p.json"
    argv = ["--snapshot", str(tiny_snapshot), "--out", str(out), "--image_size", "64", "64", "--steps", "1",
            "--warmup", "1", "--no_compile", "--unpacked", "--extra=--device cpu"]
    assert infer_profile.main(argv) == 0
    assert not json.loads(out.read_text())["packed"]


def test_settings_are_name_equals_true_or_false():
    assert infer_profile._settings("a=True, b=False") == {"a": True, "b": False}
    with pytest.raises(SystemExit, match="name=True or name=False"):
        infer_profile._settings("a=1")


@pytest.mark.parametrize("auto_gc", [False, True])
def test_sampler_images_run_the_scripts_denoising_loop(tiny_snapshot, tmp_path, auto_gc):
    import moss_image_minimal_inference as script

    out = tmp_path / "p.json"
    argv = ["--snapshot", str(tiny_snapshot), "--out", str(out), "--image_size", "64", "64", "--steps", "2",
            "--warmup", "1", "--no_compile", "--sampler_images", "2", "--sampler_steps", "3", "--extra=--device cpu"]
    assert infer_profile.main(argv + (["--auto_gc"] if auto_gc else [])) == 0
    res = json.loads(out.read_text())
    assert len(res["host_ms"]) == len(res["gc_passes"]) == 2 and res["step_mean_ms"] > 0
    sampler = res["sampler"]
    assert sampler["images"] == 2 and len(sampler["image_s"]) == len(sampler["ms_per_step"]) == 2
    assert sampler["collector"] == ("automatic" if auto_gc else "between steps")
    if not auto_gc:  # one young-generation pass after each step, none left to Python
        assert all(p.get("gen1", [0])[0] == 3 for p in sampler["gc_passes_per_image"])
    assert script.COLLECT_BETWEEN_STEPS  # restored
