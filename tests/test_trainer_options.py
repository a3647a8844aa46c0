"""Trainer options checked without a training run: the allocator switch and the compile checks."""

from __future__ import annotations

import os

import numpy as np
from PIL import Image


def test_expandable_segments_option_sets_the_allocator_config(monkeypatch):
    from library.runtime.compile import enable_expandable_segments
    from moss_image_train_network import setup_parser

    assert "--cuda_expandable_segments" in setup_parser().format_help()
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    enable_expandable_segments()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    enable_expandable_segments()  # the user's own setting wins
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"


def test_fullgraph_compile_with_convrot_int8_is_refused(tiny_snapshot, tmp_path, caplog):
    import moss_image_train_network as m

    data = tmp_path / "data" / "1_toy"
    data.mkdir(parents=True)
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(data / "a.png")
    (data / "a.txt").write_text("a toy")
    common = ["--snapshot", str(tiny_snapshot), "--train_data_dir", str(data.parent), "--resolution", "32",
              "--output_dir", str(tmp_path / "o"), "--network_module", "networks.lora_generic",
              "--compile", "--compile_fullgraph", "--compile_backend", "eager"]
    assert m.main([*common, "--convrot_int8"]) == 2  # refused before anything is loaded
    assert "--compile_fullgraph cannot be used with a ConvRot INT8 DiT" in caplog.text
    caplog.clear()
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # this run gets as far as the accelerator
    int8_file = tiny_snapshot / "moss_image_base_int8_convrot.safetensors"  # detected at load, refused there
    assert m.main([*common, "--pretrained_model_name_or_path", str(int8_file), "--max_train_steps", "1"]) == 2
    assert "--compile_fullgraph cannot be used with a ConvRot INT8 DiT" in caplog.text
