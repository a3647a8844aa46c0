"""The dataset config schema: keys, levels, types, precedence, rejected keys, command-line fallbacks."""

from __future__ import annotations

import json

import pytest

from library.datasets.config import KEYS, DatasetParams, SubsetParams, parse_resolution_arg, resolve_config
from library.errors import UserError
from tests.test_datasets_support import parse, write_toml


def _one(subset: dict | None = None, dataset: dict | None = None, general: dict | None = None, args=None):
    raw = {"datasets": [{**(dataset or {}), "subsets": [{"image_dir": "/x", **(subset or {})}]}]}
    if general is not None:
        raw["general"] = general
    if "resolution" not in (general or {}):
        raw["datasets"][0].setdefault("resolution", 64)
    return resolve_config(raw, args, "test.toml")[0]


def test_schema_names_match_dataclasses() -> None:
    dataset_fields = set(DatasetParams.__dataclass_fields__) - {"index", "sources"}
    subset_fields = set(SubsetParams.__dataclass_fields__) - {"dataset_index", "index", "sources"}
    assert dataset_fields | subset_fields == set(KEYS)


def test_precedence_subset_dataset_general_cli_default() -> None:
    args = parse(["--caption_dropout_rate", "0.4", "--keep_tokens", "3"])
    bp = _one(
        subset={"shuffle_caption": True},
        dataset={"shuffle_caption": False, "caption_prefix": "ds"},
        general={"caption_prefix": "gen", "caption_suffix": "gen", "resolution": 64},
        args=args,
    )
    s = bp.subsets[0]
    assert s.shuffle_caption is True and s.source_of("shuffle_caption") == "datasets[0].subsets[0] of test.toml"
    assert s.caption_prefix == "ds"
    assert s.caption_suffix == "gen" and s.source_of("caption_suffix") == "[general] of test.toml"
    assert s.caption_dropout_rate == 0.4 and s.source_of("caption_dropout_rate") == "--caption_dropout_rate"
    assert s.keep_tokens == 3
    assert s.token_warmup_min == 1  # CLI default
    assert _one().subsets[0].token_warmup_min == 1 and _one().subsets[0].source_of("token_warmup_min") == "the default"


def test_false_overrides_but_none_falls_through() -> None:
    args = parse(["--flip_aug"])
    assert _one(subset={"flip_aug": False}, args=args).subsets[0].flip_aug is False
    assert _one(args=args).subsets[0].flip_aug is True
    raw = {"datasets": [{"resolution": 64, "subsets": [{"image_dir": "/x", "caption_prefix": None}]}]}
    raw_general = {"general": {"caption_prefix": "g"}, **raw}
    assert resolve_config(raw_general, None)[0].subsets[0].caption_prefix == "g"  # JSON null falls through


def test_dataset_level_values_and_cli_names() -> None:
    args = parse(["--train_batch_size", "3", "--dataset_repeats", "5", "--resolution", "96,64", "--enable_bucket"])
    bp = _one(args=args, dataset={"resolution": 128})
    assert bp.params.batch_size == 3 and bp.params.enable_bucket is True
    assert bp.params.resolution == (128, 128)
    assert bp.subsets[0].num_repeats == 5
    raw = {"datasets": [{"subsets": [{"image_dir": "/x"}]}]}
    assert resolve_config(raw, args)[0].params.resolution == (96, 64)
    pair = resolve_config({"datasets": [{"resolution": [80, 48], "subsets": [{"image_dir": "/x"}]}]})[0]
    assert pair.params.resolution == (80, 48)


@pytest.mark.parametrize(
    "where, table, needle",
    [
        (
            "subset",
            {"captoin_extension": ".txt"},
            "'captoin_extension' in datasets[0].subsets[0] of test.toml (did you mean 'caption_extension'",
        ),
        ("dataset", {"shufle_caption": True}, "'shufle_caption' in datasets[0] of test.toml"),
        ("general", {"foo": 1}, "'foo' in [general] of test.toml"),
    ],
)
def test_unknown_keys_are_named_with_location(where, table, needle) -> None:
    kwargs = {where: table}
    if where == "general":
        kwargs[where] = {**table, "resolution": 64}
    with pytest.raises(UserError) as e:
        _one(**kwargs)
    assert needle in str(e.value)


def test_second_subset_location() -> None:
    raw = {"datasets": [{"resolution": 64, "subsets": [{"image_dir": "/a"}, {"image_dir": "/b", "bad_key": 1}]}]}
    with pytest.raises(UserError, match=r"datasets\[0\]\.subsets\[1\]"):
        resolve_config(raw, None, "test.toml")


@pytest.mark.parametrize(
    "table, needle",
    [
        ({"caption_dropout_rate": "high"}, "caption_dropout_rate = 'high' in datasets[0].subsets[0]"),
        ({"caption_dropout_rate": 1.5}, "at most 1.0"),
        ({"num_repeats": 0}, "num_repeats = 0"),
        ({"num_repeats": 2.5}, "whole number"),
        ({"shuffle_caption": 1}, "true or false"),
        ({"keep_tokens": True}, "whole number"),
        ({"custom_attributes": 3}, "must be a table"),
        ({"resize_interpolation": "hermite"}, "must be one of"),
        ({"caption_separator": ""}, "non-empty"),
    ],
)
def test_wrong_types_are_named(table, needle) -> None:
    with pytest.raises(UserError) as e:
        _one(subset=table)
    assert needle in str(e.value)


def test_wrong_type_in_general_is_caught_even_when_overridden() -> None:
    with pytest.raises(UserError, match=r"\[general\]"):
        _one(subset={"flip_aug": True}, general={"flip_aug": "yes", "resolution": 64})


def test_wrong_level_and_rejected_keys() -> None:
    with pytest.raises(UserError, match="'image_dir' is not allowed in \\[general\\].*datasets.subsets"):
        _one(general={"image_dir": "/x", "resolution": 64})
    with pytest.raises(UserError, match="'batch_size' is not allowed in datasets\\[0\\].subsets\\[0\\]"):
        _one(subset={"batch_size": 2})
    with pytest.raises(UserError, match="face_crop_aug_range.*Stable Diffusion"):
        _one(subset={"face_crop_aug_range": [2.0, 4.0]})
    with pytest.raises(UserError, match="conditioning_data_dir.*ControlNet"):
        _one(subset={"conditioning_data_dir": "/m"})
    with pytest.raises(UserError, match="network multipliers"):
        _one(dataset={"network_multiplier": 0.5})
    assert _one(dataset={"network_multiplier": 1.0}).params.network_multiplier == 1.0
    with pytest.raises(UserError, match="top-level key 'dataset'"):
        resolve_config({"dataset": []}, None)


def test_style_rules() -> None:
    with pytest.raises(UserError, match="neither image_dir nor metadata_file"):
        resolve_config({"datasets": [{"resolution": 64, "subsets": [{"num_repeats": 2}]}]}, None)
    with pytest.raises(UserError, match="'is_reg'.*DreamBooth"):
        _one(subset={"metadata_file": "m.json", "is_reg": True})
    with pytest.raises(UserError, match="'class_tokens'.*DreamBooth"):
        _one(subset={"metadata_file": "m.json", "class_tokens": "x"})
    # DreamBooth keys set higher up do not bother fine-tuning subsets
    bp = _one(subset={"metadata_file": "m.json"}, general={"caption_extension": ".txt", "resolution": 64})
    assert bp.subsets[0].style == "fine_tuning"
    with pytest.raises(UserError, match="same image_dir"):
        resolve_config({"datasets": [{"resolution": 64, "subsets": [{"image_dir": "/a"}, {"image_dir": "/a/"}]}]}, None)


def test_resolution_and_bucket_range_checks() -> None:
    with pytest.raises(UserError, match="No resolution"):
        resolve_config({"datasets": [{"subsets": [{"image_dir": "/x"}]}]}, None)
    with pytest.raises(UserError, match="min_bucket_reso 512 is larger than max_bucket_reso 256"):
        _one(dataset={"min_bucket_reso": 512, "max_bucket_reso": 256})
    assert parse_resolution_arg("1024") == (1024, 1024)
    assert parse_resolution_arg(" 1024, 768 ") == (1024, 768)
    for bad in ("1024x768", "0", "1,2,3", "a"):
        with pytest.raises(UserError, match="--resolution"):
            parse_resolution_arg(bad)


def test_cli_values_are_checked() -> None:
    with pytest.raises(UserError, match="--caption_dropout_rate 2.0"):
        _one(args=parse(["--caption_dropout_rate", "2"]))
    with pytest.raises(UserError, match="--validation_split 1.0"):
        _one(args=parse(["--validation_split", "1"]))


def test_masked_loss_turns_on_alpha_mask() -> None:
    assert _one(args=parse(["--masked_loss"])).subsets[0].alpha_mask is True
    assert _one(args=parse([])).subsets[0].alpha_mask is False


def test_custom_attributes_replace_not_merge() -> None:
    bp = _one(subset={"custom_attributes": {"a": 1}}, general={"custom_attributes": {"b": 2}, "resolution": 64})
    assert dict(bp.subsets[0].custom_attributes) == {"a": 1}


def test_toml_and_json_files(tmp_path) -> None:
    from library.datasets.config import load_config_file

    toml_file = write_toml(tmp_path / "c.toml", {"resolution": 64}, [({"batch_size": 2}, [{"image_dir": "/x"}])])
    json_file = tmp_path / "c.json"
    raw = {"general": {"resolution": 64}, "datasets": [{"batch_size": 2, "subsets": [{"image_dir": "/x"}]}]}
    json_file.write_text(json.dumps(raw))
    for f in (toml_file, json_file):
        bp = resolve_config(load_config_file(f), None)[0]
        assert bp.params.batch_size == 2 and bp.params.resolution == (64, 64)
    bad = tmp_path / "bad.toml"
    bad.write_text("[general\nresolution = 1")
    with pytest.raises(UserError, match="could not be parsed"):
        load_config_file(bad)
    with pytest.raises(UserError, match="does not exist"):
        load_config_file(tmp_path / "missing.toml")


def test_resolution_and_bucket_sides_are_bounded_by_the_model() -> None:
    """`resolution = 1048576` used to pass and grow the process until the kernel killed it."""
    assert _one(dataset={"resolution": 4096, "max_bucket_reso": 4096}).params.resolution == (4096, 4096)
    with pytest.raises(UserError, match=r"resolution = 1048576 in datasets\[0\] of test.toml is too large: each side"
                                        r" may be at most 4096 pixels"):
        _one(dataset={"resolution": 1048576})
    with pytest.raises(UserError, match=r"resolution = \[1024, 4112\] .*at most 4096"):
        _one(dataset={"resolution": [1024, 4112]})
    with pytest.raises(UserError, match="max_bucket_reso = 8192 .*a bucket side may be at most 4096"):
        _one(dataset={"max_bucket_reso": 8192})
    with pytest.raises(UserError, match="--resolution '1048576' is too large"):
        resolve_config({"datasets": [{"subsets": [{"image_dir": "/x"}]}]}, parse(["--resolution", "1048576"]))
