"""bench/repeat_runs.py on the CPU: the tiny snapshot trained repeatedly in one process gives the same LoRA every time
(full and selective checkpointing alike), and the bench puts the eager switches back."""

from __future__ import annotations

import json

from bench import repeat_runs
from library.lora import eager_node
from library.runtime import fused_ops


def test_runs_in_one_process_give_the_same_lora(tmp_path):
    out = tmp_path / "repeat.json"
    assert repeat_runs.main(["--runs", "3", "--policies", "full,selective", "--lora_ops", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert [r["policy"] for r in payload["runs"]] == ["full", "selective", "full"]
    assert all(r["vs_last_run"] == 0.0 for r in payload["runs"]), payload["runs"]
    # each run's cached latents and text-encoder outputs (two images: at least a latent and an output each) and its
    # three losses, the same in every run
    assert all(r["cached_tensors"] >= 4 and r["cached_inputs_vs_last_run"] == 0.0 for r in payload["runs"])
    assert all(len(r["losses"]) == 3 and r["losses"] == payload["runs"][-1]["losses"] for r in payload["runs"])
    assert payload["one_node"] is False and payload["kernels"] is True and payload["direct_launch"] is True
    assert eager_node.one_node() and fused_ops._STATE["enabled"]


def test_refusals(tmp_path, capsys):
    assert repeat_runs.main(["--runs", "1", "--out", str(tmp_path / "x.json")]) == 2
    assert repeat_runs.main(["--policies", "offload", "--out", str(tmp_path / "x.json")]) == 2
    assert "--runs must be at least 2" in capsys.readouterr().err
