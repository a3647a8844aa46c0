"""Base-model keys (ss_sd_model_*, ss_vae_*): sd-scripts' hash definitions, shards, the cache, the background thread,
and a training run whose early save comes before the sha256 is known."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path

from library.files import base_model_hash as bmh
from library.files.safetensors_io import read_metadata
from tests.test_trainer import base_args, make_toy_dataset, train


def _sd_scripts_model_hash(data: bytes) -> str:
    """sd-scripts' train_util.model_hash: sha256 of the 64 KiB at 0x100000, first 8 hex digits."""
    return hashlib.sha256(data[0x100000:0x110000]).hexdigest()[:8]


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_single_file_hashes_are_sd_scripts_values(tmp_path):
    data = os.urandom(0x100000 + 0x18000)
    f = _write(tmp_path / "model.safetensors", data)
    assert bmh.legacy_model_hash([f]) == _sd_scripts_model_hash(data)
    assert bmh.sha256_of_files([f], block=4096) == hashlib.sha256(data).hexdigest()
    small = _write(tmp_path / "small.safetensors", b"x" * 1000)
    assert bmh.legacy_model_hash([small]) == hashlib.sha256(b"").hexdigest()[:8] == "e3b0c442"


def test_sharded_model_is_the_concatenation_of_its_shards(tmp_path):
    parts = [os.urandom(n) for n in (700_000, 400_000, 300_000)]  # 0x100000 + 64 KiB crosses shards 2 and 3
    files = [_write(tmp_path / f"m-{i + 1:05d}-of-00003.safetensors", p) for i, p in enumerate(parts)]
    whole = b"".join(parts)
    assert bmh.legacy_model_hash(files) == _sd_scripts_model_hash(whole)
    assert bmh.sha256_of_files(files, block=65536) == hashlib.sha256(whole).hexdigest()


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(bmh.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert bmh.cache_dir() == tmp_path / "xdg" / "moss-image-scripts"
    monkeypatch.setenv(bmh.CACHE_DIR_ENV, str(tmp_path / "own"))
    assert bmh.cache_dir() == tmp_path / "own"
    monkeypatch.delenv(bmh.CACHE_DIR_ENV)
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert bmh.cache_dir() == tmp_path / "home" / ".cache" / "moss-image-scripts"
    assert bmh.HashCache().path == tmp_path / "home" / ".cache" / "moss-image-scripts" / bmh.CACHE_FILE_NAME


def test_cache_is_keyed_by_path_size_and_mtime(tmp_path):
    f = _write(tmp_path / "a.safetensors", b"abc" * 1000)
    cache = bmh.HashCache(tmp_path / "cache" / "hashes.json")
    assert cache.get([f]) is None
    cache.put([f], "d" * 64)
    assert cache.get([f]) == "d" * 64
    assert bmh.HashCache(cache.path).get([f]) == "d" * 64  # from the file
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 1_000_000_000))
    assert cache.get([f]) is None  # touched: hashed again
    cache.put([f], "e" * 64)
    f.write_bytes(b"abcd" * 1000)
    assert cache.get([f]) is None  # rewritten
    cache.path.write_text("{not json")
    assert cache.get([f]) is None
    cache.put([f], "f" * 64)
    assert cache.get([f]) == "f" * 64


def test_unwritable_cache_is_no_error(tmp_path):
    f = _write(tmp_path / "a.safetensors", b"abc")
    blocker = _write(tmp_path / "blocker", b"")
    cache = bmh.HashCache(blocker / "sub" / "hashes.json")  # its folder cannot be created
    cache.put([f], "a" * 64)
    assert cache.get([f]) is None


def test_background_hash_names_keys_and_uses_the_cache(tmp_path, monkeypatch, caplog):
    dit = [_write(tmp_path / f"dit-{i:05d}-of-00002.safetensors", os.urandom(600_000)) for i in (1, 2)]
    vae = _write(tmp_path / "flux2-vae.safetensors", os.urandom(1_200_000))
    cache = bmh.HashCache(tmp_path / "hashes.json")
    gate = threading.Event()
    real = bmh.sha256_of_files

    def gated(files, block=bmh.READ_BLOCK):
        gate.wait(30)
        return real(files, block)

    monkeypatch.setattr(bmh, "sha256_of_files", gated)
    hashes = bmh.BaseModelHashes({"sd_model": dit, "vae": [vae]}, cache).start()
    early = hashes.metadata()
    assert early == {"ss_sd_model_name": "dit-00001-of-00002.safetensors", "ss_sd_model_hash": bmh.legacy_model_hash(dit),
                     "ss_vae_name": "flux2-vae.safetensors", "ss_vae_hash": bmh.legacy_model_hash([vae])}
    assert hashes.pending_keys() == ["ss_new_sd_model_hash", "ss_new_vae_hash"] and not hashes.done()
    caplog.set_level(logging.INFO)
    threading.Timer(0.2, gate.set).start()
    final = hashes.metadata(wait=True)  # the final save waits
    assert "waiting for the sha256 of the base model files (ss_new_sd_model_hash, ss_new_vae_hash)" in caplog.text
    assert final["ss_new_sd_model_hash"] == hashlib.sha256(b"".join(p.read_bytes() for p in dit)).hexdigest()
    assert final["ss_new_vae_hash"] == hashlib.sha256(vae.read_bytes()).hexdigest()
    assert hashes.pending_keys() == [] and hashes.done()

    def fail(*a, **k):
        raise AssertionError("hashed again despite the cache")

    monkeypatch.setattr(bmh, "sha256_of_files", fail)
    again = bmh.BaseModelHashes({"sd_model": dit, "vae": [vae]}, cache).start()
    assert again.done() and again.metadata() == final  # a second run has it at once


def test_a_vanished_file_leaves_the_key_out(tmp_path, caplog):
    f = _write(tmp_path / "vae.safetensors", os.urandom(2000))
    hashes = bmh.BaseModelHashes({"vae": [f]}, None)
    f.unlink()
    caplog.set_level(logging.WARNING)
    assert "ss_new_vae_hash" not in hashes.start().metadata(wait=True)
    assert "ss_new_vae_hash is left out" in caplog.text


def test_training_writes_the_base_model_keys_and_an_early_save_comes_first(tiny_snapshot, tmp_path, monkeypatch,
                                                                         caplog):
    out = tmp_path / "out"
    step1 = out / "toy-step00000001.safetensors"
    real = bmh.sha256_of_files

    def after_the_first_save(files, block=bmh.READ_BLOCK):  # the sha256 finishes only after the step-1 save
        deadline = time.monotonic() + 120
        while not step1.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return real(files, block)

    monkeypatch.setattr(bmh, "sha256_of_files", after_the_first_save)
    monkeypatch.setenv(bmh.CACHE_DIR_ENV, str(tmp_path / "hash_cache"))
    caplog.set_level(logging.INFO)
    data = make_toy_dataset(tmp_path / "data", n=2)
    train(base_args(tiny_snapshot, data, out, "--max_train_steps", "2", "--save_every_n_steps", "1",
                    "--logging_dir", str(tmp_path / "logs"), "--log_config", "--wandb_api_key", "sekrit-42"))

    shards = sorted((tiny_snapshot / "transformer").glob("*-of-*.safetensors"))
    dit_bytes = b"".join(p.read_bytes() for p in shards)
    vae_bytes = (tiny_snapshot / "vae" / "diffusion_pytorch_model.safetensors").read_bytes()
    expected = {
        "ss_sd_model_name": shards[0].name,
        "ss_sd_model_hash": _sd_scripts_model_hash(dit_bytes),
        "ss_new_sd_model_hash": hashlib.sha256(dit_bytes).hexdigest(),
        "ss_vae_name": "diffusion_pytorch_model.safetensors",
        "ss_vae_hash": _sd_scripts_model_hash(vae_bytes),
        "ss_new_vae_hash": hashlib.sha256(vae_bytes).hexdigest(),
    }
    final = read_metadata(out / "toy.safetensors")
    assert {k: final.get(k) for k in expected} == expected
    early = read_metadata(step1)
    assert {k: early.get(k) for k in expected} == {**expected, "ss_new_sd_model_hash": None, "ss_new_vae_hash": None}
    assert "toy-step00000001.safetensors: ss_new_sd_model_hash, ss_new_vae_hash left out" in caplog.text
    # no option value that is a path or a secret reached the metadata or the tracker config
    for meta in (final, early):
        assert not any(str(tmp_path) in v or "sekrit" in v for v in meta.values())
    hparams = list((tmp_path / "logs").rglob("hparams.yml"))
    assert hparams
    text = hparams[0].read_text()
    assert "learning_rate" in text and "sekrit" not in text and str(tmp_path) not in text
    for events in (tmp_path / "logs").rglob("events.out.tfevents.*"):
        assert b"sekrit" not in events.read_bytes()


def test_no_metadata_does_not_hash(tiny_snapshot, tmp_path, monkeypatch):
    def fail(*a, **k):
        raise AssertionError("--no_metadata writes no base-model keys, so nothing is hashed")

    monkeypatch.setattr(bmh, "legacy_model_hash", fail)
    data = make_toy_dataset(tmp_path / "data", n=2)
    train(base_args(tiny_snapshot, data, tmp_path / "out", "--max_train_steps", "1", "--no_metadata"))
    meta = read_metadata(tmp_path / "out" / "toy.safetensors")
    assert "ss_sd_model_name" not in meta and "ss_new_sd_model_hash" not in meta
