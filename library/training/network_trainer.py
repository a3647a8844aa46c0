"""`NetworkTrainer`: the generic LoRA training loop with the hooks a model subclass fills in.

The phases of `train(args)`:
1. checks and seed; strategies; the dataset groups (`library.datasets.build_dataset_groups`, shared with the tools);
2. accelerator; model loading (`load_target_model`), latent caching, text-encoder output caching, lazy DiT load;
3. the network (`--network_module`), optimizer, data loader, LR scheduler; resume;
4. the loop: gradient accumulation, clipping, optimizer/scheduler steps, logging, sampling, saving, validation;
5. the final save (+ state).
Nothing here is MOSS-Image specific: `moss_image_train_network.MossImageNetworkTrainer` supplies the hooks.
"""

from __future__ import annotations

import abc
import argparse
import contextlib
import importlib
import logging
import math
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from library.errors import UserError
from library.files import base_model_hash, model_spec
from library.options.implications import TRAINING_IMPLICATIONS, apply_implications
from library.runtime.compile import apply_cuda_backend_options, apply_cuda_optimizations
from library.runtime.checkpointing import check_checkpointing_args, skip_blocks
from library.runtime.collector import StepGarbageCollector
from library.runtime.transfer import to_device
from library.training import checkpoints as train_checkpoints
from library.training import flow_matching
from library.training import host_random, nonfinite, run_checks, sensitive_options, state_io, trackers
from library.training.args import check_sd_scripts_options
from library.training.grad_reduce import all_reduce_mean_bucketed
from library.training.run_options import RunOptions
from library.training.step_loop import HostScalar, StepLog

logger = logging.getLogger(__name__)


@dataclass
class RunState:
    """What the loop carries between phases (instead of a 1000-line function's locals)."""

    args: argparse.Namespace
    options: RunOptions  # derived once from args (the dtypes, which networks train, ...)
    accelerator: Any = None
    text_encoders: list[Any] = field(default_factory=list)
    vae: Any = None
    unet: Any = None
    network: Any = None
    optimizer: Any = None
    lr_scheduler: Any = None
    train_group: Any = None
    val_group: Any = None
    train_dataloader: Any = None
    val_dataloader: Any = None
    metadata: dict[str, str] = field(default_factory=dict)
    global_step: int = 0
    epoch: int = 0
    num_train_epochs: int = 1
    max_train_steps: int = 0
    loss_history: list[float] = field(default_factory=list)
    lr_descriptions: list[str] = field(default_factory=list)
    fused_backward_pass: bool = False
    optimizer_train_fn: Any = None
    optimizer_eval_fn: Any = None
    validation_history: list[tuple[int, float]] = field(default_factory=list)
    skip_batches: int = 0  # batches of the first epoch already consumed (resume / --skip_until_initial_step)
    optimizer_name: str = ""
    last_validation_loss: float | None = None
    final_path: Path | None = None
    base_model_hashes: base_model_hash.BaseModelHashes | None = None  # ss_sd_model_* / ss_vae_* (main process)
    host_generator: torch.Generator | None = None  # the step's host draws: timesteps, ... (`host_random`)

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.options.weight_dtype

    @property
    def save_dtype(self) -> torch.dtype:
        return self.options.save_dtype

    @property
    def train_unet(self) -> bool:
        return self.options.train_unet

    @property
    def train_text_encoder(self) -> bool:
        return self.options.train_text_encoder


StepHook = Callable[[], contextlib.AbstractContextManager[Any]]
_STEP_HOOKS: list[StepHook] = []


@contextlib.contextmanager
def _step_hooks_entered() -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for hook in list(_STEP_HOOKS):
            stack.enter_context(hook())
        yield


class NetworkTrainer(abc.ABC):
    """Subclasses implement the abstract hooks (and may override the others); `train(args)` runs the job."""

    @staticmethod
    def add_step_hook(hook: StepHook) -> Callable[[], None]:
        """Measuring seam (`bench/measure.py`): `hook()` is called before every training step of every trainer in
        this process (one batch: forward, backward and, when gradients are synchronised, the optimizer step) and the
        context manager it returns is entered around that step. Returns a function that removes the hook."""
        _STEP_HOOKS.append(hook)
        return lambda: _STEP_HOOKS.remove(hook)

    # ------------------------------------------------------------------------------------------------ hooks
    def resolve_args(self, args: argparse.Namespace) -> None:
        """What the options imply for each other, applied before any check, each change with its warning
        (`library.options.implications`); subclasses add model-specific resolution (e.g. model paths)."""
        apply_implications(args, TRAINING_IMPLICATIONS)

    def assert_extra_args(self, args: argparse.Namespace, train_group: Any, val_group: Any) -> None:
        """Model-specific checks, on the resolved options; they change nothing."""

    @abc.abstractmethod
    def get_latents_caching_strategy(self, args: argparse.Namespace) -> Any:
        ...

    def get_text_encoder_outputs_caching_strategy(self, args: argparse.Namespace) -> Any:
        return None

    @abc.abstractmethod
    def load_target_model(self, args: argparse.Namespace, weight_dtype: torch.dtype, accelerator: Any) -> tuple:
        """(model_version, text_encoders, vae, unet or None when loaded lazily)."""
        ...

    @abc.abstractmethod
    def load_unet_lazily(self, args: argparse.Namespace, weight_dtype: torch.dtype, accelerator: Any, text_encoders: list) -> tuple:
        ...

    @abc.abstractmethod
    def cache_latents(self, run: RunState) -> None:
        ...

    def cache_text_encoder_outputs_if_needed(self, run: RunState) -> None:
        """Encode and cache captions (and sample prompts) before the encoder leaves the GPU."""

    def is_train_text_encoder(self, args: argparse.Namespace) -> bool:
        return not args.network_train_unet_only and not args.cache_text_encoder_outputs

    def is_text_encoder_not_needed_for_training(self, args: argparse.Namespace) -> bool:
        return bool(args.cache_text_encoder_outputs) and not self.is_train_text_encoder(args)

    @abc.abstractmethod
    def get_latents(self, run: RunState, batch: dict[str, Any]) -> torch.Tensor:
        ...

    @abc.abstractmethod
    def get_text_conds(self, run: RunState, batch: dict[str, Any], is_train: bool) -> Any:
        ...

    @abc.abstractmethod
    def get_noise_pred_and_target(
        self, run: RunState, latents: torch.Tensor, text_conds: Any, batch: dict[str, Any], is_train: bool,
        fixed_sigmas: torch.Tensor | None = None, generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(prediction, target, timesteps, loss weighting or None)."""

    def sample_images(self, run: RunState, epoch: int | None, step: int) -> None:
        """Generate the sample images when this step/epoch calls for it."""

    def update_metadata(self, metadata: dict[str, Any], args: argparse.Namespace) -> None:
        """Model-specific ss_* keys."""

    def base_model_files(self, args: argparse.Namespace) -> dict[str, list[Path]]:
        """The files of the base models named in the metadata: {"sd_model": [DiT files], "vae": [VAE file]} (a sharded
        checkpoint: its shards in order); none by default."""
        return {}

    def model_spec_metadata(self, args: argparse.Namespace) -> dict[str, str]:
        return model_spec.modelspec_from_args(args, lora=True)

    def training_resolution(self, run: RunState) -> Any:
        """The resolution of the first dataset (for modelspec.resolution)."""
        datasets = getattr(run.train_group, "datasets", [])
        return datasets[0].params.resolution if datasets else run.args.resolution

    def prepare_unet(self, run: RunState) -> None:
        """Device placement (and block swap / compile) of the DiT before the loop."""
        run.unet.to(run.accelerator.device)

    def on_validation_step_end(self, run: RunState) -> None:
        """Called after each validation batch (block swap re-arms here)."""

    # -------------------------------------------------------------------------------------------- checks
    def verify_args(self, args: argparse.Namespace) -> None:
        check_sd_scripts_options(args)
        run_checks.check_run_options(args)
        if args.network_module is None:
            raise UserError("--network_module is required: use --network_module networks.lora_generic.")
        if args.output_dir is None:
            raise UserError("--output_dir is required: give the folder the LoRA files are saved in.")
        if args.network_train_unet_only and args.network_train_text_encoder_only:
            raise UserError("--network_train_unet_only and --network_train_text_encoder_only exclude each other: keep one.")
        if args.persistent_data_loader_workers and args.max_data_loader_n_workers == 0:
            raise UserError("--persistent_data_loader_workers needs --max_data_loader_n_workers of 1 or more.")
        if args.full_fp16 and args.full_bf16:
            raise UserError("--full_fp16 and --full_bf16 exclude each other: keep one.")
        if (args.full_fp16 and args.mixed_precision != "fp16") or (args.full_bf16 and args.mixed_precision != "bf16"):
            raise UserError("--full_fp16/--full_bf16 need the matching --mixed_precision fp16/bf16.")
        if args.gradient_accumulation_steps < 1:
            raise UserError("--gradient_accumulation_steps must be 1 or more.")
        if args.resume:
            train_checkpoints.check_resume_folder(args.resume)
        if args.base_weights_multiplier and len(args.base_weights_multiplier) != len(args.base_weights or []):
            raise UserError("--base_weights_multiplier needs one value per --base_weights file.")
        if args.scale_weight_norms is not None and args.scale_weight_norms <= 0:
            raise UserError("--scale_weight_norms must be positive.")
        if args.ddp_gradient_as_bucket_view or args.ddp_static_graph:
            raise UserError("--ddp_gradient_as_bucket_view / --ddp_static_graph do not apply here: the LoRA is not wrapped"
                            " in DDP (its gradients are averaged directly across processes); remove them.")
        if args.initial_epoch is not None and args.initial_step is not None:
            raise UserError("--initial_epoch and --initial_step exclude each other: keep one.")
        if args.initial_epoch is not None and args.initial_epoch < 1:
            raise UserError("--initial_epoch counts from 1.")
        if args.skip_until_initial_step and args.initial_step is None and args.initial_epoch is None:
            raise UserError("--skip_until_initial_step needs --initial_step or --initial_epoch.")
        check_checkpointing_args(args)

    # -------------------------------------------------------------------------------------------- phases
    def _prepare_accelerator(self, args: argparse.Namespace, log_with: str | None) -> Any:
        from accelerate import Accelerator, DataLoaderConfiguration, InitProcessGroupKwargs
        from accelerate.utils import ProjectConfiguration
        import datetime

        if log_with in ("tensorboard", "all"):
            try:
                import tensorboard  # noqa: F401
            except ImportError as e:
                raise UserError("--log_with tensorboard needs the 'tensorboard' package: pip install tensorboard.") from e
        if log_with in ("wandb", "all"):
            try:
                import wandb  # noqa: F401
            except ImportError as e:
                raise UserError("--log_with wandb needs the 'wandb' package: pip install wandb.") from e
        logging_dir = None
        if args.logging_dir:
            logging_dir = os.path.join(args.logging_dir, (args.log_prefix or "") + time.strftime("%Y%m%d%H%M%S"))
        kwargs = []
        if args.ddp_timeout:
            kwargs.append(InitProcessGroupKwargs(timeout=datetime.timedelta(minutes=args.ddp_timeout)))
        # a multi-process launch on a machine without CUDA (torchrun / accelerate on CPU) runs DDP over gloo
        cpu_ddp = not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1
        acc = Accelerator(
            cpu=cpu_ddp,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            mixed_precision=args.mixed_precision,
            log_with=log_with,
            project_config=ProjectConfiguration(project_dir=args.output_dir, logging_dir=logging_dir),
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
            kwargs_handlers=kwargs or None,
            dynamo_backend=args.dynamo_backend if args.torch_compile else None,
        )
        return acc

    def _start_host_random(self, run: RunState) -> None:
        """The step's own generator of its host draws (`host_random`), from --seed and the process index."""
        seed = run.args.seed if run.args.seed is not None else 0
        run.host_generator = host_random.new_host_generator(seed, run.accelerator.process_index)

    def _create_network(self, run: RunState) -> None:
        args = run.args
        try:
            module = importlib.import_module(args.network_module)
        except ImportError as e:
            raise UserError(f"--network_module '{args.network_module}' cannot be imported ({e}): use networks.lora_generic.") from e
        run_checks.check_network_module(module, args)
        net_kwargs = {}
        for item in args.network_args or []:
            if "=" not in item:
                raise UserError(f"--network_args entry '{item}' is not key=value: write it as key=value.")
            k, v = item.split("=", 1)
            net_kwargs[k.strip()] = v.strip()
        # the one text encoder, or None when it is not loaded (outputs cached): modules that iterate a list (LyCORIS)
        # must not meet a None in it
        present = [te for te in run.text_encoders if te is not None]
        text_encoder = present[0] if len(present) == 1 else (present or None)
        if args.dim_from_weights:
            if not args.network_weights:
                raise UserError("--dim_from_weights needs --network_weights.")
            network, _ = module.create_network_from_weights(
                args.network_multiplier, args.network_weights, run.vae, text_encoder, run.unet, **net_kwargs
            )
        else:
            if "dropout" not in net_kwargs:  # as sd-scripts: modules that read no neuron_dropout (LyCORIS) get it here
                net_kwargs["dropout"] = args.network_dropout
            network = module.create_network(
                args.network_multiplier, args.network_dim, args.network_alpha, run.vae, text_encoder, run.unet,
                neuron_dropout=args.network_dropout, **net_kwargs,
            )
        if network is None:
            raise UserError(f"--network_module '{args.network_module}' created no network for this model.")
        run_checks.check_network(network, args)
        network.apply_to(text_encoder, run.unet, run.train_text_encoder, run.train_unet)
        if args.network_weights and not args.dim_from_weights:
            info = network.load_weights(args.network_weights)
            logger.info("loaded network weights from %s: %s", args.network_weights, info)
        run.network = network

    def _optimizer_and_scheduler(self, run: RunState) -> None:
        from library.training import optimizers

        args = run.args
        te_lr = args.text_encoder_lr[0] if args.text_encoder_lr else None
        # networks of the older contract (LyCORIS) have only prepare_optimizer_params, which may return params alone
        prepare = getattr(run.network, "prepare_optimizer_params_with_multiple_te_lrs", None)
        result = (prepare or run.network.prepare_optimizer_params)(te_lr, args.unet_lr, args.learning_rate)
        params, descriptions = result if isinstance(result, tuple) else (result, None)
        run.lr_descriptions = descriptions
        defaults = optimizers.fused_adamw_defaults(run.options.optimizer, run.accelerator.device)
        if defaults:
            logger.info("AdamW: fused CUDA kernel (set fused=False or foreach=True in --optimizer_args to change)")
        name, desc, run.optimizer = optimizers.get_optimizer(run.options.optimizer, params, defaults)
        run.optimizer_name = f"{name}({desc})" if desc else name

    def _dataloaders(self, run: RunState) -> None:
        from library.datasets import create_data_loader_from_args

        run.train_dataloader = create_data_loader_from_args(run.train_group, run.args)
        if run.val_group is not None and len(run.val_group) > 0:
            run.val_dataloader = create_data_loader_from_args(run.val_group, run.args)
        # A DataLoader iterator draws its worker base seed from the global RNG unless it has a generator of its own:
        # that draw would make a resumed run's noise differ from the uninterrupted run's.
        for i, dl in enumerate((run.train_dataloader, run.val_dataloader)):
            if dl is not None:
                dl.generator = torch.Generator().manual_seed(run.args.seed + i)

    def _steps_and_epochs(self, run: RunState) -> None:
        args = run.args
        acc = run.accelerator
        per_epoch = math.ceil(len(run.train_dataloader) / acc.num_processes / args.gradient_accumulation_steps)
        if per_epoch == 0:
            raise UserError("The dataset yields no batch: check the image folders and --train_batch_size.")
        if args.max_train_epochs is not None:
            args.max_train_steps = args.max_train_epochs * per_epoch
            logger.info("--max_train_epochs %d -> %d steps", args.max_train_epochs, args.max_train_steps)
        run.max_train_steps = args.max_train_steps
        run.num_train_epochs = math.ceil(args.max_train_steps / per_epoch)
        if args.save_n_epoch_ratio:  # as sd-scripts: at least N saves over the run, replacing --save_every_n_epochs
            args.save_every_n_epochs = math.floor(run.num_train_epochs / args.save_n_epoch_ratio) or 1
            logger.info("--save_n_epoch_ratio %d: saving every %d epochs", args.save_n_epoch_ratio,
                        args.save_every_n_epochs)
        run.train_group.set_max_train_steps(args.max_train_steps)

    # -------------------------------------------------------------------------------------------- train
    def train(self, args: argparse.Namespace) -> RunState:
        """Run the job; the output's lock (`run_checks.prepare_output`) is held until it ends, however it ends."""
        try:
            return self._train(args)
        finally:
            lock, self._output_lock = getattr(self, "_output_lock", None), None
            if lock is not None:
                lock.release()

    def _train(self, args: argparse.Namespace) -> RunState:
        from accelerate.utils import set_seed

        from library.datasets import build_dataset_groups
        from library.datasets.preflight import quick_check

        self.resolve_args(args)
        self.verify_args(args)
        self._output_lock = None if args.debug_dataset else run_checks.prepare_output(args)
        run_checks.check_sample_prompts(args)
        train_checkpoints.seed_from_state(args)
        options = RunOptions.from_args(args, self.is_train_text_encoder(args))
        flow_matching.log_timestep_sampling_info(options.timestep_sampling)
        apply_cuda_backend_options(args)
        # TF32 matmuls from the start of the run, before any model runs (it stays set for the process): set when the
        # DiT is placed, what ran before (sample prompts encoded in fp32) differed between a process's first run and
        # its later ones. Caching takes full fp32 either way (`exact_fp32_matmul`), as the cache tools do.
        apply_cuda_optimizations(args)
        if args.cuda_expandable_segments:
            from library.runtime.compile import enable_expandable_segments

            enable_expandable_segments()
        if args.seed is None:  # processes of one run must agree on it (batch plan, noise): fixed when several
            args.seed = 42 if int(os.environ.get("WORLD_SIZE", "1")) > 1 else random.randint(0, 2**32 - 1)
            logger.info("no --seed given: using %d", args.seed)
        set_seed(args.seed)
        run = RunState(args, options)
        run.train_group, run.val_group = build_dataset_groups(args)
        quick_check([run.train_group, run.val_group])
        if args.debug_dataset:
            from library.datasets import debug_dataset

            debug_dataset(run.train_group)
            return run
        self.assert_extra_args(args, run.train_group, run.val_group)

        run.accelerator = self._prepare_accelerator(args, options.log_with)
        self._start_host_random(run)
        _version, run.text_encoders, run.vae, run.unet = self.load_target_model(args, run.weight_dtype, run.accelerator)
        if args.cache_latents:
            self.cache_latents(run)
        self.cache_text_encoder_outputs_if_needed(run)
        if run.unet is None:
            run.unet, run.text_encoders = self.load_unet_lazily(args, run.weight_dtype, run.accelerator, run.text_encoders)
        if run.accelerator.is_main_process and not args.no_metadata:  # the models are read: hash them beside training
            run.base_model_hashes = base_model_hash.BaseModelHashes(
                self.base_model_files(args), base_model_hash.HashCache()).start()

        self._create_network(run)
        if args.gradient_checkpointing:
            self.enable_gradient_checkpointing(run)
        self._optimizer_and_scheduler(run)
        run_checks.check_room_for_saves(args, run.network, run.save_dtype)
        self._dataloaders(run)
        self._steps_and_epochs(run)
        from library.training import lr_schedulers

        run.lr_scheduler = lr_schedulers.get_scheduler(run.options.scheduler, run.optimizer,
                                                       run.accelerator.num_processes, run.max_train_steps)
        self._place_models(run)
        run.optimizer, run.train_dataloader, run.lr_scheduler = run.accelerator.prepare(
            run.optimizer, run.train_dataloader, run.lr_scheduler
        )
        if run.val_dataloader is not None:
            run.val_dataloader = run.accelerator.prepare(run.val_dataloader)
        self._install_fused_backward_pass(run)
        if args.resume:
            self._load_state(run, Path(args.resume))
        self._apply_initial_step(run)
        run.metadata = self._build_metadata(run)
        self._loop(run)
        return run

    def _install_fused_backward_pass(self, run: RunState) -> None:
        from library.training import optimizers

        config = run.options.optimizer
        optimizers.check_fused_backward_pass(config, run.optimizer, run.args.gradient_accumulation_steps)
        if config.fused_backward_pass:
            if run.accelerator.num_processes > 1:
                raise UserError("--fused_backward_pass steps each parameter inside backward, before gradients are"
                                " averaged across processes: use it with one process only.")
            run.fused_backward_pass = True
            optimizers.install_fused_backward_pass(run.optimizer, config.max_grad_norm)
        run.optimizer_train_fn, run.optimizer_eval_fn = optimizers.get_optimizer_train_eval_fn(run.optimizer)
        run.optimizer_train_fn()

    def enable_gradient_checkpointing(self, run: RunState) -> None:
        args = run.args
        skip = skip_blocks(args, len(getattr(run.unet, "layers", ())))
        run.unet.enable_gradient_checkpointing(
            cpu_offload=args.cpu_offload_checkpointing, unsloth_offload=args.unsloth_offload_checkpointing,
            policy=args.checkpointing_policy, **({"skip_blocks": skip} if skip else {}),
        )
        if run.train_text_encoder:
            for te in run.text_encoders:  # newer transformers renamed the switch (and its keyword)
                if hasattr(te, "activation_checkpointing_enable"):
                    te.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
                else:
                    te.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if hasattr(run.network, "enable_gradient_checkpointing"):
            run.network.enable_gradient_checkpointing()

    def _place_models(self, run: RunState) -> None:
        acc = run.accelerator
        args = run.args
        run.unet.requires_grad_(False)
        for te in run.text_encoders:
            if te is not None:
                te.requires_grad_(False)
        if args.full_fp16 or args.full_bf16:
            run.network.to(run.weight_dtype)
        self.prepare_unet(run)
        run.network.to(acc.device)
        if run.train_text_encoder:
            for te in run.text_encoders:
                te.to(acc.device)
        elif not run.options.text_encoder_needed:
            run.text_encoders = [None for _ in run.text_encoders]
        run.network.prepare_grad_etc(run.text_encoders, run.unet)

    # -------------------------------------------------------------------------------------------- metadata
    def _build_metadata(self, run: RunState) -> dict[str, str]:
        from library.datasets.metadata import dataset_metadata, train_data_dir_metadata

        ds = {k: model_spec.json_value(v) for k, v in dataset_metadata(run.train_group).items()}
        meta: dict[str, Any] = model_spec.training_metadata(
            run.args,
            **ds,
            num_train_images=run.train_group.num_train_images,
            num_reg_images=run.train_group.num_reg_images,
            num_validation_images=run.val_group.num_train_images if run.val_group is not None else 0,
            num_batches_per_epoch=len(run.train_dataloader),
            num_epochs=run.num_train_epochs,
            optimizer=run.optimizer_name,
        )
        datasets = getattr(run.train_group, "datasets", [])
        if run.args.dataset_config is None and len(datasets) == 1:  # sd-scripts' flat keys of a --train_data_dir run
            total = run.args.train_batch_size * run.accelerator.num_processes * run.args.gradient_accumulation_steps
            flat = train_data_dir_metadata(run.train_group, total)
            meta.update({f"ss_{k}": model_spec.json_value(v) if isinstance(v, dict) else v for k, v in flat.items()})
        if datasets:  # the dataset config's values (the command line's are only fallbacks)
            meta["ss_validation_split"] = datasets[0].params.validation_split
            meta["ss_validation_seed"] = datasets[0].params.validation_seed
        if run.args.dim_from_weights:  # the ranks and alphas of the loaded file, not the command-line values
            loras = list(getattr(run.network, "unet_loras", [])) + list(getattr(run.network, "text_encoder_loras", []))
            if loras:
                meta["ss_network_dim"] = loras[0].lora_dim
                meta["ss_network_alpha"] = float(loras[0].alpha)
        if run.base_model_hashes is not None:
            meta.update(run.base_model_hashes.metadata())
        self.update_metadata(meta, run.args)
        return model_spec.stringify(meta)

    # -------------------------------------------------------------------------------------------- loop
    def _loop(self, run: RunState) -> None:
        from tqdm.auto import tqdm

        args, acc = run.args, run.accelerator
        if run.options.log_with:
            trackers.hide_private_values(args, run.options.log_with)
            acc.init_trackers(args.log_tracker_name or "network_train",
                              config=sensitive_options.tracker_config(args) if args.log_config else {},
                              init_kwargs=trackers.init_kwargs(args))
        logger.info(
            "training: %d steps, %d epochs, %d batches per epoch (per process), batch sizes %s, gradient accumulation %d",
            run.max_train_steps, run.num_train_epochs, len(run.train_dataloader),
            sorted({d.params.batch_size for d in run.train_group.datasets}), args.gradient_accumulation_steps,
        )
        progress = tqdm(total=run.max_train_steps, initial=run.global_step, disable=not acc.is_local_main_process,
                        desc="steps", smoothing=0.1)
        if args.sample_at_first and run.global_step == 0:
            self.sample_images(run, None, 0)
        start_epoch = run.epoch
        loss_guard = nonfinite.NonFiniteLossGuard(args.max_nan_loss_steps)
        with StepGarbageCollector() as collector:
            for epoch in range(start_epoch, run.num_train_epochs):
                run.epoch = epoch
                if run.global_step >= run.max_train_steps:
                    break
                acc.print(f"\nepoch {epoch + 1}/{run.num_train_epochs}")
                run.train_group.set_current_epoch(epoch + 1)
                run.network.on_epoch_start(run.text_encoders, run.unet)
                dataloader = run.train_dataloader
                if hasattr(dataloader, "set_epoch"):
                    dataloader.set_epoch(epoch)
                if epoch == start_epoch and run.skip_batches > 0:
                    dataloader = acc.skip_first_batches(dataloader, run.skip_batches)
                epoch_losses = self._run_epoch(run, dataloader, progress, collector, loss_guard)
                self._after_epoch(run, epoch + 1, epoch_losses)
        progress.close()
        self._finish(run)

    def _run_epoch(self, run: RunState, dataloader: Any, progress: Any, collector: StepGarbageCollector,
                   loss_guard: nonfinite.NonFiniteLossGuard) -> list[float]:
        """The steps of one epoch; returns their losses. A step's loss is read after the next step is queued (its copy
        to the host is done by then, so reading it does not stall the GPU), or at once when something happens at
        that step (sample images, a save, a validation), so that the non-finite guard and the validation divergence
        see it first; the values and the step numbers logged are those of the step itself."""
        acc = run.accelerator
        epoch_losses: list[float] = []
        pending: StepLog | None = None
        for batch in dataloader:
            with _step_hooks_entered():
                loss = self._train_step(run, batch)
            if not acc.sync_gradients:
                continue
            run.global_step += 1
            progress.update(1)
            if pending is not None:
                self._log_step(run, progress, pending, epoch_losses, loss_guard)
            pending = StepLog(run.global_step, HostScalar(loss), self._learning_rates(run))
            if self._step_has_work(run):
                self._log_step(run, progress, pending, epoch_losses, loss_guard)
                pending = None
            self._after_step(run)
            collector.step(run.global_step)
            if run.global_step >= run.max_train_steps:
                break
        if pending is not None:
            self._log_step(run, progress, pending, epoch_losses, loss_guard)
        return epoch_losses

    def _train_step(self, run: RunState, batch: dict[str, Any]) -> torch.Tensor:
        """One micro-batch (forward, backward and, at the end of an accumulation, the optimizer step), queued without
        a host sync; returns the loss as a detached device tensor."""
        args, acc = run.args, run.accelerator
        run.train_group.set_current_step(run.global_step)
        with acc.accumulate():
            run.network.on_step_start() if hasattr(run.network, "on_step_start") else None
            loss = self.process_batch(run, batch, is_train=True)
            acc.backward(loss)
            if run.fused_backward_pass:  # parameters were stepped inside backward
                run.lr_scheduler.step()
            else:
                if acc.sync_gradients:
                    self._all_reduce_network(run)
                    if args.max_grad_norm and args.max_grad_norm > 0:
                        acc.clip_grad_norm_(run.network.get_trainable_params(), args.max_grad_norm)
                run.optimizer.step()
                run.lr_scheduler.step()
                run.optimizer.zero_grad(set_to_none=True)
        if acc.sync_gradients and args.scale_weight_norms:
            run.network.apply_max_norm_regularization(args.scale_weight_norms, acc.device)
        return loss.detach()

    def _all_reduce_network(self, run: RunState) -> None:
        """The network is not wrapped in DDP (its layers live inside the frozen models), so its gradients are
        averaged across processes here."""
        if run.accelerator.num_processes == 1:
            return
        grads = [p.grad for p in run.network.get_trainable_params() if p.grad is not None]
        all_reduce_mean_bucketed(grads, run.accelerator.num_processes)

    def process_batch(
        self, run: RunState, batch: dict[str, Any], is_train: bool,
        fixed_sigmas: torch.Tensor | None = None, generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Loss of one batch: latents, text conditions, noise prediction, loss with weighting and masks."""
        args = run.args
        with torch.no_grad():
            latents = self.get_latents(run, batch)
        with torch.set_grad_enabled(is_train and run.train_text_encoder):
            text_conds = self.get_text_conds(run, batch, is_train)
        pred, target, timesteps, weighting = self.get_noise_pred_and_target(
            run, latents, text_conds, batch, is_train, fixed_sigmas, generator
        )
        huber_c = flow_matching.get_huber_threshold(run.options.loss, timesteps)
        loss = flow_matching.conditional_loss(pred.float(), target.float(), run.options.loss.loss_type, huber_c)
        if weighting is not None:
            loss = loss * weighting.to(loss.device, loss.dtype)
        masks = batch.get("alpha_masks")
        if masks is not None and (args.masked_loss or args.alpha_mask):
            m = to_device(masks, loss.device, loss.dtype)[:, None]  # host batches: pinned, no blocking copy
            m = torch.nn.functional.interpolate(m, size=loss.shape[-2:], mode="area")
            loss = loss * m
        loss = loss.mean(dim=list(range(1, loss.ndim)))
        weights = batch.get("loss_weights")
        if weights is not None:
            loss = loss * torch.as_tensor(weights, dtype=loss.dtype).to(loss.device, non_blocking=True)
        return loss.mean()

    def _learning_rates(self, run: RunState) -> dict[str, float]:
        """The tracker entries of the learning rates now (after this step's scheduler step)."""
        logs = {}
        for i, group in enumerate(run.optimizer.param_groups):
            name = run.lr_descriptions[i] if i < len(getattr(run, "lr_descriptions", []) or []) else f"group{i}"
            logs[f"lr/{name}"] = group["lr"]
        return logs

    def _log_step(self, run: RunState, progress: Any, entry: StepLog, epoch_losses: list[float],
                  loss_guard: nonfinite.NonFiniteLossGuard) -> None:
        """A step's loss into the histories and the non-finite guard, the progress bar and the trackers (at that
        step's number)."""
        loss = entry.loss.get()
        epoch_losses.append(loss)
        run.loss_history.append(loss)
        loss_guard.observe(loss, entry.step, run.network, run.accelerator)
        window = run.loss_history[-len(run.train_dataloader):]
        avg = sum(window) / len(window)
        progress.set_postfix(loss=f"{avg:.4f}")
        if run.accelerator.trackers:
            run.accelerator.log({"loss/current": loss, "loss/average": avg, **entry.learning_rates}, step=entry.step)

    @staticmethod
    def _validation_due(run: RunState) -> bool:
        every = run.args.validate_every_n_steps
        return bool(every) and run.global_step % every == 0 and run.val_dataloader is not None

    def _step_has_work(self, run: RunState) -> bool:
        """Sample images, a save or a validation at this step (`_after_step`)."""
        args, step = run.args, run.global_step
        sampling = bool(args.sample_prompts and args.sample_every_n_steps) and step % args.sample_every_n_steps == 0
        saving = bool(args.save_every_n_steps) and step % args.save_every_n_steps == 0
        return sampling or saving or self._validation_due(run)

    def _after_step(self, run: RunState) -> None:
        """Sample images, saving and validation of the step just taken."""
        args = run.args
        self.sample_images(run, None, run.global_step)
        if args.save_every_n_steps and run.global_step % args.save_every_n_steps == 0 \
                and run.global_step < run.max_train_steps:
            self._save_checkpoint(run, train_checkpoints.step_name(self._output_name(run), run.global_step), step_save=True)
        if self._validation_due(run):
            self._validate(run, f"step {run.global_step}", "loss/validation/step_average")

    def _after_epoch(self, run: RunState, epoch: int, epoch_losses: list[float]) -> None:
        args, acc = run.args, run.accelerator
        if epoch_losses and acc.trackers:
            acc.log({"loss/epoch_average": sum(epoch_losses) / len(epoch_losses), "epoch": epoch}, step=run.global_step)
        every = args.validate_every_n_epochs or 1
        just_validated = bool(run.validation_history) and run.validation_history[-1][0] == run.global_step
        if run.val_dataloader is not None and epoch % every == 0 and not just_validated:
            self._validate(run, f"epoch {epoch}", "loss/validation/epoch_average")
        if args.save_every_n_epochs and epoch % args.save_every_n_epochs == 0 and epoch < run.num_train_epochs:
            self._save_checkpoint(run, train_checkpoints.epoch_name(self._output_name(run), epoch), step_save=False)
        self.sample_images(run, epoch, run.global_step)

    # -------------------------------------------------------------------------------------------- validation
    def _validate(self, run: RunState, what: str, log_key: str) -> float | None:
        if run.val_dataloader is None:
            return None
        args, acc = run.args, run.accelerator
        sigmas = flow_matching.validation_sigmas(4)
        losses = []
        run.optimizer_eval_fn()
        run.network.eval() if hasattr(run.network, "eval") else None
        with torch.no_grad():
            for i, batch in enumerate(run.val_dataloader):
                if args.max_validation_steps is not None and i >= args.max_validation_steps:
                    break
                for j, sigma in enumerate(sigmas):
                    g = torch.Generator().manual_seed((args.seed or 0) + 1000 * i + j)
                    loss = self.process_batch(run, batch, is_train=False, fixed_sigmas=sigma, generator=g)
                    losses.append(float(acc.gather(loss.detach()[None]).mean()))
                self.on_validation_step_end(run)
        run.network.train() if hasattr(run.network, "train") else None
        run.optimizer_train_fn()
        if not losses:
            return None
        value = sum(losses) / len(losses)
        logger.info("validation loss (%s): %.5f", what, value)
        if acc.trackers:
            logs = {log_key: value}
            if run.loss_history:
                window = run.loss_history[-len(run.train_dataloader):]
                logs[log_key.replace("_average", "_divergence")] = value - sum(window) / len(window)
            acc.log(logs, step=run.global_step)
        run.last_validation_loss = value
        run.validation_history.append((run.global_step, value))
        return value

    # -------------------------------------------------------------------------------------------- saving
    def _output_name(self, run: RunState) -> str:
        return run.args.output_name or "last"

    def _lora_metadata(self, run: RunState, epoch: int, out: Path, final: bool = False) -> dict[str, str]:
        if run.args.resolution is None:
            run.args.resolution = self.training_resolution(run)
        spec = self.model_spec_metadata(run.args)
        if run.args.no_metadata:
            return model_spec.minimal_metadata({**run.metadata, **spec})
        meta = model_spec.save_time_metadata(run.metadata, run.global_step, epoch)
        if run.base_model_hashes is not None:  # the final save waits for the background sha256
            meta.update(run.base_model_hashes.metadata(wait=final))
            pending = run.base_model_hashes.pending_keys()
            if pending:
                logger.info("%s: %s left out, the sha256 of the base model is still being computed (later saves"
                            " have it)", out.name, ", ".join(pending))
        meta.update(spec)
        return meta

    def _save_lora(self, run: RunState, stem: str, epoch: int, final: bool = False) -> Path:
        out = Path(run.args.output_dir) / f"{stem}.safetensors"
        run.accelerator.wait_for_everyone()
        run.optimizer_eval_fn()  # schedule-free optimizers hold the evaluation weights only in eval mode
        nonfinite.check_network_finite(run.network, out.name, run.global_step)
        if run.accelerator.is_main_process:
            out.parent.mkdir(parents=True, exist_ok=True)  # a third-party network's save_weights does not make it
            run.network.save_weights(str(out), run.save_dtype, self._lora_metadata(run, epoch, out, final))
        run.optimizer_train_fn()
        return out

    def _save_checkpoint(self, run: RunState, stem: str, step_save: bool) -> None:
        args = run.args
        self._save_lora(run, stem, run.epoch + (0 if step_save else 1))
        if args.save_state:
            self._save_state(run, Path(args.output_dir) / f"{stem}-state")
        name = self._output_name(run)
        if step_save:
            old = train_checkpoints.old_step_to_remove(run.global_step, args.save_every_n_steps, args.save_last_n_steps)
            old_state = train_checkpoints.old_step_to_remove(
                run.global_step, args.save_every_n_steps, args.save_last_n_steps_state)
            to_name = lambda s: train_checkpoints.step_name(name, s)  # noqa: E731
        else:
            old = train_checkpoints.old_epoch_to_remove(run.epoch + 1, args.save_every_n_epochs, args.save_last_n_epochs)
            old_state = train_checkpoints.old_epoch_to_remove(
                run.epoch + 1, args.save_every_n_epochs, args.save_last_n_epochs_state)
            to_name = lambda e: train_checkpoints.epoch_name(name, e)  # noqa: E731
        if run.accelerator.is_main_process:
            if old is not None:
                train_checkpoints.remove_path(Path(args.output_dir) / f"{to_name(old)}.safetensors")
            if old_state is not None:
                train_checkpoints.remove_path(Path(args.output_dir) / f"{to_name(old_state)}-state")

    def _save_state(self, run: RunState, folder: Path) -> None:
        """The state folder, written in a temp folder and renamed into place with its manifest (`state_io`)."""
        acc = run.accelerator
        nonfinite.check_network_finite(run.network, folder.name, run.global_step)
        fingerprint = train_checkpoints.run_fingerprint(run.args, run.train_group, acc.num_processes)

        def write(temp: Path) -> None:
            acc.save_state(str(temp))
            host_random.save_host_generator(run.host_generator, temp, acc.process_index)
            if acc.is_main_process:
                run.network.save_weights(str(temp / train_checkpoints.NETWORK_STATE_FILE), torch.float32, None)
                train_checkpoints.TrainState(run.epoch, run.global_step, fingerprint).write(temp)

        state_io.save_state_folder(folder, write, acc)
        logger.info("saved training state %s (step %d)", folder, run.global_step)

    def _load_state(self, run: RunState, folder: Path) -> None:
        acc = run.accelerator
        current = train_checkpoints.run_fingerprint(run.args, run.train_group, acc.num_processes)
        state = train_checkpoints.check_resume(folder, current, acc.process_index, run.args.resume_inexact)
        train_checkpoints.load_accelerator_state(acc, folder)
        host_random.load_host_generator(run.host_generator, folder, acc.process_index)
        run.network.load_weights(str(folder / train_checkpoints.NETWORK_STATE_FILE))
        self._start_at_step(run, state.step, skip=True)
        logger.info("resumed from %s at step %d (epoch %d)", folder, run.global_step, run.epoch + 1)

    def _start_at_step(self, run: RunState, step: int, skip: bool) -> None:
        """Continue the counters at `step`; with `skip`, the batches of that epoch already seen are consumed."""
        per_epoch = math.ceil(len(run.train_dataloader) / run.args.gradient_accumulation_steps)
        run.global_step = step
        run.epoch = step // per_epoch if per_epoch else 0
        done_in_epoch = step * run.args.gradient_accumulation_steps - run.epoch * len(run.train_dataloader)
        run.skip_batches = max(0, done_in_epoch) if skip else 0

    def _apply_initial_step(self, run: RunState) -> None:
        """--initial_step / --initial_epoch (sd-scripts): start the counters there; the batches are consumed only
        with --skip_until_initial_step."""
        args = run.args
        if args.initial_step is None and args.initial_epoch is None:
            return
        per_epoch = math.ceil(len(run.train_dataloader) / args.gradient_accumulation_steps)
        step = args.initial_step if args.initial_step is not None else (args.initial_epoch - 1) * per_epoch
        if step < 0 or step >= run.max_train_steps:
            raise UserError(f"--initial_step/--initial_epoch give step {step}, outside the run (0 to"
                            f" {run.max_train_steps - 1}): lower it or raise --max_train_steps/--max_train_epochs.")
        self._start_at_step(run, step, skip=args.skip_until_initial_step)
        logger.info("starting at step %d (epoch %d)%s", step, run.epoch + 1,
                    ", skipping the batches before it" if args.skip_until_initial_step else "")

    def _finish(self, run: RunState) -> None:
        args, acc = run.args, run.accelerator
        acc.wait_for_everyone()
        name = self._output_name(run)
        if args.save_state or args.save_state_on_train_end:
            self._save_state(run, Path(args.output_dir) / f"{name}-state")
        run.final_path = self._save_lora(run, name, run.num_train_epochs if run.global_step >= run.max_train_steps
                                         else run.epoch + 1, final=True)
        acc.end_training()
        logger.info("training finished: %d steps", run.global_step)
