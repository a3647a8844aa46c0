"""The fused element-wise kernels inside compiled regions, as registered ``torch.library`` ops.

A compiled block leaves its element-wise code to inductor, which fuses it with its neighbours. The profiles of the
compiled step (docs/benchmarks.md, fourteenth run) showed where inductor's kernels are slower than this project's
(`library.runtime.fused_kernels`): the q/k head norm with RoPE, which inductor builds from a stack of the two rotated
halves (110 us forward and 93 us backward per block against the kernels' 2 x 17 and 2 x 25 us), and SwiGLU's
backward, with a concatenation of the two halves' gradients (183 us against 88 us, though inductor's kernel also
does the add before it, which stays a pass of its own next to the op). Here those kernels are ops
(namespace ``moss_image``), each with a fake implementation for tracing, a default one in torch operators (any
device: the kernels' math in fp32) and a CUDA one (the kernels, where their self-check passed), so that a compiled
block calls them as opaque nodes and inductor fuses the code around them:

- ``fused_norm_rope`` / ``fused_norm_rope_backward``: `apply_rope(rms_norm(x, weight, eps), cos, sin)` of q or k;
- ``fused_swiglu`` / ``fused_swiglu_backward``: `silu(gate) * value` of u = [value | gate];
- ``fused_norm_modulate`` / ``fused_norm_modulate_backward``: `rms_norm(x, weight, eps) * (1 + scale) + shift`.
  Off by default (`set_compiled_kernels`): inductor fuses that norm with the gated residual add before it, which
  an opaque op would split into two passes over the activation.

- ``fused_swiglu_quant`` (no autograd: only an inductor pass puts it in a graph): ``fused_swiglu`` and the ConvRot
  INT8 codes and scales of its output rows, as ``moss_image::convrot_int8_quantize`` gives them. A compiled ConvRot
  INT8 block calls ``fused_swiglu`` and then that quantiser on the same rows for `ffn_down`;
  `fuse_quantize_into_producers`, an inductor post-grad pass (`enable_inductor_producer_codes`, installed by
  `library.runtime.compile.compile_blocks`), puts the one op in their place, so the product is not read again.
  On by default (`set_compiled_kernels(swiglu_codes=False)` turns it off): on an H200 it took 0.1-4.2 ms of GPU time
  off a checkpointed compiled INT8 step in three pairs of runs. The slower host seen twice with it (sixteenth run)
  was the process, not the pass: in the third pair the process with the pass had the faster host (seventeenth run,
  call 5; docs/benchmarks.md). The
  CUDA implementation takes `library.runtime.fused_kernels.swiglu_quant_forward` where the kernels that write codes
  passed their check (`fused_ops.prepare_fused_quant`), else the two kernels; the default one runs the two ops' torch
  implementations, so CPU graphs give the same bits either way. The norm + modulation stays inductor's there: it fuses
  the norm with the residual add before it, which an op would split into two passes, taking what the codes save.

Blocks compiled without gradients whose int8 Linears read nothing but their inputs (inference; `codes_inference_applies`
and `ConvRotInt8Linear.codes_group` decide while tracing, `inference_codes` turns it off) take ops without autograd:

- ``fused_norm_modulate_codes`` / ``fused_swiglu_codes``: only the codes and scales of the producer's output rows
  (`op_norm_modulate_codes`, `op_swiglu_codes` give them as `QuantizedRows`): the code-writing kernels without
  their output (`write_y=False`), so neither the output nor a quantiser's read of it happens;
- ``convrot_int8_linear_norm_rope`` (q and k) and ``convrot_int8_linear_gated_residual`` (o and ffn_down): the int8
  product of codes with the step after it in the GEMM's epilogue (`library.quant.int8_epilogue_kernels`), so the
  product is never written. **Off by default** (`set_compiled_kernels(inference_epilogues=True)` turns them on): on
  an H200 each fused GEMM took the time of the GEMM and the step's own kernel together (106 against 106 us for q,
  107 against 109 for o, 232 against 229 for ffn_down), since a program's epilogue runs after its main loop with
  nothing to overlap it, and 50-step inference was no faster (docs/benchmarks.md, seventeenth run);
- q, k and v as one product (``convrot_int8_linear_codes`` over their stacked weight [3W, W]) where the model stacked
  them (`MossImage.stack_qkv_weights`, which the inference script calls with `--compile`): one 9,216-wide GEMM fills
  the GPU's last wave of tiles where three 3,072-wide ones leave three partial waves (`inference_stacked_qkv`, on
  by default; `stacked_qkv_inference_applies`);
- ``fused_residual_norm_modulate_codes``: the attention branch's gated residual h = x + gate * o(...) and the
  second norm + modulation's codes of h in one kernel (`op_residual_norm_modulate_codes`), so h is written once
  and not read back (`inference_residual_codes`, on by default; `residual_codes_inference_applies`).

`op_norm_rope`, `op_swiglu` and `op_norm_modulate` are what `library.moss_image.dit` calls while torch.compile
traces a block, where `compiled_kernel` and the `*_applies` checks here (shapes, dtypes, no gradient for the
weights) say so. On the CPU the ops stay off unless a test turns them on (`set_compiled_kernels(cpu=
True)`): there they run the default implementation, which is what the CPU tests compile.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from library.quant import convrot_kernels
from library.quant.convrot_ops import QUANTIZE, QUANTIZE_SEGMENTS, VIEW_OPS, QuantizedRows, input_key
from library.runtime import fused_ops

__all__ = ["codes_inference_applies", "compiled_codes_on", "compiled_kernel", "compiled_kernels",
           "enable_inductor_producer_codes", "epilogues_inference_apply", "fuse_quantize_into_producers",
           "norm_modulate_applies", "norm_rope_applies", "norm_rope_shape_applies", "op_linear_gated_residual",
           "op_linear_norm_rope", "op_norm_modulate", "op_norm_modulate_codes", "op_norm_rope",
           "op_residual_norm_modulate_codes", "op_swiglu", "op_swiglu_codes", "producer_codes_on", "quantized_rows",
           "quantized_segments",
           "residual_codes_inference_applies", "set_compiled_kernels", "stacked_qkv_inference_applies",
           "stacked_qkv_training_on", "swiglu_applies"]

_SETTINGS: dict[str, bool] = {"norm_rope": True, "swiglu": True, "norm_modulate": False, "swiglu_codes": True,
                               "inference_codes": True, "inference_epilogues": False, "inference_stacked_qkv": True,
                               "inference_residual_codes": True, "training_stacked_qkv": True, "cpu": False}


def set_compiled_kernels(**settings: bool) -> dict[str, bool]:
    """Which kernels compiled blocks call (`norm_rope`, `swiglu`, `norm_modulate`; `swiglu_codes`: the inductor pass
    that gives SwiGLU ffn_down's codes; `inference_codes`: the codes-only producers of blocks compiled without
    gradients, and `inference_epilogues` there the int8 products with the step after them; `inference_stacked_qkv`:
    there one product for q, k and v where the model stacked them, `MossImage.stack_qkv_weights`;
    `inference_residual_codes`: there the gated residual and the second norm's codes as one op;
    `training_stacked_qkv`: blocks with a LoRA on q, k and v, stacked, run the three base products as one, on by
    default, where the trainer stacks them: compiled steps without checkpointing; see `stacked_qkv_training_on`),
    and whether CPU tensors take the ops too (`cpu`, for tests); returns the previous settings."""
    unknown = set(settings) - set(_SETTINGS)
    if unknown:
        raise ValueError(f"unknown compiled-kernel settings {sorted(unknown)}; known: {sorted(_SETTINGS)}")
    previous = dict(_SETTINGS)
    _SETTINGS.update({k: bool(v) for k, v in settings.items()})
    return previous


@contextlib.contextmanager
def compiled_kernels(**settings: bool) -> Iterator[None]:
    """`set_compiled_kernels(**settings)` for the duration of a `with` block."""
    previous = set_compiled_kernels(**settings)
    try:
        yield
    finally:
        set_compiled_kernels(**previous)


def compiled_kernel(name: str, x: torch.Tensor) -> bool:
    """Whether a block being compiled calls kernel `name` as an op for x: tracing, the fused kernels on, this kernel
    on, and x on a CUDA device whose kernel check passed (`library.runtime.fused_ops.prepare`, run before the blocks
    by `MossImage`), or on the CPU where `cpu` is set."""
    if not (torch.compiler.is_compiling() and _SETTINGS[name] and fused_ops.kernels_enabled()):
        return False
    if x.device.type == "cuda":
        return fused_ops.checked(x.device)
    return x.device.type == "cpu" and _SETTINGS["cpu"]


def epilogues_inference_apply() -> bool:
    """Whether a block compiled without gradients whose int8 Linears take their inputs as codes
    (`codes_inference_applies`) runs their products with the step after them (`op_linear_gated_residual`,
    `op_linear_norm_rope`): the `inference_epilogues` setting (off by default: no faster on an H200)."""
    return _SETTINGS["inference_epilogues"]


def stacked_qkv_inference_applies() -> bool:
    """Whether a block compiled without gradients whose q, k and v take their input as codes and are stacked
    (`BlockProjections.qkv_stack`) runs one product for the three: the `inference_stacked_qkv` setting (on by
    default), and not `inference_epilogues` (whose q and k products take their head norm and RoPE each)."""
    return _SETTINGS["inference_stacked_qkv"] and not _SETTINGS["inference_epilogues"]


def stacked_qkv_training_on() -> bool:
    """Whether the LoRA group of stacked ConvRot INT8 q, k and v takes their base products as one
    (`MossImageBlock._stacked_bases`, in compiled blocks and the eager plain forms): the `training_stacked_qkv`
    setting, on by default. The trainer stacks them for `--compile` without `--gradient_checkpointing`, where an H200
    measured 1.08x and 1.13x faster steps in two runs (`bench/checkpointing.py`, `no_gc_compile_int8` against
    `_three_qkv`); with checkpointing one run measured 0.96x, so it does not stack there. A block stacked by hand
    takes the product inside a compiled checkpoint too (tests/test_int8_stack.py)."""
    return _SETTINGS["training_stacked_qkv"]


def residual_codes_inference_applies(x: torch.Tensor, gate: torch.Tensor) -> bool:
    """Whether a block compiled without gradients, whose FFN input is given as codes, runs the attention branch's
    gated residual x + gate * y and the second norm's codes as one op (`op_residual_norm_modulate_codes`): the
    `inference_residual_codes` setting (on by default), not `inference_epilogues` (which takes the residual into
    `o`'s product), and x [B, S, W] with gate [B, W] of its dtype (y: x's shape and dtype, checked by the caller)."""
    if not _SETTINGS["inference_residual_codes"] or _SETTINGS["inference_epilogues"]:
        return False
    return x.dim() == 3 and gate.shape == (x.shape[0], x.shape[-1]) and x.dtype == gate.dtype


def codes_inference_applies(x: torch.Tensor) -> bool:
    """Whether a block being compiled gives its int8 Linears x's codes alone (`op_norm_modulate_codes`,
    `op_swiglu_codes`): tracing without gradients (an inference graph), `inference_codes` and the kernels that write
    codes on (`fused_ops.set_fused_quant`), no autocast, and x on a CUDA device where those kernels passed their
    check (`fused_ops.prepare_fused_quant`, run before the blocks by `MossImage`), or on the CPU where `cpu` is set.
    """
    if not (torch.compiler.is_compiling() and not torch.is_grad_enabled() and _SETTINGS["inference_codes"]):
        return False
    if not (fused_ops.kernels_enabled() and fused_ops.fused_quant_enabled()) or torch.is_autocast_enabled(
            x.device.type):
        return False
    if x.device.type == "cuda":
        return fused_ops.fused_quant_checked(x.device)
    return x.device.type == "cpu" and _SETTINGS["cpu"]


# --------------------------------------------------------------------------------------------------------------------
# Where the ops apply, while a block is traced: the kernels' shapes and dtypes, and no gradient for the weights (the
# ops' CUDA implementations bring any layout to one the kernels take)
# --------------------------------------------------------------------------------------------------------------------
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _no_weight_grads(*weights: torch.Tensor) -> bool:
    return not (torch.is_grad_enabled() and any(w.requires_grad for w in weights))


def norm_rope_applies(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """x [B, S, H, D] with D a power of two, a weight [D], fp32 tables [B or 1, S, D/2] of one shape."""
    return norm_rope_shape_applies(tuple(x.shape), x.dtype, weight, cos, sin)


def norm_rope_shape_applies(shape: tuple, dtype: torch.dtype, weight: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor) -> bool:
    """`norm_rope_applies` for an x of `shape` and `dtype` (one not made yet: an int8 product's output)."""
    if len(shape) != 4 or dtype not in _DTYPES or cos.dim() != 3 or cos.shape != sin.shape:
        return False
    bsz, seq, _, dim = shape
    if dim < 2 or dim & (dim - 1) or weight.shape != (dim,):
        return False
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.shape[0] not in (1, bsz):
        return False
    return cos.shape[1:] == (seq, dim // 2) and _no_weight_grads(weight, cos, sin)


def norm_modulate_applies(x: torch.Tensor, weight: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> bool:
    """x [B, S, W], a weight [W], shift and scale [B, W] of x's dtype."""
    if x.dim() != 3 or x.dtype not in _DTYPES or weight.shape != (x.shape[-1],):
        return False
    bsz, _, width = x.shape
    if shift.shape != (bsz, width) or scale.shape != (bsz, width) or shift.dtype != x.dtype or scale.dtype != x.dtype:
        return False
    return _no_weight_grads(weight, shift, scale)


def swiglu_applies(u: torch.Tensor) -> bool:
    """u [..., 2F] of a float dtype."""
    return u.dim() >= 1 and u.shape[-1] % 2 == 0 and u.dtype in _DTYPES


# --------------------------------------------------------------------------------------------------------------------
# The kernels' math in torch operators, forward and x's gradient (fp32 inside, the input's dtype out): the default
# implementations. The gradients are written out: an op's implementation runs below autograd.
# --------------------------------------------------------------------------------------------------------------------
def _normed(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x / rms(x) in fp32, and 1 / rms(x)."""
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf * r, r


def _norm_grad(x: torch.Tensor, eps: float, grad_normed: torch.Tensor) -> torch.Tensor:
    """x's gradient from the gradient of x / rms(x) (fp32), in x's dtype."""
    n, r = _normed(x, eps)
    return (r * (grad_normed - n * (grad_normed * n).mean(-1, keepdim=True))).to(x.dtype).contiguous()


def _rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return cos.float()[:, :, None], sin.float()[:, :, None]


def _norm_rope_math(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    eps: float) -> torch.Tensor:
    n = (_normed(x, eps)[0] * weight.float()).unflatten(-1, (-1, 2))
    c, s = _rope_tables(cos, sin)
    y = torch.stack([n[..., 0] * c - n[..., 1] * s, n[..., 0] * s + n[..., 1] * c], dim=-1).flatten(-2)
    return y.to(x.dtype).contiguous()


def _norm_rope_grad(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    eps: float) -> torch.Tensor:
    g = grad.float().unflatten(-1, (-1, 2))
    c, s = _rope_tables(cos, sin)
    g_n = torch.stack([g[..., 0] * c + g[..., 1] * s, g[..., 1] * c - g[..., 0] * s], dim=-1).flatten(-2)
    return _norm_grad(x, eps, g_n * weight.float())


def _norm_modulate_math(x: torch.Tensor, weight: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                        eps: float) -> torch.Tensor:
    y = _normed(x, eps)[0] * weight.float() * (1 + scale.float()[:, None]) + shift.float()[:, None]
    return y.to(x.dtype).contiguous()


def _norm_modulate_grad(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                        eps: float) -> torch.Tensor:
    return _norm_grad(x, eps, grad.float() * weight.float() * (1 + scale.float()[:, None]))


def _swiglu_math(u: torch.Tensor) -> torch.Tensor:
    value, gate = u.float().chunk(2, dim=-1)
    return (F.silu(gate) * value).to(u.dtype).contiguous()


def _swiglu_grad(grad: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    value, gate = u.float().chunk(2, dim=-1)
    g, sig = grad.float(), torch.sigmoid(gate)
    d_gate = g * value * sig * (1 + gate * (1 - sig))
    return torch.cat([g * gate * sig, d_gate], dim=-1).to(u.dtype).contiguous()


# --------------------------------------------------------------------------------------------------------------------
# The ops
# --------------------------------------------------------------------------------------------------------------------
_LIB = torch.library.Library("moss_image", "FRAGMENT")  # kept for the life of the process (it owns the registrations)


def _define(name: str, schema: str, default: Any, cuda: Any, fake: Any) -> Any:
    _LIB.define(f"{name}{schema}")
    _LIB.impl(name, default, "CompositeExplicitAutograd")
    _LIB.impl(name, cuda, "CUDA")
    torch.library.register_fake(f"moss_image::{name}", lib=_LIB)(fake)
    return getattr(torch.ops.moss_image, name).default


def _kernels_for(x: torch.Tensor) -> Any:
    """The kernel module where the kernels run for x (checked on its device), else None (the torch math runs)."""
    return fused_ops.kernel_module() if fused_ops.prepare(x.device) else None


def _rope_layout(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x and the tables in layouts the kernels take (unit last stride, one layout for both tables)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    return x, cos, sin


def _rows(t: torch.Tensor, kernels: Any) -> torch.Tensor:
    """t with evenly spaced rows of unit column stride (itself where it has them)."""
    return t if t.stride(-1) == 1 and kernels.row_stride(t) is not None else t.contiguous()


def _norm_rope_cuda(x, weight, cos, sin, eps):
    kernels = _kernels_for(x)
    if kernels is None:
        return _norm_rope_math(x, weight, cos, sin, eps)
    x, cos, sin = _rope_layout(x, cos, sin)
    return kernels.norm_rope_forward(x, weight.contiguous(), cos, sin, eps)


def _norm_rope_backward_cuda(grad, x, weight, cos, sin, eps):
    kernels = _kernels_for(x)
    if kernels is None:
        return _norm_rope_grad(grad, x, weight, cos, sin, eps)
    x, cos, sin = _rope_layout(x, cos, sin)
    return kernels.norm_rope_backward(grad, x, weight.contiguous(), cos, sin, eps)


NORM_ROPE = _define(
    "fused_norm_rope", "(Tensor x, Tensor weight, Tensor cos, Tensor sin, float eps) -> Tensor",
    _norm_rope_math, _norm_rope_cuda,
    lambda x, weight, cos, sin, eps: x.new_empty(x.shape))
NORM_ROPE_BACKWARD = _define(
    "fused_norm_rope_backward", "(Tensor grad, Tensor x, Tensor weight, Tensor cos, Tensor sin, float eps) -> Tensor",
    _norm_rope_grad, _norm_rope_backward_cuda, lambda grad, x, weight, cos, sin, eps: x.new_empty(x.shape))


def _norm_modulate_cuda(x, weight, shift, scale, eps):
    kernels = _kernels_for(x)
    if kernels is None:
        return _norm_modulate_math(x, weight, shift, scale, eps)
    if shift.stride() != scale.stride() or scale.stride(-1) != 1:
        shift, scale = shift.contiguous(), scale.contiguous()
    return kernels.norm_modulate_forward(_rows(x, kernels), weight.contiguous(), shift, scale, eps)


def _norm_modulate_backward_cuda(grad, x, weight, scale, eps):
    kernels = _kernels_for(x)
    if kernels is None:
        return _norm_modulate_grad(grad, x, weight, scale, eps)
    return kernels.norm_modulate_backward(grad, _rows(x, kernels), weight.contiguous(), _rows(scale, kernels), eps)


NORM_MODULATE = _define(
    "fused_norm_modulate", "(Tensor x, Tensor weight, Tensor shift, Tensor scale, float eps) -> Tensor",
    _norm_modulate_math, _norm_modulate_cuda, lambda x, weight, shift, scale, eps: x.new_empty(x.shape))
NORM_MODULATE_BACKWARD = _define(
    "fused_norm_modulate_backward", "(Tensor grad, Tensor x, Tensor weight, Tensor scale, float eps) -> Tensor",
    _norm_modulate_grad, _norm_modulate_backward_cuda, lambda grad, x, weight, scale, eps: x.new_empty(x.shape))


def _swiglu_cuda(u):
    kernels = _kernels_for(u)
    if kernels is None:
        return _swiglu_math(u)
    return kernels.swiglu_forward(_rows(u, kernels))


def _swiglu_backward_cuda(grad, u):
    kernels = _kernels_for(u)
    if kernels is None:
        return _swiglu_grad(grad, u)
    return kernels.swiglu_backward(grad, _rows(u, kernels))


SWIGLU = _define("fused_swiglu", "(Tensor u) -> Tensor", _swiglu_math, _swiglu_cuda,
                 lambda u: u.new_empty((*u.shape[:-1], u.shape[-1] // 2)))
SWIGLU_BACKWARD = _define("fused_swiglu_backward", "(Tensor grad, Tensor u) -> Tensor",
                          _swiglu_grad, _swiglu_backward_cuda,
                          lambda grad, u: u.new_empty(u.shape))


def _quantized_rows(y: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``convrot_int8_quantize`` of y's rows [M, F] (the op itself: its implementation for y's device)."""
    return QUANTIZE(y.reshape(-1, y.shape[-1]), group_size)


def _swiglu_quant_math(u, group_size):
    y = _swiglu_math(u)
    return (y, *_quantized_rows(y, group_size))


# (kernels on, producer, device, dtype, width, group) -> whether the kernel runs
_CODES_KERNEL_RUNS: dict[tuple, bool] = {}


def _codes_kernel_runs(name: str, t: torch.Tensor, width: int, group_size: int) -> bool:
    """Whether an op of producer `name` ("norm_modulate", "swiglu") launches the kernel that writes codes for t, rows
    of `width` (decided once per device, dtype, width and group: the ops run once per block and pass of a compiled
    step, so their host time counts)."""
    key = (fused_ops.kernels_enabled(), name, t.device, t.dtype, width, group_size)
    runs = _CODES_KERNEL_RUNS.get(key)
    if runs is None:
        kernels = _kernels_for(t)
        runs = (kernels is not None and t.dtype in (torch.bfloat16, torch.float16)
                and fused_ops.prepare_fused_quant(t.device)
                and kernels.fused_quant_plan(width, group_size) is not None)
        _CODES_KERNEL_RUNS[key] = runs
    return runs


def _swiglu_quant_cuda(u, group_size):
    if _codes_kernel_runs("swiglu", u, u.shape[-1] // 2, group_size):
        kernels = fused_ops.kernel_module()
        return kernels.swiglu_quant_forward(_rows(u, kernels), group_size, one_buffer=False)
    y = _swiglu_cuda(u)
    return (y, *_quantized_rows(y, group_size))


def _swiglu_quant_fake(u, group_size):
    y = u.new_empty((*u.shape[:-1], u.shape[-1] // 2))
    rows = y.numel() // max(1, y.shape[-1])
    return (y, u.new_empty((rows, y.shape[-1]), dtype=torch.int8), u.new_empty((rows,), dtype=torch.float32))


SWIGLU_QUANT = _define("fused_swiglu_quant", "(Tensor u, int group_size) -> (Tensor, Tensor, Tensor)",
                       _swiglu_quant_math, _swiglu_quant_cuda, _swiglu_quant_fake)


# The codes-only producers of compiled inference blocks (no autograd: `codes_inference_applies` puts them only in
# graphs traced without gradients): the codes and scales of the producer's output rows, where the int8 Linears that
# read it read nothing else, so the output itself is never written. The CUDA implementations launch the kernels that
# write codes without their output (`write_y=False`) where those kernels run (`_codes_kernel_runs`), else the
# producer op and the quantiser.
def _codes_fake(rows_of: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = rows_of.numel() // max(1, rows_of.shape[-1])
    return (rows_of.new_empty((rows, width), dtype=torch.int8), rows_of.new_empty((rows,), dtype=torch.float32))


def _norm_modulate_codes_math(x, weight, shift, scale, eps, group_size):
    return _quantized_rows(_norm_modulate_math(x, weight, shift, scale, eps), group_size)


def _norm_modulate_codes_cuda(x, weight, shift, scale, eps, group_size):
    if x.dim() == 3 and _codes_kernel_runs("norm_modulate", x, x.shape[-1], group_size):
        kernels = fused_ops.kernel_module()
        if shift.stride() != scale.stride() or scale.stride(-1) != 1:
            shift, scale = shift.contiguous(), scale.contiguous()
        _, q, s = kernels.norm_modulate_quant_forward(_rows(x, kernels), weight.contiguous(), shift, scale, eps,
                                                      group_size, one_buffer=False, write_y=False)
        return q, s
    return _quantized_rows(_norm_modulate_cuda(x, weight, shift, scale, eps), group_size)


NORM_MODULATE_CODES = _define(
    "fused_norm_modulate_codes",
    "(Tensor x, Tensor weight, Tensor shift, Tensor scale, float eps, int group_size) -> (Tensor, Tensor)",
    _norm_modulate_codes_math, _norm_modulate_codes_cuda,
    lambda x, weight, shift, scale, eps, group_size: _codes_fake(x, x.shape[-1]))


def _residual_norm_modulate_codes_math(x, gate, y, weight, shift, scale, eps, group_size):
    h = x + gate[:, None] * y  # as the plain block's gated residual (`dit.gated_residual`)
    return (h, *_quantized_rows(_norm_modulate_math(h, weight, shift, scale, eps), group_size))


def _residual_norm_modulate_codes_cuda(x, gate, y, weight, shift, scale, eps, group_size):
    if x.dim() == 3 and _codes_kernel_runs("norm_modulate", x, x.shape[-1], group_size):
        kernels = fused_ops.kernel_module()
        if not (gate.stride() == shift.stride() == scale.stride() and scale.stride(-1) == 1):
            gate, shift, scale = gate.contiguous(), shift.contiguous(), scale.contiguous()
        h, _, q, s = kernels.residual_norm_modulate_quant_forward(_rows(x, kernels), gate, _rows(y, kernels),
                                                                  weight.contiguous(), shift, scale, eps, group_size)
        return h, q, s
    h = x + gate[:, None] * y
    return (h, *_norm_modulate_codes_cuda(h, weight, shift, scale, eps, group_size))


RESIDUAL_NORM_MODULATE_CODES = _define(
    "fused_residual_norm_modulate_codes",
    "(Tensor x, Tensor gate, Tensor y, Tensor weight, Tensor shift, Tensor scale, float eps, int group_size)"
    " -> (Tensor, Tensor, Tensor)",
    _residual_norm_modulate_codes_math, _residual_norm_modulate_codes_cuda,
    lambda x, gate, y, weight, shift, scale, eps, group_size: (x.new_empty(x.shape), *_codes_fake(x, x.shape[-1])))


def _swiglu_codes_math(u, group_size):
    return _quantized_rows(_swiglu_math(u), group_size)


def _swiglu_codes_cuda(u, group_size):
    if _codes_kernel_runs("swiglu", u, u.shape[-1] // 2, group_size):
        kernels = fused_ops.kernel_module()
        _, q, s = kernels.swiglu_quant_forward(_rows(u, kernels), group_size, one_buffer=False, write_y=False)
        return q, s
    return _quantized_rows(_swiglu_cuda(u), group_size)


SWIGLU_CODES = _define("fused_swiglu_codes", "(Tensor u, int group_size) -> (Tensor, Tensor)",
                       _swiglu_codes_math, _swiglu_codes_cuda,
                       lambda u, group_size: _codes_fake(u, u.shape[-1] // 2))


# The int8 products of compiled inference blocks with the element-wise step that follows them (no autograd, like the
# codes-only producers): `o` and `ffn_down` with the gated residual, `q` and `k` with their head norm and RoPE. The
# CUDA implementations run `library.quant.int8_epilogue_kernels` where it takes the operands, else the product and the
# step's torch math; the default ones the product ("eager" backend) and the step as the plain block writes it.
def _product(x_q, x_scale, weight, weight_scale, dtype, backend):
    return convrot_kernels.int8_gemm(x_q, x_scale, weight, weight_scale, None, dtype, backend)


def _gated_residual_product(x_q, x_scale, weight, weight_scale, residual, gate, backend="eager"):
    y = _product(x_q, x_scale, weight, weight_scale, residual.dtype, backend).view(residual.shape)
    return residual + gate[:, None] * y


def _gated_residual_product_cuda(x_q, x_scale, weight, weight_scale, residual, gate):
    from library.quant import int8_epilogue_kernels as epilogue

    if epilogue.epilogue_gemm_usable(x_q, weight, residual.dtype):
        return epilogue.gemm_gated_residual(x_q, x_scale, weight, weight_scale, residual, gate)
    return _gated_residual_product(x_q, x_scale, weight, weight_scale, residual, gate, "auto")


LINEAR_GATED_RESIDUAL = _define(
    "convrot_int8_linear_gated_residual",
    "(Tensor x_q, Tensor x_scale, Tensor weight, Tensor weight_scale, Tensor residual, Tensor gate) -> Tensor",
    _gated_residual_product, _gated_residual_product_cuda,
    lambda x_q, x_scale, weight, weight_scale, residual, gate: residual.new_empty(residual.shape))


def _heads(y: torch.Tensor, seq: int, head_dim: int) -> torch.Tensor:
    return y.view(y.shape[0] // seq, seq, y.shape[1] // head_dim, head_dim)


def _norm_rope_product(x_q, x_scale, weight, weight_scale, norm_weight, cos, sin, eps, seq, dtype, backend="eager"):
    y = _heads(_product(x_q, x_scale, weight, weight_scale, dtype, backend), seq, norm_weight.shape[0])
    return _norm_rope_math(y, norm_weight, cos, sin, eps)


def _norm_rope_product_cuda(x_q, x_scale, weight, weight_scale, norm_weight, cos, sin, eps, seq, dtype):
    from library.quant import int8_epilogue_kernels as epilogue

    head_dim = norm_weight.shape[0]
    if (epilogue.epilogue_gemm_usable(x_q, weight, dtype, head_dim) and cos.stride() == sin.stride()
            and cos.stride(-1) == 1):
        return _heads(epilogue.gemm_norm_rope(x_q, x_scale, weight, weight_scale, norm_weight, cos, sin, eps, seq,
                                              dtype), seq, head_dim)
    y = _heads(_product(x_q, x_scale, weight, weight_scale, dtype, "auto"), seq, head_dim)
    return _norm_rope_cuda(y, norm_weight, cos, sin, eps)


LINEAR_NORM_ROPE = _define(
    "convrot_int8_linear_norm_rope",
    "(Tensor x_q, Tensor x_scale, Tensor weight, Tensor weight_scale, Tensor norm_weight, Tensor cos, Tensor sin,"
    " float eps, SymInt seq, ScalarType dtype) -> Tensor",
    _norm_rope_product, _norm_rope_product_cuda,
    lambda x_q, x_scale, weight, weight_scale, norm_weight, cos, sin, eps, seq, dtype: x_q.new_empty(
        (x_q.shape[0] // seq, seq, weight.shape[0] // norm_weight.shape[0], norm_weight.shape[0]), dtype=dtype))


# --------------------------------------------------------------------------------------------------------------------
# The inductor pass: a producer op and the quantisation of its output rows as one op
# --------------------------------------------------------------------------------------------------------------------
_PRODUCERS_WITH_CODES = {SWIGLU: SWIGLU_QUANT}  # producer op -> the op that also gives its output's codes


def _rows_of(view: torch.fx.Node, producer: torch.fx.Node) -> bool:
    """Whether `view` (QUANTIZE's input, reached from `producer` through view ops) is the producer's output as its
    rows [M, F]: the same last dim and element count (a row-major flattening, the only one view ops give here)."""
    out, rows = producer.meta.get("val"), view.meta.get("val")
    if not isinstance(out, torch.Tensor) or not isinstance(rows, torch.Tensor) or rows.dim() != 2:
        return False
    return out.is_contiguous() and rows.shape[-1] == out.shape[-1] and rows.numel() == out.numel()


def fuse_quantize_into_producers(graph: torch.fx.Graph) -> int:
    """In a functional (post-grad) graph, put ``fused_swiglu_quant`` in place of ``fused_swiglu`` and the
    ``convrot_int8_quantize`` of its output rows (the producer's other users take the fused op's first output, the
    quantisation's users its codes and scales). Returns the number of pairs fused."""
    fused = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not QUANTIZE or node.kwargs:
            continue
        producer, _chain = input_key(node.args[0])
        target = _PRODUCERS_WITH_CODES.get(getattr(producer, "target", None))
        if target is None or producer.kwargs or not _rows_of(node.args[0], producer):
            continue
        if not all(u.op == "call_function" and u.target is operator.getitem for u in node.users):
            continue
        with graph.inserting_after(producer):
            both = graph.call_function(target, (*producer.args, node.args[1]))
        with graph.inserting_after(both):
            out = graph.call_function(operator.getitem, (both, 0))
        both.meta["val"] = (producer.meta["val"], *node.meta["val"])
        out.meta["val"] = producer.meta["val"]
        producer.replace_all_uses_with(out)
        graph.erase_node(producer)
        for user in list(node.users):
            with graph.inserting_after(out):
                codes = graph.call_function(operator.getitem, (both, user.args[1] + 1))
            codes.meta.update(user.meta)
            user.replace_all_uses_with(codes)
            graph.erase_node(user)
        source = node.args[0]
        graph.erase_node(node)
        while isinstance(source, torch.fx.Node) and source.target in VIEW_OPS and not source.users:
            parent = source.args[0]
            graph.erase_node(source)
            source = parent
        fused += 1
    return fused


def compiled_codes_on() -> bool:
    """Whether compiled ConvRot INT8 blocks may call the kernels that write codes (the inductor pass of
    `producer_codes_on`, or the codes-only producers of inference blocks): what decides that `MossImage` has those
    kernels checked before its blocks run, also under inference_mode."""
    return (_SETTINGS["swiglu_codes"] or _SETTINGS["inference_codes"]) and fused_ops.fused_quant_enabled()


def producer_codes_on() -> bool:
    """Whether compiled INT8 blocks get SwiGLU's codes (`set_compiled_kernels(swiglu_codes=...)`, on by default, and
    `fused_ops.set_fused_quant`)."""
    return _SETTINGS["swiglu_codes"] and fused_ops.fused_quant_enabled()


@functools.cache
def _producer_pass_type() -> type:
    """The inductor pass class, made at the first compile (torch._inductor is loaded only when something compiles)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class _ProducerCodesPass(CustomGraphPass):
        """The pass configured before (the quantisations' dedupe, `library.quant.convrot_ops`), then
        `fuse_quantize_into_producers` where it is on (`set_compiled_kernels(swiglu_codes=...)`) and so are the
        kernels that write codes (`fused_ops.set_fused_quant`)."""

        def __init__(self, then: Any = None):
            self.then = then

        def __call__(self, graph: torch.fx.Graph) -> None:
            if self.then is not None:
                self.then(graph)
            if producer_codes_on():
                fuse_quantize_into_producers(graph)

        def uuid(self) -> Any:
            then = self.then.uuid() if isinstance(self.then, CustomGraphPass) else self.then
            return ("moss_image producer codes", 2, producer_codes_on(), then)

    return _ProducerCodesPass


def enable_inductor_producer_codes() -> None:
    """Install `fuse_quantize_into_producers` as inductor's ``post_grad_custom_pre_pass``, after the pass configured
    before it (idempotent). It touches only ``fused_swiglu`` nodes whose output rows are quantised."""
    import torch._inductor.config as inductor_config  # heavy: only a compile needs it

    pass_type = _producer_pass_type()
    current = inductor_config.post_grad_custom_pre_pass
    if not isinstance(current, pass_type):
        inductor_config.post_grad_custom_pre_pass = pass_type(current)


# --------------------------------------------------------------------------------------------------------------------
# Autograd (traced by torch.compile into the joint graph): x's gradient only, as the eager kernels' nodes
# --------------------------------------------------------------------------------------------------------------------
class _OpNormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, cos, sin, eps):  # type: ignore[override]
        ctx.save_for_backward(x, weight, cos, sin)
        ctx.eps = eps
        return NORM_ROPE(x, weight, cos, sin, eps)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, weight, cos, sin = ctx.saved_tensors
        return NORM_ROPE_BACKWARD(grad, x, weight, cos, sin, ctx.eps), None, None, None, None


class _OpNormModulate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, shift, scale, eps):  # type: ignore[override]
        ctx.save_for_backward(x, weight, scale)
        ctx.eps = eps
        return NORM_MODULATE(x, weight, shift, scale, eps)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, weight, scale = ctx.saved_tensors
        return NORM_MODULATE_BACKWARD(grad, x, weight, scale, ctx.eps), None, None, None, None


class _OpSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u):  # type: ignore[override]
        ctx.save_for_backward(u)
        return SWIGLU(u)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (u,) = ctx.saved_tensors
        return SWIGLU_BACKWARD(grad, u)


def op_norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """`fused_ops.fused_norm_rope` as an op (for a block being compiled; the same conditions of use)."""
    return _OpNormRope.apply(x, weight, cos, sin, eps)


def op_norm_modulate(x: torch.Tensor, weight: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                     eps: float) -> torch.Tensor:
    """`fused_ops.fused_norm_modulate` as an op (for a block being compiled; the same conditions of use)."""
    return _OpNormModulate.apply(x, weight, shift, scale, eps)


def op_swiglu(u: torch.Tensor) -> torch.Tensor:
    """`fused_ops.fused_swiglu` as an op (for a block being compiled; the same conditions of use)."""
    return _OpSwiGLU.apply(u)


def op_norm_modulate_codes(x: torch.Tensor, weight: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                           eps: float, group_size: int) -> QuantizedRows:
    """The codes of `op_norm_modulate`'s output rows, for int8 Linears of `group_size` that read nothing else (where
    `codes_inference_applies` and `norm_modulate_applies` say so)."""
    q, s = NORM_MODULATE_CODES(x, weight, shift, scale, eps, group_size)
    return QuantizedRows(q, s, tuple(x.shape[:-1]), x.dtype)


def op_residual_norm_modulate_codes(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                                   shift: torch.Tensor, scale: torch.Tensor, eps: float, group_size: int
                                   ) -> tuple[torch.Tensor, QuantizedRows]:
    """h = x + gate[:, None] * y (the attention branch's gated residual) and the codes of `op_norm_modulate`'s
    output rows for h, in one pass over h (where `residual_codes_inference_applies` says so)."""
    h, q, s = RESIDUAL_NORM_MODULATE_CODES(x, gate, y, weight, shift, scale, eps, group_size)
    return h, QuantizedRows(q, s, tuple(x.shape[:-1]), x.dtype)


def op_swiglu_codes(u: torch.Tensor, group_size: int) -> QuantizedRows:
    """The codes of `op_swiglu`'s output rows, for an int8 Linear of `group_size` that reads nothing else (where
    `codes_inference_applies` and `swiglu_applies` say so)."""
    q, s = SWIGLU_CODES(u, group_size)
    return QuantizedRows(q, s, tuple(u.shape[:-1]), u.dtype)


def op_linear_gated_residual(linear: torch.nn.Module, rows: QuantizedRows, residual: torch.Tensor,
                             gate: torch.Tensor) -> torch.Tensor:
    """residual + gate[:, None] * linear(rows) for a ConvRot INT8 Linear without bias given its input as codes (a
    block compiled without gradients; see `library.moss_image.dit.gated_project`)."""
    return LINEAR_GATED_RESIDUAL(rows.codes, rows.scales, linear.weight, linear.weight_scale, residual, gate)


def op_linear_norm_rope(linear: torch.nn.Module, rows: QuantizedRows, norm_weight: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, eps: float) -> torch.Tensor:
    """apply_rope(rms_norm(linear(rows) per head), cos, sin) as [B, S, heads, head_dim] for a ConvRot INT8 Linear
    without bias given its input as codes (see `library.moss_image.dit.MossImageBlock._attention`)."""
    seq = rows.lead_shape[1]
    return LINEAR_NORM_ROPE(rows.codes, rows.scales, linear.weight, linear.weight_scale, norm_weight, cos, sin, eps,
                            seq, rows.dtype)


def quantized_rows(x: torch.Tensor, group_size: int) -> QuantizedRows:
    """x [..., K] as the codes and scales of its rows (``convrot_int8_quantize``)."""
    q, s = _quantized_rows(x, group_size)
    return QuantizedRows(q, s, tuple(x.shape[:-1]), x.dtype)


def quantized_segments(xs: list[torch.Tensor], group_size: int) -> QuantizedRows:
    """torch.cat(xs, dim=1) ([B, S_i, K] each, B = 1) as the codes and scales of its rows, without the
    concatenation: each input's codes are written in place in the stacked buffer
    (``convrot_int8_quantize_segments``; packed sequences' attention outputs)."""
    q, s = QUANTIZE_SEGMENTS([x.reshape(-1, x.shape[-1]) for x in xs], group_size)
    lead = (xs[0].shape[0], sum(x.shape[1] for x in xs))
    return QuantizedRows(q, s, lead, xs[0].dtype)
