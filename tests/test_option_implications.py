"""library/options/implications: "X implies Y" applied once, right after parsing, with sd-scripts' warning lines; the
checks that run afterwards change nothing; the trainer's derived RunOptions."""

from __future__ import annotations

import argparse
import copy
import logging

import pytest
import torch

import moss_image_minimal_inference as inference
import moss_image_train_network as trainer
from library.memory.block_swap import check_block_swap_args
from library.options.checks import check_attention_args
from library.options.implications import TRAINING_IMPLICATIONS, Implication, apply_implications
from library.runtime.compile import check_compile_args
from library.text_encoder.quant import check_text_encoder_memory_args
from library.training.args import check_sd_scripts_options
from library.training.run_options import RunOptions


def trainer_args(*argv: str) -> argparse.Namespace:
    return trainer.setup_parser().parse_args(list(argv))


def test_training_implications_set_the_options_with_their_warnings(caplog):
    args = trainer_args("--cache_latents_to_disk", "--cache_text_encoder_outputs_to_disk", "--fp8_base",
                        "--unsloth_offload_checkpointing", "--xformers")
    with caplog.at_level(logging.WARNING):
        warnings = apply_implications(args, TRAINING_IMPLICATIONS)
    assert args.cache_latents and args.cache_text_encoder_outputs and args.gradient_checkpointing
    assert args.fp8_base is False and args.attn_mode == "xformers"
    assert warnings == [
        ("fp8_base / fp8_base_unet / fp8_scaled are not supported for MOSS-Image: use --convrot_int8"
         " (and --convrot_int8_text_encoder) instead. They are disabled."),
        "cache_text_encoder_outputs_to_disk is enabled, so cache_text_encoder_outputs is also enabled",
        "cache_latents_to_disk is enabled, so cache_latents is also enabled",
        "unsloth_offload_checkpointing is enabled, so gradient_checkpointing is also enabled",
    ]
    assert all(w in caplog.text for w in warnings)
    assert apply_implications(args, TRAINING_IMPLICATIONS) == []  # applied once: nothing left to change


def test_implications_that_change_nothing_stay_silent():
    args = trainer_args("--cache_latents", "--cache_latents_to_disk", "--gradient_checkpointing",
                        "--cpu_offload_checkpointing", "--blocks_to_swap", "4")
    assert apply_implications(args, TRAINING_IMPLICATIONS) == []
    h2d = trainer_args("--blocks_to_swap", "4", "--block_swap_h2d_only")  # an error of its check, not implied
    apply_implications(h2d, TRAINING_IMPLICATIONS)
    assert h2d.gradient_checkpointing is False
    rule = Implication(lambda a: a.flag, {"other": 1}, "flag implies other")
    ns = argparse.Namespace(flag=True, other=0)
    assert apply_implications(ns, [rule, rule]) == ["flag implies other"] and ns.other == 1


@pytest.mark.parametrize("argv, mode", [([], "torch"), (["--xformers"], "xformers"), (["--sdpa"], "torch"),
                                        (["--attn_mode", "flash", "--xformers"], "flash")])
def test_attention_aliases_resolve_the_same_in_trainer_and_inference(argv, mode):
    args = trainer_args(*argv)
    apply_implications(args, TRAINING_IMPLICATIONS)
    assert args.attn_mode == mode
    inf = inference.setup_parser().parse_args(argv)
    inference.resolve_args(inf)
    assert inf.attn_mode == mode


def test_checks_change_nothing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = trainer_args("--blocks_to_swap", "8", "--compile", "--te_quant", "auto", "--attn_mode", "flash")
    apply_implications(args, TRAINING_IMPLICATIONS)
    before = copy.deepcopy(vars(args))
    check_block_swap_args(args, training=True)
    check_text_encoder_memory_args(args, train_text_encoder=False)
    check_compile_args(args)
    check_attention_args(args, training=True)
    check_sd_scripts_options(args)
    trainer.check_model_paths(argparse.Namespace(pretrained_model_name_or_path="d", text_encoder="t", vae="v"))
    trainer.MossImageNetworkTrainer._check_swap_and_int8_args(args)
    assert vars(args) == before


def test_run_options_are_derived_once():
    args = trainer_args("--mixed_precision", "bf16", "--full_bf16", "--cache_text_encoder_outputs_to_disk",
                        "--network_train_unet_only", "--logging_dir", "logs")
    apply_implications(args, TRAINING_IMPLICATIONS)
    t = trainer.MossImageNetworkTrainer()
    options = RunOptions.from_args(args, t.is_train_text_encoder(args))
    assert options.weight_dtype == options.save_dtype == torch.bfloat16
    assert options.train_unet and not options.train_text_encoder and not options.text_encoder_needed
    assert options.log_with == "tensorboard"
    plain = RunOptions.from_args(trainer_args("--mixed_precision", "bf16", "--save_precision", "fp16"), True)
    assert plain.weight_dtype == torch.bfloat16 and plain.save_dtype == torch.float16 and plain.text_encoder_needed
    assert plain.log_with is None
    with pytest.raises(AttributeError):
        plain.weight_dtype = torch.float32  # frozen
    assert plain.timestep_sampling.method == "sigmoid" and plain.loss.loss_type == "l2"
    assert plain.optimizer.optimizer_type == "AdamW" and plain.scheduler.lr_scheduler == "constant"
    assert plain.ip_noise.gamma == 0.0


def test_run_options_check_the_optimizer_options_before_loading():
    from library.errors import UserError

    for argv in (["--optimizer_args", "weight_decay"], ["--lr_scheduler", "bogus"],
                 ["--fused_backward_pass", "--optimizer_type", "Adafactor", "--gradient_accumulation_steps", "2"]):
        with pytest.raises(UserError):
            RunOptions.from_args(trainer_args(*argv), False)


@pytest.mark.parametrize(("mode", "instead"), [("reduce-overhead", "default"),
                                               ("max-autotune", "max-autotune-no-cudagraphs")])
def test_compile_modes_with_cuda_graphs_are_refused_by_both_scripts(mode, instead):
    """The modes that capture CUDA graphs fail in the per-block compiled DiT (on an H200: a region's outputs
    overwritten by a later replay): refused before anything loads, with the mode to use instead; without --compile
    the mode is unused and nothing is said."""
    from library.errors import UserError

    inf_parser = inference.setup_parser()
    for args in (trainer_args("--compile", "--compile_mode", mode),
                 inf_parser.parse_args(["--prompt", "p", "--compile", "--compile_mode", mode])):
        with pytest.raises(UserError, match=f"--compile_mode {mode} captures CUDA graphs.*use --compile_mode {instead}"):
            check_compile_args(args)
    check_compile_args(trainer_args("--compile_mode", mode))
    check_compile_args(trainer_args("--compile", "--compile_mode", instead))
