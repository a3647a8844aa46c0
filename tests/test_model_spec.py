"""library.files.model_spec (ss_* / modelspec.* metadata, sshs hashes) and tools/show_metadata.py."""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from library.files import model_spec
from library.files.safetensors_io import load_safetensors, read_metadata, save_file_atomic
from networks.lora_generic import create_network
from tests.moss_lora_fakes import MossImage
from tools import show_metadata


def args_namespace(**overrides) -> argparse.Namespace:
    values = dict(
        output_name="my_moss_lora", learning_rate=1e-4, text_encoder_lr=None, unet_lr=None,
        network_module="networks.lora_generic", network_dim=None, network_alpha=None, network_dropout=None,
        network_args=["train_text_embedder=True", "verbose=False"], mixed_precision="bf16",
        gradient_checkpointing=True, seed=42, max_train_steps=1600, weighting_scheme="logit_normal",
        logit_mean=-1.09, logit_std=0.95, mode_scale=1.29, timestep_sampling="sigma", sigmoid_scale=1.0,
        discrete_flow_shift=1.0, resolution="1024,768", metadata_title=None, metadata_author="me",
        metadata_description=None, metadata_license="apache-2.0", metadata_tags="style, test",
    )
    values.update(overrides)
    return argparse.Namespace(**values)


# ----------------------------------------------------------------------------------------------------------------------
# hashes against independent computations


def test_model_hash_of_a_hand_built_file():
    data = struct.pack("<4f", 1.0, 2.0, 3.0, 4.0) + struct.pack("<2h", 7, -7)
    header = json.dumps(
        {
            "__metadata__": {"ss_a": "1"},
            "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
            "b": {"dtype": "I16", "shape": [2], "data_offsets": [16, 20]},
        }
    ).encode()
    header += b" " * (-len(header) % 8)
    buffer = struct.pack("<Q", len(header)) + header + data
    assert model_spec.model_hash_of_buffer(buffer) == hashlib.sha256(data).hexdigest()
    tensors = {"a": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "b": torch.tensor([7, -7], dtype=torch.int16)}
    model_hash, legacy = model_spec.precalculate_safetensors_hashes(tensors, {"ss_a": "1", "modelspec.title": "t"})
    assert model_hash == hashlib.sha256(data).hexdigest()
    assert legacy == hashlib.sha256(b"").hexdigest()[:8] == "e3b0c442"  # smaller than 1 MiB: the legacy window is empty


def test_hashes_match_files_written_to_disk(tmp_path):
    tensors = {
        "w": torch.arange(300_000, dtype=torch.float32).reshape(600, 500),
        "b": torch.ones(3, dtype=torch.bfloat16),
    }
    metadata = {"ss_network_dim": "4", "ss_tag_frequency": json.dumps({"a": {"cat": 3}}), "modelspec.title": "x"}
    model_spec.add_hashes(tensors, metadata)

    # independent: the file as it is written (all metadata) -> sha256 of the bytes after the header
    full = tmp_path / "full.safetensors"
    save_file_atomic(tensors, full, metadata)
    raw = full.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert metadata["sshs_model_hash"] == hashlib.sha256(raw[8 + n :]).hexdigest()
    assert metadata["modelspec.hash_sha256"] == "0x" + metadata["sshs_model_hash"]
    assert model_spec.file_model_hash(full) == metadata["sshs_model_hash"]

    # independent: the legacy hash is over the serialisation with only ss_* metadata, 64 KiB at 1 MiB
    ss_only = tmp_path / "ss.safetensors"
    save_file(tensors, str(ss_only), metadata={k: v for k, v in metadata.items() if k.startswith("ss_")})
    raw = ss_only.read_bytes()
    assert len(raw) > 0x110000
    assert metadata["sshs_legacy_hash"] == hashlib.sha256(raw[0x100000:0x110000]).hexdigest()[:8]
    assert model_spec.file_legacy_hash(full) == metadata["sshs_legacy_hash"]

    # editing non-ss metadata changes neither hash
    edited = tmp_path / "edited.safetensors"
    save_file_atomic(tensors, edited, {**metadata, "modelspec.description": "a long new description " * 50})
    assert model_spec.file_model_hash(edited) == metadata["sshs_model_hash"]
    assert model_spec.file_legacy_hash(edited) == metadata["sshs_legacy_hash"]


def test_whole_file_hashes(tmp_path):
    path = tmp_path / "blob.bin"
    payload = bytes(range(256)) * 5000
    path.write_bytes(payload)
    assert model_spec.file_sha256(path) == hashlib.sha256(payload).hexdigest()
    assert model_spec.file_short_hash(path) == hashlib.sha256(payload[0x100000:0x110000]).hexdigest()[:8]


# ----------------------------------------------------------------------------------------------------------------------
# ss_* metadata


def test_training_metadata_from_args():
    md = model_spec.training_metadata(
        args_namespace(), num_train_images=10, ss_num_epochs=3, optimizer="AdamW()",
        dataset_metadata={"ss_tag_frequency": {"img": {"cat": 2}}, "datasets": '[{"is_dreambooth": true}]'},
    )
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in md.items())
    assert md["ss_output_name"] == "my_moss_lora" and md["ss_learning_rate"] == "0.0001"
    assert md["ss_network_dim"] == "4" and md["ss_network_alpha"] == "1.0"  # the module defaults
    assert md["ss_text_encoder_lr"] == "None" and md["ss_gradient_checkpointing"] == "True"
    assert json.loads(md["ss_network_args"]) == {"train_text_embedder": "True", "verbose": "False"}
    assert md["ss_num_train_images"] == "10" and md["ss_num_epochs"] == "3" and md["ss_optimizer"] == "AdamW()"
    assert md["ss_v2"] == "False" and md["ss_base_model_version"] == model_spec.BASE_MODEL_VERSION
    assert int(md["ss_session_id"]) >= 0 and float(md["ss_training_started_at"]) > 0
    assert md["ss_sd_scripts_commit_hash"]
    assert json.loads(md["ss_tag_frequency"]) == {"img": {"cat": 2}}
    assert md["ss_datasets"] == '[{"is_dreambooth": true}]'
    assert "ss_clip_skip" not in md and "ss_noise_offset" not in md  # SD-only keys are not written
    md2 = model_spec.training_metadata(args_namespace(network_args=None), session_id=7, training_started_at=1.5)
    assert "ss_network_args" not in md2 and md2["ss_session_id"] == "7" and md2["ss_training_started_at"] == "1.5"


def test_moss_image_keys_of_the_seed():
    md = model_spec.moss_image_metadata(args_namespace(), dit_convrot_int8=True, text_encoder_convrot_int8=False)
    assert md == {
        "ss_weighting_scheme": "logit_normal",
        "ss_logit_mean": "-1.09",
        "ss_logit_std": "0.95",
        "ss_mode_scale": "1.29",
        "ss_timestep_sampling": "sigma",
        "ss_sigmoid_scale": "1.0",
        "ss_discrete_flow_shift": "1.0",
        "ss_convrot_int8": "True",
        "ss_convrot_int8_text_encoder": "False",
    }


def test_save_time_and_minimal_metadata():
    md = model_spec.training_metadata(args_namespace())
    md.update(model_spec.modelspec_from_args(args_namespace(), timestamp=0))
    saved = model_spec.save_time_metadata(md, steps=120, epoch=2, finished_at=99.0)
    assert saved["ss_steps"] == "120" and saved["ss_epoch"] == "2" and saved["ss_training_finished_at"] == "99.0"
    assert "ss_steps" not in md
    minimal = model_spec.minimal_metadata(saved)
    assert set(k for k in minimal if k.startswith("ss_")) == set(model_spec.MINIMAL_KEYS)
    assert minimal["modelspec.architecture"] == "moss-image-base/lora"


# ----------------------------------------------------------------------------------------------------------------------
# modelspec


def test_modelspec_keys(tmp_path):
    thumb = tmp_path / "thumb.png"
    thumb.write_bytes(b"\x89PNG fake")
    ts = 1_700_000_000.7
    md = model_spec.modelspec_from_args(args_namespace(metadata_thumbnail=str(thumb)), timestamp=ts)
    assert md["modelspec.sai_model_spec"] == "1.0.1"
    assert md["modelspec.architecture"] == "moss-image-base/lora"
    assert md["modelspec.implementation"] == model_spec.IMPLEMENTATION
    assert md["modelspec.title"] == "my_moss_lora"
    assert md["modelspec.resolution"] == "1024x768"
    assert md["modelspec.date"] == datetime.datetime.fromtimestamp(1_700_000_000).isoformat()
    assert md["modelspec.prediction_type"] == "flow"
    assert md["modelspec.author"] == "me" and md["modelspec.license"] == "apache-2.0"
    assert md["modelspec.tags"] == "style, test"
    assert md["modelspec.thumbnail"].startswith("data:image/png;base64,")
    assert md["modelspec.implementation_version"].startswith("moss-image-scripts/")
    assert "modelspec.description" not in md and "modelspec.timestep_range" not in md
    base = model_spec.modelspec_metadata("Full model", ts, None, lora=False, timestep_range=(0, 500))
    assert base["modelspec.architecture"] == "moss-image-base" and base["modelspec.resolution"] == "1024x1024"
    assert base["modelspec.timestep_range"] == "0,500"
    no_title = args_namespace(output_name=None, metadata_thumbnail="nope.png")
    untitled = model_spec.modelspec_from_args(no_title, timestamp=ts)
    assert untitled["modelspec.title"] == "LoRA@1700000000" and "modelspec.thumbnail" not in untitled


@pytest.mark.parametrize(
    "value, expected", [(None, "1024x1024"), (512, "512x512"), ("768", "768x768"), ("1024,576", "1024x576"),
                        ("640x480", "640x480"), ((832, 1216), "832x1216")]
)
def test_format_resolution(value, expected):
    assert model_spec.format_resolution(value) == expected


# ----------------------------------------------------------------------------------------------------------------------
# a saved LoRA and tools/show_metadata.py


def saved_lora(tmp_path):
    torch.manual_seed(0)
    net = create_network(1.0, 4, 1.0, None, None, MossImage())
    args = args_namespace()
    metadata = model_spec.training_metadata(args)
    metadata.update(model_spec.moss_image_metadata(args, False, False))
    metadata.update(model_spec.modelspec_from_args(args))
    metadata["ss_tag_frequency"] = model_spec.json_value({"img": {"a cat": 2, "a dog": 1}})
    path = tmp_path / "my_moss_lora.safetensors"
    net.save_weights(path, torch.bfloat16, model_spec.save_time_metadata(metadata, 10, 1))
    return path


def test_saved_lora_hashes_and_show_metadata(tmp_path, capsys):
    path = saved_lora(tmp_path)
    meta = read_metadata(path)
    assert meta["sshs_model_hash"] == model_spec.file_model_hash(path)
    assert meta["sshs_legacy_hash"] == model_spec.file_legacy_hash(path)
    assert show_metadata.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "moss-image-base/lora" in out and "ss_discrete_flow_shift" in out and "ss_convrot_int8" in out
    assert "LoRA modules: {'DiT': 18}" in out and "ranks: {4: 18}" in out
    assert out.count(" OK") == 3
    assert show_metadata.main([str(path), "--full"]) == 0
    assert '"a cat": 2' in capsys.readouterr().out
    assert show_metadata.main([str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["modelspec.title"] == "my_moss_lora"


def test_show_metadata_detects_tampering_and_bad_files(tmp_path, capsys):
    path = saved_lora(tmp_path)
    sd = load_safetensors(path)
    key = next(iter(sd))
    sd[key] = sd[key] + 1
    tampered = tmp_path / "tampered.safetensors"
    save_file_atomic(sd, tampered, read_metadata(path))
    assert show_metadata.main([str(tampered)]) == 1
    assert "MISMATCH" in capsys.readouterr().out

    not_st = tmp_path / "lora.ckpt"
    not_st.write_bytes(b"pickle")
    assert show_metadata.main([str(not_st)]) == 2
    assert "not a .safetensors file" in capsys.readouterr().err
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\xff" * 64)
    assert show_metadata.main([str(garbage)]) == 2
    assert "not a readable safetensors file" in capsys.readouterr().err
    assert show_metadata.main([str(tmp_path / "missing.safetensors")]) == 2
    assert "does not exist" in capsys.readouterr().err
