"""ConvRot INT8 through the real loaders and scripts on the tiny snapshot: quantise-at-load equals the ComfyUI
pre-quantised files bit for bit, LoRA merge rules, trainer and inference wiring, metadata."""

from __future__ import annotations

import pytest
import torch

from library.errors import UserError
from library.files.safetensors_io import load_safetensors, read_metadata, save_file_atomic
from library.moss_image.loaders import load_moss_image_model
from library.quant.convrot import ConvRotInt8Embedding, ConvRotInt8Linear, is_convrot_int8_model
from library.text_encoder.qwen35 import load_qwen35_text_model

INT8_DIT = "moss_image_base_int8_convrot.safetensors"
INT8_TE = "text_encoder_int8/qwen3.5_9b_int8_convrot.safetensors"


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, 128, 4, 4, generator=g), torch.tensor([500.0]), torch.randn(1, 6, 64, generator=g)


def test_dit_quantised_at_load_equals_the_comfy_int8_file(tiny_snapshot):
    dynamic = load_moss_image_model("cpu", tiny_snapshot, dtype=torch.float32, convrot_int8=True)
    comfy = load_moss_image_model("cpu", tiny_snapshot / INT8_DIT, dtype=torch.float32)
    base = load_moss_image_model("cpu", tiny_snapshot, dtype=torch.float32)
    assert is_convrot_int8_model(dynamic) and is_convrot_int8_model(comfy) and not is_convrot_int8_model(base)
    int8 = [n for n, m in dynamic.named_modules() if isinstance(m, ConvRotInt8Linear)]
    assert len(int8) == 24 * 6 and all(n.startswith("layers.") for n in int8)  # refiners, embedders stay float
    a, b = dynamic.state_dict(), comfy.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bit for bit
    x, t, e = _inputs()
    with torch.no_grad():
        yq, yb = dynamic(x, t, e), base(x, t, e)
    rel = ((yq - yb).norm() / yb.norm()).item()
    assert 0 < rel < 0.1, rel


def test_dtype_cast_keeps_int8_codes_and_fp32_scales(tiny_snapshot):
    model = load_moss_image_model("cpu", tiny_snapshot / INT8_DIT, dtype=torch.bfloat16)
    model.to(torch.bfloat16)
    layer = model.layers[0].proj.q
    assert layer.weight.dtype == torch.int8 and layer.weight_scale.dtype == torch.float32
    assert model.dtype == torch.bfloat16  # activations follow a float weight, never the int8 one
    x, t, e = _inputs()
    with torch.no_grad():
        assert torch.isfinite(model(x.bfloat16(), t, e.bfloat16())).all()


def test_text_encoder_quantised_at_load_equals_the_comfy_file(tiny_snapshot):
    dynamic = load_qwen35_text_model(tiny_snapshot / "text_encoder", dtype=torch.float32, convrot_int8=True)
    comfy = load_qwen35_text_model(tiny_snapshot / INT8_TE, dtype=torch.float32)
    base = load_qwen35_text_model(tiny_snapshot / "text_encoder", dtype=torch.float32)
    assert isinstance(dynamic.embed_tokens, ConvRotInt8Embedding)
    linears = [n for n, m in dynamic.named_modules() if isinstance(m, ConvRotInt8Linear)]
    assert len(linears) == 3 * 6 + 1 * 7  # GDN: qkv, z, out + MLP 3; full attention: q, k, v, o + MLP 3
    assert not any("in_proj_a" in n or "in_proj_b" in n for n in linears)
    ids = torch.tensor([[1, 5, 6, 7, 8, 2, 201]])
    with torch.no_grad():
        h1, h2, hb = (m(input_ids=ids).last_hidden_state for m in (dynamic, comfy, base))
    assert torch.equal(h1, h2)
    assert torch.nn.functional.cosine_similarity(h1.flatten(), hb.flatten(), dim=0) > 0.99


def test_lora_merge_into_a_prequantised_file_is_refused(tiny_snapshot):
    with pytest.raises(UserError, match="use the bf16 checkpoint with --convrot_int8"):
        load_moss_image_model("cpu", tiny_snapshot / INT8_DIT, tensor_hook=lambda k, t: t)
    with pytest.raises(UserError, match="--convrot_int8_text_encoder"):
        load_qwen35_text_model(tiny_snapshot / INT8_TE, tensor_hook=lambda k, t: t)


def test_w4a8_and_gptq_files_are_refused_naming_the_format(tiny_snapshot, tmp_path):
    sd = load_safetensors(tiny_snapshot / INT8_DIT)
    w4a8 = dict(sd, **{"layers.0.proj.o.weight_s_rel": torch.zeros(1)})
    save_file_atomic(w4a8, tmp_path / "w4a8.safetensors")
    with pytest.raises(UserError, match="W4A8"):
        load_moss_image_model("cpu", tmp_path / "w4a8.safetensors")
    gptq = dict(sd, **{"layers.0.proj.o.qweight": torch.zeros(1, dtype=torch.int32)})
    save_file_atomic(gptq, tmp_path / "gptq.safetensors")
    with pytest.raises(UserError, match="GPTQ"):
        load_moss_image_model("cpu", tmp_path / "gptq.safetensors")


def test_trainer_with_convrot_int8_records_it(tiny_snapshot, tmp_path):
    from tests.test_trainer import base_args, make_toy_dataset, train

    data = make_toy_dataset(tmp_path / "data", n=2)
    out = tmp_path / "out"
    run = train(base_args(tiny_snapshot, data, out, "--max_train_steps", "2", "--learning_rate", "1e-2",
                          "--convrot_int8", "--gradient_checkpointing"))
    assert run.loss_history and all(torch.isfinite(torch.tensor(run.loss_history)))
    assert is_convrot_int8_model(run.unet)
    meta = read_metadata(out / "toy.safetensors")
    assert meta["ss_convrot_int8"] == "True" and meta["ss_convrot_int8_text_encoder"] == "False"
    up = [v for k, v in load_safetensors(out / "toy.safetensors").items() if k.endswith("lora_up.weight")]
    assert all(u.abs().max() > 0 for u in up)  # the LoRA on the int8 base got gradients

    argv = base_args(tiny_snapshot, data, tmp_path / "out2", "--max_train_steps", "1",
                     "--pretrained_model_name_or_path", str(tiny_snapshot / INT8_DIT),
                     "--text_encoder", str(tiny_snapshot / INT8_TE))
    train(argv)
    meta = read_metadata(tmp_path / "out2" / "toy.safetensors")
    assert meta["ss_convrot_int8"] == "True" and meta["ss_convrot_int8_text_encoder"] == "True"  # detected


def test_inference_merges_lora_before_quantising(tiny_snapshot, tmp_path):
    import moss_image_minimal_inference as inf
    from tests.test_inference import _latents, _run

    lora = tmp_path / "lora.safetensors"
    from library.moss_image.loaders import load_moss_image_model as load
    from networks import lora_generic

    net = lora_generic.create_network(1.0, 4, 4.0, None, [], load("cpu", tiny_snapshot, dtype=torch.float32))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, 0.3)
    net.save_weights(str(lora), torch.float32, None)
    base = _latents(_run(tiny_snapshot, tmp_path / "a", "--prompt", "x", "--output_type", "latent", "--convrot_int8",
                         "--convrot_int8_text_encoder"))[0]
    merged = _latents(_run(tiny_snapshot, tmp_path / "b", "--prompt", "x", "--output_type", "latent",
                           "--convrot_int8", "--lora_weight", str(lora)))[0]
    assert (merged - base).abs().max() > 1e-3
    argv = ["--snapshot", str(tiny_snapshot), "--dit", str(tiny_snapshot / INT8_DIT), "--prompt", "x",
            "--image_size", "32", "32", "--infer_steps", "1", "--save_path", str(tmp_path / "c"),
            "--lora_weight", str(lora)]
    assert inf.main(argv) == 2  # merging into the pre-quantised file: refused with the seed's sentence


def test_prequantised_text_encoder_runs_in_bf16_like_quantise_at_load(tiny_snapshot):
    # regression: the ComfyUI file built its int8 layers in the meta model's float32, so the embedding fed float32
    # into the bf16 layers left in float (in_proj_a/b) and a bf16 run failed
    comfy = load_qwen35_text_model(tiny_snapshot / INT8_TE, dtype=torch.bfloat16)
    dynamic = load_qwen35_text_model(tiny_snapshot / "text_encoder", dtype=torch.bfloat16, convrot_int8=True)
    assert comfy.embed_tokens.compute_dtype == torch.bfloat16
    ids = torch.tensor([[1, 5, 6, 7, 8, 2, 201]])
    with torch.no_grad():
        h1, h2 = (m(input_ids=ids).last_hidden_state for m in (comfy, dynamic))
    assert h1.dtype == torch.bfloat16 and torch.equal(h1, h2)
    comfy.train()  # the text encoder LoRA path: train mode, gradients enabled
    with torch.enable_grad():
        assert comfy(input_ids=ids).last_hidden_state.dtype == torch.bfloat16
