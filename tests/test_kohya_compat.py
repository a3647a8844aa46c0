"""Pasted kohya commands and kohya_ss configuration files: the sd-scripts options that do not apply are ignored with
one warning line or refused in one sentence, unknown config keys are ignored with one warning, other models'
prompt-file options are ignored, and --cuda_allow_tf32 / --cuda_cudnn_benchmark / --save_n_epoch_ratio work.

One tiny training run (module fixture) carries a kohya command line (--v2 --v_parameterization --clip_skip 2 ...) on
top of a kohya_ss-style --config_file; the other tests only parse and check."""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from pathlib import Path

import pytest
import torch

import moss_image_minimal_inference as inference
import moss_image_train_network as trainer
from library.errors import UserError
from library.files.safetensors_io import read_metadata
from library.options.sd_scripts import BY_NAME, SD_SCRIPTS_OPTIONS
from library.runtime.compile import apply_cuda_backend_options
from library.sampling import sampler
from library.training import run_checks
from library.training.args import apply_console_log_options, check_sd_scripts_options, parse_args_with_config
from tests.test_trainer import base_args, make_toy_dataset

IGNORED_LINE = "sd-scripts options that do not apply to MOSS-Image are ignored: "
UNKNOWN_KEYS_LINE = "keys that are not options of"
PROMPT_LINE = "prompt options that MOSS-Image does not use are ignored: "

# what the kohya_ss GUI writes for a LoRA run (its own keys, sd-scripts' "off" values), sections as in its examples
KOHYA_SS_CONFIG = """\
epoch = 4
noise_offset_type = "Original"
train_inpainting = false
stop_text_encoder_training = 0
LoRA_type = "Standard"

[sd_options]
v2 = false
v_parameterization = false
clip_skip = 1
max_token_length = 75
mem_eff_attn = false
weighted_captions = false
multires_noise_discount = 0.3
min_timestep = 0
max_timestep = 1000
sample_sampler = "k_euler"

[training]
train_batch_size = 4
learning_rate = 0.01
lr_scheduler = "constant"
lr_scheduler_args = []
optimizer_args = []
network_alpha = 1
persistent_data_loader_workers = 0
save_precision = "float"
metadata_trigger_phrase = "red square"
"""


def messages(caplog: pytest.LogCaptureFixture, start: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if start in r.getMessage()]


def parse(*argv: str) -> argparse.Namespace:
    return trainer.setup_parser().parse_args(list(argv))


def run_trainer(argv: list[str]):
    """The trainer as main() runs it (the config file read under the command line), keeping the run state."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    return trainer.MossImageNetworkTrainer().train(parse_args_with_config(trainer.setup_parser(), argv))


@pytest.fixture(scope="module")
def kohya_run(tiny_snapshot, tmp_path_factory):
    """A kohya command on a kohya_ss config: 4 epochs of one batch, --save_n_epoch_ratio 2, a sample at the start
    from a prompt line with other models' options; the warnings it logged."""
    root = tmp_path_factory.mktemp("kohya")
    data = make_toy_dataset(root / "data", n=1)  # 4 repeats of one image: one batch of 4 per epoch
    config = root / "config_lora-20260101-000000.toml"
    config.write_text(KOHYA_SS_CONFIG, encoding="utf-8")
    prompts = root / "prompts.txt"
    prompts.write_text("a red square --w 32 --h 32 --s 2 --d 1 --g 3.5 --ss euler_a --zz 1\n", encoding="utf-8")
    argv = base_args(tiny_snapshot, data, root / "out", "--config_file", str(config), "--v2", "--v_parameterization",
                     "--clip_skip", "2", "--max_token_length", "225", "--no_half_vae", "--mem_eff_attn",
                     "--max_train_epochs", "4", "--save_n_epoch_ratio", "2", "--sample_prompts", str(prompts),
                     "--sample_at_first", "--cuda_allow_tf32", "--cuda_cudnn_benchmark")
    handler = _Records()
    logging.getLogger().addHandler(handler)
    try:
        run = run_trainer(argv)
    finally:
        logging.getLogger().removeHandler(handler)
    return run, root / "out", [r.getMessage() for r in handler.records if r.levelno >= logging.WARNING]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_kohya_command_on_a_kohya_ss_config_trains_with_warnings(kohya_run):
    run, out, warnings = kohya_run
    assert run.global_step == 4 and run.num_train_epochs == 4
    ignored = [w for w in warnings if w.startswith(IGNORED_LINE)]
    assert len(ignored) == 1, warnings  # one line for all of them
    named = re.findall(r"--(\w+)(?: (\S+))? \(", ignored[0])
    assert named == [("v2", ""), ("v_parameterization", ""), ("clip_skip", "2"), ("max_token_length", "225"),
                     ("no_half_vae", ""), ("mem_eff_attn", "")]  # the config's "off" values say nothing
    assert "flow velocity" in ignored[0] and "--moss_max_token_length" in ignored[0]
    unknown = [w for w in warnings if UNKNOWN_KEYS_LINE in w]
    assert len(unknown) == 1 and unknown[0].endswith(
        "are ignored: LoRA_type, epoch, noise_offset_type, stop_text_encoder_training, train_inpainting")
    prompt = [w for w in warnings if PROMPT_LINE in w]  # the file is read twice (encoding, sampling): one warning
    assert len(prompt) == 1 and "--g 3.5" in prompt[0] and "--ss euler_a" in prompt[0] and "--zz 1" in prompt[0]

    # the config's values arrived (sections flattened), the command line won over them
    assert run.args.train_batch_size == 4 and run.args.learning_rate == 0.01 and run.args.clip_skip == 2
    # --save_n_epoch_ratio 2 over 4 epochs: every 2 epochs, as sd-scripts computes it
    assert run.args.save_every_n_epochs == 2
    assert sorted(p.name for p in out.glob("toy*.safetensors")) == ["toy-000002.safetensors", "toy.safetensors"]
    assert len(list((out / "sample").glob("*.png"))) == 1
    meta = read_metadata(out / "toy.safetensors")
    assert meta["modelspec.trigger_phrase"] == "red square"
    assert "ss_clip_skip" not in meta and meta["ss_v2"] == "False"  # the ignored options leave no trace


@pytest.mark.parametrize("option", SD_SCRIPTS_OPTIONS, ids=lambda o: o.name)
def test_each_sd_scripts_option_is_ignored_or_refused(option, caplog):
    values = {bool: [], int: ["2"], float: ["0.5"], str: ["hf_secret"]}
    needs = [f"--{option.needs}", *values[BY_NAME[option.needs].kind]] if option.needs else []
    value = values[option.kind]
    args = parse(*needs, f"--{option.name}", *value)
    if option.refused:
        with pytest.raises(UserError, match=re.escape(f"--{option.name}")) as e:
            check_sd_scripts_options(args)
        assert str(e.value).startswith("MOSS-Image training cannot honour ") and "(or the config file)" in str(e.value)
    else:
        with caplog.at_level(logging.WARNING):
            check_sd_scripts_options(args)
        (line,) = messages(caplog, IGNORED_LINE)
        shown = f" {value[0]}" if option.kind in (int, float) else ""  # a text may be a token: never shown
        assert f"--{option.name}{shown} ({option.reason})" in line and "hf_secret" not in line


@pytest.mark.parametrize("argv", [
    [], ["--clip_skip", "1"], ["--max_token_length", "75"], ["--min_timestep", "0"], ["--max_timestep", "1000"],
    ["--noise_offset", "0"], ["--min_snr_gamma", "0"], ["--noise_offset_random_strength"],
    ["--multires_noise_discount", "0.5"], ["--adaptive_noise_scale", "0.1"], ["--sample_sampler", "K_EULER"],
    ["--huggingface_token", "t"], ["--huggingface_repo_id", ""], ["--zero_stage", "2"], ["--zero3_init_flag"],
])
def test_off_values_say_nothing(argv, caplog):
    """sd-scripts' "off" values, and options that act only with another that is off, are neither."""
    with caplog.at_level(logging.WARNING):
        check_sd_scripts_options(parse(*argv))
    assert not caplog.records


def test_several_refused_options_in_one_sentence():
    with pytest.raises(UserError) as e:
        check_sd_scripts_options(parse("--noise_offset", "0.05", "--min_snr_gamma", "5", "--v2"))
    text = str(e.value)
    assert "--noise_offset 0.05 (" in text and "--min_snr_gamma 5.0 (" in text and "--v2" not in text
    assert text.endswith("remove them from the command (or the config file).")


def test_sample_sampler(tmp_path, caplog):
    prompts = str(tmp_path / "p.txt")
    for name in ("euler", "k_euler", "Euler", ""):  # "" as a config file may leave it: the default
        check_sd_scripts_options(parse("--sample_sampler", name, "--sample_prompts", prompts))
    with pytest.raises(UserError, match=r"cannot honour --sample_sampler euler_a \(the sample images use the official"
                                        r" flow-matching Euler sampler of MOSS-Image: --sample_sampler euler"):
        check_sd_scripts_options(parse("--sample_sampler", "euler_a", "--sample_prompts", prompts))
    with caplog.at_level(logging.WARNING):  # no sample images: the choice selects nothing
        check_sd_scripts_options(parse("--sample_sampler", "ddim"))
    (line,) = messages(caplog, IGNORED_LINE)
    assert "--sample_sampler ddim (no --sample_prompts, so no sample images are made)" in line


def test_sample_sampler_of_a_config_file_is_checked_too(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(f'sample_sampler = "euler_a"\nsample_prompts = "{(tmp_path / "p.txt").as_posix()}"\n')
    args = parse_args_with_config(trainer.setup_parser(), ["--config_file", str(config)])
    with pytest.raises(UserError, match="--sample_sampler euler_a"):
        check_sd_scripts_options(args)


def test_config_file_unknown_keys_warn_once_and_the_command_line_wins(tmp_path, caplog):
    config = tmp_path / "c"  # sd-scripts adds .toml
    (tmp_path / "c.toml").write_text('zeta = 1\n[a]\nalpha_unknown = "x"\n[b.c]\nnetwork_dim = 8\nseed = 3\n')
    with caplog.at_level(logging.WARNING):
        args = parse_args_with_config(trainer.setup_parser(), ["--config_file", str(config), "--seed", "5"])
    assert args.network_dim == 8 and args.seed == 5
    (line,) = messages(caplog, UNKNOWN_KEYS_LINE)
    assert line == f"--config_file {config}: keys that are not options of this script are ignored: alpha_unknown, zeta"
    with pytest.raises(UserError, match="is not valid TOML"):
        (tmp_path / "bad.toml").write_text("x = [")
        parse_args_with_config(trainer.setup_parser(), ["--config_file", str(tmp_path / "bad.toml")])


def test_save_n_epoch_ratio_cannot_be_negative():
    run_checks.check_run_options(parse("--save_n_epoch_ratio", "0"))  # off, as in sd-scripts
    with pytest.raises(UserError, match="--save_n_epoch_ratio -1 is negative"):
        run_checks.check_run_options(parse("--save_n_epoch_ratio", "-1"))


@pytest.fixture
def cuda_flags():
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.benchmark = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = saved


def test_cuda_options_set_the_backends_as_sd_scripts(cuda_flags, monkeypatch, caplog):
    for args in (parse("--cuda_allow_tf32"), inference.setup_parser().parse_args(["--cuda_allow_tf32"])):
        assert args.cuda_allow_tf32 and not args.cuda_cudnn_benchmark  # a shared option of both scripts
    apply_cuda_backend_options(parse("--cuda_allow_tf32", "--cuda_cudnn_benchmark"))  # no CUDA here: nothing set
    assert not torch.backends.cudnn.benchmark and not torch.backends.cuda.matmul.allow_tf32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with caplog.at_level(logging.INFO):
        apply_cuda_backend_options(parse("--cuda_allow_tf32"))
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert not torch.backends.cudnn.benchmark and "Enabled TF32 on CUDA" in caplog.text
        apply_cuda_backend_options(parse("--cuda_cudnn_benchmark"))
    assert torch.backends.cudnn.benchmark and "Enabled cuDNN benchmark" in caplog.text


def test_prompt_options_of_other_models_are_ignored(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        d = sampler.parse_prompt_line("x --w 512 --g 3.5 --ss euler_a --cn c.png --zz 1 --s 4")
    assert (d["width"], d["sample_steps"], d["scale"]) == (512, 4, 3.0)
    (line,) = messages(caplog, PROMPT_LINE)
    assert re.findall(r"--(\w+) (\S+) \(", line) == [("g", "3.5"), ("ss", "euler_a"), ("cn", "c.png"), ("zz", "1")]
    assert "the CFG scale of MOSS-Image is --l" in line and "the options are --w --h --s --l --fs --n --d" in line
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        sampler.parse_prompt_line("x --ss euler --ss K_Euler")  # the sampler used anyway
    assert not caplog.records
    for bad, match in [("x --g 3 --w 1000", "multiple of 16"), ("x --zz --l abc", "number")]:
        with pytest.raises(UserError, match=match):  # our options keep their checks
            sampler.parse_prompt_line(bad)


def test_prompt_file_keys_of_other_models_are_ignored_once_per_file(tmp_path, caplog):
    path = tmp_path / "p.json"
    path.write_text('[{"prompt": "a", "guidance_scale": 3.5, "sample_sampler": "euler"}, "b --ss dpmsolver"]')
    with caplog.at_level(logging.WARNING):
        first = sampler.load_prompts(str(path))
        again = sampler.load_prompts(str(path))
    assert first == again and [p["prompt"] for p in first] == ["a", "b"]
    (line,) = messages(caplog, PROMPT_LINE)
    assert line.startswith(f"{path}: ") and "guidance_scale = 3.5 (the distilled guidance of FLUX" in line
    assert "--ss dpmsolver (the sampler is always the official flow-matching Euler)" in line
    assert "sample_sampler" not in line
    toml = tmp_path / "p.toml"
    toml.write_text('[prompt]\nwidth = 32\nheight = 32\nctr = 1\n[[prompt.subset]]\nprompt = "c"\n')
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        (prompt,) = sampler.load_prompts(str(toml))
    assert prompt["width"] == 32 and "ctr = 1 (not a prompt key; the keys are prompt, negative_prompt" in caplog.text


def test_inference_prompt_file_and_cuda_options(tiny_snapshot, tmp_path, caplog):
    prompts = tmp_path / "p.txt"
    prompts.write_text("cat --w 32 --h 32 --s 2 --d 3 --g 3.5 --ss euler_a\n", encoding="utf-8")
    argv = ["--snapshot", str(tiny_snapshot), "--from_file", str(prompts), "--save_path", str(tmp_path / "o"),
            "--output_type", "latent", "--device", "cpu", "--cuda_allow_tf32", "--cuda_cudnn_benchmark"]
    with caplog.at_level(logging.INFO):
        paths = inference.run(inference.setup_parser().parse_args(argv))
    assert len(paths) == 1 and Path(paths[0]).is_file()
    assert "--g 3.5" in caplog.text and "--ss euler_a" in caplog.text and "no CUDA device, nothing to set" in caplog.text


def test_console_log_options(tmp_path):
    root = logging.getLogger()
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    level, before = root.level, list(root.handlers)
    root.addHandler(console)
    try:
        apply_console_log_options(parse("--console_log_level", "DEBUG", "--console_log_simple"))
        assert root.level == logging.DEBUG and console in root.handlers
        log = tmp_path / "train.log"
        log.write_text("an older run\n")
        apply_console_log_options(parse("--console_log_file", str(log)))
        assert console not in root.handlers  # the file instead of the console
        logging.getLogger("moss").debug("to the file")
        for handler in root.handlers:
            handler.flush()
        assert log.read_text() == "DEBUG to the file\n"
        with pytest.raises(UserError, match="--console_log_file .* cannot be written"):
            apply_console_log_options(parse("--console_log_file", str(tmp_path / "no" / "such" / "x.log")))
    finally:
        for handler in [h for h in root.handlers if h not in before]:
            root.removeHandler(handler)
            handler.close()
        root.setLevel(level)


# ----------------------------------------------------------------------------------------------------------------------
# the metadata that sd-scripts' tools and the webui LoRA browsers read

_NUMBER = r"-?\d+(\.\d+)?(e-?\d+)?"
_HEX64 = r"[0-9a-f]{64}"
# key -> the form its value must have, as the readers parse it. Where each expectation comes from:
# - sd-scripts library/train_util.py SS_METADATA_MINIMUM_KEYS and build_minimum_network_metadata, read back by
#   networks/merge_lora.py, svd_merge_lora.py, sdxl_merge_lora.py, flux_merge_lora.py (ss_v2 compared with "True",
#   ss_base_model_version), networks/resize_lora.py (ss_training_comment, ss_network_dim / ss_network_alpha rewritten
#   as numbers), train_network.py's own writer (ss_session_id, ss_training_started_at, ss_output_name, the dataset keys
#   of a --train_data_dir run, ss_sd_model_name / hashes, ss_steps, ss_epoch);
# - sd-webui-additional-networks scripts/metadata_editor.py (ss_session_id, sshs_model_hash, sshs_legacy_hash);
# - stable-diffusion-webui extensions-builtin/Lora (network.py: ss_output_name, ss_base_model_version, ss_v2;
#   ui_edit_user_metadata.py: ss_sd_model_name, ss_network_module, float(ss_training_started_at), the JSON objects
#   ss_tag_frequency {dir: {tag: count}}, ss_dataset_dirs {dir: {n_repeats, img_count}}, ss_bucket_info {buckets}).
SD_SCRIPTS_METADATA = {
    "ss_v2": r"True|False",
    "ss_base_model_version": r"moss_image_\w+",
    "ss_network_module": r"networks\.lora_generic",
    "ss_network_dim": _NUMBER,
    "ss_network_alpha": _NUMBER,
    "ss_session_id": r"\d+",
    "ss_training_started_at": _NUMBER,
    "ss_training_finished_at": _NUMBER,
    "ss_output_name": r"toy",
    "ss_learning_rate": _NUMBER,
    "ss_num_train_images": r"\d+",
    "ss_num_batches_per_epoch": r"\d+",
    "ss_num_epochs": r"\d+",
    "ss_steps": r"\d+",
    "ss_epoch": r"\d+",
    "ss_max_train_steps": r"\d+",
    "ss_seed": r"\d+",
    "ss_mixed_precision": r"no|fp16|bf16",
    "ss_optimizer": r".+",
    "ss_lr_scheduler": r"\w+",
    "ss_training_comment": r"None|.*",
    "ss_sd_model_name": r"[^/\\]+\.safetensors",
    "ss_sd_model_hash": r"[0-9a-f]{8}",
    "ss_new_sd_model_hash": _HEX64,
    "ss_vae_name": r"[^/\\]+\.safetensors",
    "ss_vae_hash": r"[0-9a-f]{8}",
    "ss_new_vae_hash": _HEX64,
    "ss_batch_size_per_device": r"\d+",
    "ss_total_batch_size": r"\d+",
    "ss_resolution": r"\(\d+, \d+\)",
    "ss_enable_bucket": r"True|False",
    "ss_min_bucket_reso": r"\d+",
    "ss_max_bucket_reso": r"\d+",
    "ss_keep_tokens": r"\d+",
    "ss_shuffle_caption": r"True|False",
    "ss_tag_frequency": r"\{.*\}",
    "ss_dataset_dirs": r"\{.*\}",
    "ss_reg_dataset_dirs": r"\{.*\}",
    "ss_bucket_info": r"\{.*\}|null",
    "sshs_model_hash": _HEX64,
    "sshs_legacy_hash": r"[0-9a-f]{8}",
}


def test_saved_metadata_has_every_key_the_sd_scripts_readers_expect(kohya_run):
    _, out, _ = kohya_run
    meta = read_metadata(out / "toy.safetensors")
    missing = sorted(k for k in SD_SCRIPTS_METADATA if k not in meta)
    assert not missing, missing
    wrong = {k: meta[k] for k, form in SD_SCRIPTS_METADATA.items() if not re.fullmatch(form, meta[k], re.DOTALL)}
    assert not wrong, wrong
    assert float(meta["ss_network_dim"]) == 4 and float(meta["ss_network_alpha"]) == 1.0
    # the JSON values in the shapes the webui reads them
    tags = json.loads(meta["ss_tag_frequency"])
    assert tags == {"4_toy": {"toy": 1}}  # no .caption file (sd-scripts' default extension): the class token
    dirs = json.loads(meta["ss_dataset_dirs"])
    assert dirs == {"4_toy": {"n_repeats": 4, "img_count": 1}}
    assert json.loads(meta["ss_reg_dataset_dirs"]) == {}
    buckets = json.loads(meta["ss_bucket_info"])["buckets"]
    assert all(len(b["resolution"]) == 2 and int(b["count"]) >= 1 for b in buckets.values())
    assert meta["ss_resolution"] == "(64, 64)"
    assert all(isinstance(v, str) for v in meta.values())  # safetensors metadata: str -> str only
