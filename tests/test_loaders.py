"""The real loaders on the tiny snapshot's official layouts: DiT (shards, folder, ComfyUI fused qkv), Qwen3.5, tokenizer."""

import logging
import shutil

import pytest
import torch

from library.errors import UserError
from library.files.safetensors_io import load_safetensors, save_file_atomic
from library.moss_image.loaders import load_moss_image_model, open_dit_source, resolve_snapshot
from library.text_encoder.encoding import encode_captions, pad_and_stack
from library.text_encoder.qwen35 import (
    format_prompt,
    load_qwen35_text_model,
    load_tokenizer,
    open_text_encoder_source,
    tokenize,
)

FIRST_DIT = "transformer/diffusion_pytorch_model-00001-of-00003.safetensors"
FIRST_TE = "text_encoder/model-00001-of-00004.safetensors"
QWEN35_9B_TEXT_PARAMS = 7_936_684_544


def _sd(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_dit_layouts_load_identically(tiny_snapshot):
    ref = _sd(load_moss_image_model("cpu", tiny_snapshot / FIRST_DIT, dtype=torch.float32))
    for path in (tiny_snapshot / "transformer", tiny_snapshot, tiny_snapshot / "moss_image_base_bf16.safetensors"):
        got = _sd(load_moss_image_model("cpu", path, dtype=torch.float32))
        assert got.keys() == ref.keys()
        assert all(torch.equal(got[k], ref[k]) for k in ref), path
    mm = _sd(load_moss_image_model("cpu", tiny_snapshot / FIRST_DIT, dtype=torch.float32, disable_mmap=True))
    assert all(torch.equal(mm[k], ref[k]) for k in ref)


def test_dit_dtype_and_frozen(tiny_snapshot):
    model = load_moss_image_model("cpu", tiny_snapshot / FIRST_DIT, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and not any(p.requires_grad for p in model.parameters())
    assert model.config.num_layers == 24 and model.config.head_dim == 16


def test_comfy_fused_qkv_read_once(tiny_snapshot):
    path = tiny_snapshot / "moss_image_base_bf16.safetensors"
    src = open_dit_source(path)
    file_keys = len(load_safetensors(path))
    for k in src.keys():
        src.get_tensor(k)
    assert src.source.reads == file_keys  # every stored tensor read exactly once, fused qkv included


def test_config_json_overrides_numeric_fields(tiny_snapshot, tmp_path):
    folder = tmp_path / "transformer"
    shutil.copytree(tiny_snapshot / "transformer", folder)
    cfg = (folder / "config.json").read_text().replace('"rope_theta": 10000.0', '"rope_theta": 50.0')
    (folder / "config.json").write_text(cfg)
    model = load_moss_image_model("cpu", folder / FIRST_DIT.split("/")[1], dtype=torch.float32)
    assert model.config.rope_theta == 50.0


def test_dit_key_mismatch_lists_keys(tiny_snapshot, tmp_path):
    sd = load_safetensors(tiny_snapshot / "moss_image_base_bf16.safetensors")
    sd.pop("layers.3.norm2.weight")
    sd["layers.3.extra.weight"] = torch.zeros(1)
    bad = tmp_path / "bad.safetensors"
    save_file_atomic(sd, bad)
    with pytest.raises(UserError) as e:
        load_moss_image_model("cpu", bad, dtype=torch.float32)
    msg = str(e.value)
    assert "1 missing (layers.3.norm2.weight)" in msg and "1 unexpected (layers.3.extra.weight)" in msg
    assert str(bad) in msg


def test_dit_wrong_files(tiny_snapshot, tmp_path):
    with pytest.raises(UserError, match="not a MOSS-Image DiT"):
        load_moss_image_model("cpu", tiny_snapshot / "flux2-vae.safetensors")
    with pytest.raises(UserError, match="only safetensors"):
        (tmp_path / "x.ckpt").write_bytes(b"0" * 10)
        load_moss_image_model("cpu", tmp_path / "x.ckpt")
    shutil.copy(tiny_snapshot / FIRST_DIT, tmp_path / FIRST_DIT.split("/")[1])
    with pytest.raises(UserError, match="00002-of-00003"):
        load_moss_image_model("cpu", tmp_path / FIRST_DIT.split("/")[1])


def test_text_encoder_matches_transformers_exactly(tiny_snapshot):
    from transformers import Qwen3_5TextModel

    ours = load_qwen35_text_model(tiny_snapshot / FIRST_TE, dtype=torch.float32)
    ref = Qwen3_5TextModel.from_pretrained(str(tiny_snapshot / "text_encoder"), dtype=torch.float32)
    tok = load_tokenizer(text_encoder_path=str(tiny_snapshot / FIRST_TE))
    ids = tokenize(tok, "A photo of a cat.\nSecond line.")[None]
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).last_hidden_state, ref(input_ids=ids).last_hidden_state)
    bf = load_qwen35_text_model(tiny_snapshot / "text_encoder", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in bf.parameters())


def test_text_encoder_skips_vision_lm_head_mtp_without_reading(tiny_snapshot):
    src, _ = open_text_encoder_source(tiny_snapshot / FIRST_TE)
    keys = src.keys()
    assert keys and not any(k.startswith(("model.", "visual", "lm_head", "mtp")) for k in keys)
    for k in keys:
        src.get_tensor(k)
    assert src.reads == len(keys)


def test_full_qwen35_9b_text_model_size_on_meta():
    from pathlib import Path

    from transformers import Qwen3_5TextModel

    from library.text_encoder.qwen35 import load_text_config

    cfg = load_text_config(Path("/nonexistent/qwen3.5_9b.safetensors"))  # no config beside: the bundled 9B one
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (248320, 4096, 32)
    assert cfg.layer_types.count("full_attention") == 8
    with torch.device("meta"):
        model = Qwen3_5TextModel(cfg)
    assert sum(p.numel() for p in model.parameters()) == QWEN35_9B_TEXT_PARAMS


def test_text_encoder_single_file_without_config_uses_bundled_9b(tiny_snapshot, tmp_path):
    sd = {}
    for i in range(1, 5):
        sd.update(load_safetensors(tiny_snapshot / f"text_encoder/model-0000{i}-of-00004.safetensors"))
    save_file_atomic(sd, tmp_path / "qwen.safetensors")
    with pytest.raises(UserError, match="does not match its weights|does not match the model"):
        load_qwen35_text_model(tmp_path / "qwen.safetensors")


def test_encode_one_caption_at_a_time(tiny_snapshot):
    te = load_qwen35_text_model(tiny_snapshot / FIRST_TE, dtype=torch.float32)
    tok = load_tokenizer(str(tiny_snapshot / "tokenizer"))
    caps = ["A red cube.", "A much longer caption about a watercolor painting of mountains."]
    with torch.no_grad():
        enc = encode_captions(te, tok, caps)
        emb, mask = pad_and_stack(enc)
        alone = encode_captions(te, tok, caps[:1])[0][0]
    assert emb.shape[0] == 2 and mask[0].sum() < mask[1].sum() == emb.shape[1]
    assert torch.equal(emb[0, : alone.shape[0]], alone)  # no padding effects: encoded alone
    assert (emb[0, alone.shape[0] :] == 0).all()


def test_prompt_template_and_truncation(tiny_snapshot, caplog):
    tok = load_tokenizer(str(tiny_snapshot))
    assert format_prompt("hi") == "<|im_start|>user\nhi<|im_end|>\n"
    full = tokenize(tok, "word " * 50)
    with caplog.at_level(logging.WARNING):
        cut = tokenize(tok, "word " * 50, max_length=16)
    assert len(cut) == 16 and torch.equal(cut, full[:16]) and "truncated" in caplog.text


def test_tokenizer_missing_offline_is_clear(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))


def test_snapshot_layout_and_determinism(tiny_snapshot, tmp_path):
    from library.moss_image.tiny_snapshot import build_tiny_snapshot

    paths = resolve_snapshot(tiny_snapshot)
    assert paths.tokenizer is not None and (tiny_snapshot / "flux2-vae.safetensors").exists()
    again = build_tiny_snapshot(tmp_path / "again")
    for f in sorted(tiny_snapshot.rglob("*.safetensors")):
        assert f.read_bytes() == (again / f.relative_to(tiny_snapshot)).read_bytes(), f
    with pytest.raises(UserError, match="not a MOSS-Image snapshot"):
        resolve_snapshot(tmp_path)
