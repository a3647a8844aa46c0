"""The text-encoder output caches record what --base_weights merge into the text encoder: the identity (headers only
for files without text-encoder keys; order, multipliers and the text-encoder tensors count, the DiT part does not),
the strategy's check (old files without the record stay valid without base weights), and trainer runs that add
base weights with and without text-encoder keys or change the multiplier."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

import library.caching.strategies as sm
import library.text_encoder.base_weights as tbw
from library.errors import UserError
from library.files.safetensors_io import save_file_atomic
from library.text_encoder.base_weights import text_encoder_base_weights_identity as identity
from tests.test_caching import FakeTextEncoder, image_folder, te_groups
from tests.test_te_lazy_load import LoadSpy, te_disk_args
from tests.test_trainer import make_toy_dataset, train



def lora_file(path: Path, te: bool = True, dit: bool = True, seed: int = 0, prefix: str = "sd") -> Path:
    """A LoRA for the tiny snapshot: `layers.0.mlp.up_proj` of the text encoder and `text_embedder.proj` of the DiT."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    if te:
        head = "lora_te_layers_0_mlp_up_proj." if prefix == "sd" else "text_encoder.layers.0.mlp.up_proj."
        down, up = ("lora_down", "lora_up") if prefix == "sd" else ("lora_A", "lora_B")
        sd[f"{head}{down}.weight"] = torch.randn(4, 64, generator=g)
        sd[f"{head}{up}.weight"] = torch.randn(128, 4, generator=g)
        if prefix == "sd":
            sd[f"{head}alpha"] = torch.tensor(4.0)
    if dit:
        name = "lora_unet_text_embedder_proj." if prefix == "sd" else "diffusion_model.text_embedder.proj."
        down, up = ("lora_down", "lora_up") if prefix == "sd" else ("lora_A", "lora_B")
        sd[f"{name}{down}.weight"] = torch.randn(4, 64, generator=g)
        sd[f"{name}{up}.weight"] = torch.randn(64, 4, generator=g) * 0.01
        if prefix == "sd":
            sd[f"{name}alpha"] = torch.tensor(4.0)
    save_file_atomic(sd, path)
    return path


# ---------------------------------------------------------------------------------------------- the identity
def test_no_text_encoder_part_is_the_empty_identity_and_reads_no_tensor(tmp_path, monkeypatch):
    dit_only = lora_file(tmp_path / "dit.safetensors", te=False)

    def no_reads(path, keys):
        raise AssertionError(f"tensors of {path} were read")

    monkeypatch.setattr(tbw, "_text_encoder_digest", no_reads)
    assert identity(None) == identity([]) == ""
    assert identity([str(dit_only)]) == identity([str(dit_only)], [0.3]) == ""
    te = lora_file(tmp_path / "te.safetensors")
    assert identity([str(te)], [0.0]) == ""  # merged with 0: the merge skips it


def test_the_identity_follows_the_text_encoder_tensors_and_multipliers(tmp_path):
    te = str(lora_file(tmp_path / "te.safetensors"))
    dit_only = str(lora_file(tmp_path / "dit.safetensors", te=False))
    one = identity([te])
    assert len(one) == 16 and int(one, 16) >= 0
    assert identity([te]) == one == identity([te], [1.0]) == identity([dit_only, te], [0.5, 1.0])
    assert identity([te], [0.5]) != one
    assert identity([te, te]) != one
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(Path(te).read_bytes())
    assert identity([str(copy)]) == one  # the name does not count
    other_te = str(lora_file(tmp_path / "other_te.safetensors", seed=1))
    assert identity([other_te]) != one
    assert identity([te, other_te]) != identity([other_te, te])  # the order counts (fp32 sums)
    # another DiT part with the same text-encoder tensors (and metadata): the same identity
    from library.files.safetensors_io import load_safetensors

    sd = load_safetensors(te)
    sd["lora_unet_text_embedder_proj.lora_up.weight"] = torch.zeros(64, 4)
    save_file_atomic(sd, tmp_path / "new_dit.safetensors", {"ss_note": "changed"})
    assert identity([str(tmp_path / "new_dit.safetensors")]) == one
    peft = str(lora_file(tmp_path / "peft.safetensors", prefix="peft"))  # text_encoder.* keys count as well
    assert identity([peft]) not in ("", one)


def test_identity_errors_name_the_file(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        identity([str(tmp_path / "missing.safetensors")])
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"nonsense")
    with pytest.raises(UserError, match="bad.safetensors"):
        identity([str(bad)])
    te = str(lora_file(tmp_path / "te.safetensors"))
    with pytest.raises(UserError, match="one --base_weights_multiplier per file"):
        identity([te], [1.0, 0.5])


# ------------------------------------------------------------------------------------------------ the strategy
def cache(tmp_path: Path, folder: Path, te_base_weights: str = "") -> tuple[int, FakeTextEncoder]:
    enc = FakeTextEncoder()
    strategy = sm.MossImageTextEncoderOutputsCachingStrategy(True, te_base_weights=te_base_weights)
    return sm.cache_text_encoder_outputs([te_groups(tmp_path, folder)], enc, strategy, show_progress=False), enc


def test_the_strategy_records_and_checks_the_identity(tmp_path):
    folder = image_folder(tmp_path / "a", ["one", "two"])
    assert cache(tmp_path, folder)[0] == 2
    assert str(sm.load_npz(folder / "img0_moss_te.npz")["te_base_weights"]) == ""
    assert cache(tmp_path, folder)[0] == 0
    assert cache(tmp_path, folder, "0123456789abcdef")[0] == 2  # base weights added: re-made
    assert str(sm.load_npz(folder / "img1_moss_te.npz")["te_base_weights"]) == "0123456789abcdef"
    assert cache(tmp_path, folder, "0123456789abcdef")[0] == 0
    assert cache(tmp_path, folder, "fedcba9876543210")[0] == 2  # other base weights
    assert cache(tmp_path, folder)[0] == 2  # none again


def test_files_without_the_record_are_valid_only_without_base_weights(tmp_path):
    folder = image_folder(tmp_path / "a", ["one", "two"])
    cache(tmp_path, folder)
    for path in folder.glob("*_moss_te.npz"):  # as made by an older version
        arrays = sm.load_npz(path)
        del arrays["te_base_weights"]
        sm.save_npz_atomic(path, arrays)
    assert cache(tmp_path, folder)[0] == 0
    old = FakeTextEncoder.outputs("older single-candidate form")
    sm.save_npz_atomic(folder / "img0_moss_te.npz", {"prompt_embeds": old[0].numpy(), "attn_mask": old[1].numpy()})
    strategy = sm.MossImageTextEncoderOutputsCachingStrategy(True)
    assert strategy.is_disk_cached_outputs_expected(str(folder / "img0_moss_te.npz"), ["one"])
    strategy = sm.MossImageTextEncoderOutputsCachingStrategy(True, te_base_weights="0123456789abcdef")
    assert not strategy.is_disk_cached_outputs_expected(str(folder / "img0_moss_te.npz"), ["one"])
    assert cache(tmp_path, folder, "0123456789abcdef")[0] == 2
    skip = sm.MossImageTextEncoderOutputsCachingStrategy(True, skip_disk_cache_validity_check=True)
    assert skip.is_disk_cached_outputs_expected(str(folder / "img0_moss_te.npz"), ["one"])


# ---------------------------------------------------------------------------------------------------- trainer
def embeds(data: Path) -> np.ndarray:
    return sm.load_npz(data / "4_toy" / "img0_moss_te.npz")["prompt_embeds_0"]


def test_trainer_remakes_the_caches_when_base_weights_change_the_text_encoder(tiny_snapshot, tmp_path, monkeypatch,
                                                                              caplog):
    data = make_toy_dataset(tmp_path / "data", n=2)
    te = str(lora_file(tmp_path / "te.safetensors"))
    dit_only = str(lora_file(tmp_path / "dit.safetensors", te=False))
    spy = LoadSpy(monkeypatch)

    def run(name: str, *extra: str) -> None:
        train(te_disk_args(tiny_snapshot, data, tmp_path / name, "--max_train_steps", "1", *extra))

    run("plain")
    plain = embeds(data)
    assert spy.calls == 1

    caplog.clear()
    with caplog.at_level(logging.INFO):
        run("dit_only", "--base_weights", dit_only)  # the DiT changes, the text encoder does not
    assert spy.calls == 1 and "all 2 text-encoder cache files are valid" in caplog.text
    assert "merged 1 lora_unet LoRA modules" in caplog.text

    caplog.clear()
    with caplog.at_level(logging.INFO):
        run("te", "--base_weights", dit_only, te)
    assert spy.calls == 2 and "text encoder outputs: 2 images encoded by this process" in caplog.text
    assert "merged 1 lora_te LoRA modules" in caplog.text
    with_te = embeds(data)
    assert not np.array_equal(with_te, plain)  # the merged encoder gives other outputs
    recorded = str(sm.load_npz(data / "4_toy" / "img1_moss_te.npz")["te_base_weights"])
    assert recorded == tbw.text_encoder_base_weights_identity([dit_only, te]) != ""

    run("te_again", "--base_weights", te)  # the same text-encoder part: valid
    assert spy.calls == 2

    run("half", "--base_weights", te, "--base_weights_multiplier", "0.5")  # another multiplier: re-made
    assert spy.calls == 3 and not np.array_equal(embeds(data), with_te)

    run("plain_again")  # no base weights any more: re-made, the same outputs as at first
    assert spy.calls == 4 and np.array_equal(embeds(data), plain)
