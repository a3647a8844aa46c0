"""The converter's PEFT / diffusers input (alpha from the adapter config, save_pretrained folders and keys) and its
`comfyui_fused` output (one fused qkv module per block, merging to exactly the weights of the separate q / k / v)."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

import networks.convert_moss_image_lora as conv
from library.errors import UserError
from library.files.safetensors_io import load_safetensors, read_metadata, save_file_atomic
from library.lora.merge import merged_modules
from library.lora.peft_config import parse_config_json
from library.lora.weights import delta_weight

H = 16  # module widths of these hand-made files


def peft_pair(seed: int, rank: int, rows: int = H, cols: int = H) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rank, cols, generator=g), torch.randn(rows, rank, generator=g)


def sd_delta(sd: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    down, up = sd[f"{name}.lora_down.weight"].float(), sd[f"{name}.lora_up.weight"].float()
    return (float(sd[f"{name}.alpha"]) / down.shape[0]) * up @ down


def peft_file(paths: dict[str, int], key_head: str = "base_model.model.", adapter: str = "") -> dict[str, torch.Tensor]:
    """A PEFT state dict for module path -> rank, keys as `key_head<path>.lora_A[.adapter].weight`."""
    sd = {}
    infix = f".{adapter}" if adapter else ""
    for i, (path, rank) in enumerate(paths.items()):
        down, up = peft_pair(i, rank)
        sd[f"{key_head}{path}.lora_A{infix}.weight"] = down
        sd[f"{key_head}{path}.lora_B{infix}.weight"] = up
    return sd


def peft_delta(sd: dict[str, torch.Tensor], head: str, scale: float, adapter: str = "") -> torch.Tensor:
    infix = f".{adapter}" if adapter else ""
    return scale * sd[f"{head}.lora_B{infix}.weight"] @ sd[f"{head}.lora_A{infix}.weight"]


# ----------------------------------------------------------------------------------------------------------------------
# PEFT input: alpha from the adapter config


def test_save_pretrained_folder_r8_alpha16_comes_in_at_full_strength(tmp_path, caplog):
    folder = tmp_path / "peft_out"
    folder.mkdir()
    paths = {"layers.0.proj.q": 8, "layers.0.proj.ffn_down": 8, "layers.1.proj.v": 8}
    sd = peft_file(paths)
    save_file_atomic(sd, folder / "adapter_model.safetensors", {"format": "pt"})
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q", "v", "ffn_down"],
         "use_rslora": False, "rank_pattern": {}, "alpha_pattern": {}}))
    dst = tmp_path / "ours.safetensors"
    with caplog.at_level(logging.WARNING):
        assert conv.main([str(folder), str(dst), "--target", "sd-scripts"]) == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    out = load_safetensors(dst)
    for path in paths:
        name = "lora_unet_" + path.replace(".", "_")
        assert float(out[f"{name}.alpha"]) == 16.0
        torch.testing.assert_close(sd_delta(out, name), peft_delta(sd, f"base_model.model.{path}", 16 / 8))


def test_merge_reads_the_adapter_config_too(tmp_path):
    """--lora_weight / --base_weights: a save_pretrained folder merges at full strength."""
    from library.lora.merge import LoraMergePlan, load_lora_files

    folder = tmp_path / "peft_out"
    folder.mkdir()
    sd = peft_file({"layers.0.proj.q": 8})
    save_file_atomic(sd, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    plan = LoraMergePlan(load_lora_files([folder]), "lora_unet")
    weight = torch.zeros(H, H)
    merged = plan.merge("layers.0.proj.q.weight", weight)
    torch.testing.assert_close(merged, peft_delta(sd, "base_model.model.layers.0.proj.q", 2.0))


def test_adapter_name_infix_and_text_encoder_paths_are_read():
    paths = {"layers.2.proj.k": 4, "model.layers.3.self_attn.q_proj": 4, "model.layers.0.linear_attn.in_proj_qkv": 4}
    sd = peft_file(paths, adapter="default")
    out = conv.to_sd_scripts(sd, parse_config_json(json.dumps({"r": 4, "lora_alpha": 2}), "test"))
    assert sorted({k.partition(".")[0] for k in out}) == [
        "lora_te_layers_0_linear_attn_in_proj_qkv", "lora_te_layers_3_self_attn_q_proj", "lora_unet_layers_2_proj_k"]
    torch.testing.assert_close(sd_delta(out, "lora_te_layers_3_self_attn_q_proj"),
                               peft_delta(sd, "base_model.model.model.layers.3.self_attn.q_proj", 0.5, "default"))
    with pytest.raises(UserError, match="several PEFT adapters"):
        conv.to_sd_scripts({**sd, **peft_file({"layers.5.proj.q": 4}, adapter="other")})
    with pytest.raises(UserError, match="neither a MOSS-Image DiT module nor a Qwen3.5"):
        conv.to_sd_scripts(peft_file({"model.final_layer.linear": 4}))


def test_patterns_and_rslora():
    paths = {"layers.0.proj.q": 8, "layers.0.proj.k": 4, "layers.1.proj.q": 8, "layers.1.proj.o": 8}
    sd = peft_file(paths, key_head="transformer.")
    config = {"r": 8, "lora_alpha": 16, "rank_pattern": {"layers.0.proj.k": 4},
              "alpha_pattern": {"layers.0.proj.k": 2, "proj.o": 4}}
    out = conv.to_sd_scripts(sd, parse_config_json(json.dumps(config), "test"))
    alphas = {n: float(out[f"lora_unet_{n}.alpha"]) for n in ("layers_0_proj_q", "layers_0_proj_k", "layers_1_proj_o")}
    assert alphas == {"layers_0_proj_q": 16.0, "layers_0_proj_k": 2.0, "layers_1_proj_o": 4.0}
    # rsLoRA: PEFT's scale lora_alpha / sqrt(r) becomes the kohya alpha lora_alpha * sqrt(r)
    rs = conv.to_sd_scripts(sd, parse_config_json(json.dumps({**config, "use_rslora": True}), "test"))
    assert float(rs["lora_unet_layers_0_proj_q.alpha"]) == pytest.approx(16 * math.sqrt(8), rel=1e-7)
    for path, rank in paths.items():
        alpha = 2 if path.endswith("proj.k") else 4 if path.endswith("proj.o") else 16
        torch.testing.assert_close(sd_delta(rs, "lora_unet_" + path.replace(".", "_")),
                                   peft_delta(sd, f"transformer.{path}", alpha / math.sqrt(rank)))
    # a config whose rank does not match the tensors does not belong to the file
    with pytest.raises(UserError, match="gives module 'layers.0.proj.k' rank 8, but its lora_A has 4 rows"):
        conv.to_sd_scripts(sd, parse_config_json(json.dumps({"r": 8, "lora_alpha": 16}), "test"))
    # a module's own .alpha wins over the config
    own = dict(sd, **{"transformer.layers.0.proj.q.alpha": torch.tensor(3.0)})
    assert float(conv.to_sd_scripts(own, parse_config_json(json.dumps(config), "t"))[
        "lora_unet_layers_0_proj_q.alpha"]) == 3.0


@pytest.mark.parametrize("nested", [False, True])
def test_diffusers_lora_adapter_metadata(tmp_path, nested):
    """diffusers' save_lora_adapter (keys without prefix, the config as JSON) and its pipeline form (`transformer.`
    keys, one config per model under its prefix)."""
    if nested:
        sd = {**peft_file({"layers.0.proj.q": 4}, key_head="transformer."),
              **peft_file({"layers.3.self_attn.v_proj": 2}, key_head="text_encoder.")}
        config = {"transformer.r": 4, "transformer.lora_alpha": 8, "transformer.target_modules": ["q"],
                  "text_encoder.r": 2, "text_encoder.lora_alpha": 1, "text_encoder.use_rslora": False}
    else:
        sd = peft_file({"layers.0.proj.q": 4}, key_head="")
        config = {"r": 4, "lora_alpha": 8, "target_modules": ["q"], "use_dora": False}
    src = tmp_path / "pytorch_lora_weights.safetensors"
    save_file_atomic(sd, src, {"format": "pt", "lora_adapter_metadata": json.dumps(config, indent=2)})
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 1}))  # the metadata wins
    dst = tmp_path / "ours.safetensors"
    conv.convert_file(src, dst, "sd-scripts")
    out = load_safetensors(dst)
    assert float(out["lora_unet_layers_0_proj_q.alpha"]) == 8.0
    assert "lora_adapter_metadata" not in read_metadata(dst)  # the alphas are in the tensors now
    if nested:
        assert float(out["lora_te_layers_3_self_attn_v_proj.alpha"]) == 1.0
    # an explicit --adapter_config wins over both
    explicit = tmp_path / "explicit.json"
    given = {"transformer.r": 4, "transformer.lora_alpha": 12, "text_encoder.lora_alpha": 4} if nested else {
        "r": 4, "lora_alpha": 12}
    explicit.write_text(json.dumps(given))
    assert conv.main([str(src), str(dst), "--target", "sd-scripts", "--adapter_config", str(explicit)]) == 0
    assert float(load_safetensors(dst)["lora_unet_layers_0_proj_q.alpha"]) == 12.0
    if nested:
        assert float(load_safetensors(dst)["lora_te_layers_3_self_attn_v_proj.alpha"]) == 4.0


def test_without_a_config_alpha_is_the_rank_with_one_warning(tmp_path, caplog):
    sd = peft_file({"layers.0.proj.q": 4, "layers.0.proj.k": 4}, key_head="transformer.")
    src = tmp_path / "plain.safetensors"
    save_file_atomic(sd, src)
    with caplog.at_level(logging.WARNING):
        conv.convert_file(src, tmp_path / "out.safetensors", "sd-scripts")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "alpha = rank" in warnings[0] and "--adapter_config" in warnings[0]
    out = load_safetensors(tmp_path / "out.safetensors")
    assert float(out["lora_unet_layers_0_proj_q.alpha"]) == 4.0
    # our own PEFT output (alpha folded into lora_B, sd-scripts metadata carried over) says nothing
    caplog.clear()
    ours = tmp_path / "ours_peft.safetensors"
    save_file_atomic(sd, ours, {"ss_network_module": "networks.lora_generic"})
    with caplog.at_level(logging.WARNING):
        conv.convert_file(ours, tmp_path / "out2.safetensors", "sd-scripts")
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_pickle_and_bad_inputs_are_refused(tmp_path, capsys):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "adapter_model.bin").write_bytes(b"\x80\x04")
    (folder / "adapter_config.json").write_text("{}")
    assert conv.main([str(folder), str(tmp_path / "x.safetensors"), "--target", "sd-scripts"]) == 2
    assert "pickle file: only safetensors are read" in capsys.readouterr().err
    assert conv.main([str(folder / "adapter_model.bin"), str(tmp_path / "x.safetensors")]) == 2
    assert "only safetensors are read" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert conv.main([str(empty), str(tmp_path / "x.safetensors")]) == 2
    assert "has no adapter_model.safetensors" in capsys.readouterr().err
    src = tmp_path / "a.safetensors"
    save_file_atomic(peft_file({"layers.0.proj.q": 4}), src)
    (tmp_path / "adapter_config.json").write_text("{not json")
    assert conv.main([str(src), str(tmp_path / "x.safetensors")]) == 2
    assert "is not valid JSON" in capsys.readouterr().err
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    assert conv.main([str(src), str(tmp_path / "x.safetensors")]) == 2
    assert "has neither r nor lora_alpha" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------------
# comfyui_fused


@pytest.fixture(scope="module")
def snapshot_lora(tiny_snapshot):
    """A LoRA on every block Linear of the tiny snapshot's DiT (text-embedder blocks included), random weights; the
    k modules of the even layers get another alpha (their scale then differs from q / v), v of layer 1 is dropped."""
    from library.moss_image.loaders import load_moss_image_model
    from networks import lora_generic

    dit = load_moss_image_model("cpu", tiny_snapshot, dtype=torch.float32)
    net = lora_generic.create_network(1.0, 4, 2.0, None, [], dit, train_text_embedder="true")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    sd = {k: v.detach().clone() for k, v in net.state_dict().items()}
    for layer in range(0, 24, 2):
        sd[f"lora_unet_layers_{layer}_proj_k.alpha"] = torch.tensor(3.0)
    for suffix in ("lora_down.weight", "lora_up.weight", "alpha"):
        del sd[f"lora_unet_layers_1_proj_v.{suffix}"]
    return sd


def test_fused_qkv_merges_to_the_same_weights(tiny_snapshot, snapshot_lora):
    comfy = load_safetensors(tiny_snapshot / "moss_image_base_bf16.safetensors")
    fused = conv.fuse_qkv(snapshot_lora)
    qkv_names = sorted(k.partition(".")[0] for k in fused if k.endswith(".lora_down.weight") and "_proj_qkv" in k)
    # the key ComfyUI's generic LoRA map gives the fused Linear: lora_unet_ + its model key, "." as "_"
    model_keys = sorted("lora_unet_" + k[: -len(".weight")].replace(".", "_") for k in comfy if ".proj.qkv." in k)
    assert qkv_names == model_keys and len(qkv_names) == 26
    assert not any(k.partition(".")[0].endswith(("_proj_q", "_proj_k", "_proj_v")) for k in fused)
    assert fused.keys() - {k for k in fused if "_proj_qkv" in k} == {
        k for k in snapshot_lora if not k.partition(".")[0].endswith(("_proj_q", "_proj_k", "_proj_v"))}
    for name in qkv_names:
        path = name[len("lora_unet_"):]
        weight = next(v for k, v in comfy.items() if k.replace(".", "_") == path + "_weight").float()
        parts = {s: fused[f"{name}.{s}"] for s in ("lora_down.weight", "lora_up.weight", "alpha")}
        merged_fused = merged_modules(weight, [(parts, 1.0)], name)
        pieces = []
        for i, part in enumerate("qkv"):
            w_i = weight.chunk(3)[i]
            sep = f"{name[:-3]}{part}"
            if f"{sep}.lora_down.weight" not in snapshot_lora:
                pieces.append(w_i)
                continue
            sep_parts = {s: snapshot_lora[f"{sep}.{s}"] for s in ("lora_down.weight", "lora_up.weight", "alpha")}
            pieces.append(merged_modules(w_i, [(sep_parts, 1.0)], sep))
        diff = (merged_fused - torch.cat(pieces)).abs().max().item()
        assert diff <= 1e-6, (name, diff)
    # the equal-scale case keeps the tensors' dtype and the alpha s * 3r; the folded case is fp32 with alpha s_q * 3r
    assert float(fused["lora_unet_layers_1_proj_qkv.alpha"]) == 0.5 * 8
    assert float(fused["lora_unet_layers_0_proj_qkv.alpha"]) == 0.5 * 12
    assert fused["lora_unet_layers_0_proj_qkv.lora_up.weight"].shape == (3 * 64, 12)
    # and it splits back into q / k / v that merge to the same weights
    back = conv.to_sd_scripts(fused)
    for name in ("lora_unet_layers_0_proj_k", "lora_unet_layers_5_proj_v", "lora_unet_text_embedder_blocks_1_proj_q"):
        torch.testing.assert_close(sd_delta(back, name), sd_delta(snapshot_lora, name), atol=1e-6, rtol=1e-6)


def test_comfyui_fused_cli_and_loha(tmp_path, snapshot_lora):
    src = tmp_path / "ours.safetensors"
    save_file_atomic(snapshot_lora, src, {"ss_network_dim": "4"})
    dst = tmp_path / "fused.safetensors"
    assert conv.main([str(src), str(dst), "--target", "comfyui_fused"]) == 0
    out = load_safetensors(dst)
    assert "lora_unet_layers_3_proj_qkv.lora_up.weight" in out and "lora_unet_layers_3_proj_q.alpha" not in out
    assert read_metadata(dst)["ss_network_dim"] == "4"
    # LoHa fuses too (w1_a / w2_a block-diagonal), exactly
    g = torch.Generator().manual_seed(1)
    loha = {}
    for part, alpha in zip("qkv", (2.0, 2.0, 6.0)):
        for t, shape in (("hada_w1_a", (H, 2)), ("hada_w1_b", (2, H)), ("hada_w2_a", (H, 2)), ("hada_w2_b", (2, H))):
            loha[f"lora_unet_layers_0_proj_{part}.{t}"] = torch.randn(shape, generator=g)
        loha[f"lora_unet_layers_0_proj_{part}.alpha"] = torch.tensor(alpha)
    fused = conv.fuse_qkv(loha)
    parts = {k.partition(".")[2]: v for k, v in fused.items()}
    expected = torch.cat([delta_weight({k.partition(".")[2]: v for k, v in loha.items() if f"_proj_{p}." in k})
                          for p in "qkv"])
    assert (delta_weight(parts) - expected).abs().max().item() <= 1e-6 * expected.abs().max().item()  # fp32 rounding
    lokr = {"lora_unet_layers_0_proj_q.lokr_w1": torch.ones(2, 2), "lora_unet_layers_0_proj_q.lokr_w2": torch.ones(8, 8)}
    with pytest.raises(UserError, match="only LoRA or LoHa q / k / v modules of one kind fuse"):
        conv.fuse_qkv(lokr)


def test_modules_outside_target_modules_are_named_in_one_warning(caplog):
    sd = peft_file({"layers.0.proj.q": 4, "layers.0.proj.o": 4, "layers.1.proj.o": 4}, key_head="transformer.")
    config = parse_config_json(json.dumps({"r": 4, "lora_alpha": 4, "target_modules": ["q", "k", "v"]}), "t")
    with caplog.at_level(logging.WARNING):
        conv.to_sd_scripts(sd, config)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("2 LoRA modules are not in target_modules")
    regex = parse_config_json(json.dumps({"r": 4, "lora_alpha": 4, "target_modules": r".*proj\.(q|o)"}), "t")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        conv.to_sd_scripts(sd, regex)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
