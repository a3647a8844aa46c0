"""Optimizer factories and options (``--optimizer_type``, ``--lr_scheduler`` and friends), sd-scripts compatible.

Optimizers: AdamW (default), the bitsandbytes family (AdamW8bit, PagedAdamW, PagedAdamW8bit, PagedAdamW32bit, Lion8bit,
PagedLion8bit, SGDNesterov8bit, AdEMAMix8bit, PagedAdEMAMix8bit), Lion (a small implementation in this module, no extra
package), SGDNesterov, Adafactor (transformers), Prodigy (prodigyopt), DAdaptation / DAdapt* (dadaptation), the
schedule-free family (schedulefree), and any ``Class`` of torch.optim or ``package.module.Class``.

The ``--lr_scheduler`` options are parsed here (``add_optimizer_arguments``); the schedules themselves are
`library.training.lr_schedulers`.
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

from library.errors import UserError

logger = logging.getLogger(__name__)


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
