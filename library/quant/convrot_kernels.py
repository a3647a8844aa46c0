"""ConvRot INT8 kernels: regular-Hadamard block rotation, row-wise int8 quantisation and the int8 linear.

The format and the numerics follow comfy-kitchen's eager backend, so that weights quantised here and the ComfyUI
``int8_tensorwise`` + ``convrot`` files are interchangeable:

- rotation: ``H_g`` is the Kronecker power of the 4x4 *regular* Hadamard matrix (``-1`` where ``a + b == 3``),
  divided by ``sqrt(g)``; ``g`` must be a power of 4. It is symmetric and orthogonal. Weights are rotated per
  block of ``g`` input features (``W_rot = W @ H^T`` blockwise), activations the same way (``x_rot = x @ H``), so
  ``x_rot @ W_rot^T == x @ W^T``;
- row-wise symmetric int8: ``s = max(fp32(amax) / 127, 1e-30)`` (fp32, stored), the quotient ``x / T(s)`` in the
  tensor's dtype ``T``, round half to even, clamp to ``[-128, 127]``;
- int8 linear: dynamic per-token quantisation of the rotated activation, an exact int32 GEMM, then
  ``T_out(fp32(acc) * (s_x * s_w))`` and ``+ bias`` in ``T_out``.

Two weight recipes exist (``WEIGHT_RECIPES``): ``"fp32"`` (default) rotates and quantises in fp32, which is what the
published ComfyUI / Musubi Tuner files were made with and is also the more accurate of the two; ``"eager"`` rotates
and divides in the weight's own dtype, exactly like comfy-kitchen's ``quantize_int8_convrot_weight`` on a bf16/fp16
tensor.

The linear is split in two steps, `quantize_activation` (rotate + quantise the rows of x) and `int8_gemm` (int32 GEMM
+ dequantisation epilogue), so that the q, k and v projections of one input share one quantised activation (the
`_ActivationCache` in eager mode; common-subexpression elimination of the registered op in a compiled graph, see
`library.quant.convrot_ops`).

On CUDA with a usable Triton (``HAS_TRITON``) each step is one kernel: a quantiser that rotates the activation rows
(a radix-4 fast Hadamard transform in fp32, rounded once to the activation dtype), takes each row's absmax and writes
int8 codes + fp32 scales (`library.quant.convrot_quant_kernels`), and an autotuned int8 GEMM (int32 accumulation) that
reads the weight ``[N, K]`` in place through its strides and applies the dequantisation/bias epilogue. Everywhere
else an eager path with the same numerics runs (``torch._int_mm`` on CUDA, an exact fp32/fp64 product on the CPU).

The forward GEMM's autotuner keeps its choices on disk in Triton's cache (``cache_results=True`` where the installed
Triton has it; not the TMA and upcast tuners, whose configurations or keys Triton cannot store), so a process on a
machine that already tuned a shape picks its configuration without benchmarking (and without the benchmark's 256 MiB
L2-flush buffer) in its first training step.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import os
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from library.quant import convrot_quant_kernels as _qk
from library.quant.convrot_quant_kernels import (  # noqa: F401 - QUANTISERS, set_*, _rows_launch: re-exported
    _QUANT_PLANS,
    _TUNING,
    QUANTISERS,
    _next_pow2,
    _quantize_rows_triton,
    _rows_launch,
    _scale_rotate_triton,
    set_quantiser,
    set_row_tuning,
)
from library.quant.convrot_quant_kernels import log4 as _log4
from library.quant.triton_launch import DirectLauncher

logger = logging.getLogger(__name__)

WEIGHT_RECIPES: tuple[str, ...] = ("fp32", "eager")
DEFAULT_WEIGHT_RECIPE = "fp32"
BACKWARD_MODES: tuple[str, ...] = ("bf16", "int8")
# how the "bf16" backward runs on CUDA (`set_backward_kernel`)
BACKWARD_KERNELS: tuple[str, ...] = ("dequant", "upcast")
DEFAULT_GROUP_SIZE = 256
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

try:  # triton is optional: without it (or without a suitable GPU) everything runs eagerly.
    import triton
    import triton.language as tl

    _TRITON_IMPORTED = True
except Exception:  # noqa: BLE001 - any import failure (missing package, broken install) means "no triton"
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    _TRITON_IMPORTED = False


def _triton_usable() -> bool:
    if not _TRITON_IMPORTED:
        return False
    if _INTERPRET:
        return True
    try:
        return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
    except Exception:  # noqa: BLE001 - a broken driver means no usable GPU
        return False


HAS_TRITON: bool = _triton_usable()


# --------------------------------------------------------------------------------------------------------------------
# Hadamard rotation
# --------------------------------------------------------------------------------------------------------------------
_H4 = ((1.0, 1.0, 1.0, -1.0), (1.0, 1.0, -1.0, 1.0), (1.0, -1.0, 1.0, 1.0), (-1.0, 1.0, 1.0, 1.0))
# (group size, device as given, dtype, transposed) -> H_g; the rotations look their matrix up once per call
_HADAMARD_CACHE: dict[tuple[int, Any, torch.dtype, bool], torch.Tensor] = {}


def is_valid_group_size(group_size: int) -> bool:
    """True for the ConvRot group sizes: powers of 4 (4, 16, 64, 256, 1024, ...)."""
    g = int(group_size)
    return g >= 4 and g & (g - 1) == 0 and (g.bit_length() - 1) % 2 == 0


def check_group_size(group_size: int, in_features: int | None = None) -> None:
    """Raise ValueError unless `group_size` is a power of 4 that divides `in_features` (when given)."""
    if not is_valid_group_size(group_size):
        raise ValueError(
            f"ConvRot group size must be a power of 4 (4, 16, 64, 256, 1024, ...) for the regular Hadamard matrix,"
            f" got {group_size}"
        )
    if in_features is not None and in_features % group_size != 0:
        raise ValueError(f"ConvRot group size {group_size} does not divide the input features {in_features}")


def _hadamard_cached(
    group_size: int, device: torch.device | str | None, dtype: torch.dtype, transposed: bool = False
) -> torch.Tensor:
    key = (group_size, device, dtype, transposed)
    h = _HADAMARD_CACHE.get(key)
    if h is None:
        check_group_size(group_size)
        h4 = torch.tensor(_H4, dtype=torch.float64)
        h = h4
        while h.shape[0] < group_size:
            h = torch.kron(h, h4)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        h = (h / math.sqrt(group_size)).to(device=dev, dtype=torch.float32)
        # the weight rotation multiplies with the transposed view of the fp32 matrix cast to its dtype (the layout
        # decides the BLAS kernel, hence the fp32 sums' rounding, so it is kept as it was first written)
        h = h.t().to(dtype) if transposed else h.to(dtype)
        _HADAMARD_CACHE[key] = h
    return h


def hadamard(
    group_size: int, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The normalised regular Hadamard matrix H_g (symmetric, orthogonal, entries +-1/sqrt(g)); cached."""
    return _hadamard_cached(int(group_size), device, dtype)


_MATMUL_FLAGS = ("allow_tf32", "allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")


@contextlib.contextmanager
def _full_precision_cuda_matmul() -> Iterator[None]:
    """Run the rotation matmuls without TF32 and without reduced-precision reductions (a trainer may have enabled
    TF32 globally; that would change the quantised codes), restoring the flags afterwards."""
    m = torch.backends.cuda.matmul
    saved = {f: getattr(m, f) for f in _MATMUL_FLAGS if hasattr(m, f)}
    try:
        for f in saved:
            setattr(m, f, False)
        yield
    finally:
        for f, v in saved.items():
            setattr(m, f, v)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.mm in the operands' own dtype: an enclosing autocast would round the exact int8 sums and the fp32
    rotations to bf16 (the int8 Linear runs inside the caller's autocast region in eager mode)."""
    device = a.device.type
    if torch.is_autocast_enabled(device):
        with torch.autocast(device, enabled=False):
            return torch.mm(a, b)
    return torch.mm(a, b)


def _grouped_matmul(x: torch.Tensor, h: torch.Tensor, group_size: int) -> torch.Tensor:
    """Blockwise x [..., K] @ h along the last axis: one [numel / g, g] @ [g, g] product."""
    grouped = x.reshape(-1, group_size)
    if x.is_cuda:
        with _full_precision_cuda_matmul():
            return _mm(grouped, h).view(x.shape)
    return _mm(grouped, h).view(x.shape)


def rotate_weight(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """Blockwise ``W @ H^T`` along the last axis, one matmul in weight.dtype (fp32 accumulation, one rounding)."""
    check_group_size(group_size, weight.shape[-1])
    return _grouped_matmul(weight, _hadamard_cached(group_size, weight.device, weight.dtype, True), group_size)


def rotate_activation(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Blockwise ``x @ H`` along the last axis, in x.dtype."""
    check_group_size(group_size, x.shape[-1])
    return _grouped_matmul(x, _hadamard_cached(group_size, x.device, x.dtype), group_size)


# --------------------------------------------------------------------------------------------------------------------
# Row-wise int8 quantisation (eager, the reference numerics)
# --------------------------------------------------------------------------------------------------------------------
def quantize_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of the last axis: returns (q int8 like x, scale fp32 [..., 1]).

    ``s = max(fp32(amax) / 127, 1e-30)``; ``q = clamp(rne(T(x / T(s))), -128, 127)`` with T = x.dtype. A T(s) that
    underflows to zero (only possible in fp16) is replaced by T's smallest normal number.
    """
    dtype = x.dtype
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"quantize_rowwise expects a float32/float16/bfloat16 tensor, got {dtype}")
    scale = x.abs().amax(dim=-1, keepdim=True).to(torch.float32).div_(127.0).clamp_min_(1e-30)
    if dtype == torch.float32:
        s_t = scale
    else:
        s_t = scale.to(dtype)
        if dtype == torch.float16:  # bf16 keeps fp32's exponent range: 1e-30 never rounds to zero there
            s_t = torch.where(s_t == 0, torch.finfo(dtype).tiny, s_t)
    q = (x / s_t).round_().clamp_(-128.0, 127.0).to(torch.int8)
    return q, scale


def quantize_convrot_weight(
    weight: torch.Tensor,
    group_size: int = DEFAULT_GROUP_SIZE,
    recipe: str = DEFAULT_WEIGHT_RECIPE,
    row_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate (when group_size > 0) and quantise a weight [N, K] per output row: (q int8 [N, K], scale fp32 [N, 1]).

    `recipe` "fp32" rotates and quantises in fp32 (the default; matches the published files); "eager" works in
    weight.dtype like comfy-kitchen's eager ``quantize_int8_convrot_weight``. `group_size` 0 means plain row-wise
    int8 without rotation. `row_chunk` bounds the temporary memory (used for the 248k-row token embedding).
    """
    if recipe not in WEIGHT_RECIPES:
        raise ValueError(f"unknown ConvRot weight recipe {recipe!r}; choose one of {WEIGHT_RECIPES}")
    if weight.dim() != 2:
        raise ValueError(f"ConvRot weights must be 2-D [out, in], got shape {tuple(weight.shape)}")
    if weight.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"ConvRot quantisation expects a float weight, got {weight.dtype}")
    rows, cols = weight.shape
    if group_size:
        check_group_size(group_size, cols)
    chunk = rows if not row_chunk or row_chunk >= rows else int(row_chunk)
    q = torch.empty((rows, cols), dtype=torch.int8, device=weight.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=weight.device)
    for start in range(0, rows, max(chunk, 1)):
        part = weight[start : start + chunk]
        if recipe == "fp32":
            part = part.float()
        if group_size:
            part = rotate_weight(part, group_size)
        q[start : start + chunk], scale[start : start + chunk] = quantize_rowwise(part)
    return q, scale


# --------------------------------------------------------------------------------------------------------------------
# Dequantisation
# --------------------------------------------------------------------------------------------------------------------
def scale_vector(weight_scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A per-row scale as fp32 [rows]; accepts [rows, 1], [rows], [1] and [] (a tensor-wise scale is expanded)."""
    s = weight_scale.reshape(-1).to(torch.float32)
    if s.numel() == 1:
        return s.expand(rows).contiguous()
    if s.numel() != rows:
        raise ValueError(f"int8 weight scale must have 1 or {rows} elements, got shape {tuple(weight_scale.shape)}")
    return s.contiguous()


def dequantize_weight(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    group_size: int,
    dtype: torch.dtype = torch.float32,
    backend: str = "auto",
) -> torch.Tensor:
    """fp32(q) * s, rotated back blockwise in fp32 (``@ H^T``), cast to `dtype`: the weight in the original basis."""
    rows = weight.shape[0]
    if group_size and _use_triton(weight, backend):
        return _scale_rotate_triton(weight, scale_vector(weight_scale, rows), group_size, dtype)
    w = weight.float() * scale_vector(weight_scale, rows).to(weight.device).reshape(rows, 1)
    if group_size:
        w = rotate_weight(w, group_size)
    return w.to(dtype)


def dequantize_rows(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    indices: torch.Tensor,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Embedding lookup in an int8 table: gather rows, fp32(q) * s, un-rotate (fp32), cast; [*indices.shape, dim]."""
    rows, dim = weight.shape
    x = torch.nn.functional.embedding(indices, weight).to(torch.float32)
    s = scale_vector(weight_scale, rows).to(weight.device)
    x = x * torch.nn.functional.embedding(indices, s.reshape(rows, 1)).to(torch.float32)
    if group_size:
        x = rotate_weight(x.reshape(-1, dim), group_size).reshape(x.shape)
    return x.to(dtype)


# --------------------------------------------------------------------------------------------------------------------
# Exact int8 GEMM (eager)
# --------------------------------------------------------------------------------------------------------------------
# On the CPU, an fp32 product of int8 codes is exact while every partial sum stays below 2^24, i.e. for K <= 1024
# (|a_i b_i| <= 2^14); also under reduced-precision fp32 matmul settings (bf16/tf32 hold -128..127 exactly and
# accumulate in fp32). Wider K uses fp64 (exact for K < 2^39). Both are far faster than the CPU's torch._int_mm.
_CPU_FP32_MAX_K = 1024
# the fp32 epilogue works in row chunks of at most this many elements
_EPILOGUE_CHUNK = 64 << 20


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _pad2d(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    if t.shape[0] == rows and t.shape[1] == cols:
        return t
    return torch.nn.functional.pad(t, (0, cols - t.shape[1], 0, rows - t.shape[0]))


def _int8_mm_acc(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """Exact ``a @ b_t^T`` for int8 a [M, K] and b_t [N, K]: int32 on CUDA, integer-valued fp32/fp64 on the CPU."""
    m, k = a.shape
    n = b_t.shape[0]
    if m == 0 or n == 0 or k == 0:
        return torch.zeros((m, n), dtype=torch.int32, device=a.device)
    if a.is_cuda:  # torch._int_mm needs M > 16 and K, N multiples of 8: zero padding keeps the sums
        mp, kp, np_ = max(_round_up(m, 32), 32), _round_up(k, 8), _round_up(n, 8)
        return torch._int_mm(_pad2d(a, mp, kp), _pad2d(b_t, np_, kp).t())[:m, :n]
    dt = torch.float32 if k <= _CPU_FP32_MAX_K else torch.float64
    return _mm(a.to(dt), b_t.to(dt).t())


def int8_mm(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """Exact ``a @ b_t^T`` for int8 a [M, K] and b_t [N, K] (any strides), as int32 [M, N]."""
    return _int8_mm_acc(a, b_t).to(torch.int32)


def _epilogue_eager(
    acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """``T_out(fp32(acc) * (row_scale * col_scale))`` (row chunks bound the fp32 temporary)."""
    m, n = acc.shape
    rs = row_scale.reshape(m, 1)
    cs = None if col_scale is None else col_scale.reshape(1, n)
    if m * n <= _EPILOGUE_CHUNK:
        return (acc.to(torch.float32) * (rs if cs is None else rs * cs)).to(out_dtype)
    out = torch.empty((m, n), dtype=out_dtype, device=acc.device)
    chunk = max(1, _EPILOGUE_CHUNK // max(n, 1))
    for i in range(0, m, chunk):
        scale = rs[i : i + chunk] if cs is None else rs[i : i + chunk] * cs
        out[i : i + chunk] = (acc[i : i + chunk].to(torch.float32) * scale).to(out_dtype)
    return out


# --------------------------------------------------------------------------------------------------------------------
# The int8 linear in two steps
# --------------------------------------------------------------------------------------------------------------------
def _use_triton(t: torch.Tensor, backend: str) -> bool:
    if backend == "auto":
        return HAS_TRITON and (t.is_cuda or (_INTERPRET and t.device.type == "cpu"))
    if backend == "eager":
        return False
    if backend != "triton":
        raise ValueError(f"unknown backend {backend!r}; choose 'auto', 'triton' or 'eager'")
    if not (HAS_TRITON and (t.is_cuda or (_INTERPRET and t.device.type == "cpu"))):
        raise RuntimeError(
            "the Triton ConvRot kernels are not usable here (need triton and a CUDA GPU of compute capability >= 8.0);"
            " use backend='eager'"
        )
    return True


def quantize_activation(x2: torch.Tensor, group_size: int, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate (group_size > 0) and quantise the rows of x2 [M, K]: (q int8 [M, K], scale fp32 [M])."""
    if _use_triton(x2, backend):
        return _quantize_rows_triton(x2, group_size)
    if group_size:
        x2 = _grouped_matmul(x2, _hadamard_cached(group_size, x2.device, x2.dtype), group_size)
    q, s = quantize_rowwise(x2)
    return q, s.view(-1)


def int8_gemm(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    backend: str = "auto",
) -> torch.Tensor:
    """``T_out(fp32(x_q @ W^T) * (x_scale[m] * weight_scale[n]))`` then ``+ bias`` in T_out: [M, N].

    x_q int8 [M, K], x_scale fp32 [M], weight int8 [N, K] (any strides), weight_scale fp32 with N contiguous
    elements ([N] or [N, 1]), bias [N] or None."""
    n = weight.shape[0]
    if _use_triton(x_q, backend):
        if bias is not None and (bias.dtype != out_dtype or not bias.is_contiguous()):
            bias = bias.to(out_dtype).contiguous()
        return _int8_gemm_triton(x_q, x_scale, weight, weight.stride(), weight_scale, bias,
                                 out_dtype, n)
    out = _epilogue_eager(_int8_mm_acc(x_q, weight), x_scale, weight_scale, out_dtype)
    if bias is not None:
        out = out.add_(bias.to(out_dtype))
    return out


def _check_linear_args(x: torch.Tensor, weight: torch.Tensor, group_size: int) -> None:
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"ConvRot int8 linear needs a float32/float16/bfloat16 input, got {x.dtype}: activations must never be"
            " cast to the int8 weight's dtype (use the dtype of a norm weight or of the model)"
        )
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise TypeError(f"ConvRot int8 linear needs an int8 weight [N, K], got {weight.dtype} {tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"input features {x.shape[-1]} do not match the weight's {weight.shape[1]}")
    if group_size:
        check_group_size(group_size, weight.shape[1])


def int8_linear_eager(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    group_size: int = DEFAULT_GROUP_SIZE,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Reference int8 linear (comfy-kitchen eager numerics): rotate x in x.dtype, quantise per token, int32 GEMM,
    ``T_out(fp32(acc) * (s_x * s_w))``, then ``+ bias`` in T_out."""
    return int8_linear(x, weight, weight_scale, bias, group_size, out_dtype, backend="eager")


def int8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    group_size: int = DEFAULT_GROUP_SIZE,
    out_dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``y = x @ W^T (+ bias)`` for a frozen int8 ConvRot weight W [N, K] with fp32 per-row scales.

    `backend`: "auto" (Triton on a CUDA input when HAS_TRITON, else eager), "triton" or "eager". Output dtype is
    `out_dtype` or x.dtype. `group_size` 0 means the weight is not rotated (plain row-wise int8).
    """
    _check_linear_args(x, weight, group_size)
    n, k = weight.shape
    q_x, s_x = quantize_activation(x.reshape(-1, k), group_size, backend)
    s_w = scale_vector(weight_scale, n).to(x.device)
    bias = bias.to(x.device) if bias is not None else None
    out = int8_gemm(q_x, s_x, weight.to(x.device), s_w, bias, out_dtype or x.dtype, backend)
    return out.reshape(*x.shape[:-1], n)


def int8_linear_grad_input(
    grad_out: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    group_size: int = DEFAULT_GROUP_SIZE,
    mode: str = "bf16",
    out_dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``grad_x = grad_y @ W`` for the frozen int8 weight (the base's only gradient).

    mode "bf16" (default): W is dequantised transiently in grad_y's dtype and a plain matmul runs (most accurate);
    on CUDA `set_backward_kernel("upcast")` runs it as one GEMM on the int8 codes instead (no dequantised weight).
    mode "int8": grad_y * s_w is quantised per row and multiplied with the int8 codes through the int8 GEMM; the
    fp32 result is rotated back blockwise and cast (faster on int8 hardware, slightly quantised gradients).
    """
    if mode not in BACKWARD_MODES:
        raise ValueError(f"unknown ConvRot backward mode {mode!r}; choose one of {BACKWARD_MODES}")
    out_dtype = out_dtype or grad_out.dtype
    n, k = weight.shape
    g2 = grad_out.reshape(-1, n)
    if mode == "bf16":
        if (_TUNING["backward"] == "upcast" and g2.dtype in (torch.bfloat16, torch.float16) and group_size <= 256
                and _use_triton(g2, backend)):
            s_w = scale_vector(weight_scale, n).to(g2.device)
            return _grad_input_upcast_triton(g2, weight, s_w, group_size, out_dtype).reshape(*grad_out.shape[:-1], k)
        w = dequantize_weight(weight, weight_scale, group_size, dtype=g2.dtype, backend=backend)
        return _mm(g2, w).to(out_dtype).reshape(*grad_out.shape[:-1], k)
    s_w = scale_vector(weight_scale, n).to(g2.device)
    if _use_triton(g2, backend):
        q_g, s_g = _quantize_rows_triton(g2, 0, col_scale=s_w)
        # B[k_red = n, n_out = k] = W[n, k]: the reduction runs over W's rows, read in place.
        acc32 = _int8_gemm_triton(q_g, s_g, weight, (weight.stride(1), weight.stride(0)), None, None, torch.float32, k)
        out = _scale_rotate_triton(acc32, None, group_size, out_dtype) if group_size else acc32.to(out_dtype)
        return out.reshape(*grad_out.shape[:-1], k)
    q_g, s_g = quantize_rowwise(g2.float() * s_w.reshape(1, n))
    out = _epilogue_eager(_int8_mm_acc(q_g, weight.t()), s_g, None, torch.float32)
    if group_size:
        out = rotate_weight(out, group_size)
    return out.to(out_dtype).reshape(*grad_out.shape[:-1], k)


# --------------------------------------------------------------------------------------------------------------------
# The eager hot path of the int8 Linear module, with the activation cache
# --------------------------------------------------------------------------------------------------------------------
class _ActivationCache:
    """The last quantised activation, reused when the very same tensor object (same version, shape, dtype) comes
    again with the same group size on the same path: q, k and v projections read one input, so it is rotated and
    quantised once instead of three times. A weak reference identifies the tensor, so a new tensor that reuses the
    freed memory can never hit; an in-place change bumps the version. Only eager code may use it: a compiled graph
    reuses buffers (and writes them with raw kernels, without a version bump), so the registered ops never do."""

    __slots__ = ("hits", "key", "ref", "value")

    def __init__(self) -> None:
        self.ref: weakref.ref | None = None
        self.key: tuple = ()
        self.value: tuple[torch.Tensor, torch.Tensor] | None = None
        self.hits = 0

    def get(self, x: torch.Tensor, group_size: int, triton: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        ref = self.ref
        if ref is None or ref() is not x:
            return None
        if self.key != (x._version, group_size, triton, x.shape, x.dtype):
            return None
        self.hits += 1
        return self.value

    def put(self, x: torch.Tensor, group_size: int, triton: bool, value: tuple[torch.Tensor, torch.Tensor]) -> None:
        if x.is_inference():  # no version counter: never cached
            return
        self.ref = weakref.ref(x)
        self.key = (x._version, group_size, triton, x.shape, x.dtype)
        self.value = value

    def clear(self) -> None:
        self.ref, self.key, self.value = None, (), None


_ACT_CACHE = _ActivationCache()


def cached_quantized_activation(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_activation` of x [..., K] (as [M, K] rows), through the activation cache (eager code only)."""
    triton = HAS_TRITON and (x.is_cuda or (_INTERPRET and x.device.type == "cpu"))
    hit = _ACT_CACHE.get(x, group_size, triton)
    if hit is not None:
        return hit
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if triton:
        value = _quantize_rows_triton(x2, group_size, one_buffer=True)
    else:
        value = quantize_activation(x2, group_size, "eager")
    _ACT_CACHE.put(x, group_size, triton, value)
    return value


def linear_forward(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, group_size: int
) -> torch.Tensor:
    """The int8 Linear's eager forward: ``int8_linear`` without the argument normalisation, for the module's own
    state (int8 weight [N, K] on x's device, fp32 contiguous scale with N elements, group size already checked).
    The output dtype is x.dtype."""
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"input features {x.shape[-1]} do not match the weight's {k}")
    q_x, s_x = cached_quantized_activation(x, group_size)
    out = int8_gemm(q_x, s_x, weight, weight_scale, bias, x.dtype)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)


# --------------------------------------------------------------------------------------------------------------------
# Triton path
# --------------------------------------------------------------------------------------------------------------------
if _TRITON_IMPORTED:
    _cast_rne = _qk._cast_rne  # the jit helpers the GEMM kernels call
    _fwht_rows = _qk._fwht_rows

    @triton.jit
    def _gemm_epilogue(acc, c_ptr, sa_ptr, sb_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn,
                       HAS_SB: tl.constexpr, HAS_BIAS: tl.constexpr):
        """c = T_out(fp32(acc) * (sa[m] * sb[n])), then T_out(c + bias[n]) (bias already in T_out); masked store."""
        sa = tl.load(sa_ptr + offs_m, mask=offs_m < M, other=0.0)
        if HAS_SB:
            sb = tl.load(sb_ptr + offs_n, mask=offs_n < N, other=0.0)
            c = acc.to(tl.float32) * (sa[:, None] * sb[None, :])
        else:
            c = acc.to(tl.float32) * sa[:, None]
        out = _cast_rne(c, c_ptr.dtype.element_ty)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
            out = _cast_rne(out.to(tl.float32) + bias[None, :], c_ptr.dtype.element_ty)
        c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, out, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))

    @triton.jit
    def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """Grouped ordering of the output tiles (GROUP_M row tiles share their B columns in L2)."""
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        num_pid_in_group = GROUP_M * num_pid_n
        group_id = pid // num_pid_in_group
        first_pid_m = group_id * GROUP_M
        group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
        pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
        pid_n = (pid % num_pid_in_group) // group_size_m
        return pid_m, pid_n

    @triton.jit
    def _int8_gemm_tma_kernel(
        a_desc, b_desc, c_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K, M_BUCKET, stride_cm, stride_cn,
        HAS_SB: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        """The forward GEMM with tensor-memory-accelerator loads (Hopper+): A [M, K] and W [N, K], both K-major,
        out-of-range tiles zero-filled by the copy engine."""
        pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for kk in range(tl.cdiv(K, BLOCK_K)):
            a = a_desc.load([off_m, kk * BLOCK_K])
            b = b_desc.load([off_n, kk * BLOCK_K])
            acc = tl.dot(a, b.T, acc, out_dtype=tl.int32)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        _gemm_epilogue(
            acc, c_ptr, sa_ptr, sb_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, HAS_SB, HAS_BIAS
        )

    @triton.jit
    def _int8_gemm_kernel(
        a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K, M_BUCKET,
        stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
        HAS_SB: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        """C = epilogue(A @ B) with int8 A [M, K], B [K, N] (any strides), int32 accumulation.

        Epilogue: c = T_out(fp32(acc) * (sa[m] * sb[n])), then T_out(c + bias[n]) (bias already in T_out)."""
        pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_am = offs_m % M  # wrap-around rows/columns: loads stay in bounds, the store is masked
        offs_bn = offs_n % N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + offs_am[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_bn[None, :].to(tl.int64) * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for kk in range(tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_left = K - kk * BLOCK_K
                a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0)
                b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0)
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk

        _gemm_epilogue(
            acc, c_ptr, sa_ptr, sb_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, HAS_SB, HAS_BIAS
        )

    # the autotuners' choices persist across processes where this Triton can store them (not under the interpreter)
    _AUTOTUNE_CACHE = (
        {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
    )

    def _autotuned(kernel: Any, configs: list[tuple[int, ...]], key: list[str], disk_cache: bool = False,
                   pre_hook: Any = None) -> Any:
        """`kernel` autotuned over (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps) configurations (GROUP_M 8)."""
        return triton.autotune(
            configs=[triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_stages=st,
                                   num_warps=wp, pre_hook=pre_hook) for bm, bn, bk, st, wp in configs],
            key=key, **(_AUTOTUNE_CACHE if disk_cache else {}),
        )(kernel)

    # (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps). BLOCK_K = 128 keeps 128-byte int8 rows for the K-major operands.
    _GEMM_CONFIGS = [
        (128, 256, 128, 3, 8),
        (128, 256, 128, 4, 8),
        (256, 128, 128, 3, 8),
        (256, 128, 128, 4, 8),
        (128, 128, 128, 4, 8),
        (128, 256, 64, 4, 8),
        (64, 256, 128, 4, 4),
        (64, 128, 128, 4, 4),
    ]
    _int8_gemm_tuned = _autotuned(_int8_gemm_kernel, _GEMM_CONFIGS, ["M_BUCKET", "N", "K", "HAS_SB", "HAS_BIAS"],
                                  disk_cache=True)

    try:
        from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
    except ImportError:  # older triton: pointer kernel only
        _TensorDescriptor = None

    def _set_tma_blocks(nargs: dict) -> None:
        nargs["a_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
        nargs["b_desc"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]

    # no disk cache: its configurations carry a pre-hook, which Triton does not store
    _int8_gemm_tma_tuned = _autotuned(_int8_gemm_tma_kernel, _GEMM_CONFIGS,
                                      ["M_BUCKET", "N", "K", "HAS_SB", "HAS_BIAS"], pre_hook=_set_tma_blocks)

    @triton.jit
    def _grad_input_upcast_kernel(
        g_ptr, w_ptr, sw_ptr, o_ptr, M, N, K, M_BUCKET,
        stride_gm, stride_gk, stride_wk, stride_wn, stride_om, stride_on,
        DTYPE: tl.constexpr, LOG4G: tl.constexpr, EVEN_K: tl.constexpr, GATHER: tl.constexpr,
        INTERPRET: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        """grad_x = rotate(sum_k DTYPE(grad[m, k] * s_w[k]) * q_w[k, n]) without a dequantised weight: the int8
        codes are upcast to DTYPE (exact) inside the GEMM, the weight scale is applied to the gradient tile (rounded
        once to DTYPE), fp32 accumulation, and the blockwise inverse rotation runs on the fp32 accumulator tile in the
        epilogue (BLOCK_N is a multiple of the group). Here K is the weight's output width (the reduction) and N its
        input width; the weight is read in place through its strides."""
        pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # wrap-around rows/columns keep the loads in bounds; wrapped columns form whole groups (N % g == 0), so the
        # rotation never mixes them with real ones, and the store is masked
        offs_gm = offs_m % M
        offs_wn = offs_n % N
        offs_k = tl.arange(0, BLOCK_K)
        g_ptrs = g_ptr + offs_gm[:, None].to(tl.int64) * stride_gm + offs_k[None, :] * stride_gk
        w_ptrs = w_ptr + offs_k[:, None].to(tl.int64) * stride_wk + offs_wn[None, :] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(tl.cdiv(K, BLOCK_K)):
            k_idx = kk * BLOCK_K + offs_k
            if EVEN_K:
                a = tl.load(g_ptrs)
                b = tl.load(w_ptrs)
                sw = tl.load(sw_ptr + k_idx)
            else:
                k_ok = k_idx < K
                a = tl.load(g_ptrs, mask=k_ok[None, :], other=0.0)
                b = tl.load(w_ptrs, mask=k_ok[:, None], other=0)
                sw = tl.load(sw_ptr + k_idx, mask=k_ok, other=0.0)
            a = _cast_rne(a.to(tl.float32) * sw[None, :], DTYPE)
            if INTERPRET:  # the interpreter multiplies bf16 bit patterns: the same product in fp32 (exact inputs)
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee", out_dtype=tl.float32)
            else:
                acc = tl.dot(a, b.to(DTYPE), acc, out_dtype=tl.float32)
            g_ptrs += BLOCK_K * stride_gk
            w_ptrs += BLOCK_K * stride_wk
        if LOG4G > 0:
            acc = _fwht_rows(acc, BLOCK_M, BLOCK_N, LOG4G, GATHER)
        o_ptrs = o_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
        tl.store(o_ptrs, _cast_rne(acc, o_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))

    # (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps): BLOCK_N = 256 holds whole 256-groups for the epilogue rotation
    _UPCAST_CONFIGS = [
        (128, 256, 64, 3, 8),
        (128, 256, 32, 4, 8),
        (64, 256, 64, 3, 4),
        (64, 256, 128, 3, 8),
        (128, 256, 128, 2, 8),
        (256, 256, 32, 3, 8),
    ]
    # no disk cache: Triton 3.6 cannot write the DTYPE constexpr (a Triton dtype) into its JSON cache key (a
    # TypeError on the H200, 2026-12-01)
    _grad_input_upcast_tuned = _autotuned(_grad_input_upcast_kernel, _UPCAST_CONFIGS,
                                          ["M_BUCKET", "N", "K", "DTYPE", "LOG4G"])



def set_gemm_kernel(name: str) -> None:
    """Choose the forward int8 GEMM on CUDA: "ptr" (default; pointer loads pipelined with cp.async, lowest host cost)
    or "tma" (tensor-descriptor loads on Hopper+: 4-8 % faster on the GPU at M = 4352, about 30 us more host time per
    call; falls back to "ptr" where descriptors cannot be used)."""
    if name not in ("ptr", "tma"):
        raise ValueError(f"unknown ConvRot GEMM kernel {name!r}; choose 'ptr' or 'tma'")
    _TUNING["gemm"] = name



def set_backward_kernel(name: str) -> None:
    """Choose how the "bf16" backward (grad_x = grad_y @ W) runs on CUDA: "dequant" (default; W dequantised into a
    transient bf16 tensor by one kernel, then cuBLAS) or "upcast" (one Triton GEMM that upcasts the int8 codes inside
    the kernel and rotates its output tile: no dequantised weight; bf16/fp16 gradients and groups up to 256)."""
    if name not in BACKWARD_KERNELS:
        raise ValueError(f"unknown ConvRot backward kernel {name!r}; choose one of {BACKWARD_KERNELS}")
    _TUNING["backward"] = name


@contextlib.contextmanager
def backward_kernel(name: str) -> Iterator[None]:
    """`set_backward_kernel` for a block of code (the benchmark compares both)."""
    saved = _TUNING["backward"]
    set_backward_kernel(name)
    try:
        yield
    finally:
        _TUNING["backward"] = saved



def _tma_ok(a: torch.Tensor, b: torch.Tensor, stride_bn: int, stride_bk: int, k: int) -> bool:
    """TMA descriptors need K-major operands with 16-byte aligned bases and row strides (and a Hopper GPU)."""
    return (
        _TensorDescriptor is not None and not _INTERPRET and a.is_cuda
        and torch.cuda.get_device_capability(a.device) >= (9, 0)
        and stride_bk == 1 and a.stride(1) == 1 and k % 16 == 0 and a.stride(0) % 16 == 0 and stride_bn % 16 == 0
        and a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
    )


# (kernel kind, M, N, K, flags, out dtype, device) -> (plain kernel, grid, launch keywords) once the autotuner chose
_GEMM_PLANS: dict[tuple, tuple] = {}


def _int8_gemm_triton(
    a: torch.Tensor,
    sa: torch.Tensor,
    b: torch.Tensor,
    b_strides_nk: Sequence[int],
    sb: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    n: int,
) -> torch.Tensor:
    """epilogue(a @ B) where B[k, n] = b[n * b_strides_nk[0] + k * b_strides_nk[1]] (no copy of b)."""
    m, k = a.shape
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return c
    stride_bn, stride_bk = int(b_strides_nk[0]), int(b_strides_nk[1])
    m_bucket = min(_next_pow2(m), 8192)
    stride_am, stride_ak = a.stride()
    stride_cm, stride_cn = max(n, 1), 1  # c is new and contiguous
    args = (
        a, b, c, sa, sb if sb is not None else sa, bias if bias is not None else sa, m, n, k,
        m_bucket, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    )
    has_sb, has_bias = sb is not None, bias is not None
    if _INTERPRET:
        bm, bn, bk = 32, 32, 32
        grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
        _int8_gemm_kernel[grid](
            *args, HAS_SB=has_sb, HAS_BIAS=has_bias, EVEN_K=k % bk == 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=4,
        )
        return c
    if _TUNING["gemm"] == "tma" and _tma_ok(a, b, stride_bn, stride_bk, k):
        descs = (_TensorDescriptor(a, [m, k], [a.stride(0), 1], [1, 16]),
                 _TensorDescriptor(b, [n, k], [stride_bn, 1], [1, 16]))
        tma_args = (*descs, *args[2:10], c.stride(0), c.stride(1))
        key = ("tma", m, n, k, has_sb, has_bias, out_dtype, a.get_device())
        _launch_tuned(_int8_gemm_tma_tuned, _int8_gemm_tma_kernel, key, m, n, tma_args,
                      {"HAS_SB": has_sb, "HAS_BIAS": has_bias}, descs)
        return c
    key = ("ptr", m, n, k, has_sb, has_bias, out_dtype, a.get_device())
    # the plan fixes the sizes and dtypes and c is new: the operands' alignments and strides decide the rest
    direct_key = (a.data_ptr() & 15, b.data_ptr() & 15, sa.data_ptr() & 15, 0 if sb is None else sb.data_ptr() & 15,
                  0 if bias is None else bias.data_ptr() & 15, stride_am, stride_ak, stride_bk, stride_bn, stride_cm)
    _launch_tuned(_int8_gemm_tuned, _int8_gemm_kernel, key, m, n, args,
                  {"HAS_SB": has_sb, "HAS_BIAS": has_bias, "EVEN_K": k % 128 == 0}, None, direct_key)
    return c


def _grad_input_upcast_triton(
    g2: torch.Tensor, weight: torch.Tensor, s_w: torch.Tensor, group_size: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """grad_x [M, K_w] = g2 [M, N_w] @ W for W = rotate(s_w * q_w), by `_grad_input_upcast_kernel`."""
    m, n_red = g2.shape
    k_out = weight.shape[1]
    out = torch.empty((m, k_out), dtype=out_dtype, device=g2.device)
    if m == 0:
        return out
    flags = {"DTYPE": tl.bfloat16 if g2.dtype == torch.bfloat16 else tl.float16,
             "LOG4G": _log4(group_size) if group_size else 0, "GATHER": _INTERPRET, "INTERPRET": _INTERPRET}
    args = (g2, weight, s_w, out, m, k_out, n_red, min(_next_pow2(m), 8192), g2.stride(0), g2.stride(1),
            weight.stride(0), weight.stride(1), out.stride(0), out.stride(1))
    if _INTERPRET:
        bm, bn, bk = 16, max(32, group_size), 32
        _grad_input_upcast_kernel[(triton.cdiv(m, bm) * triton.cdiv(k_out, bn),)](
            *args, **flags, EVEN_K=n_red % bk == 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=4)
        return out
    flags["EVEN_K"] = n_red % 128 == 0
    key = ("upcast", m, k_out, n_red, g2.dtype, out_dtype, group_size, g2.get_device())
    _launch_tuned(_grad_input_upcast_tuned, _grad_input_upcast_kernel, key, m, k_out, args, flags, None)
    return out


def _launch_tuned(
    tuned: Any, raw: Any, key: tuple, m: int, n: int, args: tuple, flags: dict, descs: tuple | None,
    direct_key: tuple | None = None,
) -> None:
    """Autotune on the first call of a shape, then launch the plain kernel with the chosen config, its grid and
    keywords kept per shape (the autotuner's per-call bookkeeping is a noticeable share of the host time): directly
    (`DirectLauncher`, with `direct_key` as its specialisation key when given) unless TMA descriptors are used."""
    plan = _GEMM_PLANS.get(key)
    if plan is None:
        def grid(meta: dict) -> tuple[int]:
            return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

        tuned[grid](*args, **flags)
        cfg = tuned.best_config
        meta = dict(cfg.kwargs)
        options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        # the pointer kernels launch directly from now on; the TMA kernel's descriptors change per call
        direct = DirectLauncher(raw, {**flags, **meta}, options) if descs is None else None
        _GEMM_PLANS[key] = (raw[grid(meta)], meta, {**flags, **meta, **options}, direct, (*grid(meta), 1, 1))
        return
    launch, meta, keywords, direct, grid3 = plan
    if direct is not None:
        direct(grid3, args, direct_key)
        return
    descs[0].block_shape = [meta["BLOCK_M"], meta["BLOCK_K"]]
    descs[1].block_shape = [meta["BLOCK_N"], meta["BLOCK_K"]]
    launch(*args, **keywords)
