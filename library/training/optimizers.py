"""Optimizer and learning-rate scheduler factories (``--optimizer_type``, ``--lr_scheduler``), sd-scripts compatible.

Optimizers: AdamW (default), the bitsandbytes family (AdamW8bit, PagedAdamW, PagedAdamW8bit, PagedAdamW32bit, Lion8bit,
PagedLion8bit, SGDNesterov8bit, AdEMAMix8bit, PagedAdEMAMix8bit), Lion (a small implementation in this module, no extra
package), SGDNesterov, Adafactor (transformers), Prodigy (prodigyopt), DAdaptation / DAdapt* (dadaptation), the
schedule-free family (schedulefree), and any ``Class`` of torch.optim or ``package.module.Class``.

Schedulers are implemented here with ``torch.optim.lr_scheduler.LambdaLR`` (the same curves as transformers /
diffusers). Step counts, as in sd-scripts: the schedule is ``max_train_steps * num_processes`` ticks long, because a
scheduler prepared by accelerate advances ``num_processes`` ticks per optimizer step. A warmup or decay given as a
ratio or percentage is a share of that length. One deliberate difference: a warmup or decay given as an integer is a
number of optimizer steps and is multiplied by ``num_processes`` too (sd-scripts does not multiply it, so its warmup
shortens on several GPUs); on one process both agree.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from library.errors import UserError

logger = logging.getLogger(__name__)

LR_SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "cosine_with_min_lr",
    "warmup_stable_decay",
    "piecewise_constant",
    "adafactor",
)

# bitsandbytes optimizers: lower-case name -> (class name in bitsandbytes.optim, needs CUDA (paged memory))
_BNB_OPTIMIZERS = {
    "adamw8bit": ("AdamW8bit", False),
    "pagedadamw": ("PagedAdamW", True),
    "pagedadamw8bit": ("PagedAdamW8bit", True),
    "pagedadamw32bit": ("PagedAdamW32bit", True),
    "lion8bit": ("Lion8bit", False),
    "pagedlion8bit": ("PagedLion8bit", True),
    "sgdnesterov8bit": ("SGD8bit", False),
    "ademamix8bit": ("AdEMAMix8bit", False),
    "pagedademamix8bit": ("PagedAdEMAMix8bit", True),
}

# optional packages: lower-case name -> (module, class name, pip package)
_OPTIONAL_OPTIMIZERS = {
    "prodigy": ("prodigyopt", "Prodigy", "prodigyopt"),
    "dadaptation": ("dadaptation.experimental", "DAdaptAdamPreprint", "dadaptation"),
    "dadaptadampreprint": ("dadaptation.experimental", "DAdaptAdamPreprint", "dadaptation"),
    "dadaptadagrad": ("dadaptation", "DAdaptAdaGrad", "dadaptation"),
    "dadaptadam": ("dadaptation", "DAdaptAdam", "dadaptation"),
    "dadaptadan": ("dadaptation", "DAdaptAdan", "dadaptation"),
    "dadaptadanip": ("dadaptation.experimental", "DAdaptAdanIP", "dadaptation"),
    "dadaptlion": ("dadaptation", "DAdaptLion", "dadaptation"),
    "dadaptsgd": ("dadaptation", "DAdaptSGD", "dadaptation"),
    "adamwschedulefree": ("schedulefree", "AdamWScheduleFree", "schedulefree"),
    "radamschedulefree": ("schedulefree", "RAdamScheduleFree", "schedulefree"),
    "sgdschedulefree": ("schedulefree", "SGDScheduleFree", "schedulefree"),
}

ParamGroups = Iterable[torch.nn.Parameter] | list[dict[str, Any]]


# ----------------------------------------------------------------------------------------------------------------------
# arguments


def parse_step_count(value: str) -> int | float:
    """argparse type of --lr_warmup_steps / --lr_decay_steps: an int (steps), a float below 1 (a ratio of the
    run) or ``N%``."""
    text = str(value).strip()
    try:
        if text.endswith("%"):
            number = float(text[:-1]) / 100.0
            if not 0.0 <= number <= 1.0:
                raise ValueError
            return number
        number = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a step count: give an integer (steps), a ratio below 1 (0.1) or a percentage (10%)"
        ) from None
    if number < 0 or math.isnan(number):
        raise argparse.ArgumentTypeError(f"{value!r}: the step count must not be negative")
    if number < 1.0 and not number.is_integer():
        return number
    if not number.is_integer():
        raise argparse.ArgumentTypeError(
            f"{value!r} is neither a whole number of steps nor a ratio below 1 (0.1) or a percentage (10%)"
        )
    return int(number)


def add_optimizer_arguments(parser: argparse.ArgumentParser) -> None:
    """Optimizer and LR-scheduler options with the names and defaults of sd-scripts."""
    parser.add_argument(
        "--optimizer_type",
        type=str,
        default="",
        help="optimizer: AdamW (default), AdamW8bit, PagedAdamW, PagedAdamW8bit, PagedAdamW32bit, Lion, Lion8bit,"
        " PagedLion8bit, SGDNesterov, SGDNesterov8bit, AdEMAMix8bit, PagedAdEMAMix8bit,"
        " DAdaptation(DAdaptAdamPreprint),"
        " DAdaptAdaGrad, DAdaptAdam, DAdaptAdan, DAdaptAdanIP, DAdaptLion, DAdaptSGD, Prodigy, AdaFactor,"
        " AdamWScheduleFree, RAdamScheduleFree, SGDScheduleFree, or any torch.optim Class / package.module.Class",
    )
    parser.add_argument(
        "--optimizer_args",
        type=str,
        default=None,
        nargs="*",
        help='additional optimizer arguments as key=value, values read as Python literals (e.g. "weight_decay=0.01"'
        ' "betas=0.9,0.999")',
    )
    parser.add_argument("--learning_rate", type=float, default=2.0e-6, help="learning rate. Default 2e-6")
    parser.add_argument(
        "--max_grad_norm", type=float, default=1.0, help="max norm for gradient clipping, 0 disables. Default 1.0"
    )
    parser.add_argument(
        "--lr_scheduler",
        type=str,
        default="constant",
        help="LR scheduler: linear, cosine, cosine_with_restarts, polynomial, constant (default), constant_with_warmup,"
        " inverse_sqrt, cosine_with_min_lr, warmup_stable_decay, piecewise_constant, adafactor",
    )
    parser.add_argument(
        "--lr_warmup_steps",
        type=parse_step_count,
        default=0,
        help="warmup steps of the LR scheduler: an integer, a ratio of the training steps below 1, or N%%. Default 0",
    )
    parser.add_argument(
        "--lr_decay_steps",
        type=parse_step_count,
        default=0,
        help="decay steps of warmup_stable_decay: an integer, a ratio of the training steps below 1, or N%%."
        " Default 0",
    )
    parser.add_argument(
        "--lr_scheduler_num_cycles",
        type=int,
        default=1,
        help="number of restarts of cosine_with_restarts (and cycles of cosine_with_min_lr / warmup_stable_decay)."
        " Default 1",
    )
    parser.add_argument(
        "--lr_scheduler_power", type=float, default=1, help="power of the polynomial scheduler. Default 1"
    )
    parser.add_argument(
        "--lr_scheduler_timescale",
        type=int,
        default=None,
        help="time scale of inverse_sqrt. Default: --lr_warmup_steps (10000 when that is 0)",
    )
    parser.add_argument(
        "--lr_scheduler_min_lr_ratio",
        type=float,
        default=None,
        help="minimum LR as a ratio of the initial LR for cosine_with_min_lr (required) and warmup_stable_decay"
        " (default 0)",
    )
    parser.add_argument(
        "--lr_scheduler_type",
        type=str,
        default="",
        help="a custom scheduler class: a torch.optim.lr_scheduler name or package.module.Class (arguments from"
        " --lr_scheduler_args)",
    )
    parser.add_argument(
        "--lr_scheduler_args",
        type=str,
        default=None,
        nargs="*",
        help='additional scheduler arguments as key=value, values read as Python literals (e.g. "T_max=100")',
    )
    parser.add_argument(
        "--use_8bit_adam", action="store_true", help="legacy form of --optimizer_type AdamW8bit (needs bitsandbytes)"
    )
    parser.add_argument("--use_lion_optimizer", action="store_true", help="legacy form of --optimizer_type Lion")
    parser.add_argument(
        "--fused_backward_pass",
        action="store_true",
        help="step the optimizer inside the backward pass, parameter by parameter, to save gradient memory;"
        " Adafactor only, gradient_accumulation_steps 1",
    )


def parse_kwargs_args(values: Iterable[str] | None, option: str) -> dict[str, Any]:
    """``key=value`` strings to a dict; values are Python literals (``0.01``, ``True``, ``0.9,0.999`` -> a tuple),
    anything that is not a literal stays a string (``step_rules=1:10,0.1``)."""
    kwargs: dict[str, Any] = {}
    for item in values or ():
        key, sep, raw = str(item).partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise UserError(f"{option} {item!r} is not of the form key=value; write e.g. {option} weight_decay=0.01.")
        raw = raw.strip()
        try:
            kwargs[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            kwargs[key] = raw
    return kwargs


# ----------------------------------------------------------------------------------------------------------------------
# the typed settings: built from the parsed options in one place (`from_args`, which also parses the key=value
# lists); the factories below take these


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer of a run: its name (legacy flags resolved), --optimizer_args, learning rate and clipping."""

    optimizer_type: str  # "AdamW" when no --optimizer_type was given
    optimizer_args: Mapping[str, Any]  # --optimizer_args as values (each optimizer gets a copy)
    learning_rate: float
    max_grad_norm: float
    fused_backward_pass: bool
    lr_scheduler: str  # only for Adafactor's advice on the usual scheduler

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> OptimizerConfig:
        return cls(
            optimizer_type=resolve_optimizer_type(args.optimizer_type, args.use_8bit_adam, args.use_lion_optimizer),
            optimizer_args=MappingProxyType(parse_kwargs_args(args.optimizer_args, "--optimizer_args")),
            learning_rate=float(args.learning_rate),
            max_grad_norm=float(args.max_grad_norm or 0.0),
            fused_backward_pass=bool(args.fused_backward_pass),
            lr_scheduler=args.lr_scheduler,
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """The LR schedule of a run (--lr_scheduler or --lr_scheduler_type with their options)."""

    lr_scheduler: str  # e.g. "cosine", "adafactor:1e-3"
    warmup_steps: int | float  # --lr_warmup_steps: steps, or a ratio of the run (float below 1)
    decay_steps: int | float  # --lr_decay_steps, the same forms
    num_cycles: int
    power: float
    timescale: int | None
    min_lr_ratio: float | None
    scheduler_type: str  # --lr_scheduler_type: a custom class ("" for none)
    scheduler_args: Mapping[str, Any]  # --lr_scheduler_args as values
    learning_rate: float  # the initial LR (adafactor's schedule, polynomial's fallback)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SchedulerConfig:
        return cls(
            lr_scheduler=(args.lr_scheduler or "constant").strip(),
            warmup_steps=args.lr_warmup_steps,
            decay_steps=args.lr_decay_steps,
            num_cycles=int(args.lr_scheduler_num_cycles or 1),
            power=float(args.lr_scheduler_power),
            timescale=args.lr_scheduler_timescale,
            min_lr_ratio=args.lr_scheduler_min_lr_ratio,
            scheduler_type=args.lr_scheduler_type or "",
            scheduler_args=MappingProxyType(parse_kwargs_args(args.lr_scheduler_args, "--lr_scheduler_args")),
            learning_rate=float(args.learning_rate),
        )


# ----------------------------------------------------------------------------------------------------------------------
# Lion


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): a sign-of-momentum update.

    ``update = sign(beta1 * m + (1 - beta1) * g)``; ``p <- p * (1 - lr * wd) - lr * update``;
    ``m <- beta2 * m + (1 - beta2) * g``. Use a learning rate 3-10x smaller than for AdamW.
    """

    def __init__(
        self,
        params: ParamGroups,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        if not lr > 0:
            raise ValueError(f"Lion: learning rate must be positive, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Lion: betas must be in [0, 1), got {betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.to(torch.float32) if p.grad.dtype != torch.float32 else p.grad
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                exp_avg = state["exp_avg"]
                update = exp_avg.mul(beta1).add_(grad, alpha=1.0 - beta1).sign_()
                if p.dtype == torch.float32:
                    if wd:
                        p.mul_(1.0 - lr * wd)
                    p.add_(update, alpha=-lr)
                else:
                    new = p.to(torch.float32)
                    if wd:
                        new.mul_(1.0 - lr * wd)
                    p.copy_(new.add_(update, alpha=-lr))
                exp_avg.mul_(beta2).add_(grad, alpha=1.0 - beta2)
        return loss


# ----------------------------------------------------------------------------------------------------------------------
# optimizers


def resolve_optimizer_type(optimizer_type: str, use_8bit_adam: bool, use_lion_optimizer: bool) -> str:
    """The optimizer name after the legacy --use_8bit_adam / --use_lion_optimizer flags ("" means AdamW)."""
    optimizer_type = optimizer_type or ""
    if use_8bit_adam:
        if use_lion_optimizer:
            raise UserError(
                "--use_8bit_adam and --use_lion_optimizer were both given; keep one, or use --optimizer_type."
            )
        if optimizer_type:
            raise UserError(f"--use_8bit_adam and --optimizer_type {optimizer_type} were both given; keep one.")
        return "AdamW8bit"
    if use_lion_optimizer:
        if optimizer_type:
            raise UserError(f"--use_lion_optimizer and --optimizer_type {optimizer_type} were both given; keep one.")
        return "Lion"
    return optimizer_type or "AdamW"


def _import_class(module_name: str, class_name: str, what: str, pip_name: str | None = None) -> type:
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        if pip_name:
            raise UserError(
                f"{what} needs the {pip_name} package, which is not installed; run `pip install {pip_name}` or choose"
                " another --optimizer_type."
            ) from e
        raise UserError(f"{what}: module {module_name!r} could not be imported ({e}); check the name.") from e
    cls = getattr(module, class_name, None)
    if cls is None:
        raise UserError(f"{what}: {module_name} has no {class_name!r}; check the spelling (it is case-sensitive).")
    return cls


def _bitsandbytes_class(class_name: str, needs_cuda: bool, optimizer_type: str) -> type:
    try:
        bnb = importlib.import_module("bitsandbytes")
    except Exception as e:  # bitsandbytes raises more than ImportError when its native library cannot load
        raise UserError(
            f"--optimizer_type {optimizer_type} needs bitsandbytes, which could not be loaded"
            f" ({type(e).__name__}: {e}); run `pip install bitsandbytes` or use --optimizer_type AdamW."
        ) from e
    if needs_cuda and not torch.cuda.is_available():
        raise UserError(
            f"--optimizer_type {optimizer_type} uses paged memory, which needs a CUDA GPU; use AdamW8bit or AdamW on"
            " this machine."
        )
    cls = getattr(getattr(bnb, "optim", None), class_name, None)
    if cls is None:
        raise UserError(
            f"--optimizer_type {optimizer_type}: the installed bitsandbytes has no optim.{class_name}; upgrade it with"
            " `pip install -U bitsandbytes`."
        )
    return cls


def _group_lrs(param_groups: ParamGroups) -> list[float | None]:
    return [g.get("lr") for g in param_groups if isinstance(g, dict)]


def _without_group_lrs(param_groups: ParamGroups) -> ParamGroups:
    if isinstance(param_groups, list) and param_groups and isinstance(param_groups[0], dict):
        if any("lr" in g for g in param_groups):
            logger.warning("Adafactor with relative_step=True sets its own learning rate: per-group LRs are ignored")
        return [{k: v for k, v in g.items() if k != "lr"} for g in param_groups]
    return param_groups


def _adafactor_kwargs(config: OptimizerConfig, kwargs: dict[str, Any], lr: float) -> float | None:
    """sd-scripts' Adafactor defaults and advice; returns the lr to pass (None with relative_step)."""
    kwargs.setdefault("relative_step", True)
    if not kwargs["relative_step"] and kwargs.get("warmup_init", False):
        logger.info("Adafactor: warmup_init=True needs relative_step, so relative_step is set to True")
        kwargs["relative_step"] = True
    if kwargs["relative_step"]:
        if lr:
            logger.info(f"Adafactor with relative_step: --learning_rate {lr} is only the initial LR shown in the logs")
        return None
    if config.max_grad_norm:
        logger.info("Adafactor: gradients are clipped because --max_grad_norm is set; --max_grad_norm 0 is usual")
    if config.lr_scheduler != "constant_with_warmup":
        logger.info("Adafactor without relative_step: --lr_scheduler constant_with_warmup is usual")
    if kwargs.get("clip_threshold", 1.0) != 1.0:
        logger.info("Adafactor: clip_threshold=1.0 is usual")
    return lr


def _check_adaptive_lr(optimizer_type: str, lr: float, param_groups: ParamGroups) -> None:
    lrs = {x for x in _group_lrs(param_groups) if x is not None}
    if lr <= 0.1 and all(x <= 0.1 for x in lrs or {lr}):
        logger.warning(
            f"{optimizer_type} adapts the step size itself and expects a learning rate around 1.0; {lr} is very low"
        )
    if len(lrs) > 1:
        logger.warning(f"{optimizer_type}: different learning rates per parameter group scale its adapted step size")


def fused_adamw_defaults(config: OptimizerConfig, device: torch.device | str) -> dict[str, Any]:
    """``{"fused": True}`` for torch's AdamW on a CUDA device (the same update as the default foreach kernels, one
    kernel per step instead of a chain of them) unless --optimizer_args chooses ``fused`` or ``foreach``; else ``{}``."""
    if config.optimizer_type.lower() != "adamw" or torch.device(device).type != "cuda":
        return {}
    chosen = config.optimizer_args
    return {} if "fused" in chosen or "foreach" in chosen else {"fused": True}


def get_optimizer(config: OptimizerConfig, param_groups: ParamGroups, defaults: Mapping[str, Any] | None = None
                  ) -> tuple[str, str, torch.optim.Optimizer]:
    """Build the optimizer of --optimizer_type for ``param_groups`` (parameters or dicts with "params" / "lr").

    ``defaults``: constructor arguments the run adds (e.g. `fused_adamw_defaults`); --optimizer_args wins over them
    and they stay out of the description. Returns ``(name, description, optimizer)``: name is ``module.Class`` and
    description is the optimizer arguments as ``k=v,k=v`` (together they make sd-scripts' ``ss_optimizer`` metadata).
    """
    optimizer_type = config.optimizer_type
    key = optimizer_type.lower()
    lr = config.learning_rate
    kwargs = dict(config.optimizer_args)
    param_groups = list(param_groups)
    if not param_groups:
        raise UserError("There are no trainable parameters for the optimizer; check the network options.")
    lr_arg: float | None = lr

    if key == "adamw":
        cls: type = torch.optim.AdamW
    elif key == "sgdnesterov":
        kwargs.setdefault("momentum", 0.9)
        kwargs["nesterov"] = True
        cls = torch.optim.SGD
    elif key == "lion":
        cls = Lion
    elif key in _BNB_OPTIMIZERS:
        class_name, needs_cuda = _BNB_OPTIMIZERS[key]
        cls = _bitsandbytes_class(class_name, needs_cuda, optimizer_type)
        if key == "sgdnesterov8bit":
            kwargs.setdefault("momentum", 0.9)
            kwargs["nesterov"] = True
    elif key == "adafactor":
        cls = _import_class("transformers.optimization", "Adafactor", "--optimizer_type Adafactor", "transformers")
        lr_arg = _adafactor_kwargs(config, kwargs, lr)
        if lr_arg is None:
            param_groups = _without_group_lrs(param_groups)
    elif key in _OPTIONAL_OPTIMIZERS:
        module_name, class_name, pip_name = _OPTIONAL_OPTIMIZERS[key]
        cls = _import_class(module_name, class_name, f"--optimizer_type {optimizer_type}", pip_name)
        if key.startswith("dadapt") or key == "prodigy":
            _check_adaptive_lr(optimizer_type, lr, param_groups)
    else:
        # any optimizer class: "RAdam" (torch.optim) or "package.module.Class"
        module_name, _, class_name = optimizer_type.rpartition(".")
        cls = _import_class(module_name or "torch.optim", class_name, f"--optimizer_type {optimizer_type}")
        if not callable(cls):
            raise UserError(f"--optimizer_type {optimizer_type} is not an optimizer class.")

    logger.info(f"use {optimizer_type} optimizer | {kwargs}")
    try:
        optimizer = cls(param_groups, lr=lr_arg, **{**(defaults or {}), **kwargs})
    except (TypeError, ValueError) as e:
        raise UserError(
            f"--optimizer_type {optimizer_type} rejected its arguments ({e}); check --optimizer_args and"
            " --learning_rate."
        ) from e
    name = f"{cls.__module__}.{cls.__name__}"
    description = ",".join(f"{k}={v}" for k, v in kwargs.items())
    return name, description, optimizer


def is_schedulefree_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """True for the schedule-free optimizers, which need train() / eval() switching and no LR schedule."""
    cls = type(_unwrap(optimizer))
    return cls.__name__.lower().endswith("schedulefree") or "schedulefree" in cls.__module__.lower()


def get_optimizer_train_eval_fn(optimizer: torch.optim.Optimizer) -> tuple[Callable[[], None], Callable[[], None]]:
    """(train_fn, eval_fn) to call when training resumes / before sampling, validation and saving: the optimizer's
    own train() / eval() for schedule-free optimizers, no-ops otherwise."""
    inner = _unwrap(optimizer)
    if is_schedulefree_optimizer(inner) and hasattr(inner, "train") and hasattr(inner, "eval"):
        return inner.train, inner.eval
    return (lambda: None), (lambda: None)


def _unwrap(optimizer: Any) -> Any:
    """The torch optimizer inside an accelerate AcceleratedOptimizer (or the optimizer itself)."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def _is_relative_step_adafactor(optimizer: torch.optim.Optimizer) -> bool:
    inner = _unwrap(optimizer)
    return type(inner).__name__ == "Adafactor" and bool(inner.defaults.get("relative_step", False))


# ----------------------------------------------------------------------------------------------------------------------
# fused backward pass (Adafactor)


def check_fused_backward_pass(
    config: OptimizerConfig, optimizer: torch.optim.Optimizer, gradient_accumulation_steps: int
) -> None:
    """Reject --fused_backward_pass where it cannot work: other optimizers, or gradient accumulation."""
    if not config.fused_backward_pass:
        return
    if type(_unwrap(optimizer)).__name__ != "Adafactor":
        raise UserError(
            f"--fused_backward_pass works with --optimizer_type Adafactor only (got {config.optimizer_type});"
            " drop the option or switch to Adafactor."
        )
    if gradient_accumulation_steps != 1:
        raise UserError(
            "--fused_backward_pass steps the optimizer during every backward pass, so it cannot be combined with"
            " --gradient_accumulation_steps above 1."
        )


def step_single_param(optimizer: torch.optim.Optimizer, param: torch.nn.Parameter, group: dict[str, Any]) -> None:
    """Run ``optimizer.step()`` on one parameter of ``group`` (optimizers whose update is per parameter only)."""
    saved = optimizer.param_groups
    optimizer.param_groups = [{**group, "params": [param]}]
    try:
        optimizer.step()
    finally:
        optimizer.param_groups = saved


def install_fused_backward_pass(
    optimizer: torch.optim.Optimizer,
    max_grad_norm: float = 0.0,
    clip_grad_norm: Callable[[torch.Tensor, float], Any] | None = None,
) -> list[Any]:
    """Step each parameter as soon as its gradient is ready, then free the gradient (--fused_backward_pass).

    Gradients are clipped per parameter to ``max_grad_norm`` (0 disables), with ``clip_grad_norm(param, max_norm)``
    when given (e.g. ``accelerator.clip_grad_norm_``). The training loop must then skip ``optimizer.step()`` and
    ``zero_grad()`` (the LR scheduler still steps as usual). Returns the hook handles (``.remove()`` to undo).
    """
    inner = _unwrap(optimizer)
    clip = clip_grad_norm or (lambda p, norm: torch.nn.utils.clip_grad_norm_(p, norm))
    handles = []
    for group in inner.param_groups:
        for param in group["params"]:
            if not param.requires_grad:
                continue

            def hook(p: torch.Tensor, group: dict[str, Any] = group) -> None:
                if max_grad_norm:
                    clip(p, max_grad_norm)
                step_single_param(inner, p, group)
                p.grad = None

            handles.append(param.register_post_accumulate_grad_hook(hook))
    return handles


# ----------------------------------------------------------------------------------------------------------------------
# LR schedules (multipliers of the initial LR as functions of the scheduler tick)


def _warmup_factor(step: int, warmup: int) -> float:
    return float(step) / float(max(1, warmup))


def _progress(step: int, warmup: int, total: int) -> float:
    return float(step - warmup) / float(max(1, total - warmup))


def constant_schedule() -> Callable[[int], float]:
    return lambda step: 1.0


def constant_with_warmup_schedule(warmup: int) -> Callable[[int], float]:
    return lambda step: _warmup_factor(step, warmup) if step < warmup else 1.0


def linear_schedule(warmup: int, total: int) -> Callable[[int], float]:
    def fn(step: int) -> float:
        if step < warmup:
            return _warmup_factor(step, warmup)
        return max(0.0, float(total - step) / float(max(1, total - warmup)))

    return fn


def cosine_schedule(warmup: int, total: int, num_cycles: float = 0.5) -> Callable[[int], float]:
    def fn(step: int) -> float:
        if step < warmup:
            return _warmup_factor(step, warmup)
        progress = _progress(step, warmup, total)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress)))

    return fn


def cosine_with_restarts_schedule(warmup: int, total: int, num_cycles: int = 1) -> Callable[[int], float]:
    def fn(step: int) -> float:
        if step < warmup:
            return _warmup_factor(step, warmup)
        progress = _progress(step, warmup, total)
        if progress >= 1.0:
            return 0.0
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((float(num_cycles) * progress) % 1.0))))

    return fn


def polynomial_schedule(
    warmup: int, total: int, lr_init: float, lr_end: float = 1e-7, power: float = 1.0
) -> Callable[[int], float]:
    if not lr_init > lr_end:
        raise UserError(
            f"--lr_scheduler polynomial decays to lr_end={lr_end}, which must be below the learning rate {lr_init};"
            " set a smaller lr_end with --lr_scheduler_args lr_end=..."
        )

    def fn(step: int) -> float:
        if step < warmup:
            return _warmup_factor(step, warmup)
        if step > total:
            return lr_end / lr_init
        remaining = 1.0 - (step - warmup) / max(1, total - warmup)
        return ((lr_init - lr_end) * remaining**power + lr_end) / lr_init

    return fn


def inverse_sqrt_schedule(warmup: int, timescale: int | None = None) -> Callable[[int], float]:
    scale = timescale if timescale else (warmup or 10_000)

    def fn(step: int) -> float:
        if step < warmup:
            return _warmup_factor(step, warmup)
        return 1.0 / math.sqrt((step + scale - warmup) / scale)

    return fn


def cosine_with_min_lr_schedule(
    warmup: int, total: int, min_lr_rate: float, num_cycles: float = 0.5
) -> Callable[[int], float]:
    def fn(step: int) -> float:
        if step < warmup:
            return _warmup_factor(step, warmup)
        progress = _progress(step, warmup, total)
        factor = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
        return max(0.0, factor * (1.0 - min_lr_rate) + min_lr_rate)

    return fn


def warmup_stable_decay_schedule(
    warmup: int,
    stable: int,
    decay: int,
    min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5,
    warmup_type: str = "linear",
    decay_type: str = "cosine",
) -> Callable[[int], float]:
    """Warmup (from min_lr_ratio), a constant stretch, then a decay to min_lr_ratio (cosine, linear or 1-sqrt)."""
    shapes = ("linear", "cosine", "1-sqrt")
    if warmup_type not in shapes or decay_type not in shapes:
        raise UserError(
            f"warmup_stable_decay: warmup_type and decay_type must be one of {', '.join(shapes)} (in"
            " --lr_scheduler_args)."
        )

    def fn(step: int) -> float:
        if step < warmup:
            progress = float(step) / float(max(1, warmup))
            if warmup_type == "linear":
                factor = progress
            elif warmup_type == "cosine":
                factor = 0.5 * (1.0 - math.cos(math.pi * progress))
            else:
                factor = 1.0 - math.sqrt(1.0 - progress)
            return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
        if step < warmup + stable:
            return 1.0
        if step < warmup + stable + decay:
            progress = float(step - warmup - stable) / float(max(1, decay))
            if decay_type == "linear":
                factor = 1.0 - progress
            elif decay_type == "cosine":
                factor = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
            else:
                factor = 1.0 - math.sqrt(progress)
            return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
        return min_lr_ratio

    return fn


def piecewise_constant_schedule(step_rules: str) -> Callable[[int], float]:
    """``"1:10,0.1:20,0.01"``: multiplier 1 before step 10, 0.1 before step 20, then 0.01 (diffusers' format)."""
    try:
        parts = [p.strip() for p in str(step_rules).split(",")]
        rules = []
        for part in parts[:-1]:
            value, steps = part.split(":")
            rules.append((int(steps), float(value)))
        last = float(parts[-1])
    except ValueError:
        raise UserError(
            f"--lr_scheduler piecewise_constant: step_rules {step_rules!r} is not of the form"
            ' "1:10,0.1:20,0.01" (multiplier:until_step, ..., final multiplier).'
        ) from None
    rules.sort()

    def fn(step: int) -> float:
        for until, value in rules:
            if step < until:
                return value
        return last

    return fn


# ----------------------------------------------------------------------------------------------------------------------
# scheduler factory


def resolve_step_count(
    value: int | float | str | None, total: int | None, num_processes: int, option: str
) -> int:
    """Scheduler ticks of a warmup / decay option: a ratio (float below 1) of ``total``, or steps x num_processes."""
    if value is None:
        return 0
    if isinstance(value, str):
        try:
            value = parse_step_count(value)
        except argparse.ArgumentTypeError as e:
            raise UserError(f"{option}: {e}.") from None
    if isinstance(value, float) and value <= 1.0:  # parse_step_count returns floats for ratios only
        if total is None:
            raise UserError(f"{option} given as a ratio needs the number of training steps.")
        return int(value * total)
    return int(value) * num_processes


def _pop_known(kwargs: dict[str, Any], allowed: tuple[str, ...], name: str) -> dict[str, Any]:
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        allowed_text = ", ".join(allowed) if allowed else "none"
        raise UserError(
            f"--lr_scheduler_args {', '.join(unknown)} do not apply to --lr_scheduler {name}"
            f" (accepted: {allowed_text})."
        )
    return dict(kwargs)


def _custom_scheduler(type_name: str, optimizer: torch.optim.Optimizer, kwargs: dict[str, Any]) -> Any:
    module_name, _, class_name = type_name.rpartition(".")
    cls = _import_class(module_name or "torch.optim.lr_scheduler", class_name, f"--lr_scheduler_type {type_name}")
    logger.info(f"use {type_name} | {kwargs} as lr_scheduler")
    try:
        return cls(optimizer, **kwargs)
    except (TypeError, ValueError) as e:
        raise UserError(
            f"--lr_scheduler_type {type_name} rejected its arguments ({e}); check --lr_scheduler_args."
        ) from e


def _adafactor_scheduler(name: str, optimizer: torch.optim.Optimizer, lr: float | None, warmup: int) -> Any:
    if not _is_relative_step_adafactor(optimizer):
        raise UserError(
            "--lr_scheduler adafactor only works with --optimizer_type Adafactor and relative_step=True; use"
            " constant_with_warmup with relative_step=False."
        )
    if warmup:
        raise UserError(
            "--lr_scheduler adafactor does not use --lr_warmup_steps (Adafactor warms up itself); remove it."
        )
    _, _, explicit = name.partition(":")
    try:
        initial_lr = float(explicit) if explicit else float(lr or 0.0)
    except ValueError:
        raise UserError(f"--lr_scheduler {name}: the value after 'adafactor:' must be a learning rate.") from None
    schedule_cls = _import_class(
        "transformers.optimization", "AdafactorSchedule", "--lr_scheduler adafactor", "transformers"
    )
    return schedule_cls(_unwrap(optimizer), initial_lr)


def get_scheduler(
    config: SchedulerConfig,
    optimizer: torch.optim.Optimizer,
    num_processes: int = 1,
    max_train_steps: int | None = None,
) -> Any:
    """Build the LR scheduler of --lr_scheduler (or --lr_scheduler_type) for ``optimizer``.

    The schedule is ``max_train_steps * num_processes`` ticks long (see the module docstring); schedules that need
    the length refuse ``max_train_steps`` None. Adafactor with relative_step always gets the adafactor scheduler (it
    sets its own LR); schedule-free optimizers get a constant one.
    """
    name = config.lr_scheduler
    base = name.split(":", 1)[0].lower()
    total = int(max_train_steps) * num_processes if max_train_steps else None
    warmup = resolve_step_count(config.warmup_steps, total, num_processes, "--lr_warmup_steps")
    decay = resolve_step_count(config.decay_steps, total, num_processes, "--lr_decay_steps")
    kwargs = dict(config.scheduler_args)
    inner = _unwrap(optimizer)

    if config.scheduler_type:
        return _custom_scheduler(config.scheduler_type, optimizer, kwargs)
    if _is_relative_step_adafactor(inner) or base == "adafactor":
        if base != "adafactor":
            logger.info(f"Adafactor with relative_step sets its own LR: the adafactor scheduler replaces {name}")
        _pop_known(kwargs, (), "adafactor")
        adafactor_name = name if base == "adafactor" else "adafactor"
        return _adafactor_scheduler(adafactor_name, optimizer, config.learning_rate, warmup)
    if is_schedulefree_optimizer(inner):
        if base != "constant" or warmup:
            raise UserError(
                f"{type(inner).__name__} is schedule-free and needs no LR schedule; use --lr_scheduler constant"
                " without --lr_warmup_steps (give warmup through --optimizer_args warmup_steps=N)."
            )
        return LambdaLR(inner, constant_schedule())
    if base not in LR_SCHEDULERS:
        raise UserError(f"--lr_scheduler {name!r} is not supported; choose one of {', '.join(LR_SCHEDULERS)}.")
    return LambdaLR(inner, _schedule_lambda(config, base, inner, total, warmup, decay, kwargs))


def _schedule_lambda(
    config: SchedulerConfig,
    name: str,
    optimizer: torch.optim.Optimizer,
    total: int | None,
    warmup: int,
    decay: int,
    kwargs: dict[str, Any],
) -> Callable[[int], float]:
    if name == "constant":
        if warmup:
            raise UserError("--lr_scheduler constant does not use --lr_warmup_steps; use constant_with_warmup.")
        _pop_known(kwargs, (), name)
        return constant_schedule()
    if name == "piecewise_constant":
        kw = _pop_known(kwargs, ("step_rules",), name)
        if "step_rules" not in kw:
            raise UserError(
                '--lr_scheduler piecewise_constant needs --lr_scheduler_args "step_rules=1:10,0.1:20,0.01".'
            )
        return piecewise_constant_schedule(kw["step_rules"])
    if name == "constant_with_warmup":
        _pop_known(kwargs, (), name)
        return constant_with_warmup_schedule(warmup)
    if name == "inverse_sqrt":
        kw = _pop_known(kwargs, ("timescale",), name)
        return inverse_sqrt_schedule(warmup, kw.get("timescale", config.timescale))
    if total is None:
        raise UserError(f"--lr_scheduler {name} needs the number of training steps (--max_train_steps or epochs).")
    if warmup > total:
        raise UserError(f"--lr_warmup_steps ({warmup} scheduler steps) is longer than the run ({total} steps).")
    cycles = config.num_cycles
    min_ratio = config.min_lr_ratio
    if name == "linear":
        _pop_known(kwargs, (), name)
        return linear_schedule(warmup, total)
    if name == "cosine":
        kw = _pop_known(kwargs, ("num_cycles",), name)
        return cosine_schedule(warmup, total, kw.get("num_cycles", 0.5))
    if name == "cosine_with_restarts":
        _pop_known(kwargs, (), name)
        return cosine_with_restarts_schedule(warmup, total, cycles)
    if name == "polynomial":
        kw = _pop_known(kwargs, ("lr_end",), name)
        lr_init = float(optimizer.defaults.get("lr") or config.learning_rate)
        return polynomial_schedule(warmup, total, lr_init, kw.get("lr_end", 1e-7), config.power)
    if name == "cosine_with_min_lr":
        kw = _pop_known(kwargs, ("min_lr", "min_lr_rate"), name)
        if "min_lr" in kw:
            lr0 = float(optimizer.defaults.get("lr") or config.learning_rate)
            min_ratio = float(kw["min_lr"]) / lr0
        min_ratio = kw.get("min_lr_rate", min_ratio)
        if min_ratio is None:
            raise UserError("--lr_scheduler cosine_with_min_lr needs --lr_scheduler_min_lr_ratio (e.g. 0.1).")
        return cosine_with_min_lr_schedule(warmup, total, float(min_ratio), cycles / 2)
    # warmup_stable_decay
    kw = _pop_known(kwargs, ("warmup_type", "decay_type"), name)
    stable = total - warmup - decay
    if stable < 0:
        raise UserError(
            f"--lr_warmup_steps + --lr_decay_steps ({warmup} + {decay} scheduler steps) are longer than the run"
            f" ({total} steps)."
        )
    return warmup_stable_decay_schedule(
        warmup, stable, decay, float(min_ratio or 0.0), cycles / 2, kw.get("warmup_type", "linear"),
        kw.get("decay_type", "cosine"),
    )


def verify_optimizer_arguments(config: OptimizerConfig, gradient_accumulation_steps: int) -> None:
    """Cheap checks to run before any model is loaded (the names and key=value lists were parsed by `from_args`)."""
    if config.fused_backward_pass:
        if config.optimizer_type.lower() != "adafactor":
            raise UserError(
                "--fused_backward_pass works with --optimizer_type Adafactor only; drop it or use Adafactor."
            )
        if gradient_accumulation_steps != 1:
            raise UserError("--fused_backward_pass cannot be combined with --gradient_accumulation_steps above 1.")
    if config.max_grad_norm < 0:
        raise UserError("--max_grad_norm must be 0 (off) or positive.")


def verify_scheduler_arguments(config: SchedulerConfig) -> None:
    """The scheduler name, before any model is loaded."""
    name = config.lr_scheduler.split(":", 1)[0].lower()
    if not config.scheduler_type and name not in LR_SCHEDULERS:
        raise UserError(
            f"--lr_scheduler {config.lr_scheduler!r} is not supported; choose one of {', '.join(LR_SCHEDULERS)}."
        )
