"""bench.make_full_snapshot at --scale small: every file it writes loads through the project's real loaders, the
ComfyUI INT8 files equal quantise-at-load bit for bit, the text encoder shards carry the VL extras, the planned sizes
(--dry-run) are the written ones, and the full-size plan has the official sizes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.make_full_snapshot import make_snapshot, parse_args
from library.quant.convrot import ConvRotInt8Embedding, ConvRotInt8Linear
from library.errors import UserError
from library.moss_image.vae import load_flux2_vae
from library.moss_image.loaders import load_moss_image_model
from library.text_encoder.qwen35 import load_qwen35_text_model
from library.files.safetensors_io import TensorSource, discover_shards

REPO = Path(__file__).resolve().parent.parent
TE_FIRST = "text_encoder/model-00001-of-00004.safetensors"
INT8_TE = "text_encoder_int8/qwen3.5_9b_int8_convrot.safetensors"


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("full_snapshot") / "small"
    proc = subprocess.run([sys.executable, "-m", "bench.make_full_snapshot", str(out), "--scale", "small",
                           "--seed", "3", "--device", "cpu"], check=False, cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads(proc.stdout)


def _equal_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_summary_lists_every_file_with_its_size(snapshot):
    out, summary = snapshot
    written = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert sorted(f["path"] for f in summary["files"]) == written
    assert all((out / f["path"]).stat().st_size == f["bytes"] for f in summary["files"])
    assert summary["total_bytes"] == sum(f["bytes"] for f in summary["files"])
    assert summary["peak_rss_mib"] > 0 and summary["seconds"] > 0 and not summary["dry_run"]
    names = {Path(p).name for p in written}
    assert {f"diffusion_pytorch_model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)} <= names
    assert {f"model-0000{i}-of-00004.safetensors" for i in (1, 2, 3, 4)} <= names
    assert {"moss_image_base_bf16.safetensors", "moss_image_base_int8_convrot.safetensors", "flux2-vae.safetensors",
            "qwen3.5_9b_int8_convrot.safetensors", "tokenizer.json", "model.safetensors.index.json"} <= names


def test_dit_shards_and_both_comfy_files_load(snapshot):
    out, _ = snapshot
    base = load_moss_image_model("cpu", out / "transformer" / "diffusion_pytorch_model-00001-of-00003.safetensors",
                                 dtype=torch.float32)
    assert (base.config.num_layers, base.config.hidden_size, base.config.text_dim) == (4, 256, 256)
    fused = load_moss_image_model("cpu", out / "moss_image_base_bf16.safetensors", dtype=torch.float32)
    assert _equal_state(base, fused)
    dynamic = load_moss_image_model("cpu", out, dtype=torch.float32, convrot_int8=True)
    comfy = load_moss_image_model("cpu", out / "moss_image_base_int8_convrot.safetensors", dtype=torch.float32)
    int8 = [n for n, m in comfy.named_modules() if isinstance(m, ConvRotInt8Linear)]
    assert len(int8) == 4 * 6 and all(m.group_size == 256 for m in comfy.modules() if isinstance(m, ConvRotInt8Linear))
    assert _equal_state(dynamic, comfy)  # bit for bit
    g = torch.Generator().manual_seed(0)
    x, e = torch.randn(1, 128, 8, 8, generator=g), torch.randn(1, 7, 256, generator=g)
    with torch.no_grad():
        y, yq = base(x, torch.tensor([500.0]), e), comfy(x, torch.tensor([500.0]), e)
    assert torch.isfinite(y).all() and 0.3 < y.std().item() < 3.0
    assert 0 < ((yq - y).norm() / y.norm()).item() < 0.1


def test_text_encoder_shards_carry_the_vl_extras(snapshot):
    out, _ = snapshot
    index = json.loads((out / "text_encoder" / "model.safetensors.index.json").read_text())
    with TensorSource(discover_shards(out / TE_FIRST)) as src:
        keys = src.keys()
        assert set(index["weight_map"]) == set(keys)
        assert src.shape("model.visual.patch_embed.proj.weight") == (64, 3, 2, 16, 16)
        assert src.shape("model.visual.merger.linear_fc2.weight") == (256, 256)
        assert len({k.split(".")[3] for k in keys if k.startswith("model.visual.blocks.")}) == 2
        assert src.shape("lm_head.weight") == (2048, 256)
        assert src.shape("mtp.fc.weight") == (256, 512)
        assert "mtp.layers.0.self_attn.q_proj.weight" in keys and "mtp.norm.weight" in keys
    config = json.loads((out / "text_encoder" / "config.json").read_text())
    assert config["model_type"] == "qwen3_5" and config["vision_config"]["depth"] == 2


def test_text_encoder_shards_and_int8_file_load(snapshot):
    out, _ = snapshot
    base = load_qwen35_text_model(out / TE_FIRST, dtype=torch.float32)
    assert base.config.hidden_size == 256 and base.embed_tokens.weight.shape == (2048, 256)
    dynamic = load_qwen35_text_model(out / "text_encoder", dtype=torch.float32, convrot_int8=True)
    comfy = load_qwen35_text_model(out / INT8_TE, dtype=torch.float32)
    assert isinstance(comfy.embed_tokens, ConvRotInt8Embedding) and comfy.embed_tokens.group_size == 256
    assert sum(isinstance(m, ConvRotInt8Linear) for m in comfy.modules()) == 3 * 6 + 7
    assert _equal_state(dynamic, comfy)  # bit for bit
    ids = torch.tensor([[1, 5, 6, 7, 8, 2, 201, 399]])
    with torch.no_grad():
        h, hq = (m(input_ids=ids).last_hidden_state for m in (base, comfy))
    assert torch.isfinite(h).all() and 0.3 < h.std().item() < 3.0
    assert torch.nn.functional.cosine_similarity(h.flatten(), hq.flatten(), dim=0) > 0.95


def test_both_vae_layouts_load_with_the_same_weights(snapshot):
    out, _ = snapshot
    diffusers = load_flux2_vae(out / "vae")
    bfl = load_flux2_vae(out / "flux2-vae.safetensors")
    assert diffusers.config.encoder_widths == (32, 32, 64, 64)
    assert _equal_state(diffusers, bfl)
    with torch.no_grad():
        z = bfl.encode(torch.rand(1, 3, 32, 32) * 2 - 1)
        assert torch.isfinite(bfl.decode(z)).all()


def test_dry_run_sizes_are_the_written_ones_and_values_do_not_depend_on_what(snapshot, tmp_path):
    out, summary = snapshot
    planned = make_snapshot(parse_args([str(tmp_path / "none"), "--scale", "small", "--dry-run"]))
    assert not (tmp_path / "none").exists()
    assert {f["path"]: f["bytes"] for f in planned["files"]} == {
        f["path"]: f["bytes"] for f in summary["files"] if not f["path"].startswith("tokenizer/")}
    make_snapshot(parse_args([str(tmp_path / "vae_only"), "--scale", "small", "--seed", "3", "--what", "vae",
                              "--device", "cpu"]))
    for rel in ("vae/diffusion_pytorch_model.safetensors", "flux2-vae.safetensors"):
        assert (tmp_path / "vae_only" / rel).read_bytes() == (out / rel).read_bytes()


def test_full_size_plan_has_the_official_sizes(tmp_path):
    plan = make_snapshot(parse_args([str(tmp_path / "full"), "--dry-run"]))
    size = {f["path"]: f["bytes"] for f in plan["files"]}

    def total(prefix: str) -> int:
        return sum(b for p, b in size.items() if p.startswith(prefix) and p.endswith(".safetensors"))

    assert 10.16e9 < total("transformer/") < 10.18e9  # 5.08B bf16 parameters
    assert 19.29e9 < total("text_encoder/") < 19.32e9  # 9.65B: text, vision, lm_head, MTP
    assert 5.0e9 < size["moss_image_base_int8_convrot.safetensors"] < 5.6e9
    assert 7.9e9 < size["text_encoder_int8/qwen3.5_9b_int8_convrot.safetensors"] < 8.0e9  # text weights only
    assert 0.33e9 < size["flux2-vae.safetensors"] < 0.34e9


def test_bad_options_and_missing_shards_are_refused(tmp_path):
    with pytest.raises(UserError, match="--what"):
        make_snapshot(parse_args([str(tmp_path), "--scale", "small", "--what", "dit,unet"]))
    with pytest.raises(UserError, match="add dit to --what"):
        make_snapshot(parse_args([str(tmp_path / "empty"), "--scale", "small", "--what", "comfy", "--device", "cpu"]))
    assert not any((tmp_path / "empty").rglob("*.safetensors"))
