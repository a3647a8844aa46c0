"""tools/show_metadata.py on files of each tool: ours (intact, damaged, metadata edited), ours after sd-scripts'
resize_lora, sd-scripts' own, LyCORIS', and a file without hashes. The other tools' hashes are computed here the way
their code computes them (sd-scripts' precalculate_safetensors_hashes, LyCORIS' per-tensor sha256)."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import torch
from safetensors.torch import save, save_file

from library.files import model_spec
from library.files.safetensors_io import load_safetensors, read_metadata
from tools import show_metadata

MODULES = ("lora_unet_layers_0_proj_q", "lora_unet_layers_0_proj_k", "lora_unet_layers_1_proj_q",
           "lora_unet_layers_1_proj_k")


def lora_tensors(rank: int = 16, width: int = 4096, seed: int = 0) -> dict[str, torch.Tensor]:
    """Four modules of 2 x 256 KiB each: larger than 1 MiB, so the legacy hash reads real data."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name in MODULES:
        sd[f"{name}.lora_down.weight"] = torch.randn(rank, width, generator=g)
        sd[f"{name}.lora_up.weight"] = torch.randn(width, rank, generator=g)
        sd[f"{name}.alpha"] = torch.tensor(float(rank))
    return sd


def our_metadata() -> dict[str, str]:
    meta = {"ss_network_module": "networks.lora_generic", "ss_network_dim": "16", "ss_network_alpha": "16.0",
            "ss_base_model_version": model_spec.BASE_MODEL_VERSION, "ss_training_comment": "None"}
    meta.update(model_spec.modelspec_metadata("mine", timestamp=1.7e9))
    return meta


def write_ours(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """As the trainer saves (lora_generic.save_weights): sshs_* and modelspec.hash_sha256 added."""
    meta = our_metadata()
    model_spec.add_hashes(tensors, meta)
    save_file(tensors, str(path), meta)
    return path


def sd_scripts_hashes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[str, str]:
    """sd-scripts' train_util.precalculate_safetensors_hashes."""
    b = io.BytesIO(save(tensors, {k: v for k, v in metadata.items() if k.startswith("ss_")}))
    n = int.from_bytes(b.read(8), "little")
    b.seek(8 + n)
    model_hash = hashlib.sha256(b.read()).hexdigest()
    b.seek(0x100000)
    return model_hash, hashlib.sha256(b.read(0x10000)).hexdigest()[:8]


def lycoris_hash(tensors: dict[str, torch.Tensor]) -> str:
    """LyCORIS' utils.precalculate_safetensors_hashes: each tensor serialised alone, in the network's order."""
    digest = hashlib.sha256()
    for t in tensors.values():
        buf = save({"tensor": t})
        digest.update(buf[8 + int.from_bytes(buf[:8], "little"):])
    return "0x" + digest.hexdigest()


def run(path: Path, capsys) -> tuple[int, str, dict[str, str]]:
    code = show_metadata.main([str(path)])
    out = capsys.readouterr().out
    rows = {}
    for line in out.splitlines():
        for key in ("sshs_model_hash", "sshs_legacy_hash", "modelspec.hash_sha256"):
            if line.strip().startswith(key):
                rows[key] = line
    return code, out, rows


def test_our_intact_file(tmp_path, capsys):
    code, out, rows = run(write_ours(tmp_path / "ours.safetensors", lora_tensors()), capsys)
    assert code == 0 and all("  OK" in r for r in rows.values()) and len(rows) == 3
    assert "verdict: intact: every stored hash matches" in out


def test_our_damaged_file_is_exit_1(tmp_path, capsys):
    path = write_ours(tmp_path / "ours.safetensors", lora_tensors())
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # one flipped byte in the tensor data
    path.write_bytes(bytes(data))
    code, out, rows = run(path, capsys)
    assert code == 1
    assert "MISMATCH" in rows["sshs_model_hash"] and "MISMATCH" in rows["modelspec.hash_sha256"]
    assert "DAMAGED or changed" in out


def test_our_file_with_edited_training_keys_is_intact(tmp_path, capsys):
    path = write_ours(tmp_path / "ours.safetensors", lora_tensors())
    meta = read_metadata(path)
    meta["ss_training_comment"] = "edited later by a metadata editor"
    save_file(load_safetensors(path), str(path), meta)
    code, out, rows = run(path, capsys)
    assert code == 0
    assert "  OK" in rows["sshs_model_hash"] and "  OK" in rows["modelspec.hash_sha256"]
    assert "stale" in rows["sshs_legacy_hash"] and "ss_* metadata was edited" in rows["sshs_legacy_hash"]
    assert "verdict: intact: the tensor data matches; sshs_legacy_hash left stale" in out


def test_our_file_resized_by_sd_scripts(tmp_path, capsys):
    """resize_lora: new tensors, its ss_* edits, sshs_* recomputed, our modelspec keys copied (hash_sha256 stale)."""
    src = write_ours(tmp_path / "ours.safetensors", lora_tensors(rank=16))
    meta = dict(read_metadata(src))
    sd = load_safetensors(src)
    resized = {k: (v[:8] if "lora_down" in k else v[:, :8] if "lora_up" in k else torch.tensor(8.0)) for k, v in sd.items()}
    resized = {k: v.contiguous() for k, v in resized.items()}
    meta["ss_training_comment"] = "dimension is resized from 16 to 8; None"
    meta["ss_network_dim"], meta["ss_network_alpha"] = "8", "8.0"
    meta["sshs_model_hash"], meta["sshs_legacy_hash"] = sd_scripts_hashes(resized, meta)
    out_path = tmp_path / "resized.safetensors"
    save_file(resized, str(out_path), meta)
    code, out, rows = run(out_path, capsys)
    assert code == 0
    assert "  OK" in rows["sshs_model_hash"] and "  OK" in rows["sshs_legacy_hash"]
    assert "stale" in rows["modelspec.hash_sha256"] and "resize_lora" in rows["modelspec.hash_sha256"]
    assert "MISMATCH" not in out and "verdict: intact: the tensor data matches; modelspec.hash_sha256 left stale" in out


def sd_scripts_file(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    meta = {"ss_network_module": "networks.lora", "ss_base_model_version": "flux1",
            "modelspec.implementation_version": "sd-scripts/0123abcd", "modelspec.architecture": "flux-1-dev/lora"}
    meta["sshs_model_hash"], meta["sshs_legacy_hash"] = sd_scripts_hashes(tensors, meta)
    save_file(tensors, str(path), meta)
    return path


def test_sd_scripts_file(tmp_path, capsys):
    code, out, rows = run(sd_scripts_file(tmp_path / "sd.safetensors", lora_tensors(seed=1)), capsys)
    assert code == 0 and "  OK" in rows["sshs_model_hash"] and "  OK" in rows["sshs_legacy_hash"]
    assert "not stored" in rows["modelspec.hash_sha256"]
    assert "verdict: written by sd-scripts: the stored hashes that can be recomputed match" in out


def test_another_tools_file_whose_hash_differs_is_not_judged(tmp_path, capsys):
    """A converter that casts the tensors and copies the metadata without recomputing the hashes."""
    path = sd_scripts_file(tmp_path / "sd.safetensors", lora_tensors(seed=1))
    meta = read_metadata(path)
    save_file({k: v.half() for k, v in load_safetensors(path).items()}, str(path), meta)
    code, out, rows = run(path, capsys)
    assert code == 0 and "MISMATCH" in rows["sshs_model_hash"]
    assert "written by sd-scripts: some stored hashes differ from the file; not judged as damage" in out


def test_lycoris_files(tmp_path, capsys):
    tensors = lora_tensors(seed=2)
    for version in ("sd-scripts/0123abcd", f"{model_spec.IMPLEMENTATION_NAME}/0123abcd"):  # trained by either
        meta = {"ss_network_module": "lycoris.kohya", "modelspec.implementation_version": version,
                "sshs_model_hash": lycoris_hash(tensors)}
        path = tmp_path / "lycoris.safetensors"
        save_file(tensors, str(path), meta)
        code, out, rows = run(path, capsys)
        assert code == 0
        assert "not checked" in rows["sshs_model_hash"] and "LyCORIS' format" in rows["sshs_model_hash"]
        assert "no hash that can be recomputed here, nothing verified" in out


def test_file_without_metadata(tmp_path, capsys):
    path = tmp_path / "bare.safetensors"
    save_file(lora_tensors(rank=2, width=64), str(path))
    code, out, rows = run(path, capsys)
    assert code == 0 and all("not stored" in r for r in rows.values())
    assert "verdict: written by another tool: no hash that can be recomputed here" in out
