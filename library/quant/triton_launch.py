"""Direct launches of compiled Triton kernels, for the eager hot path of the int8 Linear.

``kernel[grid](*args, **constexprs)`` runs Triton's ``JITFunction.run`` on every call: it binds the arguments,
derives their specialisation, builds a cache key, checks the kernel's globals and only then calls the compiled
launcher. For a Linear of a few dozen tokens that work is most of the call's host time. `DirectLauncher` pays it
once per specialisation: the first call goes through Triton (compiling when needed) and keeps the compiled kernel;
later calls with the same specialisation launch it directly, with the arguments in the kernel's parameter order.

Two direct levels exist. "raw" (default): the compiled kernel's C launch function is called with everything that
does not change per call fixed once (function handle, packed metadata, cooperative/PDL flags, no scratch buffers,
no launch hooks); only the stream is read per call. This skips ``CompiledKernel.__getitem__``, its runner, the
launch metadata and the ``CudaLauncher.__call__`` wrapper. It is used only where the launcher's layout is one this
module knows (recognised once per process by the launcher's attributes and call signature: Triton 3.5-3.6's
per-kernel launch modules and the generic launcher of later versions), the kernel needs no scratch memory and no
launch hook is registered (a profiler such as proton keeps the normal path). Otherwise, or after `set_raw_launch(
False)`, the compiled kernel's own launcher runs (``CompiledKernel[grid](*args)``).

The specialisation key mirrors what Triton specialises on: per tensor its dtype and whether its address is 16-byte
aligned, per integer whether it is 1, whether it is a multiple of 16 and whether it needs 64 bits. Where a direct
launch refuses the arguments (a Triton whose launchers take another layout), that level is logged once and turned
off, and the call is repeated through the next level; `set_direct_launch(False)` sends every call through Triton.
Under ``TRITON_INTERPRET=1`` Triton returns no compiled kernel, so every call takes the normal launch.

Callers that replay launches (`library.quant.linear_plan`) take the cheapest launch of an already compiled
specialisation once (`DirectLauncher.bound`, `TmaLauncher.bound_a`) and keep it while `plan_epoch()` stays the same:
every switch that changes which kernel or launch path a call takes (here and in the kernel modules) calls
`invalidate_plans`.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

try:  # triton is optional; without it only the bookkeeping here is used (tests give stand-in kernels)
    import triton
    from triton import knobs as _knobs
except Exception:  # noqa: BLE001 - a missing or broken triton (or one without knobs) means no raw launches
    triton = None  # type: ignore[assignment]
    _knobs = None  # type: ignore[assignment]

_INTERPRET_MODE = os.environ.get("TRITON_INTERPRET", "0") == "1"
_STATE = {"enabled": True, "failed": False, "raw": True, "raw_failed": False}
# bumped by every switch that changes the kernel or the launch path of a call: replayed launches check it
_EPOCH = [0]
# the launcher layout of this Triton ("v36", "generic" or None for unknown), recognised on the first kernel
_LAYOUT: dict[type, str | None] = {}


def plan_epoch() -> int:
    """A number that changes whenever a launch bound earlier may no longer be the one a call would take."""
    return _EPOCH[0]


def invalidate_plans() -> None:
    """Make every bound launch (`DirectLauncher.bound`, `TmaLauncher.bound_a`) stale: callers bind again."""
    _EPOCH[0] += 1


def set_direct_launch(enabled: bool) -> None:
    """Turn the direct launches on (default) or off (every launch through ``JITFunction.run``)."""
    _STATE["enabled"] = bool(enabled)
    invalidate_plans()


def direct_launch_enabled() -> bool:
    """True when launches may bypass ``JITFunction.run`` (on, and not refused by this Triton)."""
    return _STATE["enabled"] and not _STATE["failed"]


def set_raw_launch(enabled: bool) -> None:
    """Turn the raw launches (the C launch function called directly) on (default) or off (direct launches then go
    through ``CompiledKernel[grid]``)."""
    _STATE["raw"] = bool(enabled)
    invalidate_plans()


def raw_launch_enabled() -> bool:
    """True when direct launches may call the C launch function (on, direct launches on, nothing refused)."""
    return _STATE["raw"] and not _STATE["raw_failed"] and direct_launch_enabled()


def spec_key(args: tuple) -> tuple:
    """What Triton specialises a kernel on, for the runtime arguments `args`. Computed for every launch that brings no
    key of its own, so written for host time: a list comprehension (a generator into tuple() costs 1.6 us more per
    launch of a dozen arguments) that tests for an int first (exactly int: a bool is not one)."""
    return tuple([(a == 1, a % 16 == 0, a > 0x7FFFFFFF) if type(a) is int
                  else (a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor)
                  else a for a in args])


def _launch_hooks_idle() -> bool:
    """True when no launch enter/exit hook is registered (a hook needs the launch metadata: normal path)."""
    if _knobs is None:
        return True
    rt = _knobs.runtime
    for hook in (rt.launch_enter_hook, rt.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


_V36_CALL = ["self", "gridX", "gridY", "gridZ", "stream", "function", "args"]
_GENERIC_CALL = ["self", "gridX", "gridY", "gridZ", "stream", "function", "kernel_metadata", "launch_metadata",
                 "launch_enter_hook", "launch_exit_hook", "args"]


def _launcher_layout(launcher: Any) -> str | None:
    """How this Triton's CudaLauncher calls its C launch function, from its call signature and attributes:
    "v36" (Triton 3.5-3.6: ``launch(gx, gy, gz, stream, function, coop, pdl, global_scratch, profile_scratch,
    kernel_metadata, launch_metadata, enter_hook, exit_hook, *args)``), "generic" (later: ``launch(gx, gy, gz,
    stream, function, coop, pdl, kernel_metadata, launch_metadata, enter_hook, exit_hook, global_scratch,
    profile_scratch, arg_annotations, kernel_signature, args)``) or None (unknown: no raw launches)."""
    cls = type(launcher)
    if cls in _LAYOUT:
        return _LAYOUT[cls]
    layout = None
    try:
        names = list(inspect.signature(cls.__call__).parameters)
    except (TypeError, ValueError):
        names = []
    common = all(hasattr(launcher, a) for a in ("launch", "launch_cooperative_grid", "launch_pdl",
                                                 "global_scratch_size", "profile_scratch_size"))
    version = tuple(int(p) for p in triton.__version__.split(".")[:2] if p.isdigit()) if triton else ()
    if cls.__name__ == "CudaLauncher" and common:
        if names == _V36_CALL and version in ((3, 5), (3, 6)):
            layout = "v36"
        elif names == _GENERIC_CALL and hasattr(launcher, "arg_annotations") and hasattr(launcher,
                                                                                          "kernel_signature"):
            layout = "generic"
    _LAYOUT[cls] = layout
    logger.debug("Triton %s launcher %s (call %s): raw launch layout %s",
                 getattr(triton, "__version__", "?"), cls.__name__, names, layout)
    return layout


def raw_launcher(kernel: Any, tail: tuple, grid: tuple | None = None, device: int | None = None
                 ) -> Callable[..., None] | None:
    """A function ``launch(grid3, args)`` that calls the C launch function of the compiled `kernel` directly with
    the runtime arguments `args` followed by the constexprs `tail`, or None where this kernel or Triton does not
    allow it (unknown launcher layout, scratch memory, a tensor-descriptor wrapper, a sanitizer). With `grid` given,
    ``launch(args)`` on that grid; with `device` given too, on that device's current stream (else the current
    device's)."""
    if triton is None:
        return None
    try:
        launcher = kernel.run  # loads the module and builds the CudaLauncher when needed
        function = kernel.function
        packed = kernel.packed_metadata
    except Exception as e:  # noqa: BLE001 - whatever this Triton lacks means the normal launch
        logger.debug("no raw launch for %r: %s", kernel, e)
        return None
    layout = _launcher_layout(launcher)
    launch = getattr(launcher, "launch", None)
    # a Python wrapper around the launch function (tensor descriptors) needs the normal path
    if (layout is None or launch is None or inspect.isfunction(launch) or inspect.ismethod(launch)
            or launcher.global_scratch_size or launcher.profile_scratch_size
            or getattr(launcher, "gsan_enabled", False)):
        logger.debug("no raw launch for %s (layout %s, scratch %s/%s)", getattr(kernel, "name", kernel), layout,
                     getattr(launcher, "global_scratch_size", "?"), getattr(launcher, "profile_scratch_size", "?"))
        return None
    coop, pdl = launcher.launch_cooperative_grid, launcher.launch_pdl
    drv = triton.runtime.driver.active
    get_device, get_stream = drv.get_current_device, drv.get_current_stream
    if grid is not None:
        return _fixed_grid_launch(launch, layout, launcher, function, packed, coop, pdl, tail, grid, device,
                                  get_device, get_stream)
    if layout == "v36":
        def launch_v36(grid: tuple, args: tuple) -> None:
            launch(grid[0], grid[1], grid[2], get_stream(get_device()), function, coop, pdl, None, None, packed,
                   None, None, None, *args, *tail)

        return launch_v36
    annotations, signature = launcher.arg_annotations, launcher.kernel_signature

    def launch_generic(grid: tuple, args: tuple) -> None:
        launch(grid[0], grid[1], grid[2], get_stream(get_device()), function, coop, pdl, packed, None, None, None,
               None, None, annotations, signature, args + tail)

    return launch_generic


def _fixed_grid_launch(launch: Any, layout: str, launcher: Any, function: Any, packed: Any, coop: Any, pdl: Any,
                       tail: tuple, grid: tuple, device: int | None, get_device: Callable[[], int],
                       get_stream: Callable[[int], int]) -> Callable[[tuple], None]:
    """`raw_launcher`'s ``launch(args)`` on a fixed grid (and device, where one is given): one Python frame."""
    gx, gy, gz = grid
    if layout == "v36":
        if device is None:
            return lambda args: launch(gx, gy, gz, get_stream(get_device()), function, coop, pdl, None, None, packed,
                                       None, None, None, *args, *tail)
        return lambda args: launch(gx, gy, gz, get_stream(device), function, coop, pdl, None, None, packed, None,
                                   None, None, *args, *tail)
    annotations, signature = launcher.arg_annotations, launcher.kernel_signature
    if device is None:
        return lambda args: launch(gx, gy, gz, get_stream(get_device()), function, coop, pdl, packed, None, None,
                                   None, None, None, annotations, signature, args + tail)
    return lambda args: launch(gx, gy, gz, get_stream(device), function, coop, pdl, packed, None, None, None, None,
                               None, annotations, signature, args + tail)


def constexpr_tail(fn: Any, constexprs: dict[str, Any]) -> tuple:
    """The values of `constexprs` in the parameter order of the @triton.jit `fn`, whose trailing parameters they
    must be (what a raw launch passes after the runtime arguments)."""
    names = list(fn.arg_names)
    first = len(names) - len(constexprs)
    if sorted(names[first:]) != sorted(constexprs):
        raise ValueError(f"the constexprs {sorted(constexprs)} must be the trailing parameters of {names}")
    return tuple(constexprs[n] for n in names[first:])


class DirectLauncher:
    """One @triton.jit kernel with fixed constexprs (its trailing parameters) and launch options."""

    __slots__ = ("compiled", "constexprs", "fn", "options", "raw", "tail")

    def __init__(self, fn: Any, constexprs: dict[str, Any], options: dict[str, Any]):
        self.fn = fn
        self.constexprs = dict(constexprs)
        self.options = dict(options)
        self.tail = constexpr_tail(fn, constexprs)
        # specialisation key -> the compiled kernel, or None where it must go through Triton
        self.compiled: dict[tuple, Any] = {}
        # specialisation key -> its raw launch function (`raw_launcher`), where there is one
        self.raw: dict[tuple, Callable[[tuple, tuple], None]] = {}

    def __call__(self, grid: tuple[int, int, int], args: tuple, key: tuple | None = None) -> None:
        """Launch on `grid` (3 dimensions) with the runtime arguments `args`. `key`, when the caller gives one, must
        determine the specialisation of `args` by itself (what the caller's plan does not fix: the alignments of
        its inputs, the values of strides and sizes that vary); without it `spec_key(args)` is used."""
        state = _STATE
        if not (state["enabled"] and not state["failed"]):
            self.fn[grid](*args, **self.constexprs, **self.options)
            return
        if key is None:
            key = spec_key(args)
        raw = self.raw.get(key)
        if raw is not None and state["raw"] and not state["raw_failed"] and _launch_hooks_idle():
            try:
                raw(grid, args)
                return
            except TypeError as e:  # this launch function wants other arguments: the compiled kernel's launcher
                state["raw_failed"] = True
                invalidate_plans()
                logger.info("raw Triton launches are not usable with this Triton (%s); using CompiledKernel[grid]",
                            e)
        kernel = self.compiled.get(key, False)
        if kernel is False:  # first call of this specialisation: Triton compiles (or finds) the kernel
            kernel = self.fn[grid](*args, **self.constexprs, **self.options)
            # a CompiledKernel can be launched by `kernel[grid](*args)`; the interpreter returns no kernel
            kernel = kernel if kernel is not None and hasattr(type(kernel), "__getitem__") else None
            self.compiled[key] = kernel
            if kernel is not None:
                raw = raw_launcher(kernel, self.tail)
                if raw is not None:
                    self.raw[key] = raw
            return
        if kernel is None:
            self.fn[grid](*args, **self.constexprs, **self.options)
            return
        try:
            kernel[grid](*args, *self.tail)
        except TypeError as e:  # this Triton's launcher wants other arguments: launch through Triton from now on
            state["failed"] = True
            invalidate_plans()
            logger.info("direct Triton launches are not usable with this Triton (%s); using kernel[grid]", e)
            self.fn[grid](*args, **self.constexprs, **self.options)


    def bound(self, grid: tuple[int, int, int], key: tuple, device: int | None = None
              ) -> Callable[[tuple], None] | None:
        """The cheapest launch of the specialisation `key` (as `__call__` would key it) on `grid` (and on the current
        stream of `device` where given, else of the current device): a function of the runtime arguments alone, or
        None where that specialisation has not been launched yet. Under the interpreter (no compiled kernels) it is
        the normal launch. Valid while `plan_epoch()` is unchanged and no launch hook is registered (the caller
        checks `_launch_hooks_idle`)."""
        if triton is not None and _INTERPRET_MODE:
            fn, constexprs, options = self.fn, self.constexprs, self.options
            return lambda args: fn[grid](*args, **constexprs, **options)
        if not direct_launch_enabled():
            return None
        kernel = self.compiled.get(key)
        if self.raw.get(key) is not None and raw_launch_enabled():
            fixed = raw_launcher(kernel, self.tail, grid, device)
            if fixed is not None:
                return fixed
        if not kernel:  # not launched yet (False) or only through Triton (None)
            return None
        runner, tail = kernel[grid], self.tail
        return lambda args: runner(*args, *tail)


# --------------------------------------------------------------------------------------------------------------------
# Raw launches of kernels that take host tensor descriptors (TMA)
# --------------------------------------------------------------------------------------------------------------------
# A Triton launch of a TMA kernel builds a TensorDescriptor per operand (its checks), specialises on it, and
# encodes a CUtensorMap for it (``cuTensorMapEncodeTiled``) in a Python wrapper around the C launch function: about
# 40-55 us of host time per call on the H200, against about 15 us for a raw pointer-kernel launch. A CUtensorMap is
# determined by the operand's base address, shape and strides (and the kernel's block, swizzle and element type, fixed
# per compiled kernel), so `TmaLauncher` encodes each once and keeps the expansion the C function takes.
_TMA_CACHE_LIMIT = 4096  # encoded descriptors kept per launcher (weights: one per Linear; activations: a few)


def _c_launch_under_tensordesc_wrapper(launcher: Any) -> Any:
    """The C launch function that Triton 3.5-3.6's tensor-descriptor wrapper (a closure over ``launcher``) calls,
    or None where the launcher is not laid out that way."""
    inner = getattr(launcher, "launch", None)
    if not inspect.isfunction(inner) or inner.__closure__ is None:
        return None
    names = inner.__code__.co_freevars
    if "launcher" not in names:
        return None
    c_launch = inner.__closure__[names.index("launcher")].cell_contents
    return None if inspect.isfunction(c_launch) or inspect.ismethod(c_launch) else c_launch


def _tensordesc_expander() -> Callable[[Any, dict], list] | None:
    """The NVIDIA backend's ``make_tensordesc_arg(descriptor, metadata)`` (Triton 3.5-3.6), or None."""
    try:
        from triton.backends.nvidia import driver as nvidia_driver
    except Exception:  # noqa: BLE001 - no NVIDIA backend: no TMA raw launches
        return None
    fn = getattr(nvidia_driver, "make_tensordesc_arg", None)
    if fn is None:
        return None
    try:
        if len(inspect.signature(fn).parameters) != 2:
            return None
    except (TypeError, ValueError):
        return None
    return fn


class TmaLauncher:
    """Raw launches of one compiled kernel whose first parameters are host tensor descriptors (`n_desc` of them):
    ``launch(grid3, descs, args)`` with `descs` as (tensor, shape, strides) per descriptor and `args` the other
    runtime arguments; the kernel's constexprs (`tail`) follow. Build with `TmaLauncher.of`, which returns None
    where this Triton or kernel does not allow it (then launch through Triton)."""

    __slots__ = ("blocks", "c_launch", "cache", "coop", "encodes", "expand", "function", "metas", "packed", "pdl",
                 "tail")

    def __init__(self, c_launch: Any, kernel: Any, launcher: Any, metas: list[dict], blocks: list[list[int]],
                 tail: tuple, expand: Callable[[Any, dict], list]):
        self.c_launch = c_launch
        self.function = kernel.function
        self.packed = kernel.packed_metadata
        self.coop, self.pdl = launcher.launch_cooperative_grid, launcher.launch_pdl
        self.metas, self.blocks, self.tail, self.expand = metas, blocks, tail, expand
        self.cache: dict[tuple, tuple] = {}
        self.encodes = 0  # descriptors encoded (cache misses): the benchmark counts them per step

    @classmethod
    def of(cls, kernel: Any, tail: tuple, blocks: Sequence[Sequence[int]]) -> TmaLauncher | None:
        """For the compiled `kernel` (returned by its first launch through Triton), whose first ``len(blocks)``
        parameters are tensor descriptors with those block shapes; None where raw launches are not possible."""
        if triton is None or _TensorDescriptor is None:
            return None
        try:
            launcher = kernel.run
            function = kernel.function  # noqa: F841 - loaded by kernel.run; its absence means no raw launch
            signature = list(kernel.src.signature.values())
            metas = list(getattr(kernel.metadata, "tensordesc_meta", None) or [])
        except Exception as e:  # noqa: BLE001 - whatever this Triton lacks means the normal launch
            logger.debug("no raw TMA launch for %r: %s", kernel, e)
            return None
        n = len(blocks)
        descs = [i for i, s in enumerate(signature) if isinstance(s, str) and s.startswith("tensordesc")]
        expand = _tensordesc_expander()
        c_launch = _c_launch_under_tensordesc_wrapper(launcher)
        if (_launcher_layout(launcher) != "v36" or c_launch is None or expand is None or descs != list(range(n))
                or len(metas) != n or any(not isinstance(m, dict) for m in metas)
                or launcher.global_scratch_size or launcher.profile_scratch_size
                or getattr(launcher, "gsan_enabled", False)):
            logger.debug("no raw TMA launch for %s", getattr(kernel, "name", kernel))
            return None
        return cls(c_launch, kernel, launcher, metas, [list(b) for b in blocks], tail, expand)

    def bound_a(self, grid: tuple, b: torch.Tensor, b_shape: tuple, b_strides: tuple, device: int
                ) -> Callable[[torch.Tensor, tuple, tuple, tuple], None]:
        """``launch(a, a_shape, a_strides, args)``: this kernel on `grid`, on the current stream of `device`, with
        its second descriptor fixed to `b` (encoded once, here) and the first one per call (encoded once per
        address, shape and strides)."""
        b_enc = self._encoded(1, b, b_shape, b_strides)
        c_launch, function, coop, pdl, packed, tail = (self.c_launch, self.function, self.coop, self.pdl,
                                                       self.packed, self.tail)
        get_stream = triton.runtime.driver.active.get_current_stream
        encoded = self._encoded
        gx, gy, gz = grid

        def launch(a: torch.Tensor, a_shape: tuple, a_strides: tuple, args: tuple) -> None:
            c_launch(gx, gy, gz, get_stream(device), function, coop, pdl, None, None, packed, None, None, None,
                     *encoded(0, a, a_shape, a_strides), *b_enc, *args, *tail)

        return launch

    def _encoded(self, i: int, tensor: torch.Tensor, shape: tuple, strides: tuple) -> tuple:
        key = (i, tensor.data_ptr(), shape, strides)
        enc = self.cache.get(key)
        if enc is None:
            if len(self.cache) >= _TMA_CACHE_LIMIT:
                self.cache.clear()
            self.encodes += 1
            desc = _TensorDescriptor(tensor, list(shape), list(strides), self.blocks[i])
            enc = self.cache[key] = tuple(self.expand(desc, self.metas[i]))
        return enc

    def __call__(self, grid: tuple, descs: Sequence[tuple], args: tuple) -> None:
        expanded: list = []
        for i, (tensor, shape, strides) in enumerate(descs):
            expanded.extend(self._encoded(i, tensor, shape, strides))
        drv = triton.runtime.driver.active
        self.c_launch(grid[0], grid[1], grid[2], drv.get_current_stream(drv.get_current_device()), self.function,
                      self.coop, self.pdl, None, None, self.packed, None, None, None, *expanded, *args, *self.tail)


try:  # the host descriptor type of the TMA kernels (Triton 3.3+)
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except Exception:  # noqa: BLE001 - no descriptors: no TMA raw launches
    _TensorDescriptor = None  # type: ignore[assignment,misc]
