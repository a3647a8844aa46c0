"""bench/grad_compare.py --tiny: two checkpointing configurations run the trainer's steps in their own processes and
are compared step by step; on the CPU (fp32) eager and compiled full checkpointing give the same gradients."""

from __future__ import annotations

import json

from bench import grad_compare


def test_tiny_grad_compare_finds_the_same_gradients(tiny_snapshot, tmp_path):
    out = tmp_path / "grads.json"
    argv = ["--tiny", "--snapshot", str(tiny_snapshot), "--configs", "gc_full_eager,gc_full_compile",
            "--steps", "2", "--out", str(out)]
    assert grad_compare.main(argv) == 0
    payload = json.loads(out.read_text())
    assert payload["reference"] == "gc_full_eager" and payload["device"] == "cpu"
    ref, other = payload["results"]
    assert "error" not in ref and "error" not in other, payload
    assert len(ref["losses"]) == 2 and len(other["steps"]) == 2
    for row in other["steps"]:
        assert row["grad_rel_diff"] < 1e-5 and row["worst"], row
    assert max(abs(d) for d in other["loss_diff"]) < 1e-5
    assert other["same_host_rng_before_step"] == [True, True]  # the same timesteps
    assert ref["host_rng_before_step"][0] != ref["host_rng_before_step"][1]  # the step draws them there


def test_grad_compare_needs_two_known_configurations(capsys):
    assert grad_compare.main(["--tiny", "--configs", "gc_full_eager"]) == 2
    assert grad_compare.main(["--tiny", "--configs", "gc_full_eager,nope"]) == 2
    assert "unknown: ['nope']" in capsys.readouterr().err
