#!/usr/bin/env python
"""LoRA training for MOSS-Image (sd-scripts style): `accelerate launch moss_image_train_network.py ...` or plain python.

`MossImageNetworkTrainer` fills in the hooks of `library.training.network_trainer.NetworkTrainer`: the Qwen3.5 text encoder
and the FLUX.2 VAE load first, the DiT lazily after caching (with the TE outputs cached to disk and no sample prompts,
the text encoder is read only if some cache file must be made); latents are patchified and BatchNorm-normalised at
training time; the target is the flow velocity noise - x0 with timesteps sigma * 1000.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from pathlib import Path
from typing import Any

import torch

from library.datasets.args import add_dataset_arguments
from library.errors import UserError
from library.files import model_spec
from library.memory.block_swap import check_block_swap_args
from library.moss_image.loaders import fill_paths_from_snapshot
from library.options.checks import check_attention_args
from library.planning.run_options import add_vram_budget_argument, apply_vram_budget
from library.quant.convrot_kernels import HAS_TRITON
from library.runtime.compile import check_compile_args, check_cpu_compiler
from library.runtime.transfer import to_device
from library.text_encoder.encoding import LazyEncoder, encode_captions, pad_and_stack, text_encoder_batch_size
from library.text_encoder.loading import (
    TextEncoderOptions,
    load_text_encoder,
    place_text_encoder,
    predict_text_encoder_variant,
)
from library.text_encoder.quant import check_text_encoder_memory_args
from library.text_encoder.qwen35 import check_max_token_length, load_tokenizer
from library.text_encoder.variant import check_predicted_variant
from library.training import flow_matching
from library.training.args import (
    add_common_arguments,
    apply_console_log_options,
    parse_args_with_config,
    write_config_file,
)
from library.training.network_trainer import NetworkTrainer, RunState
from library.training.optimizers import add_optimizer_arguments

logger = logging.getLogger("moss_image_train_network")


def check_model_paths(args: argparse.Namespace) -> None:
    """The three model paths are required (after --snapshot filled those not given)."""
    for opt, what in (("pretrained_model_name_or_path", "the MOSS-Image DiT (first shard or ComfyUI file)"),
                      ("text_encoder", "the Qwen3.5-9B text encoder (first shard)"), ("vae", "the FLUX.2 VAE")):
        if not getattr(args, opt):
            raise UserError(f"--{opt} is required: give the path of {what} (or --snapshot with a snapshot folder).")


class MossImageNetworkTrainer(NetworkTrainer):
    def __init__(self) -> None:
        self.tokenizer: Any = None
        self.bn_running_mean: torch.Tensor | None = None
        self.bn_running_var: torch.Tensor | None = None
        self.sample_prompts_te_outputs: dict[str, Any] | None = None
        self.dit_convrot_int8 = False
        self.text_encoder_convrot_int8 = False
        self.text_encoder_variant: str | None = None  # recorded in the TE caches
        self.deferred_te_variant: str | None = None  # predicted variant while the text encoder load is deferred
        self.te_base_weights: str | None = None  # identity of the --base_weights text-encoder part (TE caches)
        self.te_device: torch.device | None = None  # where the text encoder runs (--te_device / --te_quant)

    # ----------------------------------------------------------------------------------------------- checks
    def resolve_args(self, args: argparse.Namespace) -> None:
        """--snapshot fills the model paths (and the tokenizer) that are not given, then the options' implications."""
        fill_paths_from_snapshot(args, "pretrained_model_name_or_path", "text_encoder", "vae")
        super().resolve_args(args)

    def assert_extra_args(self, args: argparse.Namespace, train_group: Any, val_group: Any) -> None:
        check_model_paths(args)
        check_max_token_length(args.moss_max_token_length)
        text_encoder_batch_size(args.text_encoder_batch_size)
        if args.mixed_precision == "fp16":
            logger.warning("mixed_precision fp16 is not recommended for MOSS-Image: the text encoder and the DiT are"
                           " bf16 models. Use bf16.")
        if args.cache_text_encoder_outputs:
            if not args.network_train_unet_only:
                raise UserError("--cache_text_encoder_outputs needs --network_train_unet_only: the text encoder LoRA"
                                " cannot be trained on cached outputs.")
            blockers = train_group.text_encoder_output_cache_blockers(True, True)
            if blockers:
                raise UserError(f"Text encoder outputs cannot be cached with {', '.join(blockers)}: turn those off or"
                                " drop --cache_text_encoder_outputs.")
        if self.is_train_text_encoder(args):
            logger.info("Training the text encoder (Qwen3.5-9B) LoRA. Note: the official recommendation is to keep"
                        " the text encoder frozen.")
        check_attention_args(args, training=True)
        if args.compile and args.torch_compile:
            raise UserError("--compile (per-block torch.compile) and --torch_compile (accelerate dynamo) cannot be"
                            " used together: keep one.")
        check_compile_args(args)
        check_cpu_compiler(args, "cuda" if torch.cuda.is_available() else "cpu")
        if args.unsloth_offload_checkpointing and args.cpu_offload_checkpointing:
            raise UserError("Cannot use both --unsloth_offload_checkpointing and --cpu_offload_checkpointing.")
        self._check_swap_and_int8_args(args)
        check_text_encoder_memory_args(args, self.is_train_text_encoder(args))
        for group in (train_group, val_group):
            if group is not None:
                group.verify_bucket_reso_steps(16)  # FLUX.2 VAE 8x and 2x2 patchify

    @staticmethod
    def _check_swap_and_int8_args(args: argparse.Namespace) -> None:
        """Block swap conflicts (seed 000's messages) and what --convrot_int8_bwd int8 needs."""
        check_block_swap_args(args, training=True)
        if args.convrot_int8_bwd == "int8":
            if not (HAS_TRITON and torch.cuda.is_available()):
                raise UserError("--convrot_int8_bwd int8 needs triton and a CUDA GPU (triton-windows on Windows): use"
                                " the default --convrot_int8_bwd bf16.")
            if not (args.convrot_int8 or args.convrot_int8_text_encoder):
                logger.info("--convrot_int8_bwd int8 only takes effect with a ConvRot INT8 base (--convrot_int8,"
                            " --convrot_int8_text_encoder or a pre-quantised checkpoint)")

    # --------------------------------------------------------------------------------------------- models
    def load_target_model(self, args: argparse.Namespace, weight_dtype: torch.dtype, accelerator: Any) -> tuple:
        from library.moss_image.vae import load_flux2_vae

        self.tokenizer = load_tokenizer(args.tokenizer_cache_dir, args.text_encoder)
        self.deferred_te_variant = self._deferrable_te_variant(args, accelerator)
        if self.deferred_te_variant is None:
            text_encoder = self._load_text_encoder(args, accelerator)
        else:  # read only if some cache file must be made (cache_text_encoder_outputs_if_needed)
            text_encoder = None
            self.text_encoder_variant = self.deferred_te_variant
            self.text_encoder_convrot_int8 = self.deferred_te_variant.startswith("convrot_int8")
            logger.info("the text encoder (%s) is read only if some text-encoder cache file must be made",
                        self.deferred_te_variant)
        # --lowram: straight to the GPU (little CPU RAM); otherwise kept on the CPU until it is needed
        home = accelerator.device if args.lowram else "cpu"
        logger.info("loading the FLUX.2 VAE (fp32)")
        vae = load_flux2_vae(args.vae, dtype=torch.float32, device=home, disable_mmap=args.disable_mmap_load_safetensors)
        self.bn_running_mean = vae.bn.running_mean.detach().clone().float()
        self.bn_running_var = vae.bn.running_var.detach().clone().float()
        return "moss_image", [text_encoder], vae, None

    def _deferrable_te_variant(self, args: argparse.Namespace, accelerator: Any) -> str | None:
        """The predicted text-encoder variant when loading the encoder can wait for the TE cache check (its outputs
        are cached to disk, it is not trained, no sample prompt is to be encoded at startup), else None."""
        if not (args.cache_text_encoder_outputs_to_disk and self.is_text_encoder_not_needed_for_training(args)):
            return None
        if args.sample_prompts:
            return None
        return predict_text_encoder_variant(TextEncoderOptions.from_args(args), accelerator.device)

    def _load_text_encoder(self, args: argparse.Namespace, accelerator: Any, used_now: bool = False) -> Any:
        """Read the text encoder (LoRA --base_weights merged, ConvRot INT8 / --te_quant applied) and note its device
        and variant; kept on the CPU until it is used, unless it is used now (`used_now`) or --lowram: then read
        straight to where it runs."""
        plan = self._base_weights_plan(args, "lora_te", accelerator.device)
        loaded = load_text_encoder(TextEncoderOptions.from_args(args), accelerator.device,
                                   tensor_hook=plan.merge if plan else None, frozen=not self.is_train_text_encoder(args),
                                   home=None if args.lowram or used_now else "cpu")
        if plan:
            plan.finish()
        self.te_device = loaded.device
        self.text_encoder_convrot_int8 = loaded.convrot_int8
        self.text_encoder_variant = loaded.variant
        return loaded.model

    @staticmethod
    def _base_weights_plan(args: argparse.Namespace, prefix: str, device: Any = None) -> Any:
        """--base_weights: LoRA files merged into the base weights while they are read (before any quantisation), the
        math on `device` when it is a GPU."""
        from library.lora.merge import LoraMergePlan, load_lora_files

        if not args.base_weights:
            return None
        plan = LoraMergePlan(load_lora_files(args.base_weights, args.base_weights_multiplier), prefix,
                             names=args.base_weights, device=device)
        return None if plan.is_empty else plan

    def load_unet_lazily(self, args: argparse.Namespace, weight_dtype: torch.dtype, accelerator: Any,
                         text_encoders: list) -> tuple:
        from library.moss_image.loaders import load_moss_image_model
        from library.quant.convrot import is_convrot_int8_model

        # with --convrot_int8 the bf16 weights are read to the CPU and quantised on the GPU, one layer at a time
        loading_device = "cpu" if args.convrot_int8 or args.blocks_to_swap else accelerator.device
        plan = self._base_weights_plan(args, "lora_unet", accelerator.device)
        model = load_moss_image_model(
            accelerator.device, args.pretrained_model_name_or_path, args.attn_mode, args.split_attn,
            loading_device=loading_device, dtype=weight_dtype, disable_mmap=args.disable_mmap_load_safetensors,
            convrot_int8=args.convrot_int8, convrot_int8_bwd=args.convrot_int8_bwd, calc_device=accelerator.device,
            tensor_hook=plan.merge if plan else None,
        )
        if plan:
            plan.finish()
        self.dit_convrot_int8 = is_convrot_int8_model(model)
        if self.dit_convrot_int8:
            logger.info("the DiT base is ConvRot INT8 (%s)", "quantised at load" if args.convrot_int8 else "pre-quantised file")
        if args.blocks_to_swap:
            self._enable_block_swap(args, model, accelerator)
        return model, text_encoders

    @staticmethod
    def _enable_block_swap(args: argparse.Namespace, model: Any, accelerator: Any) -> None:
        """Freeze the base (the H2D-only ring never writes back), then swap blocks; prepare_unet places the rest."""
        from library.memory.block_swap import BlockSwapConfig, check_block_swap_device

        check_block_swap_device(accelerator.device, accelerator.num_processes)
        model.requires_grad_(False)
        model.enable_block_swap(args.blocks_to_swap, BlockSwapConfig.from_args(args, accelerator.device))

    def prepare_unet(self, run: RunState) -> None:
        from library.runtime.compile import compile_blocks
        from library.runtime.fused_compiled import stacked_qkv_training_on

        if getattr(run.unet, "block_offloader", None) is not None:
            run.unet.move_to_device_except_swap_blocks(run.accelerator.device)
            run.unet.prepare_block_swap_before_forward()
        else:
            run.unet.to(run.accelerator.device)
            # ConvRot INT8 q, k and v as one base product in compiled steps without checkpointing (measured faster
            # there, slower with checkpointing: library.runtime.fused_compiled.stacked_qkv_training_on)
            if stacked_qkv_training_on() and run.args.compile and not run.args.gradient_checkpointing:
                run.unet.stack_qkv_weights()
        if run.args.compile:
            buckets = {i.bucket_reso for g in (run.train_group, run.val_group) if g is not None for i in g.image_infos()}
            compile_blocks(run.args, run.unet, num_shapes=len(buckets))

    # --------------------------------------------------------------------------------------------- caching
    def get_latents_caching_strategy(self, args: argparse.Namespace) -> Any:
        from library.caching.strategies import MossImageLatentsCachingStrategy

        return MossImageLatentsCachingStrategy(args.cache_latents_to_disk, args.vae_batch_size, args.skip_cache_check)

    def get_text_encoder_outputs_caching_strategy(self, args: argparse.Namespace) -> Any:
        from library.caching.strategies import MossImageTextEncoderOutputsCachingStrategy

        if not args.cache_text_encoder_outputs:
            return None
        return MossImageTextEncoderOutputsCachingStrategy(
            args.cache_text_encoder_outputs_to_disk, args.text_encoder_batch_size, args.skip_cache_check,
            max_token_length=args.moss_max_token_length, encoder_variant=self.text_encoder_variant,
            te_base_weights=self._te_base_weights(args),
        )

    def _te_base_weights(self, args: argparse.Namespace) -> str:
        """The identity of what --base_weights merge into the text encoder ("" for nothing), from the options and the
        files (never the encoder), so the caches can be checked before the encoder is read; computed once."""
        from library.text_encoder.base_weights import text_encoder_base_weights_identity

        if self.te_base_weights is None:
            self.te_base_weights = text_encoder_base_weights_identity(args.base_weights, args.base_weights_multiplier)
        return self.te_base_weights

    def cache_latents(self, run: RunState) -> None:
        from library.caching.strategies import cache_latents

        acc = run.accelerator
        run.vae.to(acc.device)
        cache_latents([run.train_group, run.val_group], run.vae, self.get_latents_caching_strategy(run.args),
                      acc.process_index, acc.num_processes, acc.is_local_main_process)
        if not run.args.highvram:  # --highvram keeps the VAE on the GPU (faster sample images, more VRAM)
            run.vae.to("cpu")
        acc.wait_for_everyone()

    def cache_text_encoder_outputs_if_needed(self, run: RunState) -> None:
        from library.caching.strategies import cache_text_encoder_outputs

        args, acc = run.args, run.accelerator
        if not args.cache_text_encoder_outputs:
            return

        def make_encode() -> Any:  # called only when something is encoded: a deferred encoder is read here
            if run.text_encoders[0] is None:
                run.text_encoders[0] = self._load_deferred_text_encoder(args, acc)
            te = place_text_encoder(run.text_encoders[0], self.te_device)  # a bitsandbytes one is there already
            return functools.partial(encode_captions, te, self.tokenizer, max_length=args.moss_max_token_length,
                                     batch_size=text_encoder_batch_size(args.text_encoder_batch_size))

        encode = LazyEncoder(make_encode, loads_model=run.text_encoders[0] is None)
        cache_text_encoder_outputs([run.train_group, run.val_group], encode,
                                   self.get_text_encoder_outputs_caching_strategy(args),
                                   acc.process_index, acc.num_processes, acc.is_local_main_process)
        if args.sample_prompts:
            self.sample_prompts_te_outputs = self._encode_sample_prompts(args, encode)
        acc.wait_for_everyone()
        if self.is_text_encoder_not_needed_for_training(args):
            run.text_encoders[0] = None  # freed before the DiT is read: the two are never in RAM together
            del encode
        elif run.text_encoders[0] is not None:  # offloaded, except a bitsandbytes one (it stays on the GPU)
            place_text_encoder(run.text_encoders[0], "cpu")

    def _load_deferred_text_encoder(self, args: argparse.Namespace, accelerator: Any) -> Any:
        """The text encoder whose loading was deferred, checked against the variant the caches were checked with;
        read straight to where it runs: it encodes at once and is freed after the caching (a deferred encoder is not
        needed for training), so it is on that device only in the phase that uses it."""
        text_encoder = self._load_text_encoder(args, accelerator, used_now=True)
        if self.deferred_te_variant is not None:
            check_predicted_variant(self.deferred_te_variant, self.text_encoder_variant)
        return text_encoder

    def _encode_sample_prompts(self, args: argparse.Namespace, encode: Any) -> dict[str, Any]:
        from library.sampling.sampler import load_prompts

        texts: list[str] = []
        for p in load_prompts(args.sample_prompts):
            for t in (p.get("prompt", ""), p.get("negative_prompt", "") or ""):
                if t not in texts:
                    texts.append(t)
        logger.info("caching the text encoder outputs of %d sample prompts", len(texts))
        return {t: (e.cpu(), m.cpu()) for t, (e, m) in zip(texts, encode(texts))}

    # --------------------------------------------------------------------------------------------- batches
    def get_latents(self, run: RunState, batch: dict[str, Any]) -> torch.Tensor:
        from library.moss_image.vae import normalize_latents, patchify_latents

        acc = run.accelerator
        raw = batch.get("latents")
        if raw is None:
            run.vae.to(acc.device)
            raw = run.vae.encode(batch["images"].to(acc.device))
        raw = to_device(raw, acc.device, torch.float32)  # pinned first: the queue keeps running
        if self.bn_running_mean.device != acc.device:  # moved once, not copied every step
            self.bn_running_mean = self.bn_running_mean.to(acc.device)
            self.bn_running_var = self.bn_running_var.to(acc.device)
        return normalize_latents(patchify_latents(raw), self.bn_running_mean, self.bn_running_var)

    def get_text_conds(self, run: RunState, batch: dict[str, Any], is_train: bool) -> tuple[torch.Tensor, torch.Tensor]:
        outputs = batch.get("text_encoder_outputs")
        if outputs is None:  # gradients flow when the text encoder LoRA is trained (the caller sets the grad mode)
            te = place_text_encoder(run.text_encoders[0], self.te_device)
            outputs = encode_captions(te, self.tokenizer, batch["captions"], run.args.moss_max_token_length,
                                      text_encoder_batch_size(run.args.text_encoder_batch_size), grad=True)
        # padded where they are (the host for cached outputs): one copy of the batch, and the mask stays on the host,
        # where the DiT reads the text lengths and decides about padding without a device sync
        embeds, mask = pad_and_stack(outputs)
        if embeds.shape[-1] != run.unet.config.text_dim:  # caches of another text encoder
            raise UserError(f"The text-encoder outputs are {embeds.shape[-1]} wide, but the DiT takes"
                            f" {run.unet.config.text_dim}: the *_moss_te.npz cache files were made by another text"
                            " encoder; delete them (or drop --skip_cache_check) to re-create them.")
        return to_device(embeds, run.accelerator.device), mask

    def get_noise_pred_and_target(
        self, run: RunState, latents: torch.Tensor, text_conds: Any, batch: dict[str, Any], is_train: bool,
        fixed_sigmas: torch.Tensor | None = None, generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        args, acc = run.args, run.accelerator
        if generator is not None:
            noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32).to(latents.device)
        else:
            noise = torch.randn_like(latents)
        offset = None
        if is_train and "custom_attributes" in batch:
            offs = [float((ca or {}).get("timestep_sampling", {}).get("offset", 0.0)) for ca in batch["custom_attributes"]]
            if any(offs):
                offset = torch.tensor(offs, dtype=torch.float32)
        sampling = run.options.timestep_sampling
        noisy, timesteps, sigmas = flow_matching.get_noisy_model_input_and_timesteps(
            sampling, latents, noise, acc.device, torch.float32, generator=generator, timestep_sampling_offset=offset,
            sigmas=fixed_sigmas, ip_noise=run.options.ip_noise if is_train else None,
            host_generator=generator if generator is not None else run.host_generator,
        )
        embeds, mask = text_conds
        embeds = embeds.to(acc.device, run.weight_dtype)
        if args.gradient_checkpointing and is_train:
            noisy.requires_grad_(True)
        with torch.set_grad_enabled(is_train), acc.autocast():
            pred = run.unet(noisy, timesteps, embeds, mask)
        target = noise - latents
        weighting = flow_matching.compute_loss_weighting(sampling.weighting_scheme, sigmas)
        return pred, target, timesteps, weighting

    # --------------------------------------------------------------------------------------------- sampling
    def on_validation_step_end(self, run: RunState) -> None:
        run.unet.prepare_block_swap_before_forward()  # block swap: re-arm the ring (a no-op when it is armed)

    def sample_images(self, run: RunState, epoch: int | None, step: int) -> None:
        from library.training.sample_images import is_due, sample_images_if_due

        if is_due(run.args, epoch, step):
            run.optimizer_eval_fn()
            sample_images_if_due(self, run, epoch, step)
            run.optimizer_train_fn()

    # --------------------------------------------------------------------------------------------- metadata
    def base_model_files(self, args: argparse.Namespace) -> dict[str, list[Path]]:
        """ss_sd_model_* of the DiT (all its shards), ss_vae_* of the VAE's weights file."""
        from library.moss_image.loaders import dit_checkpoint_files
        from library.moss_image.vae import vae_weights_file

        return {"sd_model": dit_checkpoint_files(args.pretrained_model_name_or_path),
                "vae": [vae_weights_file(args.vae)]}

    def update_metadata(self, metadata: dict[str, Any], args: argparse.Namespace) -> None:
        metadata.update(model_spec.moss_image_metadata(args, self.dit_convrot_int8, self.text_encoder_convrot_int8))


def setup_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="LoRA training for MOSS-Image (sd-scripts style).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_common_arguments(parser)
    add_dataset_arguments(parser)
    add_optimizer_arguments(parser)
    flow_matching.add_flow_matching_arguments(parser)
    add_vram_budget_argument(parser.add_argument_group("memory plan"))
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = setup_parser()
    try:
        args = parse_args_with_config(parser, argv)
        apply_console_log_options(args)
        if args.output_config:
            out = args.config_file or str(Path(args.output_dir or ".") / f"{args.output_name or 'config'}.toml")
            write_config_file(args, parser, out)
            print(f"wrote the arguments to {out}")
            return 0
        if args.show_timesteps:
            flow_matching.show_timesteps(flow_matching.ShowTimestepsConfig.from_args(args))
            return 0
        apply_vram_budget(args, setup_parser, argv)  # --vram_budget: the planned options, before anything loads
        MossImageNetworkTrainer().train(args)
    except UserError as e:
        logger.error("%s", e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
