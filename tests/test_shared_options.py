"""The options the trainer, the inference script and the two cache tools share are declared once: each shared option
prints the same `--help` entry (help, default, choices, metavar) in every script that has it."""

from __future__ import annotations

import argparse
import importlib
from collections import defaultdict

import pytest

SCRIPTS = ("moss_image_train_network", "moss_image_minimal_inference", "tools.cache_latents",
           "tools.cache_text_encoder_outputs")

# options that must be shared by the scripts named (seed 001's model, attention, caching, memory and ConvRot options)
EXPECTED_SHARED = {
    "--text_encoder": 3, "--vae": 3, "--snapshot": 4, "--tokenizer_cache_dir": 3, "--moss_max_token_length": 3,
    "--disable_mmap_load_safetensors": 4, "--pretrained_model_name_or_path": 2, "--dit": 2, "--attn_mode": 2,
    "--split_attn": 2, "--xformers": 2, "--sdpa": 2, "--convrot_int8": 2, "--convrot_int8_text_encoder": 3,
    "--cache_latents": 2, "--cache_latents_to_disk": 2, "--vae_batch_size": 2, "--cache_text_encoder_outputs": 2,
    "--cache_text_encoder_outputs_to_disk": 2, "--text_encoder_batch_size": 3, "--skip_cache_check": 3,
    "--blocks_to_swap": 2, "--te_quant": 3, "--te_device": 3, "--text_encoder_cpu": 3, "--compile": 2,
    "--compile_backend": 2, "--compile_mode": 2, "--compile_dynamic": 2, "--compile_fullgraph": 2,
    "--compile_cache_size_limit": 2, "--cuda_expandable_segments": 2, "--seed": 4, "--device": 3,
}


def _parsers() -> dict[str, argparse.ArgumentParser]:
    return {name: importlib.import_module(name).setup_parser() for name in SCRIPTS}


def _help_entry(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The text `--help` prints for `action`: laid out with the parser's formatter and its full option list."""
    formatter = parser._get_formatter()
    for group in parser._action_groups:
        formatter.add_arguments(group._group_actions)
    formatter._indent()
    return formatter._format_action(action)


def _by_option(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings}


@pytest.fixture(scope="module")
def parsers() -> dict[str, argparse.ArgumentParser]:
    return _parsers()


def test_every_shared_option_prints_the_same_help(parsers):
    owners: dict[str, list[str]] = defaultdict(list)
    actions = {name: _by_option(p) for name, p in parsers.items()}
    for name, options in actions.items():
        for option in options:
            owners[option].append(name)
    shared = {o: names for o, names in owners.items() if len(names) > 1 and o not in ("-h", "--help")}
    for option, count in EXPECTED_SHARED.items():
        assert len(shared.get(option, [])) == count, (option, shared.get(option))
    for option, names in sorted(shared.items()):
        first = names[0]
        a = actions[first][option]
        fields = (a.help, a.default, a.choices, a.metavar, a.nargs, a.const, a.type, type(a), a.option_strings)
        entry = _help_entry(parsers[first], a)
        assert entry in parsers[first].format_help(), option  # the entry is what --help prints
        for other in names[1:]:
            b = actions[other][option]
            assert (b.help, b.default, b.choices, b.metavar, b.nargs, b.const, b.type, type(b),
                    b.option_strings) == fields, (option, first, other)
            assert _help_entry(parsers[other], b) == entry, (option, first, other)


def test_dit_path_has_both_names_and_each_script_keeps_its_own():
    import moss_image_minimal_inference as inference
    import moss_image_train_network as trainer

    assert trainer.setup_parser().parse_args(["--dit", "x"]).pretrained_model_name_or_path == "x"
    assert inference.setup_parser().parse_args(["--pretrained_model_name_or_path", "x"]).dit == "x"


def test_one_device_option_each_script_checks_what_it_can_use():
    import moss_image_minimal_inference as inference
    from library.caching.tool_common import check_tool_device
    from library.errors import UserError
    from tools import cache_latents

    assert inference.setup_parser().parse_args(["--device", "cuda:1"]).device == "cuda:1"
    args = cache_latents.setup_parser().parse_args(["--moss_image", "--cache_latents_to_disk", "--vae", "v",
                                                    "--device", "cuda:1"])
    with pytest.raises(UserError, match="cpu or cuda"):
        cache_latents.check_args(args)
    for ok in (None, "cpu", "cuda"):
        check_tool_device(ok)
