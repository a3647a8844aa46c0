"""bench.epilogue_gemm: the CPU-safe parts (the inputs it builds, and its refusal without a GPU)."""

from __future__ import annotations

import torch

from bench import epilogue_gemm


def test_inputs_have_the_dit_shapes_and_the_script_needs_a_gpu(capsys, monkeypatch):
    t = epilogue_gemm._inputs(96, 64, "cpu")
    assert t["x_q"].shape == (epilogue_gemm.M, 64) and t["x_q"].dtype == torch.int8
    assert t["weight"].shape == (96, 64) and t["residual"].shape == (1, epilogue_gemm.M, 96)
    assert t["cos"].shape == (1, epilogue_gemm.M, epilogue_gemm.HEAD // 2) and t["cos"].dtype == torch.float32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert epilogue_gemm.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
