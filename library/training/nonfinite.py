"""NaN and infinity: found where they appear, never saved, never silently turned into black images.

- `NonFiniteLossGuard`: the training loop reports each step's loss; `--max_nan_loss_steps` consecutive steps with a
  NaN or infinite loss (default 1: the first one) stop the run with a sentence, and so does a non-finite loss after
  which the LoRA weights themselves are no longer finite (they cannot recover). What was saved before stays as it is.
- `check_network_finite`: called before every save, so a LoRA file or state with NaN weights is never written.
- `check_finite_options`: the numeric options of a script (e.g. `--guidance_scale nan` at inference).
- `check_file_finite`: every floating tensor of a safetensors file (a LoRA given to the inference script).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from library.errors import UserError
from library.files.safetensors_io import TensorSource, check_safetensors_path

logger = logging.getLogger(__name__)

DEFAULT_MAX_NAN_LOSS_STEPS = 1
_ADVICE = ("lower --learning_rate, set --max_grad_norm, or check the data (a cache file with NaN values is re-made"
           " when the run starts)")


class NonFiniteTrainingError(UserError):
    """Training stopped because the loss or the weights are no longer finite."""


def first_nonfinite(tensors: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first floating tensor holding a NaN or an infinity (None when all are finite); one device
    synchronisation for all of them."""
    items = [(k, t) for k, t in tensors if t.is_floating_point() and t.numel() > 0]
    if not items:
        return None
    device = items[0][1].device
    finite = torch.stack([torch.isfinite(t).all().to(device) for _, t in items]).tolist()
    return next((k for (k, _), ok in zip(items, finite) if not ok), None)


def network_tensors(network: Any) -> list[tuple[str, torch.Tensor]]:
    return [(k, v.detach()) for k, v in network.state_dict().items() if isinstance(v, torch.Tensor)]


def check_network_finite(network: Any, target: str, step: int) -> None:
    """Refuse to save `target` (a LoRA file or a state) from weights that are not finite."""
    bad = first_nonfinite(network_tensors(network))
    if bad is not None:
        raise NonFiniteTrainingError(
            f"The LoRA weights hold NaN or infinite values at step {step} (first in '{bad}'), so '{target}' was not"
            f" saved and training stopped; the files saved before are kept: {_ADVICE}.")


class NonFiniteLossGuard:
    """Counts consecutive steps whose loss is NaN or infinite and stops the run at `limit` of them."""

    def __init__(self, limit: int = DEFAULT_MAX_NAN_LOSS_STEPS):
        self.limit = max(1, int(limit))
        self.count = 0

    def observe(self, loss: float, step: int, network: Any, accelerator: Any = None) -> None:
        """One optimizer step's loss. With several processes (`accelerator`), the step counts as non-finite when the
        loss of any process is, so that all of them stop together."""
        if _finite_everywhere(math.isfinite(loss), accelerator):
            self.count = 0
            return
        self.count += 1
        shown = loss if not math.isfinite(loss) else "NaN or infinite on another process"
        if self.count >= self.limit:
            where = f"step {step}" if self.count == 1 else f"{self.count} consecutive steps (the last: step {step})"
            raise NonFiniteTrainingError(
                f"The loss was {shown} at {where}, so training stopped; the files saved before"
                f" are kept and nothing more is written: {_ADVICE} (--max_nan_loss_steps sets how many such steps in"
                " a row are tolerated).")
        bad = first_nonfinite(network_tensors(network))
        if bad is not None:
            raise NonFiniteTrainingError(
                f"The loss was {shown} at step {step} and the LoRA weights are no longer finite (first in '{bad}'), so"
                f" training stopped; the files saved before are kept and nothing more is written: {_ADVICE}.")
        logger.warning("the loss was %s at step %d (%d of --max_nan_loss_steps %d in a row); the weights are still"
                       " finite, training goes on", shown, step, self.count, self.limit)


def _finite_everywhere(finite: bool, accelerator: Any) -> bool:
    if accelerator is None or accelerator.num_processes == 1:
        return finite
    flags = accelerator.gather(torch.tensor([1.0 if finite else 0.0], device=accelerator.device))
    return bool(flags.min() > 0)


def check_finite_options(values: Mapping[str, Any]) -> None:
    """Each numeric option (a number or a list of numbers) must be finite: {"--guidance_scale": 3.0, ...}."""
    for option, value in values.items():
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, float) and not math.isfinite(v):
                raise UserError(f"{option} is {v}: give a finite number.")


def check_file_finite(path: str | os.PathLike, what: str) -> None:
    """Every floating tensor of a safetensors file is finite (read one tensor at a time)."""
    p = check_safetensors_path(path, what)
    with TensorSource([p]) as source:
        for key in source.keys():
            if not source.dtype(key).is_floating_point:
                continue
            t = source.get_tensor(key)
            if t.numel() and not bool(torch.isfinite(t).all()):
                raise UserError(f"The {what} '{p}' holds NaN or infinite values (tensor '{key}'): it is damaged or"
                                " was saved from a run that diverged; use another file.")
