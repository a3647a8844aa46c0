"""`RunOptions`: what the trainer derives from its options, once, right after parsing and the implications
(`library.options.implications`); the training loop reads these values instead of deriving them again, and the math
modules (flow matching, optimizers, schedulers) get their typed settings from here rather than from `args`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from library.training import optimizers
from library.training import lr_schedulers
from library.training.flow_matching import InputPerturbation, LossConfig, TimestepSamplingConfig

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "float": torch.float32}


def dtype_of(name: str | None, fallback: torch.dtype) -> torch.dtype:
    """The torch dtype of a --mixed_precision / --save_precision value (`fallback` for "no" and None)."""
    return _DTYPES.get(name or "", fallback)


@dataclass(frozen=True)
class RunOptions:
    """Derived, frozen: which networks train, whether the text encoder is needed during the loop, the dtypes of the
    base models (weight) and of the saved LoRA, the logging backend, and the settings of the math modules."""

    train_unet: bool
    train_text_encoder: bool
    text_encoder_outputs_cached: bool  # --cache_text_encoder_outputs (or ..._to_disk, which implies it)
    weight_dtype: torch.dtype  # --mixed_precision: the dtype the DiT is loaded in
    save_dtype: torch.dtype  # --save_precision, else the LoRA's own precision (fp32 unless --full_fp16/--full_bf16)
    log_with: str | None  # --log_with, tensorboard when only --logging_dir is given
    timestep_sampling: TimestepSamplingConfig
    ip_noise: InputPerturbation
    loss: LossConfig
    optimizer: optimizers.OptimizerConfig
    scheduler: lr_schedulers.SchedulerConfig

    @property
    def text_encoder_needed(self) -> bool:
        """False when its outputs are cached and it is not trained: it is freed before the loop."""
        return self.train_text_encoder or not self.text_encoder_outputs_cached

    @classmethod
    def from_args(cls, args: argparse.Namespace, train_text_encoder: bool) -> RunOptions:
        """The derived options of parsed `args` (after the implications); `train_text_encoder` is the trainer's
        `is_train_text_encoder(args)`. The optimizer and scheduler options are checked here (UserError), before any
        model is loaded."""
        weight = dtype_of(args.mixed_precision, torch.float32)
        lora = weight if (args.full_fp16 or args.full_bf16) else torch.float32
        optimizer = optimizers.OptimizerConfig.from_args(args)
        scheduler = lr_schedulers.SchedulerConfig.from_args(args)
        optimizers.verify_optimizer_arguments(optimizer, args.gradient_accumulation_steps)
        lr_schedulers.verify_scheduler_arguments(scheduler)
        return cls(
            train_unet=not args.network_train_text_encoder_only,
            train_text_encoder=train_text_encoder,
            text_encoder_outputs_cached=bool(args.cache_text_encoder_outputs),
            weight_dtype=weight,
            save_dtype=dtype_of(args.save_precision, lora),  # as sd-scripts: the LoRA's own precision by default
            log_with=args.log_with or ("tensorboard" if args.logging_dir else None),
            timestep_sampling=TimestepSamplingConfig.from_args(args),
            ip_noise=InputPerturbation.from_args(args),
            loss=LossConfig.from_args(args),
            optimizer=optimizer,
            scheduler=scheduler,
        )
