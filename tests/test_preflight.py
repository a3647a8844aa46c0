"""The dataset preflight: tools/check_dataset.py on a dataset with every kind of problem (caches made by the real cache
tools on the tiny snapshot, then damaged), its exit codes, JSON and text, the size estimates against the files the
tools write, the caching strategies' reasons for a stale file, and the quick check the trainer and the tools run."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import library.caching.strategies as sm
from library.datasets import build_dataset_groups
from library.datasets.preflight import quick_check
from tests.test_caching import FakeTextEncoder, FakeVAE
from tests.test_datasets_support import make_gradient, make_image, parse, write_caption, write_toml
from tools import cache_latents as latents_tool
from tools import cache_text_encoder_outputs as te_tool
from tools import check_dataset

BUCKETS = {"resolution": 64, "enable_bucket": True, "min_bucket_reso": 32, "max_bucket_reso": 128,
           "bucket_reso_steps": 16, "caption_extension": ".txt"}
LONG = " ".join(["a long caption about a red square on a grey background"] * 12)


def gradient(path: Path, number: int) -> Path:
    """A gradient image with a pixel of its own, so that the gradients are not duplicates of each other."""
    img = Image.open(make_gradient(path, (96, 64)))
    img.putpixel((0, 0), (number, number, number))
    img.save(path)
    return path


def good_folder(root: Path) -> Path:
    """Nine decodable images in every common mode, with captions; g0_copy.png has g0.png's bytes."""
    folder = root / "good"
    for i in range(3):
        write_caption(gradient(folder / f"g{i}.png", i + 1), f"gradient number {i}", ".txt")
    shutil.copy(folder / "g0.png", folder / "g0_copy.png")
    write_caption(folder / "g0_copy.png", "the same file again", ".txt")
    write_caption(make_image(folder / "grey.png", (64, 64), 80, "L"), "a grey square", ".txt")
    write_caption(make_image(folder / "la.png", (64, 64), (120, 200), "LA"), "a grey square with alpha", ".txt")
    write_caption(make_image(folder / "cmyk.jpg", (64, 64), (0, 255, 255, 0), "CMYK"), "a cmyk square", ".txt")
    Image.fromarray(np.full((64, 64), 257 * 60, np.uint16)).save(folder / "g16.png")
    write_caption(folder / "g16.png", "a sixteen bit square", ".txt")
    palette = Image.new("P", (64, 64), 1)
    palette.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)
    palette.save(folder / "pal.png", transparency=0)
    write_caption(folder / "pal.png", "a palette square", ".txt")
    return folder


def bad_folder(root: Path) -> Path:
    folder = root / "bad"
    data = make_gradient(folder / "whole.png", (64, 64)).read_bytes()
    (folder / "whole.png").unlink()
    (folder / "trunc.png").write_bytes(data[: len(data) // 2])  # the header is fine, the pixels are cut off
    write_caption(folder / "trunc.png", "a truncated file", ".txt")
    (folder / "junk.png").write_bytes(b"not an image")
    Image.new("F", (64, 64), 0.5).save(folder / "float.png", format="TIFF")
    write_caption(make_image(folder / "tiny.png", (8, 8), (10, 20, 10)), "a tiny image", ".txt")
    make_image(folder / "nocap.png", (64, 64), (10, 20, 20))
    write_caption(make_image(folder / "empty.png", (64, 64), (10, 20, 30)), "  \n", ".txt")
    write_caption(make_image(folder / "long.png", (64, 64), (10, 20, 40)), LONG, ".txt")
    write_caption(make_image(folder / "multi.png", (64, 64), (10, 20, 50)), "first line\nsecond line", ".txt")
    return folder


def small_folders(root: Path) -> None:
    """A DreamBooth folder and a metadata file, each with an image narrower than bucket_reso_steps."""
    write_caption(make_image(root / "small" / "narrow.png", (8, 100), (10, 20, 60)), "narrow", ".txt")
    write_caption(make_image(root / "small" / "fine.png", (64, 64), (10, 20, 70)), "fine", ".txt")
    make_image(root / "meta" / "narrow.png", (8, 100), (10, 20, 80))
    make_image(root / "meta" / "fine.png", (64, 64), (10, 20, 90))
    (root / "meta.json").write_text(json.dumps({
        "meta/fine.png": {"caption": "listed"}, "meta/gone.png": {"caption": "no such file"},
        "meta/narrow": {"tags": "narrow, tall"},
    }))


def problem_config(root: Path, good: dict | None = None) -> Path:
    good_folder(root), bad_folder(root), small_folders(root)
    return write_toml(root / "all.toml", BUCKETS, [
        ({}, [{"image_dir": str(root / "good"), **(good or {})}, {"image_dir": str(root / "bad")}]),
        ({"bucket_no_upscale": True}, [{"image_dir": str(root / "small"), "num_repeats": 2},
                                       {"metadata_file": str(root / "meta.json"), "image_dir": str(root)}]),
    ])


def make_caches(snapshot: Path, cfg: Path, *te_extra: str) -> None:
    """The caches of a dataset config, made by the real tools."""
    common = ["--moss_image", "--snapshot", str(snapshot), "--dataset_config", str(cfg), "--device", "cpu"]
    latents_tool.run([*common, "--cache_latents_to_disk"])
    te_tool.run([*common, "--cache_text_encoder_outputs_to_disk", *te_extra])


def check(capsys, *argv: str) -> tuple[int, dict]:
    capsys.readouterr()  # what the cache tools printed
    code = check_dataset.main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def by_where(report: dict) -> dict[str, dict]:
    return {s["where"]: s for d in report["datasets"] for s in d["subsets"]}


def names(paths) -> list[str]:
    return sorted(Path(p).name for p in paths)


def test_every_kind_of_problem_is_reported(tiny_snapshot, tmp_path, capsys):
    cfg = problem_config(tmp_path)
    good_only = write_toml(tmp_path / "good.toml", BUCKETS, [({}, [{"image_dir": str(tmp_path / "good")}])])
    make_caches(tiny_snapshot, good_only, "--moss_max_token_length", "64")  # the same buckets as in all.toml
    good = tmp_path / "good"
    (good / "g1_0096x0064_moss.npz").unlink()  # missing
    (good / "grey_0064x0064_moss.npz").write_bytes(b"PK garbage")  # damaged
    (good / "cmyk_moss_te.npz").unlink()
    (good / "g2.txt").write_text("an edited caption")  # the TE file of g2 is stale
    code, report = check(capsys, "--dataset_config", str(cfg), "--snapshot", str(tiny_snapshot),
                         "--moss_max_token_length", "64", "--cache_latents_to_disk",
                         "--cache_text_encoder_outputs_to_disk")
    assert code == 1 and report["ok"] is False  # the truncated file would stop training
    subsets = by_where(report)

    s = subsets["datasets[0].subsets[0]"]
    assert (s["found"], s["used"], s["not_used"]) == (9, 9, [])
    assert s["modes"] == {"CMYK": 1, "I;16": 1, "L": 1, "LA": 1, "P": 1, "RGB": 4}

    b = subsets["datasets[0].subsets[1]"]
    assert (b["found"], b["used"]) == (8, 6)
    reasons = {Path(d["file"]).name: d["reason"] for d in b["not_used"]}
    assert reasons["junk.png"].startswith("unreadable: cannot identify image file")
    assert reasons["float.png"].startswith("unreadable: colour mode F is not supported")
    cap = b["captions"]
    assert names(cap["missing"]) == ["nocap.png"] and names(cap["empty"]) == ["empty.png"]
    assert names(cap["extra_lines_dropped"]) == ["multi.png"]
    assert [(Path(t["file"]).name, t["candidate"]) for t in cap["too_long"]] == [("long.png", 0)]
    assert cap["too_long"][0]["tokens"] > 64 and cap["longest_tokens"] == cap["too_long"][0]["tokens"]

    small = subsets["datasets[1].subsets[0]"]
    assert (small["found"], small["used"]) == (2, 1)
    assert small["not_used"][0]["reason"] == "too small: 8x100 has a side below bucket_reso_steps 16"
    meta = subsets["datasets[1].subsets[1]"]
    assert (meta["found"], meta["used"]) == (3, 1)
    meta_reasons = sorted(d["reason"] for d in meta["not_used"])
    assert meta_reasons[0].startswith("no image file found") and meta_reasons[1].startswith("too small: 8x100")
    assert report["duplicates"] == [[str(good / "g0.png"), str(good / "g0_copy.png")]]

    latents, te = report["caches"]
    assert (latents["files"], latents["valid"], len(latents["missing"])) == (17, 7, 9)
    assert str(good / "g1_0096x0064_moss.npz") in latents["missing"]
    assert [(Path(x["file"]).name, x["reason"]) for x in latents["stale"]] == [
        ("grey_0064x0064_moss.npz", "unreadable (a damaged file)")]
    assert te["valid"] == 7 and [(Path(x["file"]).name, x["reason"]) for x in te["stale"]] == [
        ("g2_moss_te.npz", "caption 0 changed (now 'an edited caption')")]
    assert str(good / "cmyk_moss_te.npz") in te["missing"]
    assert latents["to_disk"] and te["to_disk"] and 0 < latents["bytes_to_write"] < latents["bytes_total"]

    problems = [(p["level"], p["where"], p["message"]) for p in report["problems"]]
    errors = [p for p in problems if p[0] == "error"]
    assert len(errors) == 1 and "trunc.png" in errors[0][2] and "cannot be decoded" in errors[0][2]
    text = " | ".join(p[2] for p in problems)
    for needle in ("not used: 2 images (", "no caption, so trained with an empty one: 1 image",
                   "empty caption files", "only the first is used: 1 caption",
                   "longer than --moss_max_token_length 64 tokens", "enlarged more than 2 times", "tiny.png",
                   "the same content under different names", "g0.png = g0_copy.png",
                   "stale, so re-made by the caching: 1 cache file (grey_0064x0064_moss.npz: unreadable",
                   "stale, so re-made by the caching: 1 cache file (g2_moss_te.npz: caption 0 changed"):
        assert needle in text, needle
    assert "datasets[0].subsets[0]: 1 16-bit greyscale image scaled to 8 bits" in report["notes"]


def test_text_report_and_exit_codes(tiny_snapshot, tmp_path, capsys):
    cfg = problem_config(tmp_path)
    assert check_dataset.main(["--dataset_config", str(cfg), "--no_decode", "--network_dim", "16"]) == 0
    out = capsys.readouterr().out
    for needle in ("datasets[0].subsets[1] (", "not used: junk.png: unreadable", "bucket        images",
                   "colour modes: CMYK 1, I;16 1, L 1, LA 1, P 1, RGB 4", "caption token counts were not checked",
                   "latents cache (*_moss.npz, not cached by this run): 17 files, 0 valid",
                   "the images were not decoded (--no_decode)", "result: 0 errors,"):
        assert needle in out, needle
    assert check_dataset.main(["--dataset_config", str(cfg)]) == 1  # decoding finds the truncated file
    assert "result: 1 error," in capsys.readouterr().out
    assert check_dataset.main(["--dataset_config", str(tmp_path / "missing.toml"), "--json"]) == 2
    assert json.loads(capsys.readouterr().out) == {
        "ok": False, "error": f"The dataset config '{tmp_path / 'missing.toml'}' does not exist: check --dataset_config."}


def test_clean_dataset_passes_and_the_size_estimates_match_the_files(tiny_snapshot, tmp_path, capsys):
    good_folder(tmp_path)
    for name in ("g0_copy.png", "g0_copy.txt"):
        (tmp_path / "good" / name).unlink()
    cfg = write_toml(tmp_path / "good.toml", {**BUCKETS, "flip_aug": True},
                     [({}, [{"image_dir": str(tmp_path / "good")}])])
    make_caches(tiny_snapshot, cfg)
    code, report = check(capsys, "--dataset_config", str(cfg), "--snapshot", str(tiny_snapshot),
                         "--cache_latents_to_disk", "--cache_text_encoder_outputs_to_disk")
    assert code == 0 and report["ok"] and not [p for p in report["problems"] if p["level"] == "error"]
    for cache, pattern in zip(report["caches"], ("*_moss.npz", "*_moss_te.npz")):
        actual = sum(p.stat().st_size for p in (tmp_path / "good").glob(pattern))
        assert cache["valid"] == cache["files"] == 8 and cache["bytes_to_write"] == 0
        assert cache["seconds_to_encode"] == 0 and cache["seconds_total"] > 0
        assert abs(cache["bytes_total"] - actual) < 0.03 * actual, (cache["kind"], cache["bytes_total"], actual)

    code, report = check(capsys, "--dataset_config", str(cfg), "--snapshot", str(tiny_snapshot), "--no_decode",
                         "--cache_text_encoder_outputs_to_disk", "--moss_max_token_length", "100",
                         "--skip_cache_check", "--shuffle_caption")
    errors = [p["message"] for p in report["problems"] if p["level"] == "error"]
    assert code == 1 and len(errors) == 2
    assert errors[0].startswith("text encoder outputs cannot be cached with shuffle_caption in datasets[0]")
    assert ("stale: 8 cache files (cmyk_moss_te.npz: --moss_max_token_length 4096 (now 100)), which"
            " --skip_cache_check trusts") in errors[1]


def test_config_file_and_unused_options(tiny_snapshot, tmp_path, capsys, caplog):
    good_folder(tmp_path)
    (tmp_path / "train.toml").write_text(
        f'dataset_config = "{(tmp_path / "ds.toml").as_posix()}"\nresolution = "64"\nnetwork_dim = 16\n'
        '[model]\ncaption_extension = ".txt"\n')
    good = (tmp_path / "good").as_posix()
    (tmp_path / "ds.toml").write_text(f'[[datasets]]\n[[datasets.subsets]]\nimage_dir = "{good}"\n')
    with caplog.at_level(logging.INFO):
        code, report = check(capsys, "--config_file", str(tmp_path / "train.toml"), "--no_decode", "--xformers")
    assert code == 0 and report["datasets"][0]["resolution"] == [64, 64]
    assert by_where(report)["datasets[0].subsets[0]"]["captions"]["missing"] == []
    assert "not used by the check: --xformers, network_dim (in --config_file)" in caplog.text


def test_strategies_say_why_a_cache_file_is_stale(tmp_path):
    folder = tmp_path / "img"
    write_caption(make_gradient(folder / "a.png", (64, 64)), "first")
    cfg = write_toml(tmp_path / "ds.toml", {"resolution": 64}, [({}, [{"image_dir": str(folder)}])])
    train, _ = build_dataset_groups(parse(["--dataset_config", str(cfg)]))
    info = next(train.image_infos())
    lat = sm.MossImageLatentsCachingStrategy(True)
    npz = lat.get_latents_npz_path(info.absolute_path, info.image_size)
    assert lat.latents_cache_problem((64, 64), npz, False, False) == sm.CACHE_MISSING
    sm.cache_latents([train], FakeVAE(), lat)
    assert lat.latents_cache_problem((64, 64), npz, False, False) is None
    assert lat.latents_cache_problem((64, 64), npz, True, True) == \
        "no latents_flipped_8x8, alpha_mask_8x8 (bucket 64x64)"
    assert lat.latents_cache_problem((128, 64), npz, False, False) == "no latents_8x16 (bucket 128x64)"

    te = sm.MossImageTextEncoderOutputsCachingStrategy(True, max_token_length=77, encoder_variant="none")
    sm.cache_text_encoder_outputs([train], FakeTextEncoder(), te)
    path = info.te_outputs_npz
    assert te.outputs_cache_problem(path, ["first"]) is None
    assert te.outputs_cache_problem(path, ["first", "second"]) == "caption candidates: 1 in the file, 2 now"
    assert te.outputs_cache_problem(path, ["other"]) == "caption 0 changed (now 'other')"
    for kwargs, reason in (({"max_token_length": 100}, "--moss_max_token_length 77 (now 100)"),
                           ({"encoder_variant": "bnb_nf4"}, "text encoder variant none (now bnb_nf4)"),
                           ({"te_base_weights": "0123"}, "made with other --base_weights text-encoder LoRAs")):
        other = sm.MossImageTextEncoderOutputsCachingStrategy(True, **{"max_token_length": 77,
                                                                       "encoder_variant": "none", **kwargs})
        assert other.outputs_cache_problem(path, ["first"]) == reason
        assert not other.is_disk_cached_outputs_expected(path, ["first"])
    Path(path).write_bytes(b"garbage")
    assert te.outputs_cache_problem(path, ["first"]) == sm.CACHE_UNREADABLE
    assert not te.is_disk_cached_outputs_expected(path, ["first"])


def test_quick_check_warns_about_crops_and_enlargements_by_percentage(tmp_path, caplog):
    folder = tmp_path / "img"
    for name, size in (("wide.png", (2000, 60)), ("square.png", (64, 64)), ("tiny.png", (16, 16))):
        make_image(folder / name, size)
    cfg = write_toml(tmp_path / "ds.toml", {"resolution": 64}, [({}, [{"image_dir": str(folder)}])])
    train, val = build_dataset_groups(parse(["--dataset_config", str(cfg)]))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        problems = quick_check([train, val])
    assert [Path(f).name for p in problems for f in p.files] == ["wide.png", "tiny.png"]
    assert "the crop to the bucket cuts away more than 25% of the area of 1 image (up to 97%: wide.png 97%)" \
        in caplog.text
    assert "enlarged more than 2 times, so trained blurry: 1 image (up to 4.0x: tiny.png 4.0x)" in caplog.text


def test_the_cache_tools_run_the_quick_check(tiny_snapshot, tmp_path, caplog):
    make_image(tmp_path / "img" / "wide.png", (640, 32))
    cfg = write_toml(tmp_path / "ds.toml", {"resolution": 32}, [({}, [{"image_dir": str(tmp_path / "img")}])])
    with caplog.at_level(logging.WARNING):
        assert latents_tool.run(["--moss_image", "--snapshot", str(tiny_snapshot), "--dataset_config", str(cfg),
                                 "--cache_latents_to_disk", "--debug_dataset"]) is None
    assert "cuts away more than 25% of the area of 1 image (up to 95%: wide.png 95%)" in caplog.text


def test_the_trainer_runs_the_quick_check(tiny_snapshot, tmp_path, caplog):
    from tests.test_trainer import base_args, train

    make_image(tmp_path / "data" / "1_wide" / "wide.png", (640, 32))
    argv = base_args(tiny_snapshot, tmp_path / "data", tmp_path / "out", "--debug_dataset")
    argv[argv.index("--resolution") + 1] = "32"
    with caplog.at_level(logging.WARNING):
        train(argv)
    assert "cuts away more than 25% of the area of 1 image (up to 95%: wide.png 95%)" in caplog.text


def test_16_bit_png_caches_as_the_right_image(tmp_path):
    """Through the latent caching path (prepare_image_for_cache): the 16-bit file gives the 8-bit file's latents."""
    folder = tmp_path / "img"
    ramp = np.tile(np.arange(0, 256, 4, dtype=np.uint8), (64, 1))
    folder.mkdir()
    Image.fromarray(ramp, "L").save(folder / "a8.png")
    Image.fromarray(ramp.astype(np.uint16) * 257).save(folder / "a16.png")
    cfg = write_toml(tmp_path / "ds.toml", {"resolution": 64}, [({}, [{"image_dir": str(folder)}])])
    train, _ = build_dataset_groups(parse(["--dataset_config", str(cfg)]))
    lat = sm.MossImageLatentsCachingStrategy(False)
    sm.cache_latents([train], FakeVAE(), lat)
    by_name = {Path(i.absolute_path).name: i.latents for i in train.image_infos()}
    assert torch.equal(by_name["a8.png"], by_name["a16.png"])
