"""bench/eager_host.py on the CPU: the host time per block of an eager checkpointed step, bf16 and ConvRot INT8, both
checkpoint forms, runs and writes its JSON (the figures come from a CUDA GPU), and puts the trainer's switches back."""

from __future__ import annotations

import json

from bench import eager_host
from library.quant import linear_plan
from library.runtime import checkpointing


def test_eager_host_bench_runs_each_configuration_and_restores_the_switches(tmp_path):
    out = tmp_path / "eager_host.json"
    argv = ["--device", "cpu", "--layers", "1", "--width", "256", "--tokens", "260", "--iters", "2", "--warmup", "1",
            "--configs", "bf16,int8_nonreentrant,int8_unplanned", "--out", str(out)]
    assert eager_host.main(argv) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["config"] for r in results] == ["bf16", "int8_nonreentrant", "int8_unplanned"]
    for r in results:
        assert r["layers"] == 1 and len(r["forward_ms"]) == 2 and abs(r["step_us"] - r["forward_us"] - r["backward_us"]) < 0.2
        assert r["forward_us"] > 0 and r["backward_us"] > 0
    assert checkpointing.EAGER_FULL["reentrant"] and linear_plan._STATE["enabled"]
    assert eager_host.main(["--width", "200", "--device", "cpu", "--out", str(out)]) == 2


def test_the_op_profile_names_the_lora_node_and_counts_per_block(tmp_path):
    """`--ops N`: the host time by operator and by autograd node, per block; the LoRA-wrapped Linears show as one
    node each (`library.lora.eager_node.LoRALinear`), and q, k and v as one node for the three (`LoRAGroup`): three
    and one per block in backward."""
    out = tmp_path / "eager_host.json"
    argv = ["--device", "cpu", "--layers", "2", "--width", "256", "--tokens", "40", "--iters", "1", "--warmup", "1",
            "--configs", "bf16", "--ops", "2", "--out", str(out)]
    assert eager_host.main(argv) == 0
    (prof,) = json.loads(out.read_text())["op_profiles"]
    assert prof["config"] == "bf16" and prof["layers"] == 2 and prof["iters"] == 2
    assert prof["events_per_block"] > 0 and prof["self_us_per_block"] > 0
    nodes = {r["name"]: r for r in prof["autograd_nodes_by_total_time"]}
    assert nodes["LoRALinearBackward"]["calls_per_block"] == 3, nodes
    assert nodes["LoRAGroupBackward"]["calls_per_block"] == 1, nodes
