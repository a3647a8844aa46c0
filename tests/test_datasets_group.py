"""DatasetGroup built through build_dataset_groups: every behaviour-changing key, batching, caches, loaders."""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from pathlib import Path

import pytest
import torch

from library.datasets import build_dataset_groups, create_data_loader, create_data_loader_from_args, debug_dataset
from library.datasets.dataset_group import BatchKey, prepare_image_for_cache
from library.errors import UserError
from tests.test_datasets_support import make_gradient, make_image, parse, write_caption, write_toml

SMALL = {
    "resolution": 64, "enable_bucket": True, "min_bucket_reso": 32, "max_bucket_reso": 128, "bucket_reso_steps": 16
}


def folder(
    root: Path, sizes: list[tuple[int, int]], captions: dict[int, str] | None = None, ext: str = ".caption"
) -> Path:
    for i, size in enumerate(sizes):
        img = make_gradient(root / f"img{i}.png", size)
        if captions and i in captions:
            write_caption(img, captions[i], ext)
    return root


def build(tmp_path: Path, datasets, general=None, argv=()):
    cfg = write_toml(tmp_path / "ds.toml", {**SMALL, **(general or {})}, datasets)
    return build_dataset_groups(parse(["--dataset_config", str(cfg), "--seed", "7", *argv]))


def all_batches(group, epoch: int = 1):
    group.set_current_epoch(epoch)
    return [group[i] for i in range(len(group))]


def test_batches_captions_and_shapes(tmp_path) -> None:
    d = folder(tmp_path / "a", [(64, 64), (64, 64), (96, 64)], {0: "a red cat", 1: "a dog\nsecond line"})
    train, val = build(tmp_path, [({"batch_size": 2}, [{"image_dir": str(d), "class_tokens": "sks"}])])
    assert val is None and len(train) == 2  # bucket 64x64 holds 2 images, bucket 80x48 one
    batches = all_batches(train)
    for b in batches:
        n = len(b["image_keys"])
        w, h = b["bucket_reso"]
        assert b["images"].shape == (n, 3, h, w) and b["latents"] is None and b["alpha_masks"] is None
        assert b["images"].min() >= -1 and b["images"].max() <= 1
        assert b["loss_weights"].tolist() == [1.0] * n and b["custom_attributes"] == [{}] * n
        assert b["target_sizes_hw"].tolist() == [[h, w]] * n and b["text_encoder_outputs"] is None
    captions = {os.path.basename(k): c for b in batches for k, c in zip(b["image_keys"], b["captions"])}
    assert captions == {"img0.png": "a red cat", "img1.png": "a dog", "img2.png": "sks"}


def test_missing_captions_are_counted(tmp_path, caplog) -> None:
    d = folder(tmp_path / "a", [(64, 64)] * 3, {0: "x"})
    (d / "img1.caption").write_text("")  # an empty caption file is an empty caption, not class tokens
    with caplog.at_level(logging.INFO):
        train, _ = build(tmp_path, [({}, [{"image_dir": str(d), "class_tokens": "sks"}])])
    assert "1 images have no caption file; their caption is class_tokens 'sks'" in caplog.text
    assert "1 images have no caption" in caplog.text
    caps = sorted(c for b in all_batches(train) for c in b["captions"])
    assert caps == ["", "sks", "x"]


def test_plan_is_deterministic_repeats_and_never_mixes_buckets(tmp_path) -> None:
    d = folder(tmp_path / "a", [(64, 64), (64, 64), (64, 64), (96, 64), (64, 96)])
    cfg = [({"batch_size": 2}, [{"image_dir": str(d), "num_repeats": 3, "flip_aug": True}])]
    train, _ = build(tmp_path, cfg)
    again, _ = build(tmp_path, cfg)
    e1 = all_batches(train, 1)
    counts = Counter(k for b in e1 for k in b["image_keys"])
    assert set(counts.values()) == {3} and len(counts) == 5
    for b in e1:
        assert len({tuple(x.shape) for x in b["images"]}) == 1
    assert [b["image_keys"] for b in all_batches(again, 1)] == [b["image_keys"] for b in e1]
    assert [b["flippeds"] for b in all_batches(again, 1)] == [b["flippeds"] for b in e1]
    assert any(any(b["flippeds"]) for b in e1) and not all(all(b["flippeds"]) for b in e1)
    e2 = all_batches(train, 2)
    assert [b["image_keys"] for b in e2] != [b["image_keys"] for b in e1]
    assert torch.equal(train[BatchKey(1, 2, 0)]["images"], e2[1]["images"])


def test_regularisation_images_get_prior_loss_weight(tmp_path) -> None:
    d = folder(tmp_path / "a", [(64, 64)] * 2)
    r = folder(tmp_path / "r", [(64, 64)] * 3)
    cfg = write_toml(tmp_path / "ds.toml", SMALL, [({}, [{"image_dir": str(d), "num_repeats": 2},
                                                       {"image_dir": str(r), "is_reg": True, "class_tokens": "dog"}])])
    train, _ = build_dataset_groups(parse(["--dataset_config", str(cfg), "--prior_loss_weight", "0.25"]))
    assert train.num_train_images == 4 and train.num_reg_images == 3
    keys = Counter()
    for b in all_batches(train):
        for k, w, reg in zip(b["image_keys"], b["loss_weights"].tolist(), b["is_reg"].tolist()):
            keys[k] += 1
            assert (w == 0.25) == reg == ("/r/" in k)
    assert sum(v for k, v in keys.items() if "/r/" in k) == 4  # balanced to the training count


def test_validation_split_dreambooth(tmp_path) -> None:
    d = folder(tmp_path / "a", [(64, 64)] * 10)
    cfg = [({"validation_split": 0.35, "validation_seed": 3}, [{"image_dir": str(d), "num_repeats": 4,
                                                                 "flip_aug": True, "caption_dropout_rate": 1.0}])]
    train, val = build(tmp_path, cfg)
    train_keys = {k for b in all_batches(train) for k in b["image_keys"]}
    val_batches = all_batches(val)
    val_keys = [k for b in val_batches for k in b["image_keys"]]
    assert len(train_keys) == 7 and len(val_keys) == 3 and not train_keys & set(val_keys)  # ceil(10 * 0.65) = 7
    assert all(not any(b["flippeds"]) and not b["captions_dropped"].any() for b in val_batches)
    assert [b["image_keys"] for b in all_batches(val, 5)] == [b["image_keys"] for b in val_batches]
    _, val2 = build(tmp_path, cfg)
    assert sorted(k for b in all_batches(val2) for k in b["image_keys"]) == sorted(val_keys)
    cfg[0][0]["validation_seed"] = 4
    _, val3 = build(tmp_path, cfg)
    assert sorted(k for b in all_batches(val3) for k in b["image_keys"]) != sorted(val_keys)


def test_fine_tuning_json_jsonl_and_validation(tmp_path) -> None:
    imgs = tmp_path / "ft"
    for i in range(4):
        make_image(imgs / f"p{i}.jpg", (64, 64))
    meta = {f"p{i}": {"caption": f"cap {i}", "tags": "t1, t2"} for i in range(3)}
    meta["p3"] = {"tags": "only tags", "image_size": [64, 64]}
    meta["missing"] = {"caption": "nothing"}
    (tmp_path / "m.json").write_text(json.dumps(meta))
    with open(tmp_path / "m.jsonl", "w") as f:
        for i in range(4):
            f.write(json.dumps({"image_path": str(imgs / f"p{i}.jpg"), "caption": f"line {i}"}) + "\n")
    train, _ = build(tmp_path, [({}, [{"metadata_file": str(tmp_path / "m.json"), "image_dir": str(imgs)}])])
    caps = sorted(c for b in all_batches(train) for c in b["captions"])
    assert caps == ["cap 0,t1, t2", "cap 1,t1, t2", "cap 2,t1, t2", "only tags"]
    train, val = build(tmp_path, [({"validation_split": 0.5}, [{"metadata_file": str(tmp_path / "m.jsonl")}])])
    assert len({k for b in all_batches(train) for k in b["image_keys"]}) == 2
    assert len({k for b in all_batches(val) for k in b["image_keys"]}) == 2


def test_multiline_candidates_reach_the_batch(tmp_path) -> None:
    d = folder(tmp_path / "a", [(64, 64)], {0: "First long caption.\nStill first.\n---\nShort one."})
    train, _ = build(tmp_path, [({}, [{"image_dir": str(d), "enable_multiline_caption": True, "num_repeats": 30}])])
    info = next(train.image_infos())
    assert info.caption_candidates == ["First long caption.\nStill first.", "Short one."]
    seen = {(i, c) for b in all_batches(train) for i, c in zip(b["caption_candidate_indices"], b["captions"])}
    assert seen == {(0, "First long caption.\nStill first."), (1, "Short one.")}


def test_caption_keys_from_the_config_reach_the_batch(tmp_path) -> None:
    d = folder(tmp_path / "a", [(64, 64)], {0: "k1, b, c, d, e, f"}, ext=".txt")
    subset = {"image_dir": str(d), "caption_extension": ".txt", "shuffle_caption": True, "keep_tokens": 1,
              "caption_prefix": "pre", "caption_suffix": "suf", "num_repeats": 20, "secondary_separator": ";"}
    train, _ = build(tmp_path, [({}, [subset])])
    caps = {c for b in all_batches(train) for c in b["captions"]}
    assert len(caps) > 3 and all(c.startswith("pre k1, ") for c in caps)


def test_dropout_every_n_epochs_and_token_warmup_follow_epoch_and_step(tmp_path) -> None:
    d = folder(tmp_path / "a", [(64, 64)], {0: "k, a, b, c, d"})
    subset = {"image_dir": str(d), "caption_dropout_every_n_epochs": 2, "token_warmup_step": 4, "keep_tokens": 1,
              "token_warmup_min": 0, "custom_attributes": {"timestep_sampling": {"offset": 0.1}}}
    train, _ = build(tmp_path, [({}, [subset])])
    assert all_batches(train, 1)[0]["captions"] == ["k"]
    assert all_batches(train, 2)[0]["captions_dropped"].tolist() == [True]
    train.set_current_step(2)
    assert all_batches(train, 3)[0]["captions"] == ["k, a, b"]
    train.set_current_step(4)
    b = all_batches(train, 3)[0]
    assert b["captions"] == ["k, a, b, c, d"]
    assert b["custom_attributes"] == [{"timestep_sampling": {"offset": 0.1}}]


def test_alpha_mask_random_crop_and_interpolation_keys(tmp_path) -> None:
    d = folder(tmp_path / "a", [(128, 64)])
    train, _ = build(tmp_path, [({"enable_bucket": False, "resolution": 32},
                                 [{"image_dir": str(d), "alpha_mask": True, "random_crop": True, "num_repeats": 8}])])
    batches = all_batches(train)
    assert all(b["alpha_masks"].shape == (1, 32, 32) for b in batches)
    assert len({tuple(b["crop_top_lefts"][0].tolist()) for b in batches}) > 1
    near, _ = build(tmp_path, [({"enable_bucket": False, "resolution": 32},
                                [{"image_dir": str(d), "resize_interpolation": "nearest"}])])
    lanc, _ = build(tmp_path, [({"enable_bucket": False, "resolution": 32}, [{"image_dir": str(d)}])])
    assert not torch.equal(near[0]["images"], lanc[0]["images"])


def test_color_aug_key(tmp_path) -> None:
    d = folder(tmp_path / "a", [(64, 64)])
    train, _ = build(tmp_path, [({}, [{"image_dir": str(d), "color_aug": True, "num_repeats": 12}])])
    plain = prepare_image_for_cache(next(train.image_infos())).image
    assert any(not torch.equal(b["images"][0], plain) for b in all_batches(train))


def test_bucket_keys_and_small_image_report(tmp_path, caplog) -> None:
    d = folder(tmp_path / "a", [(200, 100), (20, 20)])
    with caplog.at_level(logging.WARNING):
        train, _ = build(tmp_path, [({}, [{"image_dir": str(d)}])])
    assert "1 images are smaller than the smallest bucket" in caplog.text and "img1.png" in caplog.text
    # AR 2: 80x48 (1.67) is nearer than 96x32 (3); the 20x20 image is enlarged into 64x64
    assert {b["bucket_reso"] for b in all_batches(train)} == {(80, 48), (64, 64)}
    nb, _ = build(tmp_path, [({"bucket_no_upscale": True, "bucket_reso_steps": 32}, [{"image_dir": str(d)}])])
    # 200x100 shrinks to area 64^2 (90.5 x 45.3), rounded to steps of 32 -> 64x32; 20x20 has no bucket: skipped
    assert {b["bucket_reso"] for b in all_batches(nb)} == {(64, 32)}
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        fixed, _ = build(tmp_path, [({"enable_bucket": False, "resolution": [48, 32], "bucket_no_upscale": True},
                                     [{"image_dir": str(d)}])])
    assert {b["bucket_reso"] for b in all_batches(fixed)} == {(48, 32)}
    assert "bucket_no_upscale (datasets[0]" in caplog.text and "has no effect without enable_bucket" in caplog.text


def test_unreadable_images_are_skipped_with_their_name(tmp_path, caplog) -> None:
    d = folder(tmp_path / "a", [(64, 64)])
    (d / "broken.png").write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING):
        train, _ = build(tmp_path, [({}, [{"image_dir": str(d)}])])
    assert "1 images are skipped because they cannot be read" in caplog.text and "broken.png" in caplog.text
    assert train.num_train_images == 1


def test_bucket_multiple_of_16_is_enforced(tmp_path) -> None:
    d = folder(tmp_path / "a", [(64, 64)])
    with pytest.raises(UserError, match="bucket_reso_steps = 24 .*datasets\\[0\\].*not a multiple of 16"):
        build(tmp_path, [({"bucket_reso_steps": 24}, [{"image_dir": str(d)}])])
    with pytest.raises(UserError, match="resolution 40x40.*multiple of 16"):
        build(tmp_path, [({"enable_bucket": False, "resolution": 40}, [{"image_dir": str(d)}])])
    train, _ = build(tmp_path, [({"bucket_reso_steps": 32}, [{"image_dir": str(d)}])])
    train.verify_bucket_reso_steps(16)
    with pytest.raises(UserError, match="not a multiple of 64"):
        train.verify_bucket_reso_steps(64)


class FakeLatents:
    def __init__(self) -> None:
        self.calls = []

    def get_latents_npz_path(self, absolute_path, image_size):
        return f"{os.path.splitext(absolute_path)[0]}_{image_size[0]:04d}x{image_size[1]:04d}_moss.npz"

    def get_latents(self, info, flipped):
        self.calls.append(flipped)
        w, h = info.bucket_reso
        return torch.full((32, h // 8, w // 8), -1.0 if flipped else 1.0), None


class FakeTE:
    def get_outputs_npz_path(self, absolute_path):
        return os.path.splitext(absolute_path)[0] + "_moss_te.npz"

    def get_outputs(self, info, candidate_index, dropped, variant_index=0):
        return ("uncond",) if dropped else (info.caption_candidates[candidate_index],)


def test_cache_hooks(tmp_path) -> None:
    d = folder(tmp_path / "a", [(96, 64)], {0: "one\n---\ntwo"})
    subset = {"image_dir": str(d), "enable_multiline_caption": True, "caption_prefix": "p", "flip_aug": True,
              "caption_dropout_rate": 0.3, "num_repeats": 20}
    train, _ = build(tmp_path, [({}, [subset])])
    assert train.is_text_encoder_output_cacheable(
        cache_supports_dropout=True, supports_multiple_caption_candidates=True
    )
    assert not train.is_text_encoder_output_cacheable(cache_supports_dropout=False)
    assert not train.is_text_encoder_output_cacheable(supports_multiple_caption_candidates=False)
    info = next(train.image_infos())
    assert train.captions_for_text_encoder_cache(info) == ["p one", "p two"]
    lat, te = FakeLatents(), FakeTE()
    train.attach_latents_cache(lat)
    train.attach_text_encoder_outputs_cache(te)
    assert info.latents_npz.endswith("img0_0096x0064_moss.npz") and info.te_outputs_npz.endswith("img0_moss_te.npz")
    for b in all_batches(train):
        assert b["images"] is None and b["latents"].shape == (1, 32, 6, 10)
        assert (b["latents"][0, 0, 0, 0] < 0) == b["flippeds"][0]
        out = b["text_encoder_outputs"][0]
        picked = info.caption_candidates[b["caption_candidate_indices"][0]]
        assert out == (("uncond",) if b["captions_dropped"][0] else (picked,))
    assert True in lat.calls and False in lat.calls


def test_cacheability_blockers(tmp_path) -> None:
    d = folder(tmp_path / "a", [(64, 64)], {0: "a {b|c}"})
    train, _ = build(tmp_path, [({}, [{"image_dir": str(d), "shuffle_caption": True, "random_crop": True,
                                        "enable_wildcard": True}])])
    reasons = train.text_encoder_output_cache_blockers()
    assert any("shuffle_caption" in r for r in reasons) and any("wildcards" in r for r in reasons)
    assert not train.is_latent_cacheable()
    with pytest.raises(UserError, match="random_crop in datasets\\[0\\].subsets\\[0\\]"):
        train.attach_latents_cache(FakeLatents())
    with pytest.raises(UserError, match="shuffle_caption"):
        train.attach_text_encoder_outputs_cache(FakeTE())


def test_data_loader_with_persistent_worker_follows_epochs(tmp_path) -> None:
    d = folder(tmp_path / "a", [(64, 64)], {0: "cap"})
    train, _ = build(tmp_path, [({}, [{"image_dir": str(d), "caption_dropout_every_n_epochs": 2}])])
    loader = create_data_loader(train, num_workers=1, persistent_workers=True)
    seen = []
    for epoch in (1, 2, 3):
        train.set_current_epoch(epoch)
        seen += [b["captions"][0] for b in loader]
    assert seen == ["cap", "", "cap"]
    with pytest.raises(UserError, match="persistent_data_loader_workers"):
        create_data_loader(train, num_workers=0, persistent_workers=True)
    args = parse(["--max_data_loader_n_workers", "0"])
    assert [b["captions"] for b in create_data_loader_from_args(train, args)] == [["cap"]]  # epoch 3 is still set
    with pytest.raises(UserError, match="needs at least one worker"):
        create_data_loader_from_args(train, parse(["--max_data_loader_n_workers", "0",
                                                   "--persistent_data_loader_workers"]))


def test_cli_folders_and_in_json(tmp_path, caplog) -> None:
    root = tmp_path / "train"
    folder(root / "3_sks dog", [(64, 64), (64, 64)], {0: "a photo"})
    folder(root / "notrepeats", [(64, 64)])
    folder(tmp_path / "reg" / "1_dog", [(64, 64)])
    argv = ["--train_data_dir", str(root), "--reg_data_dir", str(tmp_path / "reg"), "--resolution", "64",
            "--train_batch_size", "2"]
    with caplog.at_level(logging.WARNING):
        train, _ = build_dataset_groups(parse(argv))
    assert "'notrepeats' does not start with '<repeats>_'" in caplog.text
    assert train.num_train_images == 6 and train.num_reg_images == 1
    caps = Counter(c for b in all_batches(train) for c in b["captions"])
    assert caps == Counter({"a photo": 3, "sks dog": 3, "dog": 6})
    (tmp_path / "m.json").write_text(json.dumps({"img0": {"caption": "ft"}}))
    ft, _ = build_dataset_groups(parse(["--in_json", str(tmp_path / "m.json"), "--train_data_dir",
                                        str(root / "3_sks dog"), "--resolution", "64", "--dataset_repeats", "2"]))
    assert [c for b in all_batches(ft) for c in b["captions"]] == ["ft", "ft"]


def test_rejected_and_conflicting_options(tmp_path) -> None:
    with pytest.raises(UserError, match="No dataset was given"):
        build_dataset_groups(parse([]))
    with pytest.raises(UserError, match="--face_crop_aug_range .*Stable Diffusion"):
        build_dataset_groups(parse(["--face_crop_aug_range", "2.0,4.0", "--train_data_dir", str(tmp_path)]))
    with pytest.raises(UserError, match="--conditioning_data_dir"):
        build_dataset_groups(parse(["--conditioning_data_dir", "x", "--train_data_dir", str(tmp_path)]))
    cfg = write_toml(tmp_path / "c.toml", SMALL, [({}, [{"image_dir": str(tmp_path)}])])
    with pytest.raises(UserError, match="--train_data_dir cannot be combined with --dataset_config"):
        build_dataset_groups(parse(["--dataset_config", str(cfg), "--train_data_dir", str(tmp_path)]))
    with pytest.raises(UserError, match="No training image"):
        build_dataset_groups(parse(["--dataset_config", str(cfg)]))


def test_cache_info_keeps_sizes_and_captions(tmp_path) -> None:
    d = folder(tmp_path / "a", [(64, 64), (96, 64)], {0: "x"})
    cfg = [({}, [{"image_dir": str(d), "cache_info": True}])]
    build(tmp_path, cfg)
    cache = json.loads((d / "metadata_cache.json").read_text())
    sizes = {os.path.basename(k): v["resolution"] for k, v in cache.items()}
    assert sizes == {"img0.png": [64, 64], "img1.png": [96, 64]}
    (d / "img0.caption").write_text("changed")  # the cached caption wins until the cache is deleted
    train, _ = build(tmp_path, cfg)
    assert "x" in [c for b in all_batches(train) for c in b["captions"]]


def test_debug_dataset_logs_batches(tmp_path, caplog) -> None:
    d = folder(tmp_path / "a", [(64, 64)] * 3, {0: "hello"})
    train, _ = build(tmp_path, [({}, [{"image_dir": str(d)}])])
    with caplog.at_level(logging.INFO):
        assert debug_dataset(train, max_batches=2) == 2
    assert "bucket 64x64" in caplog.text


def test_dataset_metadata_shapes(tmp_path) -> None:
    from library.datasets.metadata import dataset_metadata

    a = folder(tmp_path / "x" / "imgs", [(64, 64), (64, 64)], {0: "Red, cat", 1: "red, dog"})
    b = folder(tmp_path / "y" / "imgs", [(64, 64)], {0: "cat"})
    r = folder(tmp_path / "reg", [(64, 64)])
    train, _ = build(tmp_path, [({}, [{"image_dir": str(a), "num_repeats": 2}, {"image_dir": str(b)},
                                      {"image_dir": str(r), "is_reg": True}])])
    md = dataset_metadata(train)
    assert md["tag_frequency"] == {"imgs": {"red": 2, "cat": 1, "dog": 1}, "imgs (2)": {"cat": 1}, "reg": {}}
    dirs = {"imgs": {"n_repeats": 2, "img_count": 2}, "imgs (2)": {"n_repeats": 1, "img_count": 1}}
    assert md["dataset_dirs"] == dirs
    ds = md["datasets"][0]
    assert ds["num_train_images"] == 5 and ds["num_reg_images"] == 1 and ds["is_dreambooth"] is True
    assert [s["image_dir"] for s in ds["subsets"]] == ["imgs", "imgs", "reg"] and ds["subsets"][2]["is_reg"]
    assert ds["bucket_info"]["buckets"][0] == {"resolution": (64, 64), "count": 10}
    assert "/" not in json.dumps(md).replace("\\/", "")  # base names only
