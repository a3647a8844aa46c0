"""Direct launches of compiled Triton kernels, for the eager hot path of the int8 Linear.

``kernel[grid](*args, **constexprs)`` runs Triton's ``JITFunction.run`` on every call: it binds the arguments,
derives their specialisation, builds a cache key, checks the kernel's globals and only then calls the compiled
launcher. For a Linear of a few dozen tokens that work is most of the call's host time. `DirectLauncher` pays it
once per specialisation: the first call goes through Triton (compiling when needed) and keeps the compiled kernel;
later calls with the same specialisation call the compiled kernel's own launcher (``CompiledKernel[grid]``) with
the arguments in the kernel's parameter order.

The specialisation key mirrors what Triton specialises on: per tensor its dtype and whether its address is 16-byte
aligned, per integer whether it is 1, whether it is a multiple of 16 and whether it needs 64 bits. Where the
compiled launcher refuses the arguments (a Triton whose launchers take another layout), the launcher logs it once
and every later call goes through Triton again; `set_direct_launch(False)` does that from the start.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

_STATE = {"enabled": True, "failed": False}


def set_direct_launch(enabled: bool) -> None:
    """Turn the direct launches on (default) or off (every launch through ``JITFunction.run``)."""
    _STATE["enabled"] = bool(enabled)


def direct_launch_enabled() -> bool:
    """True when launches may bypass ``JITFunction.run`` (on, and not refused by this Triton)."""
    return _STATE["enabled"] and not _STATE["failed"]


def spec_key(args: tuple) -> tuple:
    """What Triton specialises a kernel on, for the runtime arguments `args`."""
    return tuple(
        (a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor)
        else (a == 1, a % 16 == 0, a > 0x7FFFFFFF) if type(a) is int
        else a
        for a in args
    )


class DirectLauncher:
    """One @triton.jit kernel with fixed constexprs (its trailing parameters) and launch options."""

    __slots__ = ("compiled", "constexprs", "fn", "options", "tail")

    def __init__(self, fn: Any, constexprs: dict[str, Any], options: dict[str, Any]):
        names = list(fn.arg_names)
        first = len(names) - len(constexprs)
        if sorted(names[first:]) != sorted(constexprs):
            raise ValueError(f"the constexprs {sorted(constexprs)} must be the trailing parameters of {names}")
        self.fn = fn
        self.constexprs = dict(constexprs)
        self.options = dict(options)
        self.tail = tuple(constexprs[n] for n in names[first:])
        # specialisation key -> the compiled kernel, or None where it must go through Triton
        self.compiled: dict[tuple, Any] = {}

    def __call__(self, grid: tuple[int, int, int], args: tuple, key: tuple | None = None) -> None:
        """Launch on `grid` (3 dimensions) with the runtime arguments `args`. `key`, when the caller gives one, must
        determine the specialisation of `args` by itself (what the caller's plan does not fix: the alignments of
        its inputs, the values of strides and sizes that vary); without it `spec_key(args)` is used."""
        if not (_STATE["enabled"] and not _STATE["failed"]):
            self.fn[grid](*args, **self.constexprs, **self.options)
            return
        if key is None:
            key = spec_key(args)
        kernel = self.compiled.get(key, False)
        if kernel is False:  # first call of this specialisation: Triton compiles (or finds) the kernel
            kernel = self.fn[grid](*args, **self.constexprs, **self.options)
            # a CompiledKernel can be launched by `kernel[grid](*args)`; the interpreter returns no kernel
            self.compiled[key] = kernel if kernel is not None and hasattr(type(kernel), "__getitem__") else None
            return
        if kernel is None:
            self.fn[grid](*args, **self.constexprs, **self.options)
            return
        try:
            kernel[grid](*args, *self.tail)
        except TypeError as e:  # this Triton's launcher wants other arguments: launch through Triton from now on
            _STATE["failed"] = True
            logger.info("direct Triton launches are not usable with this Triton (%s); using kernel[grid]", e)
            self.fn[grid](*args, **self.constexprs, **self.options)
