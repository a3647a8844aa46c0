"""Learning-rate schedules (``--lr_scheduler``, ``--lr_scheduler_type``), sd-scripts compatible.

The schedules are implemented here with ``torch.optim.lr_scheduler.LambdaLR`` (the same curves as transformers /
diffusers). Step counts, as in sd-scripts: the schedule is ``max_train_steps * num_processes`` ticks long, because a
scheduler prepared by accelerate advances ``num_processes`` ticks per optimizer step. A warmup or decay given as a
ratio or percentage is a share of that length. One deliberate difference: a warmup or decay given as an integer is a
number of optimizer steps and is multiplied by ``num_processes`` too (sd-scripts does not multiply it, so its warmup
shortens on several GPUs); on one process both agree.
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from library.errors import UserError
from library.training.optimizers import (
    _import_class,
    _is_relative_step_adafactor,
    _unwrap,
    is_schedulefree_optimizer,
    parse_kwargs_args,
    parse_step_count,
)

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

def verify_scheduler_arguments(config: SchedulerConfig) -> None:
    """The scheduler name, before any model is loaded."""
    name = config.lr_scheduler.split(":", 1)[0].lower()
    if not config.scheduler_type and name not in LR_SCHEDULERS:
        raise UserError(
            f"--lr_scheduler {config.lr_scheduler!r} is not supported; choose one of {', '.join(LR_SCHEDULERS)}."
        )
