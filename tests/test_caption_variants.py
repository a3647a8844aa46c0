"""Caption variants with cached text-encoder outputs (`caption_cache_variants`, library/datasets/caption_variants.py):
the draws (deterministic, distinct, kept tokens in place), the per-use pick (deterministic, every variant once per
cycle), the cache files (format, recipe, stale reasons, files without variants unchanged), the preflight's reason and
one short training run on the tiny snapshot."""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

import library.caching.strategies as sm
from library.datasets import build_dataset_groups
from library.datasets.caption_variants import (
    VariantRecipe,
    draw_variants,
    pick_variant,
    recipe_for,
    variant_settings,
)
from library.datasets.captions import CaptionSettings
from library.datasets.preflight_caches import CacheOptions, text_encoder_cache_report
from library.errors import UserError
from tests.test_caching import FakeTextEncoder, build, cache_te, image_folder
from tests.test_datasets_support import parse, write_toml

TAGS = "sks, red, green, blue, round, small, shiny"
SHUFFLE = CaptionSettings(shuffle_caption=True, keep_tokens=1)


def variants_of(settings: CaptionSettings, count: int, seed: int, caption: str = TAGS,
                name: str = "img0.png") -> tuple[str, ...]:
    recipe = recipe_for(settings, count, seed, [caption])
    assert recipe is not None
    return draw_variants([caption], settings, recipe, name)


def group_with(tmp_path: Path, captions: list[str], seed: int = 3, **subset):
    folder = image_folder(tmp_path / "img", captions)
    train, _ = build(tmp_path, [({}, [{"image_dir": str(folder), "num_repeats": 4, **subset}])], "--seed", str(seed))
    return train


def all_uses(group, epochs) -> dict[str, list[tuple[int, str]]]:
    """image -> [(variant index, caption)] over the epochs, in plan order."""
    uses: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for epoch in epochs:
        group.set_current_epoch(epoch)
        for i in range(len(group)):
            b = group[i]
            for key, v, caption, (embeds, _), dropped in zip(b["image_keys"], b["caption_variant_indices"],
                                                              b["captions"], b["text_encoder_outputs"],
                                                              b["captions_dropped"]):
                if not dropped:  # the outputs are those of the caption the batch names
                    assert torch.equal(embeds, FakeTextEncoder.outputs(caption)[0])
                    uses[key].append((v, caption))
    return uses


# ------------------------------------------------------------------------------------------------- drawing
def test_variants_are_deterministic_distinct_and_keep_the_kept_tokens():
    first = variants_of(SHUFFLE, 8, 3)
    assert first == variants_of(SHUFFLE, 8, 3)  # the same seed and file: the same draws
    assert len(set(first)) == 8  # 720 orders of the six free tags: eight different ones
    assert all(v.startswith("sks, ") and sorted(v.split(", ")) == sorted(TAGS.split(", ")) for v in first)
    assert variants_of(SHUFFLE, 8, 4) != first and variants_of(SHUFFLE, 8, 3, name="img1.png") != first
    assert variants_of(SHUFFLE, 3, 3) == first[:3]  # variant v does not depend on N

    fixed = CaptionSettings(shuffle_caption=True, keep_tokens_separator="|||", caption_tag_dropout_rate=0.4)
    dropped = variants_of(fixed, 8, 3, caption="sks, person ||| red, green, blue, round ||| masterpiece")
    assert all(v.startswith("sks, person, ") and v.endswith(", masterpiece") for v in dropped)
    assert any(len(v.split(", ")) < 7 for v in dropped)  # tag dropout drops free tags only

    wild = CaptionSettings(enable_wildcard=True)
    assert set(variants_of(wild, 6, 3, caption="a {red|blue} cube")) == {"a red cube", "a blue cube"}
    assert recipe_for(wild, 6, 3, ["no wildcard here"]) is None  # nothing random: one text, today's format
    assert recipe_for(SHUFFLE, 1, 3, [TAGS]) is None
    validation = variant_settings(SHUFFLE, for_validation=True)
    assert not validation.shuffle_caption and recipe_for(validation, 8, 3, [TAGS]) is None


def test_the_pick_is_deterministic_and_uses_every_variant_once_per_cycle():
    picks = [pick_variant(3, "img0.png", o, 4) for o in range(12)]
    assert picks == [pick_variant(3, "img0.png", o, 4) for o in range(12)]
    assert all(sorted(picks[c : c + 4]) == [0, 1, 2, 3] for c in range(0, 12, 4))
    assert picks != [pick_variant(3, "img1.png", o, 4) for o in range(12)]
    assert len({tuple(picks[c : c + 4]) for c in range(0, 12, 4)}) > 1  # each cycle in its own order


def test_the_batches_serve_the_picked_variant_of_each_use(tmp_path):
    train = group_with(tmp_path, [TAGS, "sks, cat, dog, bird, fish"], shuffle_caption=True, keep_tokens=1,
                       caption_cache_variants=4, caption_dropout_rate=0.2)
    cache_te(train, FakeTextEncoder(), to_disk=False)
    uses = all_uses(train, range(1, 4))
    for key, seen in uses.items():
        info = next(i for i in train.image_infos() if i.image_key == key)
        texts = train.text_encoder_cache_captions(info).texts
        assert len(texts) == 4 and all(caption == texts[v] for v, caption in seen)
        assert {v for v, _ in seen} == {0, 1, 2, 3}  # 12 uses, dropped ones aside: every variant
    assert all_uses(train, range(1, 4)) == uses  # served again: the same picks
    first_two = all_uses(train, range(1, 3))
    again = group_with(tmp_path, [TAGS, "sks, cat, dog, bird, fish"], shuffle_caption=True, keep_tokens=1,
                       caption_cache_variants=4, caption_dropout_rate=0.2)
    cache_te(again, FakeTextEncoder(), to_disk=False)
    # a new process serving epoch 3 only (a resume there) makes the picks of the uninterrupted run
    assert all_uses(again, [3]) == {key: seen[len(first_two[key]):] for key, seen in uses.items()}


# ------------------------------------------------------------------------------------------------- files
def test_the_files_hold_the_variants_and_their_recipe(tmp_path):
    subset = {"shuffle_caption": True, "keep_tokens": 1, "caption_cache_variants": 3, "caption_dropout_rate": 0.25}
    train = group_with(tmp_path, [TAGS], **subset)
    encoder = FakeTextEncoder()
    assert cache_te(train, encoder)[0] == 1
    info = next(train.image_infos())
    data = sm.load_npz(info.te_outputs_npz)
    assert int(data["num_candidates"]) == 1 and int(data["num_variants"]) == 3
    assert json.loads(str(data["variant_recipe"])) == {
        "count": 3, "seed": 3, "shuffle_caption": True, "keep_tokens": 1, "keep_tokens_separator": "",
        "caption_separator": ",", "secondary_separator": None, "caption_tag_dropout_rate": 0.0,
        "enable_wildcard": False, "draw": "sha512-random-v1"}
    texts = [str(data[f"caption_0_{v}"]) for v in range(3)]
    assert texts == list(train.text_encoder_cache_captions(info).texts) and encoder.image_captions == texts
    assert "uncond_embeds" in data and "prompt_embeds_0" not in data

    again = group_with(tmp_path, [TAGS], **subset)
    assert cache_te(again, FakeTextEncoder())[0] == 0  # valid: nothing encoded
    assert all_uses(again, range(1, 3))  # read from the file, the outputs of the captions named
    rate_changed = group_with(tmp_path, [TAGS], **{**subset, "caption_dropout_rate": 0.5})
    assert cache_te(rate_changed, FakeTextEncoder())[0] == 0  # the dropout rate is a per-step choice


@pytest.mark.parametrize(("change", "argv", "reason"), [
    ({"shuffle_caption": False, "caption_tag_dropout_rate": 0.3}, (),
     "caption_tag_dropout_rate 0.0 in the file, now 0.3, shuffle_caption True in the file, now False"),
    ({"keep_tokens": 2}, (), "keep_tokens 1 in the file, now 2"),
    ({"caption_cache_variants": 5}, (), "caption_cache_variants 3 in the file, now 5"),
    ({}, ("--seed", "4"), "seed 3 in the file, now 4"),
    ({"shuffle_caption": False}, (), "the file holds 3 variants per caption, now one text per caption"),
])
def test_a_changed_recipe_makes_the_file_stale_with_the_reason(tmp_path, caplog, change, argv, reason):
    subset = {"shuffle_caption": True, "keep_tokens": 1, "caption_cache_variants": 3}
    cache_te(group_with(tmp_path, [TAGS], **subset), FakeTextEncoder())
    folder = tmp_path / "img"
    cfg = write_toml(tmp_path / "changed.toml", {"resolution": 64},
                     [({}, [{"image_dir": str(folder), "num_repeats": 4, **subset, **change}])])
    changed, _ = build_dataset_groups(parse(["--dataset_config", str(cfg), "--seed", "3", *argv]))
    info = next(changed.image_infos())
    entry = changed.text_encoder_cache_captions(info)
    strategy = sm.MossImageTextEncoderOutputsCachingStrategy(True)
    problem = strategy.outputs_cache_problem(str(folder / "img0_moss_te.npz"), entry.texts, entry.recipe)
    assert problem == f"variant recipe changed ({reason})"

    report = text_encoder_cache_report([changed], CacheOptions(cache_text_encoder_outputs=True,
                                                               cache_text_encoder_outputs_to_disk=True), None, [])
    assert report.valid == 0 and [s.reason for s in report.stale] == [problem]  # the preflight says why
    with caplog.at_level(logging.INFO):
        assert sm.cache_text_encoder_outputs([changed], FakeTextEncoder(), strategy, show_progress=False) == 1
    assert "1 text-encoder cache files are re-made because their caption variants were drawn otherwise" in caplog.text
    assert strategy.outputs_cache_problem(str(folder / "img0_moss_te.npz"), entry.texts, entry.recipe) is None


def test_files_without_variants_keep_todays_format_and_stay_valid(tmp_path):
    train = group_with(tmp_path, ["sks, red, green"])
    cache_te(train, FakeTextEncoder())
    path = next(train.image_infos()).te_outputs_npz
    before = Path(path).read_bytes()
    names = set(sm.load_npz(path))
    assert {"prompt_embeds_0", "attn_mask_0", "caption_0", "num_candidates"} <= names
    assert not names & {"num_variants", "variant_recipe", "prompt_embeds_0_0"}
    # N given but nothing random to draw: the same file stays valid, and is not rewritten
    same = group_with(tmp_path, ["sks, red, green"], caption_cache_variants=8)
    assert cache_te(same, FakeTextEncoder())[0] == 0 and Path(path).read_bytes() == before
    # shuffling now: one text per caption is not what is needed
    shuffled = group_with(tmp_path, ["sks, red, green"], shuffle_caption=True, caption_cache_variants=3)
    entry = shuffled.text_encoder_cache_captions(next(shuffled.image_infos()))
    assert sm.MossImageTextEncoderOutputsCachingStrategy(True).outputs_cache_problem(path, entry.texts, entry.recipe) \
        == "variant recipe changed (the file holds one text per caption, now 3 variants)"


def test_variants_go_through_the_batched_encoder(tmp_path):
    calls: list[int] = []

    def encode(captions):
        calls.append(len(captions))
        return FakeTextEncoder()(captions)

    train = group_with(tmp_path, [TAGS, TAGS, "sks, a, b"], shuffle_caption=True, caption_cache_variants=4)
    strategy = sm.MossImageTextEncoderOutputsCachingStrategy(True, batch_size=2)
    assert sm.cache_text_encoder_outputs([train], encode, strategy, show_progress=False) == 3
    assert calls == [1, 8, 4]  # the empty prompt, then two images x 4 variants per call, then the last image


# ------------------------------------------------------------------------------------------------ options
def test_blockers_and_the_option(tmp_path):
    with pytest.raises(UserError, match=r"shuffle_caption in datasets\[0\].subsets\[0\] \(or set"
                                        r" caption_cache_variants to e.g. 8"):
        cache_te(group_with(tmp_path, [TAGS], shuffle_caption=True), FakeTextEncoder())
    with pytest.raises(UserError, match="token_warmup_step in .* cached variants cannot follow"):
        cache_te(group_with(tmp_path, [TAGS], caption_cache_variants=3, token_warmup_step=4), FakeTextEncoder())
    wild = group_with(tmp_path, ["a {red|blue} cube"], enable_wildcard=True, caption_cache_variants=2)
    assert wild.is_text_encoder_output_cacheable()
    for bad, message in ((0, "must be >= 1"), (65, "at most 64 variants")):
        with pytest.raises(UserError, match=f"caption_cache_variants = {bad} in datasets\\[0\\].subsets\\[0\\].*"
                                            f"{message}"):
            group_with(tmp_path, [TAGS], caption_cache_variants=bad)
    folder = tmp_path / "img"
    cfg = write_toml(tmp_path / "general.toml", {"resolution": 64, "caption_cache_variants": 5},
                     [({}, [{"image_dir": str(folder)}])])
    train, _ = build_dataset_groups(parse(["--dataset_config", str(cfg), "--caption_cache_variants", "2"]))
    assert next(train.image_infos()).subset.caption_cache_variants == 5  # [general] before the command line
    image_folder(tmp_path / "cli" / "1_x", [TAGS])
    train, _ = build_dataset_groups(parse(["--train_data_dir", str(tmp_path / "cli"), "--resolution", "64",
                                           "--caption_cache_variants", "2"]))
    assert next(train.image_infos()).subset.caption_cache_variants == 2


def test_validation_images_cache_their_plain_caption(tmp_path):
    folder = image_folder(tmp_path / "img", [TAGS] * 4)
    train, val = build(tmp_path, [({"validation_split": 0.5}, [{"image_dir": str(folder), "shuffle_caption": True,
                                                                "caption_cache_variants": 3}])])
    assert train.text_encoder_cache_captions(next(train.image_infos())).recipe is not None
    entry = val.text_encoder_cache_captions(next(val.image_infos()))
    assert entry.recipe is None and entry.texts == (TAGS,)


# ----------------------------------------------------------------------------------------------- training
def test_a_short_training_run_with_shuffled_variants_resumes_exactly(tiny_snapshot, tmp_path, caplog):
    from accelerate.state import AcceleratorState

    from library.files.safetensors_io import load_safetensors, read_metadata
    from tests.test_trainer import base_args, make_toy_dataset, train
    from tools import cache_text_encoder_outputs as te_tool

    data = make_toy_dataset(tmp_path / "data", n=2)
    for caption in (data / "4_toy").glob("*.txt"):
        caption.with_suffix(".caption").write_text("toy, red square, grey background, centred, flat")
    variants = ("--shuffle_caption", "--keep_tokens", "1", "--caption_cache_variants", "3")
    made = te_tool.run(["--moss_image", "--snapshot", str(tiny_snapshot), "--train_data_dir", str(data), "--resolution",
                        "64", "--device", "cpu", "--cache_text_encoder_outputs_to_disk", "--seed", "7",
                        "--text_encoder_batch_size", "2", *variants])
    assert made.encoded == 2 and made.captions == 6  # three variants of each caption, through the batched encoder
    AcceleratorState._reset_state(reset_partial_state=True)
    common = ("--cache_text_encoder_outputs_to_disk", *variants, "--max_train_steps", "4", "--learning_rate", "1e-3")
    out = tmp_path / "out"
    with caplog.at_level(logging.INFO):  # the tool's files, drawn with the same seed, are the trainer's
        run = train(base_args(tiny_snapshot, data, out, *common, "--save_every_n_steps", "2", "--save_state"))
    assert run.global_step == 4 and "all 2 text-encoder cache files are valid" in caplog.text
    files = sorted((data / "4_toy").glob("*_moss_te.npz"))
    assert len(files) == 2
    for path in files:
        cached = sm.load_npz(path)
        assert int(cached["num_variants"]) == 3
        recipe = VariantRecipe(**json.loads(str(cached["variant_recipe"])))
        assert recipe.seed == 7 and recipe.keep_tokens == 1
        texts = [str(cached[f"caption_0_{v}"]) for v in range(3)]
        assert len(set(texts)) == 3 and all(t.startswith("toy, ") for t in texts)
        assert np.isfinite(cached["prompt_embeds_0_2"]).all()
    assert all(c.startswith("toy, ") for c in run.train_group[0]["captions"])
    datasets = json.loads(read_metadata(out / "toy.safetensors")["ss_datasets"])
    assert datasets[0]["subsets"][0]["caption_cache_variants"] == 3  # the LoRA records how its captions varied

    caplog.clear()
    with caplog.at_level(logging.INFO):  # resumed at step 2: the files are valid, the picks those of the first run
        resumed = train(base_args(tiny_snapshot, data, tmp_path / "resumed", *common,
                                  "--resume", str(out / "toy-step00000002-state")))
    assert resumed.global_step == 4 and "all 2 text-encoder cache files are valid" in caplog.text
    a, b = load_safetensors(out / "toy.safetensors"), load_safetensors(tmp_path / "resumed" / "toy.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
