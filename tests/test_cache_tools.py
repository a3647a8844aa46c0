"""tools/cache_latents.py and tools/cache_text_encoder_outputs.py on the tiny snapshot and a generated image folder:
files written, nothing re-encoded on a second run, one changed caption re-cached, training from the caches, errors,
and two processes under torchrun."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from library.caching.strategies import load_npz
from tests.test_trainer import base_args, make_toy_dataset, train
from tools import cache_latents as latents_tool
from tools import cache_text_encoder_outputs as te_tool

REPO = Path(__file__).resolve().parent.parent




def dataset(root: Path, **subset: object) -> Path:
    """Four toy images (one with two caption candidates) and a dataset config holding a validation split."""
    data = make_toy_dataset(root / "data", n=4)
    (data / "4_toy" / "img0.txt").write_text("a red square\n---\na red square\non a grey background")
    extra = "".join(f"{k} = {str(v).lower() if isinstance(v, bool) else v}\n" for k, v in subset.items())
    cfg = root / "dataset.toml"
    cfg.write_text(
        '[general]\nresolution = 64\ncaption_extension = ".txt"\nenable_multiline_caption = true\n'
        f'[[datasets]]\nvalidation_split = 0.25\n[[datasets.subsets]]\nimage_dir = "{(data / "4_toy").as_posix()}"\n'
        f"flip_aug = true\n{extra}"
    )
    return cfg


def tool_args(snapshot: Path, cfg: Path, *extra: str) -> list[str]:
    return ["--moss_image", "--snapshot", str(snapshot), "--dataset_config", str(cfg), "--device", "cpu", *extra]


def cache_both(snapshot: Path, cfg: Path, *extra: str):
    lat = latents_tool.run(tool_args(snapshot, cfg, "--cache_latents_to_disk", "--vae_batch_size", "2", *extra))
    te = te_tool.run(tool_args(snapshot, cfg, "--cache_text_encoder_outputs_to_disk", *extra))
    return lat, te


def mtimes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.glob("*.npz")}


def test_tools_cache_recache_only_changes_and_training_reads_the_files(tiny_snapshot, tmp_path, capsys, caplog):
    cfg = dataset(tmp_path)
    images = tmp_path / "data" / "4_toy"
    lat, te = cache_both(tiny_snapshot, cfg)
    assert (lat.images, lat.files, lat.encoded, lat.processes) == (4, 4, 4, 1)
    assert (te.files, te.encoded) == (4, 4)
    assert sorted(mtimes(images)) == sorted([f"img{i}_0064x0064_moss.npz" for i in range(4)]
                                            + [f"img{i}_moss_te.npz" for i in range(4)])
    out = capsys.readouterr().out
    assert "latents: 4 images in 4 cache files; 4 encoded now, 0 already cached (1 process)" in out
    assert "text encoder outputs: 4 cache files; 4 encoded now, 0 already cached (1 process)" in out
    lat_file = load_npz(images / "img0_0064x0064_moss.npz")
    assert lat_file["latents_8x8"].shape == (32, 8, 8) and "latents_flipped_8x8" in lat_file
    te_file = load_npz(images / "img0_moss_te.npz")
    assert int(te_file["num_candidates"]) == 2 and str(te_file["caption_1"]) == "a red square\non a grey background"
    assert te_file["prompt_embeds_0"].shape[1] == 64 and te_file["prompt_embeds_0"].dtype == np.float32

    lat, te = cache_both(tiny_snapshot, cfg)  # nothing to do the second time
    assert (lat.encoded, te.encoded) == (0, 0)
    before = mtimes(images)
    (images / "img2.txt").write_text("a red square, edited")
    lat, te = cache_both(tiny_snapshot, cfg)
    assert (lat.encoded, te.encoded) == (0, 1)
    after = mtimes(images)
    assert [n for n in before if before[n] != after[n]] == ["img2_moss_te.npz"]
    assert str(load_npz(images / "img2_moss_te.npz")["caption_0"]) == "a red square, edited"

    # the trainer (another --seed, so another validation split) finds every file valid and encodes nothing
    argv = base_args(tiny_snapshot, images.parent, tmp_path / "out", "--max_train_steps", "2",
                     "--cache_latents_to_disk", "--cache_text_encoder_outputs_to_disk", "--skip_cache_check")
    at = argv.index("--train_data_dir")
    argv[at : at + 2] = ["--dataset_config", str(cfg)]
    caplog.clear()
    with caplog.at_level(logging.INFO):
        run = train(argv)
    assert run.global_step == 2 and (tmp_path / "out" / "toy.safetensors").exists()
    assert "latents: 0 images encoded by this process" in caplog.text
    assert "text encoder outputs: 0 images encoded by this process" in caplog.text
    assert mtimes(images) == after

    argv.remove("--skip_cache_check")  # its own validity check agrees with the tools' files
    argv[argv.index("--max_train_steps") + 1] = "1"
    caplog.clear()
    with caplog.at_level(logging.INFO):
        train(argv)
    assert "latents: 0 images encoded by this process" in caplog.text
    assert "text encoder outputs: 0 images encoded by this process" in caplog.text
    assert mtimes(images) == after


def test_skip_cache_check_trusts_existing_files(tiny_snapshot, tmp_path):
    cfg = dataset(tmp_path)
    cache_both(tiny_snapshot, cfg)
    (tmp_path / "data" / "4_toy" / "img3.txt").write_text("changed")
    lat, te = cache_both(tiny_snapshot, cfg, "--skip_cache_check")
    assert (lat.encoded, te.encoded) == (0, 0)


@pytest.mark.parametrize(
    "tool, extra, message",
    [
        ("latents", ["--cache_latents_to_disk"], "add --moss_image"),
        ("latents", ["--moss_image", "--cache_latents"], "add --cache_latents_to_disk"),
        ("latents", ["--moss_image", "--cache_latents_to_disk", "--snapshot"], "--vae is required"),
        ("latents", ["--moss_image", "--cache_latents_to_disk", "--vae_batch_size", "0"], "at least 1"),
        ("te", ["--cache_text_encoder_outputs_to_disk"], "add --moss_image"),
        ("te", ["--moss_image", "--cache_text_encoder_outputs"], "add --cache_text_encoder_outputs_to_disk"),
        ("te", ["--moss_image", "--cache_text_encoder_outputs_to_disk", "--moss_max_token_length", "9000"],
         "out of range"),
    ],
)
def test_bad_command_lines_are_one_sentence_and_exit_2(tiny_snapshot, tmp_path, caplog, tool, extra, message):
    module = latents_tool if tool == "latents" else te_tool
    cfg = dataset(tmp_path)
    if "--snapshot" in extra:  # here: no model path at all
        argv = ["--dataset_config", str(cfg), *[a for a in extra if a != "--snapshot"]]
    else:
        argv = ["--snapshot", str(tiny_snapshot), "--dataset_config", str(cfg), *extra]
    assert module.main(argv) == 2
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and message in errors[0].getMessage()
    assert not list((tmp_path / "data" / "4_toy").glob("*.npz"))


def test_datasets_that_cannot_be_cached_are_refused(tiny_snapshot, tmp_path, caplog):
    cfg = dataset(tmp_path, random_crop=True, shuffle_caption=True)
    assert latents_tool.main(tool_args(tiny_snapshot, cfg, "--cache_latents_to_disk")) == 2
    assert "Latents cannot be cached with random_crop" in caplog.text
    assert te_tool.main(tool_args(tiny_snapshot, cfg, "--cache_text_encoder_outputs_to_disk")) == 2
    assert "Text encoder outputs cannot be cached with shuffle_caption" in caplog.text
    assert latents_tool.run(tool_args(tiny_snapshot, cfg, "--cache_latents_to_disk", "--debug_dataset")) is None


def test_two_processes_under_torchrun_each_cache_their_share(tiny_snapshot, tmp_path):
    cfg = dataset(tmp_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "tools.cache_latents", *tool_args(tiny_snapshot, cfg, "--cache_latents_to_disk")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=90)
    assert done.returncode == 0, done.stderr[-6000:]
    assert "latents: 4 images in 4 cache files; 4 encoded now, 0 already cached (2 processes)" in done.stdout
    shares = sorted(int(n) for n in re.findall(r"latents: (\d) images encoded by this process", done.stderr))
    assert shares == [2, 2]
    assert len(list((tmp_path / "data" / "4_toy").glob("*_moss.npz"))) == 4
