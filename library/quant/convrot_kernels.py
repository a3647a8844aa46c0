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
reads the weight ``[N, K]`` in place through its strides and applies the dequantisation/bias epilogue
(`library.quant.int8_gemm_kernels`). Everywhere
else an eager path with the same numerics runs (``torch._int_mm`` on CUDA, an exact fp32/fp64 product on the CPU).

The forward GEMM's autotuner keeps its choices on disk in Triton's cache (``cache_results=True`` where the installed
Triton has it; not the TMA and upcast tuners, whose configurations or keys Triton cannot store), so a process on a
machine that already tuned a shape picks its configuration without benchmarking (and without the benchmark's 256 MiB
L2-flush buffer) in its first training step.
"""

from __future__ import annotations

import logging
import math
import os
import weakref
from typing import Any

import torch

from library.quant.convrot_quant_kernels import (  # noqa: F401 - QUANTISERS, set_*, _*_launch: re-exported
    _QUANT_PLANS,
    _TUNING,
    QUANTISERS,
    _h64,
    _next_pow2,
    _quantize_rows_triton,
    _quarters_launch,
    _rows_launch,
    _scale_rotate_triton,
    set_quantiser,
    set_row_tuning,
)
from library.quant.fused_linear_kernels import (  # noqa: F401 - set_fused_linear: re-exported
    _FUSED,
    fused_linear_ok,
    fused_linear_triton,
    set_fused_linear,
)
from library.quant.int8_gemm_kernels import (  # noqa: F401 - set_*, backward_kernel, *_KERNELS: re-exported
    _GEMM_PLANS,
    BACKWARD_KERNELS,
    GEMM_KERNELS,
    _int8_gemm_triton,
    _launch_tuned,
    backward_kernel,
    set_backward_kernel,
    set_gemm_kernel,
)
from library.quant.int8_grad_kernels import _grad_input_upcast_triton
from library.runtime.compile import exact_fp32_matmul

logger = logging.getLogger(__name__)

WEIGHT_RECIPES: tuple[str, ...] = ("fp32", "eager")
DEFAULT_WEIGHT_RECIPE = "fp32"
BACKWARD_MODES: tuple[str, ...] = ("bf16", "int8")
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

if _TRITON_IMPORTED:  # the raw GEMM kernel (tests launch it directly)
    from library.quant.int8_gemm_kernels import _int8_gemm_kernel  # noqa: F401 - re-exported


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


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.mm in the operands' own dtype: an enclosing autocast would round the exact int8 sums and the fp32
    rotations to bf16 (the int8 Linear runs inside the caller's autocast region in eager mode)."""
    device = a.device.type
    if torch.is_autocast_enabled(device):
        with torch.autocast(device, enabled=False):
            return torch.mm(a, b)
    return torch.mm(a, b)


def _addmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """torch.addmm(c, a, b) in the operands' own dtype (as `_mm`); with `in_place`, into c (c.addmm_(a, b): no copy
    of c first)."""
    if in_place:  # in-place operators are not cast by autocast
        return c.addmm_(a, b)
    device = a.device.type
    if torch.is_autocast_enabled(device):
        with torch.autocast(device, enabled=False):
            return torch.addmm(c, a, b)
    return torch.addmm(c, a, b)


def _grouped_matmul(x: torch.Tensor, h: torch.Tensor, group_size: int) -> torch.Tensor:
    """Blockwise x [..., K] @ h along the last axis: one [numel / g, g] @ [g, g] product."""
    grouped = x.reshape(-1, group_size)
    if x.is_cuda:
        with exact_fp32_matmul(exact_reductions=True):  # a trainer's TF32 would change the quantised codes
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


def quantize_segments(xs: list[torch.Tensor], group_size: int, backend: str = "auto"
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_activation` of the rows of several inputs [M_i, K] (one K, one dtype) stacked in order: (q int8
    [sum M_i, K], scale fp32 [sum M_i]). With the Triton quantiser each input's codes are written in place in the
    stacked buffer (where every start is at a 16-byte boundary), so nothing is concatenated but the scales."""
    k = xs[0].shape[1]
    if any(x.shape[1] != k or x.dtype != xs[0].dtype for x in xs):
        raise ValueError("quantize_segments needs inputs of one width and dtype")
    if not all(_use_triton(x, backend) for x in xs) or k % 16:
        parts = [quantize_activation(x, group_size, backend) for x in xs]
        return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])
    q = torch.empty((sum(x.shape[0] for x in xs), k), dtype=torch.int8, device=xs[0].device)
    scales, start = [], 0
    for x in xs:
        scales.append(_quantize_rows_triton(x, group_size, out_codes=q[start:start + x.shape[0]])[1])
        start += x.shape[0]
    return q, torch.cat(scales)


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


def cache_quantized_activation(x: torch.Tensor, group_size: int, value: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Leave `value`, the quantised rows of x (codes [M, K] and scales [M] in one buffer, as `_codes_and_scales` lays
    them out) that a fused producer made (`library.runtime.fused_ops.fused_norm_modulate_quant`), for the int8
    Linears that read x next (eager code only; the Triton path's entry)."""
    _ACT_CACHE.put(x, group_size, True, value)


def linear_forward(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, group_size: int
) -> torch.Tensor:
    """The int8 Linear's eager forward: ``int8_linear`` without the argument normalisation, for the module's own
    state (int8 weight [N, K] on x's device, fp32 contiguous scale with N elements, group size already checked).
    The output dtype is x.dtype."""
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"input features {x.shape[-1]} do not match the weight's {k}")
    if _FUSED["max_m"] and HAS_TRITON and (x.is_cuda or (_INTERPRET and x.device.type == "cpu")):
        x2 = x if x.dim() == 2 else x.reshape(-1, k)
        if fused_linear_ok(x2, weight, group_size):  # few rows: one launch (`set_fused_linear`)
            out = fused_linear_triton(x2, weight, weight_scale, bias, _h64(x.device, x.dtype))
            return out if x.dim() == 2 else out.view(*x.shape[:-1], n)
    q_x, s_x = cached_quantized_activation(x, group_size)
    out = int8_gemm(q_x, s_x, weight, weight_scale, bias, x.dtype)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)

