"""Text encoder memory (library/text_encoder/quant.py): the auto decision by free VRAM, the errors, the Linear replacement on the
tiny Qwen3.5 model, the options of the trainer and the inference script; bitsandbytes on CUDA when present."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch
from torch import nn

from library.text_encoder import quant as te_quant
from library.errors import UserError
from library.text_encoder.quant import TextEncoderSizes, choose_plan

GIB = 2**30
CUDA = torch.device("cuda")
# the Qwen3.5-9B text encoder of MOSS-Image (bf16), as text_encoder_sizes() reports it for the bundled config
QWEN35_9B = TextEncoderSizes(linear_weights=6_912_212_992, linear_rows=1_425_408, linear_bytes=13_824_425_984,
                             other_bytes=2_048_943_232)


def tiny_qwen(seed: int = 0) -> nn.Module:
    from transformers import Qwen3_5TextConfig, Qwen3_5TextModel

    from library.moss_image.tiny_snapshot import TINY_TEXT_CONFIG

    torch.manual_seed(seed)
    model = Qwen3_5TextModel(Qwen3_5TextConfig(**{k: v for k, v in TINY_TEXT_CONFIG.items() if k != "model_type"}))
    model.requires_grad_(False)
    return model.eval()


@pytest.mark.parametrize(
    "free_gib, bnb, quant, device",
    [(23.0, True, "none", "cuda"), (18.5, False, "none", "cuda"), (15.0, True, "int8", "cuda"),
     (11.3, True, "int8", "cuda"), (10.0, True, "nf4", "cuda"), (7.0, True, "none", "cpu"),
     (15.0, False, "none", "cpu")],
)
def test_auto_tiers_by_free_vram(free_gib, bnb, quant, device):
    plan = choose_plan("auto", CUDA, QWEN35_9B, int(free_gib * GIB), bnb)
    assert (plan.quant, plan.device.type) == (quant, device), plan.reason


def test_documented_thresholds_match_the_estimate():
    need = {q: QWEN35_9B.needed_bytes(q) / GIB for q in ("none", "int8", "nf4")}
    assert need == pytest.approx({"none": 18.26, "int8": 11.19, "nf4": 7.75}, abs=0.01)
    assert "bf16 >= 18.3 GiB free, int8 >= 11.2 GiB, nf4 >= 7.8 GiB" in " ".join(te_quant.__doc__.split())


def test_auto_keeps_the_weights_when_trained_prequantised_or_without_cuda():
    assert choose_plan("auto", CUDA, QWEN35_9B, 4 * GIB, True, frozen=False).quant == "none"
    assert choose_plan("auto", CUDA, QWEN35_9B, 4 * GIB, True, prequantised=True).device.type == "cuda"
    plan = choose_plan("auto", torch.device("cpu"), QWEN35_9B, None, False)
    assert (plan.quant, plan.device.type, plan.reason) == ("none", "cpu", "no CUDA device")
    assert choose_plan("none", CUDA, None, None, False, te_cpu=True).device.type == "cpu"


@pytest.mark.parametrize(
    "mode, device, bnb, prequantised, message",
    [("int8", "cpu", True, False, "--te_quant int8 needs a CUDA GPU"),
     ("nf4", "cuda", False, False, "needs the 'bitsandbytes' package"),
     ("int8", "cuda", True, True, "cannot quantise a ConvRot INT8 text encoder")],
)
def test_explicit_quantisation_errors(mode, device, bnb, prequantised, message):
    with pytest.raises(UserError, match=message):
        choose_plan(mode, torch.device(device), None, None, bnb, prequantised=prequantised)


def test_auto_without_cuda_falls_back_to_cpu_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = tiny_qwen()
    with caplog.at_level(logging.WARNING):
        plan = te_quant.prepare_text_encoder(model, "auto", "cuda")
    assert plan.device.type == "cpu" and "runs on the CPU" in caplog.text
    with pytest.raises(UserError, match="needs a CUDA GPU"):
        te_quant.prepare_text_encoder(model, "nf4", "cuda")


@pytest.mark.parametrize("quant, cls", [("int8", "Linear8bitLt"), ("nf4", "Linear4bit")])
def test_linear_layers_replaced_without_copy(quant, cls):
    pytest.importorskip("bitsandbytes")
    model = tiny_qwen().to(torch.bfloat16)
    weight = model.layers[3].self_attn.q_proj.weight.data
    expected = {name for name, _ in te_quant.quantisable_linears(model)}
    assert te_quant.quantise_linear_layers(model, quant) == len(expected) == 25  # 4 layers, GDN gates kept
    replaced = {n for n, m in model.named_modules() if type(m).__name__ == cls}
    assert replaced == expected
    assert type(model.layers[0].linear_attn.in_proj_a) is nn.Linear and type(model.embed_tokens) is nn.Embedding
    q = model.layers[3].self_attn.q_proj.weight
    assert q.data_ptr() == weight.data_ptr() and not q.requires_grad  # handed over; quantised on the move to CUDA


def test_size_estimate_of_the_tiny_model():
    model = tiny_qwen().to(torch.bfloat16)
    sizes = te_quant.text_encoder_sizes(model)
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert sizes.weight_bytes("none") == total
    assert sizes.weight_bytes("nf4") < sizes.weight_bytes("int8") < sizes.weight_bytes("none")


def memory_args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"te_quant": "none", "te_device": None, "text_encoder_cpu": False, **kw})


@pytest.mark.parametrize(
    "kw, trained, message",
    [(dict(te_quant="int8", te_device="cpu"), False, "runs on the GPU only"),
     (dict(te_quant="nf4", text_encoder_cpu=True), False, "runs on the GPU only"),
     (dict(te_quant="int8"), True, "is for a frozen text encoder"),
     (dict(te_device="cpu"), True, "cannot train a text encoder LoRA"),
     (dict(te_device="gpu", text_encoder_cpu=True), False, "contradict each other")],
)
def test_argument_conflicts(kw, trained, message):
    with pytest.raises(UserError, match=message):
        te_quant.check_text_encoder_memory_args(memory_args(**kw), trained)


def test_options_in_trainer_and_inference():
    import moss_image_minimal_inference as inference
    import moss_image_train_network as trainer

    args = trainer.setup_parser().parse_args(["--text_encoder_cpu", "--te_quant", "auto"])
    assert te_quant.te_on_cpu(args) and args.te_quant == "auto"
    assert trainer.setup_parser().parse_args([]).te_quant == "none"
    args = inference.setup_parser().parse_args(["--te_device", "cpu", "--te_quant", "none"])
    assert te_quant.te_on_cpu(args)
    args = inference.setup_parser().parse_args(["--prompt", "x", "--te_quant", "int8", "--text_encoder_cpu"])
    with pytest.raises(UserError, match="runs on the GPU only"):
        inference._check_args(args)
    assert te_quant.loading_device("auto", False, CUDA).type == "cpu"
    assert te_quant.loading_device("none", False, CUDA).type == "cuda"


# ---------------------------------------------------------------------------------------------------- CUDA + bnb
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("quant, tolerance", [("int8", 0.05), ("nf4", 0.25)])
def test_bitsandbytes_on_cuda_close_to_bf16_and_moves_back(quant, tolerance):
    pytest.importorskip("bitsandbytes")
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(0))
    ref = tiny_qwen().to(torch.bfloat16).to("cuda")
    with torch.no_grad():
        expected = ref(input_ids=ids.cuda(), use_cache=False).last_hidden_state.float()
    del ref
    model = tiny_qwen().to(torch.bfloat16)
    plan = te_quant.prepare_text_encoder(model, quant, "cuda")
    model.to(plan.device)
    assert str(model.layers[3].mlp.up_proj.weight.dtype) == ("torch.int8" if quant == "int8" else "torch.uint8")
    for _ in range(2):  # the trainer moves the encoder back to the CPU after caching, and to the GPU again later
        with torch.no_grad():
            out = model(input_ids=ids.cuda(), use_cache=False).last_hidden_state.float()
        rel = ((out - expected).norm() / expected.norm()).item()
        assert rel < tolerance, rel
        model.to("cpu")
        model.to("cuda")
