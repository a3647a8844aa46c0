"""bench/plan_verify.py in its --tiny CPU mode: the snapshot, the data with cached latents, one child process per
budget (a budget too small for the plan, one that trains), and the JSON report."""

from __future__ import annotations

import json

from bench import plan_verify


def test_plan_verify_tiny_runs(tmp_path):
    out = tmp_path / "out"
    assert plan_verify.main(["--tiny", "--root", str(tmp_path / "work"), "--out", str(out), "--budgets", "1,8",
                             "--steps", "2", "--images", "1"]) == 0
    report = json.loads((out / "plan_verify.json").read_text())
    too_small, trained = report["runs"]
    assert too_small["budget_gib"] == 1 and too_small["returncode"] == 2
    assert too_small["error"].startswith("--vram_budget 1 GiB is too small for this run")
    assert trained["returncode"] == 0 and trained["error"] is None and not trained["oom"]
    assert len(trained["steps_s"]) == 2 and trained["step_median_s"] > 0
    plan = trained["plan"]
    assert plan["chosen"] == "bf16, no checkpointing" and plan["predicted_reserved_gib"] > 0
    assert plan["lines"][0].startswith("VRAM plan for --vram_budget 8 GiB: training at 64x64")
    assert (tmp_path / "work" / "runs" / "budget_8" / "out" / "pv.safetensors").is_file()  # the LoRA was saved
    assert "measured_max_reserved_gib" not in trained  # nothing to measure on the CPU
