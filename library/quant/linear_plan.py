"""The eager ConvRot INT8 Linear's forward (and its backward's weight dequantisation) replayed from a per-module
launch plan.

An eager int8 Linear call on CUDA is two kernels (rotate + quantise the input rows, then the int8 GEMM with its
epilogue), and finding them costs more host time than launching them: the quantiser's and the GEMM's plan lookups,
the variant choice, the TMA checks, the argument tuples and the specialisation keys are rebuilt on every call. At a
few dozen rows (the text encoder's captions, the text refiner) and in eager training, where the GPU waits for the
host, that host time is the step's time.

`LinearPlans` (one per `ConvRotInt8Linear`) keeps, per input layout (rows, dtype, alignment, row stride) and weight
address, the two launches that the regular path (`library.quant.convrot_kernels.linear_forward`) made the first time:
the quantiser's and the GEMM's cheapest launch functions with their grids and every argument that does not change
between calls (`bound_quantiser`, `bound_gemm`). A later call allocates the codes, the scales and the output and
launches both. The kernels, configurations, grids and arguments are those of the regular path, so the outputs are
identical (tested on CUDA and under Triton's interpreter). The activation cache (q, k and v share one quantised
input) works as before. The backward's default form (dequantise the weight with one kernel, then cuBLAS) keeps its
dequantisation's launch the same way (`LinearPlans.grad_input`, `bound_dequantiser`).

A plan is rebuilt when the weight, its scales or the bias move (block swap's slots, `.to()`), and dropped when a
switch changes which kernel or launch a call would take (`library.quant.triton_launch.plan_epoch`). With a launch
hook registered (a profiler such as proton) calls take the regular path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from library.quant import convrot_kernels as kernels
from library.quant.convrot_quant_kernels import bound_dequantiser, bound_quantiser, scales_offset
from library.quant.int8_gemm_kernels import bound_gemm
from library.quant.triton_launch import _EPOCH, _launch_hooks_idle, invalidate_plans

__all__ = ["LinearPlans", "set_linear_plans"]

_STATE = {"enabled": True}
_MAX_PLANS = 64  # per module: input layouts x weight addresses (block swap's slots); cleared when exceeded
_MAX_TRIES = 3  # calls of one key that may fail to bind (a first autotuned launch) before it stops trying (per epoch)


class _GradPlan:
    """The backward's bound weight dequantisation of one key, and the epoch it was bound in."""

    __slots__ = ("dequantise", "epoch")

    def __init__(self, epoch: int, dequantise: Callable):
        self.epoch, self.dequantise = epoch, dequantise


def set_linear_plans(enabled: bool) -> None:
    """Let the int8 Linear modules replay their launches (default), or send every call through the regular path
    (the benchmark's same-run comparison)."""
    _STATE["enabled"] = bool(enabled)
    invalidate_plans()


class _Plan:
    """The two bound launches of one key, the epoch they were bound in, and the codes + scales buffer's layout."""

    __slots__ = ("epoch", "gemm", "m", "nbytes", "quantise", "s_off")

    def __init__(self, epoch: int, m: int, k: int, quantise: Callable, gemm: Callable):
        self.epoch, self.m, self.quantise, self.gemm = epoch, m, quantise, gemm
        self.s_off = scales_offset(m, k)  # as `_codes_and_scales` lays them out
        self.nbytes = self.s_off + 4 * m


class LinearPlans:
    """The launch plans of one int8 Linear's eager forward (see the module docstring)."""

    __slots__ = ("plans", "replays", "tries")

    def __init__(self) -> None:
        self.plans: dict[tuple, _Plan | _GradPlan] = {}
        self.tries: dict[tuple, tuple[int, int]] = {}  # key -> (epoch, calls that could not bind in it)
        self.replays = 0  # calls served from a plan

    def __reduce__(self) -> tuple:
        return LinearPlans, ()  # a copy or a pickle starts empty: plans name addresses of this process

    def __len__(self) -> int:
        return len(self.plans)

    def clear(self) -> None:
        self.plans.clear()
        self.tries.clear()

    def forward(self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                group_size: int) -> torch.Tensor:
        """``linear_forward(x, weight, weight_scale, bias, group_size)``, from the plan of x's layout where there is
        one; otherwise the regular path, whose launches are then bound for the next call."""
        n, k = weight.shape
        if x.shape[-1] != k:
            raise ValueError(f"input features {x.shape[-1]} do not match the weight's {k}")
        x2 = x if x.dim() == 2 else x.reshape(-1, k)
        key = (x2.shape[0], x2.dtype, x2.data_ptr() & 15, x2.stride(0), x2.stride(1), weight.data_ptr(),
               weight_scale.data_ptr(), 0 if bias is None else bias.data_ptr())
        plan = self.plans.get(key)
        if plan is not None and plan.epoch == _EPOCH[0] and _launch_hooks_idle():
            self.replays += 1
            cache = kernels._ACT_CACHE
            qs = cache.get(x, group_size, True)
            if qs is None:  # `_codes_and_scales`: codes, then the scales at the next 16-byte boundary, one buffer
                buf = torch.empty((plan.nbytes,), dtype=torch.int8, device=x2.device)
                qs = buf.as_strided((plan.m, k), (k, 1)), buf[plan.s_off:].view(torch.float32)
                plan.quantise(x2, qs[0], qs[1])
                cache.put(x, group_size, True, qs)
            out = torch.empty((plan.m, n), dtype=x2.dtype, device=x2.device)
            plan.gemm(qs[0], qs[1], weight, weight_scale, bias, out)
        elif self._plannable(x2, weight, bias, group_size):  # the regular path's two steps, then bound
            q, s = kernels.cached_quantized_activation(x, group_size)
            out = kernels.int8_gemm(q, s, weight, weight_scale, bias, x.dtype)
            self._bind(key, x2, weight, weight_scale, bias, group_size, q, s, out)
        else:
            return kernels.linear_forward(x, weight, weight_scale, bias, group_size)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], n)

    def grad_input(self, grad: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group_size: int,
                   bwd: str, accumulate: torch.Tensor | None = None, in_place: bool = False) -> torch.Tensor:
        """``int8_linear_grad_input(grad, weight, weight_scale, group_size, bwd)``: where that dequantises the
        weight with the Triton kernel and multiplies (the default), the dequantisation's launch from a plan of the
        weight's address and the gradient's dtype (bound after a regular call), then the same product.
        `accumulate` (grad's rows x K, grad's dtype): a gradient to add, which the replayed product takes as its
        addend (addmm) instead of a separate add; with `in_place`, the sum is written into `accumulate` (the
        caller's own tensor: no copy of it first)."""
        n, k = weight.shape
        key = (grad.dtype, weight.data_ptr(), weight_scale.data_ptr())  # forward keys have 8 items
        plan = self.plans.get(key)
        if plan is not None and plan.epoch == _EPOCH[0] and _launch_hooks_idle():
            self.replays += 1
            w = torch.empty((n, k), dtype=grad.dtype, device=grad.device)
            plan.dequantise(weight, w, weight_scale.view(-1))
            g2 = grad.reshape(-1, n)
            if accumulate is not None:
                return kernels._addmm(accumulate.view(-1, k), g2, w, in_place).view(*grad.shape[:-1], k)
            return kernels._mm(g2, w).view(*grad.shape[:-1], k)
        out = self._regular_grad_input(grad, weight, weight_scale, group_size, bwd)
        if accumulate is not None:
            out = out.add_(accumulate.view(out.shape)) if in_place else out + accumulate.view(out.shape)
        return out

    def _regular_grad_input(self, grad: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                            group_size: int, bwd: str) -> torch.Tensor:
        """The regular path of `grad_input`, whose dequantisation is then bound for the next call."""
        key = (grad.dtype, weight.data_ptr(), weight_scale.data_ptr())
        out = kernels.int8_linear_grad_input(grad, weight, weight_scale, group_size, bwd)
        if self._dequantises(grad, weight, weight_scale, group_size, bwd):
            epoch = _EPOCH[0]
            dequantise = bound_dequantiser(weight, weight_scale.view(-1), group_size, grad.dtype)
            if dequantise is not None:
                if len(self.plans) >= _MAX_PLANS:
                    self.clear()
                self.plans[key] = _GradPlan(epoch, dequantise)
        return out

    @staticmethod
    def _dequantises(grad: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group_size: int,
                     bwd: str) -> bool:
        """Whether `int8_linear_grad_input` dequantises the weight with the Triton kernel (its "bf16" mode, not the
        upcast GEMM), reading fp32 row scales in place."""
        if not _STATE["enabled"] or bwd != "bf16" or not group_size or grad.dtype not in kernels._FLOAT_DTYPES:
            return False
        if not kernels._use_triton(weight, "auto") or weight.stride(1) != 1:
            return False
        if (kernels._TUNING["backward"] == "upcast" and grad.dtype in (torch.bfloat16, torch.float16)
                and group_size <= 256):
            return False
        return weight_scale.dtype == torch.float32 and weight_scale.is_contiguous() and \
            weight_scale.numel() == weight.shape[0]

    def _bind(self, key: tuple, x2: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
              bias: torch.Tensor | None, group_size: int, q: torch.Tensor, s: torch.Tensor, out: torch.Tensor) -> None:
        """Bind the launches of a regular call (codes q, scales s, output out) for `key`, where both can be bound
        (a shape's first, autotuned launch cannot: a few more calls try again)."""
        epoch = _EPOCH[0]
        tried_in, tries = self.tries.get(key, (epoch, 0))
        if tried_in == epoch and tries >= _MAX_TRIES:
            return
        quantise = bound_quantiser(x2, group_size)
        gemm = bound_gemm(q, s, weight, weight_scale, bias, out) if quantise is not None else None
        if gemm is None:
            self.tries[key] = (epoch, tries + 1 if tried_in == epoch else 1)
            return
        if len(self.plans) >= _MAX_PLANS:
            self.clear()
        self.plans[key] = _Plan(epoch, x2.shape[0], x2.shape[1], quantise, gemm)

    @staticmethod
    def _plannable(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group_size: int) -> bool:
        """Whether `linear_forward` runs the quantiser + GEMM pair on these operands as they are (Triton, rows
        contiguous, a bias in the output dtype, not the one-kernel fused forward)."""
        if not _STATE["enabled"] or not kernels.HAS_TRITON:
            return False
        if not (x2.is_cuda or (kernels._INTERPRET and x2.device.type == "cpu")):
            return False
        if x2.shape[0] == 0 or x2.stride(1) != 1:
            return False
        if bias is not None and (bias.dtype != x2.dtype or not bias.is_contiguous()):
            return False
        return not (kernels._FUSED["max_m"] and kernels.fused_linear_ok(x2, weight, group_size))
