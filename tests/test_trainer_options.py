"""Trainer options: the allocator switch and the compile options (--compile_fullgraph with ConvRot INT8)."""

from __future__ import annotations

import os

import numpy as np


def test_expandable_segments_option_sets_the_running_allocator(monkeypatch):
    """torch reads PYTORCH_CUDA_ALLOC_CONF when its allocator settings are first used, which may be before the option
    is read (on the H200 the variable set at run time had no effect, docs/benchmarks.md): the option tells the running
    allocator, and sets the variable for child processes."""
    import torch

    from library.runtime.compile import enable_expandable_segments
    from moss_image_train_network import setup_parser

    assert "--cuda_expandable_segments" in setup_parser().format_help()
    told: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", told.append, raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    enable_expandable_segments()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert told == ["expandable_segments:True"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    enable_expandable_segments()  # the user's own setting wins
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128" and told == ["expandable_segments:True"]
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")  # torch's newer name wins as well
    enable_expandable_segments()
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and told == ["expandable_segments:True"]


def test_fullgraph_compile_with_convrot_int8_trains(tiny_snapshot, tmp_path):
    """The int8 Linear is a registered op, so an INT8 block traces as one graph: --compile_fullgraph trains with
    --convrot_int8 and with a pre-quantised file (a graph break would be an error under fullgraph)."""
    from library.files.safetensors_io import load_safetensors
    from library.quant.convrot import is_convrot_int8_model
    from tests.test_trainer import base_args, make_toy_dataset, train

    data = make_toy_dataset(tmp_path / "data", n=2)
    int8_file = tiny_snapshot / "moss_image_base_int8_convrot.safetensors"
    for i, extra in enumerate((["--convrot_int8"], ["--pretrained_model_name_or_path", str(int8_file)])):
        out = tmp_path / f"out{i}"
        run = train(base_args(tiny_snapshot, data, out, "--max_train_steps", "2", "--learning_rate", "1e-2",
                              "--compile", "--compile_fullgraph", "--compile_backend", "eager", *extra))
        assert is_convrot_int8_model(run.unet)
        assert run.loss_history and all(np.isfinite(run.loss_history))
        up = [v for k, v in load_safetensors(out / "toy.safetensors").items() if k.endswith("lora_up.weight")]
        assert up and all(u.abs().max() > 0 for u in up)  # the LoRA got gradients through the compiled int8 blocks
