"""bench/checkpointing.py --tiny: the trainer's step per checkpointing configuration runs on the CPU and writes its
JSON (the GPU figures come from the same code on the full-size snapshot)."""

from __future__ import annotations

import json

from bench import checkpointing as bench
from library.runtime import fused_ops


def test_tiny_bench_runs_the_trainer_step_per_configuration(tiny_snapshot, tmp_path):
    out = tmp_path / "tiny.json"
    names = ["gc_full_eager", "gc_selective_eager", "gc_full_compile", "swap20_h2d_selective_compile",
             "gc_full_eager_no_kernels"]
    argv = ["--tiny", "--snapshot", str(tiny_snapshot), "--configs", ",".join(names), "--steps", "2", "--warmup", "1",
            "--host_profile"]
    assert bench.main([*argv, "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["image"] == 64 and payload["device"] == "cpu"
    results = {r["config"]: r for r in payload["results"]}
    assert list(results) == names
    assert results["swap20_h2d_selective_compile"]["skipped"] == "block swap needs a CUDA device"
    for name in names[:3]:
        r = results[name]
        assert r["ok"] and len(r["step_ms"]) == 2 and r["step_ms_median"] > 0 and len(r["losses"]) == 3
        assert r["checkpointing"] == "plain" and r["policy"] == ("selective" if "selective" in name else "full")
    # the same inputs, noise and initial LoRA in every configuration: the same losses (fp32 on the CPU)
    ref = results["gc_full_compile"]["losses"]
    for name in ("gc_full_eager", "gc_selective_eager", "gc_full_eager_no_kernels"):
        assert results[name]["max_rel_loss_diff"] < 1e-6, results[name]["losses"]
    assert fused_ops._STATE["enabled"]  # `_no_kernels` turned the fused kernels off for its own run only
    # --host_profile: cProfile of 3 steps names the trainer's step among the functions with the most total time
    host = results["gc_full_eager"]["host_profile"]
    assert host["steps"] == 3 and host["wall_ms_per_call"] > 0
    assert any("_run_epoch" in row["where"] and row["calls"] == 1 for row in host["by_total_time"]), host
    assert all(v > 0 for v in ref) and results["gc_full_compile"]["dynamo_stats"]["unique_graphs"] >= 1


def test_bench_variants_switch_the_lora_node_for_their_own_run():
    from library.lora import eager_node

    with bench.bench_variant("gc_full_eager_lora_copies"):
        assert eager_node.one_node() and not eager_node.in_place()
    with bench.bench_variant("no_gc_eager_int8_lora_ungrouped"):
        assert eager_node.in_place() and not eager_node.grouped()
    with bench.bench_variant("no_gc_eager_lora_ops"):
        assert not eager_node.one_node() and eager_node.in_place()
    assert eager_node.one_node() and eager_node.in_place() and eager_node.grouped()
    assert {"no_gc_eager_lora_copies", "gc_full_eager_int8_lora_copies", "gc_full_eager_lora_ungrouped"} <= set(
        bench.CONFIGS)


def test_block_memory_reads_the_growth_of_each_main_block(monkeypatch):
    """--block_memory: the allocated memory each main block's forward leaves behind, from the eager block loop; the
    text refiner's blocks are not listed and the DiT's own `_run_block` is back afterwards."""
    import torch

    allocated = [0]
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: allocated[0])

    class FakeDit:
        def __init__(self):
            self.layers = ["block0", "block1"]

        def _run_block(self, block, x, *args):
            allocated[0] += {"block0": 3 * 2**20, "block1": 2**19, "refiner": 2**20}[block]
            return x

        def forward(self):
            for block in ("refiner", *self.layers):
                self._run_block(block, None)

    dit = FakeDit()
    assert bench.block_memory(dit, dit.forward) == [3.0, 0.5]
    assert "_run_block" not in vars(dit)


def test_host_columns_say_where_the_gpu_waited_for_the_host():
    """gpu_lag_ms: the GPU's time to each boundary less the host's. Boundary 1: the host took 100 ms, the GPU 100 ms
    (the GPU kept pace with the host: lag 0, it waited); boundary 2: the host queued the next step in 50 ms while the
    GPU took 100 ms (the host 50 ms ahead)."""
    S = bench.HostSample
    host = [S(10.0, 0, 1.0, 3, 7, 2.0, 5.0), S(10.1, 2, 1.09, 3, 7, 2.25, 5.0), S(10.15, 2, 1.13, 5, 9, 2.3, 5.01)]
    cols = bench.host_columns(host, [100.0, 100.0], cuda=True)
    assert cols["host_step_ms"] == [100.0, 50.0] and cols["host_cpu_ms"] == [90.0, 40.0]
    assert cols["involuntary_switches_per_step"] == [0, 2] and cols["device_allocs_per_step"] == [0, 2]
    assert cols["process_cpu_ms"] == [250.0, 50.0] and cols["steal_ms"] == [0.0, 10.0]
    assert cols["tma_encodes_per_step"] == [2, 0] and cols["gpu_lag_ms"] == [0.0, 50.0]
    assert "gpu_lag_ms" not in bench.host_columns(host, [100.0, 100.0], cuda=False)


def test_the_trainer_stacks_q_k_and_v_without_checkpointing_and_the_three_qkv_variant_does_not(
        tiny_snapshot, tmp_path, stacked_forward_calls):
    """By default the trainer stacks ConvRot INT8 q, k and v before compiling (`prepare_unet`, --compile without
    --gradient_checkpointing) and the LoRA group takes their base products as one; `_three_qkv` runs three, to the
    first loss within float rounding; with checkpointing nothing is stacked; the setting is on again after the
    runs."""
    from library.runtime import fused_compiled

    calls = stacked_forward_calls
    out = tmp_path / "tiny.json"
    argv = ["--tiny", "--snapshot", str(tiny_snapshot), "--steps", "2", "--warmup", "1"]
    assert bench.main([*argv, "--configs", "gc_full_compile_int8", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["results"][0]["ok"] and calls["n"] == 0
    names = ["no_gc_compile_int8_three_qkv", "no_gc_compile_int8"]
    assert bench.main([*argv, "--configs", ",".join(names), "--out", str(out)]) == 0
    results = {r["config"]: r for r in json.loads(out.read_text())["results"]}
    assert all(results[n]["ok"] for n in names), results
    assert calls["n"] > 0 and fused_compiled.stacked_qkv_training_on()
    base, stacked = results[names[0]]["losses"], results[names[1]]["losses"]
    assert len(base) == len(stacked) == 3
    # the first step's loss agrees to float rounding; later ones follow updates from input gradients summed in
    # another order (one product's sums where three products' were added), which later steps' int8 codes amplify
    assert abs(base[0] - stacked[0]) <= 1e-6 * abs(base[0]), (base, stacked)
    assert all(abs(a - b) <= 1e-3 * abs(a) for a, b in zip(base, stacked)), (base, stacked)
