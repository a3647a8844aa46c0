"""library/text_encoder as a whole on the tiny snapshot: the one loader (its dtype rule, where the model runs, its
cache variant, the run's RNG), the variant names, the same numbers from the trainer, the inference script and the
cache tool, and sample prompts encoded where the encoder runs (--te_device cpu)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

import moss_image_minimal_inference as inference
from library.caching.strategies import load_npz
from library.text_encoder.encoding import encode_captions
from library.text_encoder.loading import (
    TEXT_ENCODER_DTYPE,
    TextEncoderOptions,
    load_text_encoder,
    predict_text_encoder_variant,
)
from library.text_encoder.qwen35 import load_tokenizer
from library.text_encoder.variant import WEIGHTS_VARIANTS, cache_variant, variant_dtype
from library.training.sample_images import _text_outputs
from tests.test_cache_tools import dataset, tool_args
from tools import cache_text_encoder_outputs as te_tool

INT8_TE = "text_encoder_int8/qwen3.5_9b_int8_convrot.safetensors"


def options(path, **kw) -> TextEncoderOptions:
    return TextEncoderOptions(path=path, **kw)


@pytest.mark.parametrize("convrot, path, variant", [(False, "text_encoder", "none"),
                                                    (True, "text_encoder", "convrot_int8"),
                                                    (False, INT8_TE, "convrot_int8")])
def test_the_loader_runs_bf16_on_the_cpu_and_says_so(tiny_snapshot, convrot, path, variant):
    opts = options(tiny_snapshot / path, convrot_int8=convrot)
    rng = torch.get_rng_state()
    loaded = load_text_encoder(opts, "cpu")
    assert torch.equal(torch.get_rng_state(), rng)  # reading it leaves the run's randomness alone
    assert (loaded.device.type, loaded.dtype, loaded.variant) == ("cpu", torch.bfloat16, variant)
    assert loaded.convrot_int8 == (variant == "convrot_int8")
    floats = [p for p in loaded.model.parameters() if p.is_floating_point()]
    assert floats and all(p.dtype == TEXT_ENCODER_DTYPE and p.device.type == "cpu" for p in floats)
    assert not any(p.requires_grad for p in loaded.model.parameters()) and not loaded.model.training
    assert predict_text_encoder_variant(opts, "cpu") == loaded.variant


def test_cuda_without_a_gpu_and_te_device_cpu_run_on_the_cpu(tiny_snapshot):
    loaded = load_text_encoder(options(tiny_snapshot, on_cpu=True), "cuda")
    assert loaded.device.type == "cpu" and loaded.placed() is loaded.model
    assert next(loaded.model.parameters()).device.type == "cpu"
    if not torch.cuda.is_available():
        assert load_text_encoder(options(tiny_snapshot), "cuda").device.type == "cpu"


def test_options_from_each_script_command_line(tiny_snapshot):
    import moss_image_train_network as trainer

    train_args = trainer.setup_parser().parse_args(["--text_encoder", "te", "--text_encoder_cpu",
                                                    "--convrot_int8_text_encoder", "--convrot_int8_bwd", "int8"])
    assert TextEncoderOptions.from_args(train_args) == TextEncoderOptions("te", "none", True, True, "int8", False)
    inf_args = inference.setup_parser().parse_args(["--text_encoder", "te", "--te_quant", "auto",
                                                    "--disable_mmap_load_safetensors"])
    assert TextEncoderOptions.from_args(inf_args) == TextEncoderOptions("te", "auto", False, False, "bf16", True)
    tool_ns = te_tool.setup_parser().parse_args(["--text_encoder", "te", "--te_device", "cpu"])
    assert TextEncoderOptions.from_args(tool_ns) == TextEncoderOptions("te", on_cpu=True)


def test_variant_names_keep_the_bf16_names_and_name_other_dtypes():
    assert cache_variant("none", torch.bfloat16) == "none" and cache_variant("convrot_int8", "bf16") == "convrot_int8"
    assert cache_variant("none", torch.float32) == "none_fp32"
    for weights in WEIGHTS_VARIANTS:
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            name = cache_variant(weights, dtype)
            assert variant_dtype(name) == {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}[dtype]
    assert variant_dtype("unknown") == "bf16"


def test_the_three_scripts_give_the_same_numbers(tiny_snapshot, tmp_path):
    """A cache file of the tool is what the inference script (and the trainer, which reads the tool's files as
    valid: tests/test_cache_tools.py) computes for the same caption, to the bit."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    cfg = dataset(tmp_path)
    assert te_tool.run(tool_args(tiny_snapshot, cfg, "--cache_text_encoder_outputs_to_disk")).encoded == 4
    cached = load_npz(tmp_path / "data" / "4_toy" / "img1_moss_te.npz")
    assert (str(cached["encoder"]), str(cached["encoder_dtype"])) == ("none", "bf16")
    args = inference.setup_parser().parse_args(["--snapshot", str(tiny_snapshot), "--prompt", "x"])
    inference._resolve_paths(args)
    te, tokenizer = inference.load_text_encoder_for(args, torch.device("cpu"))
    caption = str(cached["caption_0"])
    outputs = inference.encode_texts(args, te, tokenizer, [caption, ""])
    assert torch.equal(outputs[caption][0].float(), torch.from_numpy(cached["prompt_embeds_0"]))
    assert torch.equal(outputs[""][0].float(), torch.from_numpy(cached["uncond_embeds"]))


def test_sample_prompts_are_encoded_where_the_encoder_runs(tiny_snapshot):
    """--te_device cpu: the encoder stays on the CPU even though the run's device is another (here 'meta', which
    would leave no numbers at all)."""
    loaded = load_text_encoder(options(tiny_snapshot, on_cpu=True), "cpu")
    tokenizer = load_tokenizer(text_encoder_path=str(tiny_snapshot / "text_encoder"))
    trainer = SimpleNamespace(sample_prompts_te_outputs={"cached": "kept"}, te_device=loaded.device,
                              tokenizer=tokenizer, is_train_text_encoder=lambda args: False)
    run = SimpleNamespace(text_encoders=[loaded.model], accelerator=SimpleNamespace(device=torch.device("meta")),
                          args=argparse.Namespace(moss_max_token_length=4096, sample_prompts="prompts.txt"))
    outputs = _text_outputs(trainer, run, ["cached", "a red square"])
    expected = encode_captions(loaded.model, tokenizer, ["a red square"])[0][0]
    assert outputs["cached"] == "kept" and outputs["a red square"][0].device.type == "cpu"
    assert torch.equal(outputs["a red square"][0], expected)
    assert next(loaded.model.parameters()).device.type == "cpu"
