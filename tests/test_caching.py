"""The MOSS-Image caching strategies and drivers (library/caching/strategies.py) with a fake VAE and text encoder:
file names, round trips, validity and re-cache rules, the older TE format, candidates, dropout, atomic writes and the
split of the work between processes."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import library.caching.strategies as sm
from library.datasets import build_dataset_groups
from library.datasets.dataset_group import prepare_image_for_cache
from library.errors import UserError
from library.text_encoder.qwen35 import PROMPT_TEMPLATE_ID
from tests.test_datasets_support import make_gradient, parse, write_caption, write_toml

SMALL = {
    "resolution": 64, "enable_bucket": True, "min_bucket_reso": 32, "max_bucket_reso": 128, "bucket_reso_steps": 16
}



class FakeVAE:
    """Raw latents [B, 32, H/8, W/8] computed from the pixels (so flips and crops show), counting images."""

    def __init__(self) -> None:
        self.images = 0

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        self.images += images.shape[0]
        pooled = torch.nn.functional.avg_pool2d(images.float(), 8)
        return pooled.repeat(1, 11, 1, 1)[:, :32] + torch.arange(32.0)[None, :, None, None] / 100


class FakeTextEncoder:
    """(embeds [len + 1, 4], mask) per caption, a function of the text; records what it encodes."""

    def __init__(self) -> None:
        self.encoded: list[str] = []

    @staticmethod
    def outputs(caption: str) -> tuple[torch.Tensor, torch.Tensor]:
        value = zlib.crc32(caption.encode()) % 1000 / 1000
        embeds = torch.full((len(caption) + 1, 4), value) + torch.arange(4.0)
        return embeds, torch.ones(len(caption) + 1, dtype=torch.bool)

    def __call__(self, captions):
        self.encoded += list(captions)
        return [self.outputs(c) for c in captions]

    @property
    def image_captions(self) -> list[str]:
        return [c for c in self.encoded if c]  # without the empty prompt encoded at every start


def build(tmp_path: Path, datasets, *argv: str):
    cfg = write_toml(tmp_path / "ds.toml", SMALL, datasets)
    return build_dataset_groups(parse(["--dataset_config", str(cfg), "--seed", "3", *argv]))


def image_folder(root: Path, captions: list[str], size=(96, 64)) -> Path:
    for i, cap in enumerate(captions):
        write_caption(make_gradient(root / f"img{i}.png", size), cap)
    return root


def te_groups(tmp_path: Path, folder: Path, **subset):
    train, _ = build(tmp_path, [({}, [{"image_dir": str(folder), "enable_multiline_caption": True, **subset}])])
    return train


def cache_te(group, encoder, skip_check: bool = False, to_disk: bool = True, max_token_length: int | None = None,
             variant: str | None = None):
    strategy = sm.MossImageTextEncoderOutputsCachingStrategy(to_disk, 2, skip_check, max_token_length=max_token_length,
                                                             encoder_variant=variant)
    return sm.cache_text_encoder_outputs([group, None], encoder, strategy, show_progress=False), strategy


def all_batches(group, epochs=range(1, 4)):
    for epoch in epochs:
        group.set_current_epoch(epoch)
        yield from (group[i] for i in range(len(group)))


# -------------------------------------------------------------------------------------------------- latents
def test_latent_file_name_carries_the_original_size():
    s = sm.MossImageLatentsCachingStrategy(cache_to_disk=True)
    path = s.get_latents_npz_path(os.path.join("d", "a.b.png"), (1024, 768))
    assert path == os.path.join("d", "a.b_1024x0768_moss.npz")
    assert s.get_image_size_from_disk_cache_path(path) == (1024, 768)
    assert s.get_image_size_from_disk_cache_path("d/a_12345x0768_moss.npz") == (12345, 768)
    assert s.get_image_size_from_disk_cache_path("d/a_moss_te.npz") is None
    assert s.get_image_size_from_disk_cache_path("d/a_1024x0768_sd.npz") is None
    assert s.latent_hw((96, 64)) == (8, 12)


def test_latents_round_trip_two_buckets_flip_and_alpha_in_one_file(tmp_path):
    img = np.zeros((60, 100, 4), np.uint8)
    img[..., 0] = np.linspace(0, 255, 100, dtype=np.uint8)[None]
    img[..., 3] = 255
    img[:, :30, 3] = 0
    (tmp_path / "a").mkdir()
    Image.fromarray(img, "RGBA").save(tmp_path / "a" / "pic.png")
    subset = {"image_dir": str(tmp_path / "a"), "flip_aug": True, "alpha_mask": True}
    train, _ = build(tmp_path, [({"resolution": 64}, [subset]), ({"resolution": 32}, [subset])])
    vae, strategy = FakeVAE(), sm.MossImageLatentsCachingStrategy(True, batch_size=4)
    assert sm.cache_latents([train], vae, strategy, show_progress=False) == 2
    files = sorted(p.name for p in (tmp_path / "a").iterdir() if p.suffix == ".npz")
    assert files == ["pic_0100x0060_moss.npz"]  # the ORIGINAL size, both buckets in one file
    infos = list(train.image_infos())
    assert len({i.bucket_reso for i in infos}) == 2
    data = sm.load_npz(infos[0].latents_npz)
    for info in infos:
        w, h = info.bucket_reso
        key = f"{h // 8}x{w // 8}"
        assert {f"latents_{key}", f"latents_flipped_{key}", f"alpha_mask_{key}"} <= set(data)
        assert data[f"original_size_{key}"].tolist() == [100, 60]
        prepared = prepare_image_for_cache(info)
        lat, mask = strategy.get_latents(info, flipped=False)
        flipped, _ = strategy.get_latents(info, flipped=True)
        assert torch.equal(lat, FakeVAE().encode(prepared.image[None])[0]) and lat.shape == (32, h // 8, w // 8)
        assert torch.equal(flipped, FakeVAE().encode(prepared.image[None].flip(-1))[0])
        assert torch.equal(mask, prepared.alpha_mask) and mask[:, 0].max() == 0 and mask[:, -1].min() == 1
        left, top, right, bottom = data[f"crop_ltrb_{key}"].tolist()
        assert (right - left, bottom - top) == (w, h)
    # batches carry the cached latents (flipped ones when the sample is flipped) and the masks
    for batch in all_batches(train):
        info = next(i for i in infos if i.bucket_reso == batch["bucket_reso"])
        lat, mask = strategy.get_latents(info, batch["flippeds"][0])
        assert batch["images"] is None and torch.equal(batch["latents"][0], lat)
        assert torch.equal(batch["alpha_masks"][0], mask.flip(-1) if batch["flippeds"][0] else mask)
    # a second run finds everything cached
    assert sm.cache_latents([train], vae, strategy, show_progress=False) == 0 and vae.images == 4


def test_latent_validity_rules(tmp_path, caplog):
    folder = image_folder(tmp_path / "a", ["x"])
    train, _ = build(tmp_path, [({}, [{"image_dir": str(folder)}])])
    vae, strategy = FakeVAE(), sm.MossImageLatentsCachingStrategy(True)
    sm.cache_latents([train], vae, strategy, show_progress=False)
    info = next(train.image_infos())
    path, bucket = info.latents_npz, info.bucket_reso
    assert strategy.is_disk_cached_latents_expected(bucket, path, False, False)
    assert not strategy.is_disk_cached_latents_expected((bucket[0] + 16, bucket[1]), path, False, False)
    assert not strategy.is_disk_cached_latents_expected(bucket, path, True, False)  # no flipped latents
    assert not strategy.is_disk_cached_latents_expected(bucket, path, False, True)  # no alpha mask
    assert not strategy.is_disk_cached_latents_expected(bucket, path + ".missing", False, False)
    trusting = sm.MossImageLatentsCachingStrategy(True, skip_disk_cache_validity_check=True)
    assert trusting.is_disk_cached_latents_expected(bucket, path, True, True)  # --skip_cache_check: file exists
    Path(path).write_bytes(b"PK\x03\x04 broken")
    assert not strategy.is_disk_cached_latents_expected(bucket, path, False, False)
    assert "unreadable latent cache" in caplog.text
    with pytest.raises(UserError, match="cannot be read.*delete it"):
        strategy.get_latents(info, flipped=False)
    assert sm.cache_latents([train], vae, strategy, show_progress=False) == 1  # the damaged file is replaced
    assert strategy.get_latents(info, flipped=False)[0].shape[0] == 32


def test_latents_in_memory_write_no_file(tmp_path):
    folder = image_folder(tmp_path / "a", ["x", "y"])
    train, _ = build(tmp_path, [({}, [{"image_dir": str(folder), "flip_aug": True}])])
    strategy = sm.MossImageLatentsCachingStrategy(cache_to_disk=False)
    assert sm.cache_latents([train], FakeVAE(), strategy, show_progress=False) == 2
    assert not list(folder.glob("*.npz"))
    info = next(train.image_infos())
    assert torch.equal(strategy.get_latents(info, True)[0], info.latents_flipped)


def test_caching_runs_with_full_fp32_matmuls_whatever_the_process_set(tmp_path):
    """The trainer turns TF32 on for its steps and leaves it on for the process: caching turns it off while it
    encodes (latents and text-encoder outputs), so a process's later runs cache what its first run and the cache
    tools cache, and puts the setting back afterwards."""
    seen: list[bool] = []
    matmul = torch.backends.cuda.matmul

    class RecordingVAE(FakeVAE):
        def encode(self, images: torch.Tensor) -> torch.Tensor:
            seen.append(matmul.allow_tf32)
            return super().encode(images)

    class RecordingTextEncoder(FakeTextEncoder):
        def __call__(self, captions):
            seen.append(matmul.allow_tf32)
            return super().__call__(captions)

    folder = image_folder(tmp_path / "a", ["x", "y"])
    train, _ = build(tmp_path, [({}, [{"image_dir": str(folder)}])])
    before = matmul.allow_tf32
    matmul.allow_tf32 = True
    try:
        assert sm.cache_latents([train], RecordingVAE(), sm.MossImageLatentsCachingStrategy(False),
                                show_progress=False)
        cache_te(train, RecordingTextEncoder(), to_disk=False)
        assert matmul.allow_tf32
    finally:
        matmul.allow_tf32 = before
    assert len(seen) >= 3 and not any(seen), seen  # a latents batch, the empty prompt, the captions


# -------------------------------------------------------------------------------------- text-encoder outputs
def test_te_cache_holds_every_candidate_and_the_uncond(tmp_path):
    folder = image_folder(tmp_path / "a", ["first\nline two\n---\nsecond", "only one"])
    group = te_groups(tmp_path, folder, caption_prefix="pre")
    enc = FakeTextEncoder()
    count, strategy = cache_te(group, enc)
    assert count == 2 and enc.encoded[0] == ""
    data = sm.load_npz(folder / "img0_moss_te.npz")
    assert int(data["num_candidates"]) == 2 and str(data["template"]) == PROMPT_TEMPLATE_ID
    assert [str(data["caption_0"]), str(data["caption_1"])] == ["pre first\nline two", "pre second"]
    for k in range(2):
        embeds, mask = FakeTextEncoder.outputs(str(data[f"caption_{k}"]))
        assert np.array_equal(data[f"prompt_embeds_{k}"], embeds.numpy()) and data[f"attn_mask_{k}"].all()
    assert np.array_equal(data["uncond_embeds"], FakeTextEncoder.outputs("")[0].numpy())
    assert int(sm.load_npz(folder / "img1_moss_te.npz")["num_candidates"]) == 1
    assert strategy.is_disk_cached_outputs_expected(str(folder / "img0_moss_te.npz"),
                                                    ["pre first\nline two", "pre second"])


def test_te_recache_rules_and_skip_cache_check(tmp_path):
    folder = image_folder(tmp_path / "a", ["one", "two\n---\nthree", "four"])
    group = te_groups(tmp_path, folder)
    assert cache_te(group, FakeTextEncoder())[0] == 3
    enc = FakeTextEncoder()
    assert cache_te(te_groups(tmp_path, folder), enc)[0] == 0 and enc.image_captions == []

    write_caption(folder / "img0.png", "one changed")  # caption text differs: only that file
    write_caption(folder / "img1.png", "two\n---\nthree\n---\nfive")  # candidate count differs
    enc = FakeTextEncoder()
    assert cache_te(te_groups(tmp_path, folder), enc)[0] == 2
    assert sorted(enc.image_captions) == ["five", "one changed", "three", "two"]

    enc = FakeTextEncoder()  # a prefix changes every cached text
    assert cache_te(te_groups(tmp_path, folder, caption_prefix="p:"), enc)[0] == 3

    path = folder / "img2_moss_te.npz"  # another prompt template
    sm.save_npz_atomic(path, {**sm.load_npz(path), "template": np.array("older-template")})
    write_caption(folder / "img0.png", "edited again")
    enc = FakeTextEncoder()  # --skip_cache_check trusts every existing file
    assert cache_te(te_groups(tmp_path, folder, caption_prefix="p:"), enc, skip_check=True)[0] == 0
    enc = FakeTextEncoder()
    assert cache_te(te_groups(tmp_path, folder, caption_prefix="p:"), enc)[0] == 2
    assert sorted(enc.image_captions) == ["p: edited again", "p: four"]

    path.write_bytes(b"not a zip at all")  # a damaged file is re-made, and reading it names it
    group = te_groups(tmp_path, folder, caption_prefix="p:")
    group.attach_text_encoder_outputs_cache(sm.MossImageTextEncoderOutputsCachingStrategy(True))
    info = next(i for i in group.image_infos() if i.te_outputs_npz == str(path))
    with pytest.raises(UserError, match="img2_moss_te.npz' cannot be read"):
        group.text_encoder_outputs_cache.get_outputs(info, 0, False)
    assert cache_te(group, FakeTextEncoder())[0] == 1


def test_te_cache_remade_when_the_token_limit_changes(tmp_path):
    folder = image_folder(tmp_path / "a", ["one", "two"])
    assert cache_te(te_groups(tmp_path, folder), FakeTextEncoder(), max_token_length=4096)[0] == 2
    assert cache_te(te_groups(tmp_path, folder), FakeTextEncoder(), max_token_length=4096)[0] == 0
    assert cache_te(te_groups(tmp_path, folder), FakeTextEncoder(), max_token_length=512)[0] == 2


def test_te_cache_remade_for_a_differently_quantised_encoder(tmp_path):
    folder = image_folder(tmp_path / "a", ["one", "two"])
    assert cache_te(te_groups(tmp_path, folder), FakeTextEncoder(), variant="none")[0] == 2
    assert cache_te(te_groups(tmp_path, folder), FakeTextEncoder(), variant="none")[0] == 0
    assert cache_te(te_groups(tmp_path, folder), FakeTextEncoder(), variant="convrot_int8")[0] == 2
    assert str(sm.load_npz(folder / "img0_moss_te.npz")["encoder"]) == "convrot_int8"


def test_older_single_candidate_files_stay_valid_and_dropout_uses_the_strategy_uncond(tmp_path):
    folder = image_folder(tmp_path / "a", ["a cat"])
    old = FakeTextEncoder.outputs("made by 0.12.1")
    sm.save_npz_atomic(folder / "img0_moss_te.npz", {"prompt_embeds": old[0].numpy(), "attn_mask": old[1].numpy()})
    group = te_groups(tmp_path, folder, caption_dropout_rate=0.5, num_repeats=8)
    enc = FakeTextEncoder()
    count, strategy = cache_te(group, enc)
    assert count == 0 and enc.image_captions == []  # valid for one candidate: not re-encoded
    dropped = kept = 0
    for batch in all_batches(group):
        embeds, _ = batch["text_encoder_outputs"][0]
        if batch["captions_dropped"][0]:
            dropped += 1
            assert torch.equal(embeds, strategy.uncond[0]) and embeds.shape[0] == 1  # the empty prompt
        else:
            kept += 1
            assert torch.equal(embeds, old[0])
    assert dropped and kept
    write_caption(folder / "img0.png", "a cat\n---\na small cat")  # two candidates: the old file is not enough
    enc = FakeTextEncoder()
    assert cache_te(te_groups(tmp_path, folder), enc)[0] == 1 and enc.image_captions == ["a cat", "a small cat"]


def test_dataset_picks_among_cached_candidates_and_dropout_gives_uncond(tmp_path):
    folder = image_folder(tmp_path / "a", ["long caption\nwith two lines\n---\nshort\n---\nmedium one"])
    group = te_groups(tmp_path, folder, caption_dropout_rate=0.3, num_repeats=10)
    count, strategy = cache_te(group, FakeTextEncoder())
    info = next(group.image_infos())
    texts = group.captions_for_text_encoder_cache(info)
    assert count == 1 and len(texts) == 3
    seen, dropped = set(), 0
    for batch in all_batches(group):
        for out, k, drop, caption in zip(batch["text_encoder_outputs"], batch["caption_candidate_indices"],
                                         batch["captions_dropped"], batch["captions"]):
            if drop:
                dropped += 1
                assert caption == "" and torch.equal(out[0], FakeTextEncoder.outputs("")[0])
            else:
                seen.add(k)
                assert caption == texts[k] and torch.equal(out[0], FakeTextEncoder.outputs(texts[k])[0])
    assert seen == {0, 1, 2} and dropped


def test_te_in_memory_and_two_subsets_with_different_captions(tmp_path):
    folder = image_folder(tmp_path / "a", ["x"])
    ds = [({}, [{"image_dir": str(folder), "caption_prefix": "A"}]), ({}, [{"image_dir": str(folder)}])]
    train, _ = build(tmp_path, ds)
    with pytest.raises(UserError, match="different captions.*one cache file"):
        cache_te(train, FakeTextEncoder())
    assert not list(folder.glob("*.npz"))
    count, strategy = cache_te(train, FakeTextEncoder(), to_disk=False)  # in memory each entry has its own
    assert count == 2 and not list(folder.glob("*.npz"))
    outs = [strategy.get_outputs(i, 0, False)[0] for i in train.image_infos()]
    assert torch.equal(outs[0], FakeTextEncoder.outputs("A x")[0])
    assert torch.equal(outs[1], FakeTextEncoder.outputs("x")[0])


# ------------------------------------------------------------------------------------------- atomic writes
def test_a_failing_write_leaves_no_file_and_no_temp_file(tmp_path, monkeypatch):
    target = tmp_path / "img_moss_te.npz"

    def broken_savez(file, *args, **kwds):
        if isinstance(file, (str, os.PathLike)):
            Path(file).write_bytes(b"PK\x03\x04 half of a file")
        else:
            file.write(b"PK\x03\x04 half of a file")
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", broken_savez)
    with pytest.raises(OSError, match="disk full"):
        sm.save_npz_atomic(target, {"a": np.zeros(3)})
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    sm.save_npz_atomic(target, {"a": np.ones(3)})
    monkeypatch.setattr(np, "savez", broken_savez)
    with pytest.raises(OSError):
        sm.save_npz_atomic(target, {"a": np.zeros(3)})
    assert [p.name for p in tmp_path.iterdir()] == [target.name]  # the previous file is intact
    assert sm.load_npz(target)["a"].tolist() == [1, 1, 1]


def test_cache_files_get_the_usual_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        sm.save_npz_atomic(tmp_path / "x.npz", {"a": np.zeros(1)})
    finally:
        os.umask(old)
    assert (tmp_path / "x.npz").stat().st_mode & 0o777 == 0o644


# ------------------------------------------------------------------------------------------ several processes
def test_my_share_splits_the_work():
    items = list(range(11))
    shares = [sm.my_share(items, p, 3) for p in range(3)]
    assert sorted(x for s in shares for x in s) == items
    assert [len(s) for s in shares] == [4, 4, 3]
    assert sm.my_share(items, 0, 1) == items


def test_processes_cache_disjoint_shares_whatever_the_order(tmp_path):
    folder = image_folder(tmp_path / "a", [f"caption {i}" for i in range(5)])
    written: dict[int, set[str]] = {}
    for process in (1, 0):  # process 1 finishes before process 0 looks at the files
        train, _ = build(tmp_path, [({}, [{"image_dir": str(folder), "enable_multiline_caption": True}])])
        before = set(os.listdir(folder))
        strategy = sm.MossImageTextEncoderOutputsCachingStrategy(True)
        n_te = sm.cache_text_encoder_outputs([train], FakeTextEncoder(), strategy, process, 2, False)
        n_lat = sm.cache_latents([train], FakeVAE(), sm.MossImageLatentsCachingStrategy(True), process, 2, False)
        written[process] = set(os.listdir(folder)) - before
        assert (n_te, n_lat) == ((3, 3) if process == 0 else (2, 2))
    assert not written[0] & written[1]
    assert len(list(folder.glob("*_moss_te.npz"))) == 5 and len(list(folder.glob("*_0096x0064_moss.npz"))) == 5


class Bf16TextEncoder(FakeTextEncoder):
    """FakeTextEncoder's outputs rounded to bf16, as a bf16 encoder gives them (widened to fp32 in the files)."""

    @staticmethod
    def outputs(caption: str) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, mask = FakeTextEncoder.outputs(caption)
        return embeds.bfloat16().float(), mask


def as_earlier_version(path: Path) -> None:
    """Rewrite a TE cache file as the versions before `encoder_dtype` wrote it."""
    data = sm.load_npz(path)
    del data["encoder_dtype"]
    sm.save_npz_atomic(path, data)


def test_te_cache_records_the_dtype_and_reads_no_embedding_to_check_it(tmp_path, monkeypatch):
    folder = image_folder(tmp_path / "a", ["one", "two"])
    assert cache_te(te_groups(tmp_path, folder), FakeTextEncoder(), variant="none_fp32")[0] == 2
    data = sm.load_npz(folder / "img0_moss_te.npz")
    assert (str(data["encoder"]), str(data["encoder_dtype"])) == ("none_fp32", "fp32")
    monkeypatch.setattr(sm, "_first_values", lambda *a: pytest.fail("an embedding was read"))
    assert cache_te(te_groups(tmp_path, folder), FakeTextEncoder(), variant="none_fp32")[0] == 0
    assert cache_te(te_groups(tmp_path, folder), FakeTextEncoder(), variant="none")[0] == 2  # bf16 now


def test_te_cache_files_of_earlier_versions_are_valid_when_made_in_the_same_dtype(tmp_path):
    """Earlier versions recorded `none` for bf16 (trainer, tool on a GPU) and for fp32 (the tool on the CPU): the
    values tell them apart, so a bf16 file stays valid for the bf16 encoder and an fp32 one is re-made."""
    bf16_folder = image_folder(tmp_path / "bf16", ["one", "two"])
    fp32_folder = image_folder(tmp_path / "fp32", ["one", "two"])
    for folder, encoder in ((bf16_folder, Bf16TextEncoder()), (fp32_folder, FakeTextEncoder())):
        cache_te(te_groups(tmp_path, folder), encoder, variant="none")
        for path in folder.glob("*_moss_te.npz"):
            as_earlier_version(path)
    assert cache_te(te_groups(tmp_path, bf16_folder), Bf16TextEncoder(), variant="none")[0] == 0
    assert cache_te(te_groups(tmp_path, bf16_folder), Bf16TextEncoder(), variant="none_fp32")[0] == 2
    assert cache_te(te_groups(tmp_path, fp32_folder), FakeTextEncoder(), variant="none")[0] == 2
    for path in fp32_folder.glob("*_moss_te.npz"):  # re-made: now with the record
        assert str(sm.load_npz(path)["encoder_dtype"]) == "bf16"

    older = image_folder(tmp_path / "older", ["one"])  # no `encoder` at all: the dtype alone decides
    cache_te(te_groups(tmp_path, older), FakeTextEncoder(), variant="convrot_int8")
    path = older / "img0_moss_te.npz"
    data = sm.load_npz(path)
    del data["encoder"], data["encoder_dtype"]
    sm.save_npz_atomic(path, data)
    assert cache_te(te_groups(tmp_path, older), FakeTextEncoder(), variant="convrot_int8_fp32")[0] == 0
    assert cache_te(te_groups(tmp_path, older), FakeTextEncoder(), variant="convrot_int8")[0] == 1


def test_single_candidate_files_of_0_12_1_are_checked_for_their_dtype(tmp_path):
    folder = image_folder(tmp_path / "a", ["a cat"])
    path = folder / "img0_moss_te.npz"
    for encoder, valid_for_bf16 in ((Bf16TextEncoder, True), (FakeTextEncoder, False)):
        old = encoder.outputs("made by 0.12.1")
        sm.save_npz_atomic(path, {"prompt_embeds": old[0].numpy(), "attn_mask": old[1].numpy()})
        count = cache_te(te_groups(tmp_path, folder), Bf16TextEncoder(), variant="none")[0]
        assert count == (0 if valid_for_bf16 else 1)


def test_exact_fp32_matmul_turns_the_reduced_precision_switches_off_and_back():
    """The one context for full-precision matmuls (caching, the LoRA merge, the ConvRot rotations): TF32 off, with
    `exact_reductions` the bf16 / fp16 reduced-precision reductions too; every switch back as it was afterwards;
    for a device other than CUDA nothing is touched."""
    from library.runtime.compile import exact_fp32_matmul

    matmul = torch.backends.cuda.matmul
    names = ("allow_tf32", "allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")
    before = {n: getattr(matmul, n) for n in names}
    try:
        for n in names:
            setattr(matmul, n, True)
        with exact_fp32_matmul():
            assert [getattr(matmul, n) for n in names] == [False, True, True]
        with exact_fp32_matmul("cuda", exact_reductions=True):
            assert [getattr(matmul, n) for n in names] == [False, False, False]
        with exact_fp32_matmul("cpu", exact_reductions=True):
            assert all(getattr(matmul, n) for n in names)
        assert all(getattr(matmul, n) for n in names)
    finally:
        for n, value in before.items():
            setattr(matmul, n, value)
