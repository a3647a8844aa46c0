"""bench/eager_block.py on fake tensors (the CPU mode): full-width operator counts and bytes, plain against fused and
against the fused kernels (stand-in launches)."""

from __future__ import annotations

import json

import pytest

from bench import eager_block
from library.moss_image.dit import MossImageConfig
from library.planning import memory_model, sizes
from library.runtime import fused_ops

HAVE_TRITON = fused_ops._kernels() is not None


def test_fake_counts_with_and_without_the_lora_group(tmp_path):
    """q, k and v's LoRA as one node against a node each: six products and the two adds of the block input's three
    gradients fewer per block."""
    runs = {}
    for flag in ([], ["--lora_ungrouped"]):
        out = tmp_path / f"eager_block{len(flag)}.json"
        assert eager_block.main(["--device", "cpu", "--fake", "--layers", "1", "--tokens", "320", "--checkpointing",
                                 "none", *flag, "--out", str(out)]) == 0
        payload = json.loads(out.read_text())
        runs[payload["lora_grouped"]] = payload["runs"]["bf16_none"]["fused"]["ops"]
    assert runs[False]["count"]["matmul"] - runs[True]["count"]["matmul"] == 6
    assert runs[False]["other_ops"]["add"] - runs[True]["other_ops"].get("add", 0) == 2
    assert runs[False]["bytes"]["matmul"] > runs[True]["bytes"]["matmul"]


def test_fake_counts_at_full_width(tmp_path):
    out = tmp_path / "eager_block.json"
    assert eager_block.main(["--device", "cpu", "--fake", "--layers", "1", "--tokens", "320",
                             "--checkpointing", "none,full", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == {"bf16_none", "bf16_full"}
    for mode, run in runs.items():
        summary = run["summary"]
        # fewer element-wise operators and fewer bytes through them, the same matrix products and attention calls
        assert summary["other_ops_fused"] < summary["other_ops_plain"], mode
        assert summary["other_gb_fused"] < 0.8 * summary["other_gb_plain"], mode
        plain, fused = run["plain"]["ops"]["count"], run["fused"]["ops"]["count"]
        # the same attention calls and matrix products: q, k and v's LoRA is one down-projection in both forms (the
        # eager LoRAGroup node, and the plain forms' group of library.lora.compiled_group, what a compiled block
        # computes)
        assert plain["attention"] == fused["attention"], mode
        assert plain["matmul"] == fused["matmul"], mode
        assert "train_ms" not in run["plain"]  # fake tensors: nothing to time
        if not HAVE_TRITON:  # no kernels form without Triton
            assert "kernels" not in run, mode
            continue
        # the kernels form (stand-in launches on fake tensors): the norms, q/k norm + RoPE, SwiGLU and the gated
        # residuals leave the aten operators
        kernels = summary["kernel_launches"]
        # 2 norms, q, k, FFN, 2 residuals; forward, backward, recompute
        assert kernels == (14 if mode == "bf16_none" else 21), mode
        assert summary["other_ops_kernels"] < summary["other_ops_fused"] - 3 * kernels, mode
        assert summary["other_gb_kernels"] + summary["kernel_gb"] < 0.6 * summary["other_gb_fused"], mode
        assert run["kernels"]["ops"]["count"]["matmul"] == fused["matmul"], mode
    # checkpointing recomputes the forward: more element-wise work than without
    assert runs["bf16_full"]["summary"]["other_ops_plain"] > runs["bf16_none"]["summary"]["other_ops_plain"]
    # what autograd keeps is the planner's per-block figure (fp32 norm inputs: the CPU's rms_norm is a composite),
    # the weights not counted; the block's per-sample tensors add a little at this short sequence
    planned = memory_model.block_kept_bytes_per_token(sizes.dit_sizes(MossImageConfig()), e=2, rank=16)
    for form in ("plain", "fused"):
        assert runs["bf16_none"][form]["saved_bytes_per_block_token"] == pytest.approx(planned, rel=0.06), form
    # the kernels keep their bf16 inputs (no fp32 norm copies, no complex RoPE input, no silu(gate)): the planner's
    # figure for eager CUDA runs with the kernels
    if HAVE_TRITON:
        with_kernels = memory_model.block_kept_bytes_per_token(sizes.dit_sizes(MossImageConfig()), e=2, rank=16,
                                                               norm_bytes=2, fused_swiglu=True)
        assert runs["bf16_none"]["kernels"]["saved_bytes_per_block_token"] == pytest.approx(with_kernels, rel=0.06)
