"""library.lora.merge (load-time merge, streaming plan, ConvRot refusal) and networks.convert_moss_image_lora."""

from __future__ import annotations

import logging

import pytest
import torch

from library.errors import UserError
from library.lora.merge import LoraMergePlan, load_lora_files, merge_into_module, merged_weight
from library.files.safetensors_io import TensorSource, load_safetensors, read_metadata, save_file_atomic
from networks import convert_moss_image_lora as conv
from networks.lora_generic import create_network
from tests.moss_lora_fakes import MossImage, quantize_blocks, tiny_qwen35


def dit(seed: int = 0) -> MossImage:
    torch.manual_seed(seed)
    return MossImage()


def trained_lora(seed: int, model: MossImage | None = None, te=None, dim: int = 4, alpha: float = 2.0, **kw):
    net = create_network(1.0, dim, alpha, None, [te] if te is not None else None, model or dit(), **kw)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return net


# ----------------------------------------------------------------------------------------------------------------------
# math


def test_merged_weight_formula_and_dtype():
    torch.manual_seed(0)
    w = torch.randn(6, 5).to(torch.bfloat16)
    d1, u1 = torch.randn(3, 5), torch.randn(6, 3)
    d2, u2 = torch.randn(2, 5).half(), torch.randn(6, 2).half()
    out = merged_weight(w, [(d1, u1, torch.tensor(6.0), 0.5), (d2, u2, None, -1.0)])
    expected = w.float() + 0.5 * (6.0 / 3) * (u1 @ d1) - 1.0 * (u2.float() @ d2.float())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected.bfloat16())
    w32 = torch.randn(6, 5)
    keep = w32.clone()
    merged_weight(w32, [(d1, u1, 1.0, 1.0)])
    assert torch.equal(w32, keep)  # never in place
    assert merged_weight(w, [(d1, u1, 1.0, 0.0)]) is w  # multiplier 0: the exact base weight
    with pytest.raises(UserError, match="does not fit"):
        merged_weight(torch.randn(7, 5), [(d1, u1, 1.0, 1.0)])


# ----------------------------------------------------------------------------------------------------------------------
# the streaming plan


def test_streaming_merge_matches_applied_lora(tmp_path):
    base = dit()
    ckpt = tmp_path / "dit.safetensors"
    save_file_atomic(base.state_dict(), ckpt)
    lora_a = trained_lora(1, train_text_embedder="true")
    lora_b = trained_lora(2, dim=2, alpha=1.0)
    plan = LoraMergePlan([(lora_a.state_dict(), 1.0), (lora_b.state_dict(), 0.5)], "lora_unet", ["a", "b"])
    assert len(plan) == 31

    merged = {}
    with TensorSource([ckpt]) as source:
        plan.check_checkpoint_keys(source.keys(), ckpt)
        for key in source.keys():
            merged[key] = plan.merge(key, source.get_tensor(key))
    assert plan.finish() == []
    target = dit(5)
    target.load_state_dict(merged)
    untouched = "video_embedder.weight"
    assert torch.equal(merged[untouched], base.state_dict()[untouched])

    reference = dit()  # both LoRAs applied as modules (B wraps A): the merged model must give the same output
    applied_a = create_network(1.0, 4, 2.0, None, None, reference, train_text_embedder="true")
    applied_a.load_state_dict(lora_a.state_dict())
    applied_b = create_network(0.5, 2, 1.0, None, None, reference)
    applied_b.load_state_dict(lora_b.state_dict())
    applied_a.apply_to(None, reference, False, True)
    applied_b.apply_to(None, reference, False, True)
    x, text = torch.randn(2, 4, 8), torch.randn(2, 2, 12)
    torch.testing.assert_close(target(x, text), reference(x, text), atol=1e-5, rtol=1e-5)


def test_unmatched_modules_are_reported(caplog):
    sd = dict(trained_lora(1).state_dict())
    sd["lora_unet_layers_9_proj_q.lora_down.weight"] = torch.zeros(4, 16)
    sd["lora_unet_layers_9_proj_q.lora_up.weight"] = torch.zeros(16, 4)
    sd["lora_unet_layers_9_proj_k.lora_down.weight"] = torch.zeros(4, 16)
    sd["lora_unet_layers_9_proj_k.lora_up.weight"] = torch.zeros(16, 4)
    plan = LoraMergePlan([(sd, 1.0)], "lora_unet")
    model = dit()
    assert merge_into_module(model, plan) == 18
    with caplog.at_level(logging.WARNING, logger="library.lora.merge"):
        missing = plan.finish()
    assert missing == ["lora_unet_layers_9_proj_k", "lora_unet_layers_9_proj_q"]
    assert "2 DiT LoRA modules matched no weight" in caplog.text and "layers_9_proj_k" in caplog.text


def test_prefixes_are_separated_and_text_encoder_merges():
    te = tiny_qwen35()
    net = trained_lora(3, te=te)
    sd = net.state_dict()
    unet_plan = LoraMergePlan([(sd, 1.0)], "lora_unet")
    te_plan = LoraMergePlan([(sd, 1.0)], "lora_te")
    assert len(unet_plan) == 18 and len(te_plan) == 13
    key = "layers.1.self_attn.q_proj.weight"
    assert te_plan.targets(key) and not unet_plan.targets(key)
    weight = te.state_dict()[key]
    lora = net.lora_te_layers_1_self_attn_q_proj
    expected = weight + (2.0 / 4) * lora.lora_up.weight.detach() @ lora.lora_down.weight.detach()
    torch.testing.assert_close(te_plan.merge(key, weight), expected)
    assert te_plan.merge("layers.1.self_attn.q_norm.weight", torch.ones(32)).equal(torch.ones(32))


def test_quantized_checkpoints_are_refused():
    sd = trained_lora(1).state_dict()
    plan = LoraMergePlan([(sd, 1.0)], "lora_unet")
    with pytest.raises(UserError, match=r"pre-quantized DiT checkpoint 'dit_int8.safetensors'.*--convrot_int8 "):
        plan.check_checkpoint_keys(["layers.0.proj.q.weight", "layers.0.proj.q.weight_scale"], "dit_int8.safetensors")
    with pytest.raises(UserError, match="int8"):
        plan.merge("layers.0.proj.q.weight", torch.zeros(16, 16, dtype=torch.int8))
    with pytest.raises(UserError, match="int8"):
        plan.check_checkpoint_keys(["x.weight"], dtypes={"x.weight": torch.int8})
    te_plan = LoraMergePlan([(trained_lora(1, te=tiny_qwen35()).state_dict(), 1.0)], "lora_te")
    with pytest.raises(UserError, match="--convrot_int8_text_encoder"):
        te_plan.check_checkpoint_keys(["embed_tokens.weight", "embed_tokens.comfy_quant"])
    empty = LoraMergePlan([], "lora_unet")
    empty.check_checkpoint_keys(["a.weight_scale"])  # nothing to merge: nothing to refuse
    assert empty.merge("a.weight", torch.zeros(2, dtype=torch.int8)).dtype == torch.int8
    model = dit()
    quantize_blocks(model)
    with pytest.raises(UserError, match="--convrot_int8"):
        merge_into_module(model, plan)


def test_bad_lora_inputs(tmp_path):
    with pytest.raises(UserError, match="empty"):
        LoraMergePlan([({}, 1.0)], "lora_unet")
    with pytest.raises(UserError, match="not an sd-scripts LoRA key.*not LoHa"):
        LoraMergePlan([({"lora_unet_x.oft_blocks": torch.zeros(1)}, 1.0)], "lora_unet")
    with pytest.raises(UserError, match="lacks one of hada_w1_a"):  # LoHa files merge (test_lora_lycoris_family)
        LoraMergePlan([({"lora_unet_x.hada_w1_a": torch.zeros(1)}, 1.0)], "lora_unet")
    with pytest.raises(UserError, match="lacks lora_down or lora_up"):
        LoraMergePlan([({"lora_unet_x.lora_up.weight": torch.zeros(2, 2)}, 1.0)], "lora_unet")
    path = tmp_path / "l.safetensors"
    trained_lora(1).save_weights(path, None, None)
    with pytest.raises(UserError, match="one --lora_multiplier per --lora_weight"):
        load_lora_files([path, path], [1.0])
    with pytest.raises(UserError, match="LoRA file .* does not exist"):
        load_lora_files([tmp_path / "nope.safetensors"])
    pairs = load_lora_files([path, path], [0.5, 2.0])
    assert [m for _, m in pairs] == [0.5, 2.0]
    assert [m for _, m in load_lora_files([path])] == [1.0]


def test_plan_accepts_peft_named_lora():
    net = trained_lora(4)
    plan = LoraMergePlan([(conv.to_peft(net.state_dict(), "diffusers"), 1.0)], "lora_unet")
    reference = LoraMergePlan([(net.state_dict(), 1.0)], "lora_unet")
    w = torch.randn(16, 16)
    torch.testing.assert_close(plan.merge("layers.2.proj.o.weight", w), reference.merge("layers.2.proj.o.weight", w))


# ----------------------------------------------------------------------------------------------------------------------
# the converter


def delta(sd, name):
    down, up = sd[f"{name}.lora_down.weight"].float(), sd[f"{name}.lora_up.weight"].float()
    return (float(sd[f"{name}.alpha"]) / down.shape[0]) * up @ down


def test_to_peft_names_and_roundtrips():
    te = tiny_qwen35()
    net = trained_lora(5, te=te, train_text_embedder="true", include_patterns="['.*in_proj_[ab]']")
    sd = {k: v.clone() for k, v in net.state_dict().items()}
    peft = conv.to_peft(sd, "comfyui", keep_alpha=True)
    assert "diffusion_model.layers.0.proj.ffn_up_gate.lora_A.weight" in peft
    assert "diffusion_model.text_embedder.blocks.1.proj.q.lora_B.weight" in peft
    assert "diffusion_model.text_embedder.proj.alpha" in peft
    assert "text_encoder.layers.0.linear_attn.in_proj_a.lora_A.weight" in peft
    assert "text_encoder.layers.1.self_attn.o_proj.lora_B.weight" in peft
    assert "text_encoder.layers.1.mlp.gate_proj.lora_A.weight" in peft
    back = conv.to_sd_scripts(peft)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)

    folded = conv.to_peft(sd, "diffusers")
    assert not any(k.endswith(".alpha") for k in folded)
    assert "transformer.layers.1.proj.k.lora_A.weight" in folded
    back = conv.to_sd_scripts(folded)
    for name in {k.partition(".")[0] for k in sd}:
        assert float(back[f"{name}.alpha"]) == back[f"{name}.lora_down.weight"].shape[0]
        torch.testing.assert_close(delta(back, name), delta(sd, name))
    assert conv.convert_state_dict(folded, "comfyui").keys() == conv.to_peft(sd, "comfyui").keys()


def test_converter_errors():
    with pytest.raises(UserError, match="is neither sd-scripts .* nor PEFT"):
        conv.to_sd_scripts({"model.layers.0.q.weight": torch.zeros(1)})
    with pytest.raises(UserError, match="not a multiple of 3"):
        conv.to_sd_scripts({"diffusion_model.layers.0.proj.qkv.lora_A.weight": torch.zeros(2, 4),
                            "diffusion_model.layers.0.proj.qkv.lora_B.weight": torch.zeros(13, 2)})
    with pytest.raises(UserError, match="Cannot map LoRA module 'lora_unet_final_layer_linear'"):
        conv.to_peft({"lora_unet_final_layer_linear.lora_down.weight": torch.zeros(2, 4),
                      "lora_unet_final_layer_linear.lora_up.weight": torch.zeros(4, 2)})
    names = conv.to_peft({"lora_unet_final_layer_linear.lora_down.weight": torch.zeros(2, 4),
                          "lora_unet_final_layer_linear.lora_up.weight": torch.zeros(4, 2)},
                         module_names=["final_layer.linear"])
    assert "diffusion_model.final_layer.linear.lora_A.weight" in names
    with pytest.raises(UserError, match="not an sd-scripts LoRA key"):
        conv.to_peft({"lora_unet_layers_0_proj_q.lokr_w1": torch.zeros(1)})
    with pytest.raises(UserError, match="lacks lora_A or lora_B"):
        conv.to_sd_scripts({"transformer.layers.0.proj.q.lora_A.weight": torch.zeros(2, 4)})
    with pytest.raises(UserError, match="Unknown target"):
        conv.convert_state_dict({}, "kohya")


def test_converter_cli(tmp_path, capsys):
    net = trained_lora(6)
    src = tmp_path / "ours.safetensors"
    net.save_weights(src, torch.bfloat16, {"ss_network_dim": "4", "modelspec.title": "x"})
    dst = tmp_path / "comfy.safetensors"
    assert conv.main([str(src), str(dst), "--target", "comfyui"]) == 0
    out = load_safetensors(dst)
    assert all(k.startswith("diffusion_model.") for k in out) and len(out) == 2 * 18
    meta = read_metadata(dst)
    assert meta["ss_network_dim"] == "4" and meta["modelspec.title"] == "x"
    assert meta["sshs_model_hash"] != read_metadata(src)["sshs_model_hash"]  # recomputed for the new tensors
    back = tmp_path / "back.safetensors"
    assert conv.main([str(dst), str(back), "--target", "sd-scripts"]) == 0
    sd_back, sd_src = load_safetensors(back), load_safetensors(src)
    assert sd_back.keys() == sd_src.keys()
    for name in {k.partition(".")[0] for k in sd_src}:
        torch.testing.assert_close(delta(sd_back, name), delta(sd_src, name), atol=2e-2, rtol=2e-2)
    assert conv.main([str(src), str(tmp_path / "x.safetensors"), "--target", "diffusers", "--keep_alpha"]) == 0
    assert conv.main([str(src), str(src)]) == 2
    assert "same file" in capsys.readouterr().err
    assert conv.main([str(tmp_path / "none.safetensors"), str(dst)]) == 2


@pytest.mark.parametrize("peft", [True, False])
def test_fused_qkv_lora_is_split_exactly(peft):
    torch.manual_seed(0)
    down, up = torch.randn(2, 16), torch.randn(48, 2)
    if peft:
        sd = {"diffusion_model.layers.1.proj.qkv.lora_A.weight": down,
              "diffusion_model.layers.1.proj.qkv.lora_B.weight": up,
              "diffusion_model.layers.1.proj.qkv.alpha": torch.tensor(1.0)}
    else:
        sd = {"lora_unet_layers_1_proj_qkv.lora_down.weight": down, "lora_unet_layers_1_proj_qkv.lora_up.weight": up,
              "lora_unet_layers_1_proj_qkv.alpha": torch.tensor(1.0)}
    ours = conv.to_sd_scripts(sd)
    assert sorted({k.partition(".")[0] for k in ours}) == [f"lora_unet_layers_1_proj_{p}" for p in "kqv"]
    fused_delta = 0.5 * up @ down
    parts = [delta(ours, f"lora_unet_layers_1_proj_{p}") for p in "qkv"]
    torch.testing.assert_close(torch.cat(parts), fused_delta)
    plan = LoraMergePlan([(sd, 1.0)], "lora_unet")
    model = dit()
    w = model.layers[1].proj.k.weight.detach().clone()
    assert merge_into_module(model, plan) == 3 and plan.finish() == []
    torch.testing.assert_close(model.layers[1].proj.k.weight.detach(), w + fused_delta[16:32])


def test_merge_through_the_dit_loader_tensor_hook(tmp_path):
    from library.moss_image.dit import MossImage as RealMossImage
    from library.moss_image.loaders import load_moss_image_model
    from library.moss_image.tiny_snapshot import TINY_DIT_CONFIG, tiny_dit_state_dict

    sd = {k: v.float() for k, v in tiny_dit_state_dict(0).items()}
    path = tmp_path / "dit.safetensors"
    save_file_atomic(sd, path)
    reference = RealMossImage(TINY_DIT_CONFIG).eval()
    reference.load_state_dict(sd)
    lora = create_network(1.0, 4, 2.0, None, None, reference, train_text_embedder="true")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in lora.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    plan = LoraMergePlan([(lora.state_dict(), 0.8)], "lora_unet")
    merged = load_moss_image_model("cpu", path, dtype=torch.float32, tensor_hook=plan.merge)
    assert plan.finish() == []
    lora.set_multiplier(0.8)
    lora.apply_to(None, reference, False, True)
    x, t, text = torch.randn(1, 128, 2, 2), torch.tensor([300.0]), torch.randn(1, 3, TINY_DIT_CONFIG.text_dim)
    with torch.no_grad():
        torch.testing.assert_close(merged(x, t, text), reference(x, t, text), atol=1e-4, rtol=1e-4)
