"""bench.loading on the tiny snapshot (the CPU here): every phase runs, the new and old paths give the same models."""

from __future__ import annotations

import json

from bench import loading
from library.moss_image.tiny_snapshot import TINY_DIT_CONFIG


def test_tiny_run_writes_every_phase_and_the_paths_agree(tmp_path):
    out = tmp_path / "loading.json"
    assert loading.main(["--tiny", "--device", "cpu", "--no_fresh", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["page_cache_warm"]["bytes"] > 0
    for what in ("dit", "te"):
        for which in ("new", "old"):
            assert result["read_floor"][f"{what}_{which}_s"] >= 0
    assert result["lora"]["modules"] == TINY_DIT_CONFIG.num_layers * 6 and result["lora"]["rank"] == loading.LORA_RANK
    assert result["te_model_code_import_s"] >= 0
    for phase in ("te", "dit", "dit_cpu_home", "dit_lora", "dit_lora_cpu_home"):
        assert result[phase]["new_s"] > 0 and result[phase]["old_s"] > 0, phase
        assert result[phase]["equal"], (phase, result[phase])  # on the CPU both paths run the same math
        for which in ("new", "old"):  # two runs each (the order alternating), the best one's split
            runs = result[phase][f"{which}_runs_s"]
            assert len(runs) == 2 and result[phase][f"{which}_s"] == min(runs), (phase, which)
            assert result[phase][f"{which}_split"]["s"] == min(runs) and result[phase][f"{which}_split"]["sync_s"] >= 0
    for phase in ("dit_lora", "dit_lora_cpu_home"):  # every block Linear merged, on either path
        for which in ("new", "old"):
            assert result[phase][f"{which}_split"]["merge"]["merges"] == result["lora"]["modules"], (phase, which)
    assert not list(tmp_path.glob("*.safetensors"))  # the LoRA file was removed
