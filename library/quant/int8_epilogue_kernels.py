"""The ConvRot INT8 forward GEMM with the block's next element-wise step in its epilogue, for compiled inference
blocks (Triton, tensor-descriptor loads: Hopper or newer, or Triton's interpreter).

In a compiled inference block the int8 Linears' outputs go straight into element-wise code: `o` and `ffn_down` into
the gated residual ``x + gate * y``, `q` and `k` into the per-head RMSNorm and RoPE. Each of those is a pass of its
own that reads the product back (26.7 MB per Linear at 1024x1024) after the GEMM wrote it. Here the GEMM's
epilogue does that step on the tile it holds and writes only its result:

- ``EPILOGUE == 1`` (`gemm_gated_residual`): ``T(r + gate[b] * y)`` in fp32 with the residual r [M, N] and the gate
  [B, N] of each row's sample (row m belongs to sample m // seq);
- ``EPILOGUE == 2`` (`gemm_norm_rope`): the tile is one head (BLOCK_N = head_dim): ``rope(y * rstd * w)`` with
  rstd = 1 / sqrt(mean(y^2) + eps) over the head and the cos/sin tables [B or 1, S, head_dim / 2] of each row's
  token, the rotation over adjacent pairs (as `library.moss_image.rope.apply_rope`).

y is the Linear's output as the plain GEMM rounds it (``T(fp32(acc) * sa[m] * sb[n])``), so these are the plain
kernels' steps on the same values; only where the fp32 arithmetic is contracted or summed in another order may the
last bit differ. The main loop and the tile order are the forward GEMM's (`library.quant.int8_gemm_kernels`); the
launch configuration is the pinned table's for the shape (BLOCK_N set to the head size for the norm; an unpinned
shape takes `_DEFAULT_CONFIG`: no autotuning in a denoising step). A shape's first call launches through Triton;
the later ones launch the compiled kernel raw, with each operand's descriptor encoded once per address
(`library.quant.triton_launch.TmaLauncher`, as the forward GEMM's TMA variants), where this Triton allows it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from library.quant import int8_gemm_kernels as G
from library.quant.convrot_quant_kernels import _INTERPRET, _TRITON_IMPORTED, tl, triton
from library.quant.int8_gemm_configs import GemmConfig
from library.quant.triton_launch import TmaLauncher, _launch_hooks_idle, constexpr_tail, raw_launch_enabled, spec_key

logger = logging.getLogger(__name__)

__all__ = ["epilogue_gemm_usable", "gemm_gated_residual", "gemm_norm_rope"]

GATED_RESIDUAL, NORM_ROPE = 1, 2
_DEFAULT_CONFIG = GemmConfig(128, 128, 128, group_m=8, num_stages=4, num_warps=8)
_INTERPRET_CONFIG = GemmConfig(16, 32, 32, group_m=2, num_stages=2, num_warps=4)

if _TRITON_IMPORTED:
    _cast_rne = G._cast_rne

    @triton.jit
    def _int8_gemm_epilogue_kernel(
        a_desc, b_desc, c_ptr, sa_ptr, sb_ptr, r_ptr, g_ptr, w_ptr, cos_ptr, sin_ptr, M, N, K, seq, stride_gb,
        cs_b, cs_s, eps,
        EPILOGUE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        """C [M, N] = the epilogue (module docstring) of A [M, K] @ W [N, K]^T, both int8 and K-major."""
        pid_m, pid_n = G._tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = G._tma_tile_acc(a_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, 0, tl.cdiv(K, BLOCK_K), BLOCK_M,
                              BLOCK_N, BLOCK_K)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = offs_m < M
        mask = row_ok[:, None] & (offs_n < N)[None, :]
        sa = tl.load(sa_ptr + offs_m, mask=row_ok, other=0.0)
        sb = tl.load(sb_ptr + offs_n, mask=offs_n < N, other=0.0)
        out_ty = c_ptr.dtype.element_ty
        y = _cast_rne(acc.to(tl.float32) * (sa[:, None] * sb[None, :]), out_ty).to(tl.float32)
        rows = offs_m.to(tl.int64)
        sample = rows // seq
        if EPILOGUE == 1:
            r = tl.load(r_ptr + rows[:, None] * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + sample[:, None] * stride_gb + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
            out = r + g * y
        else:
            half: tl.constexpr = BLOCK_N // 2
            w = tl.load(w_ptr + tl.arange(0, BLOCK_N)).to(tl.float32)
            rstd = tl.rsqrt(tl.sum(y * y, axis=1) / BLOCK_N + eps)
            n0, n1 = tl.split(tl.reshape(y * rstd[:, None] * w[None, :], (BLOCK_M, half, 2)))
            c_off = (sample * cs_b + (rows - sample * seq) * cs_s)[:, None] + tl.arange(0, half)[None, :]
            c = tl.load(cos_ptr + c_off, mask=row_ok[:, None], other=0.0)
            s = tl.load(sin_ptr + c_off, mask=row_ok[:, None], other=0.0)
            out = tl.reshape(tl.join(n0 * c - n1 * s, n0 * s + n1 * c), (BLOCK_M, BLOCK_N))
        tl.store(c_ptr + rows[:, None] * N + offs_n[None, :], _cast_rne(out, out_ty), mask=mask)


def epilogue_gemm_usable(x_q: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, head_dim: int | None = None
                         ) -> bool:
    """Whether the kernel takes these operands: Triton with tensor descriptors, a Hopper-or-newer GPU (or the
    interpreter on the CPU), int8 codes [M, K] and weight [N, K] K-major with 16-byte aligned rows, a bf16 or fp16
    output, and for the norm a power-of-two head size of 16 to 256 dividing N."""
    if not _TRITON_IMPORTED or G._TensorDescriptor is None or dtype not in (torch.bfloat16, torch.float16):
        return False
    if x_q.dtype != torch.int8 or weight.dtype != torch.int8 or x_q.dim() != 2 or weight.dim() != 2:
        return False
    if x_q.device.type == "cuda":
        if _INTERPRET or not G._is_hopper_or_newer(x_q.device):
            return False
    elif not (_INTERPRET and x_q.device.type == "cpu"):
        return False
    k = x_q.shape[1]
    if weight.shape[1] != k or k % 16 or x_q.stride() != (k, 1) or weight.stride() != (k, 1):
        return False
    if x_q.data_ptr() % 16 or weight.data_ptr() % 16:
        return False
    if head_dim is not None:
        return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0 and weight.shape[0] % head_dim == 0
    return True


def _config(device: torch.device, m: int, n: int, k: int, head_dim: int | None) -> GemmConfig:
    """The pinned forward configuration of the shape (the default one where the table has none), with BLOCK_N the
    head size for the norm."""
    if _INTERPRET:
        base = _INTERPRET_CONFIG
    else:
        pinned = G.pinned_gemm(G._gpu_names(device), n, k, m)
        base = pinned[1] if pinned is not None else _DEFAULT_CONFIG
    if head_dim is not None and base.block_n != head_dim:
        base = GemmConfig(base.block_m, head_dim, base.block_k, group_m=base.group_m, num_stages=base.num_stages,
                          num_warps=base.num_warps)
    return base


# (epilogue, M, N, K, head size, device, what Triton specialises the other arguments on) -> (configuration, grid,
# raw launch or None): a shape's first call goes through Triton, the later ones launch its compiled kernel raw
_PLANS: dict[tuple, tuple] = {}


def _launch(mode: int, x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
            out: torch.Tensor, seq: int, tensors: tuple, scalars: tuple, head_dim: int | None = None) -> None:
    m, k = x_q.shape
    n = weight.shape[0]
    args = (out, x_scale, weight_scale.reshape(-1), *tensors, m, n, k, seq, *scalars)
    key = (mode, m, n, k, head_dim, x_q.device, spec_key(args))
    plan = _PLANS.get(key)
    if plan is not None and plan[2] is not None and raw_launch_enabled() and _launch_hooks_idle():
        plan[2](plan[1], ((x_q, (m, k), (k, 1)), (weight, (n, k), (k, 1))), args)
        return
    cfg = plan[0] if plan is not None else _config(x_q.device, m, n, k, head_dim)
    blocks = ([cfg.block_m, cfg.block_k], [cfg.block_n, cfg.block_k])
    a_desc = G._TensorDescriptor(x_q, [m, k], [k, 1], blocks[0])
    b_desc = G._TensorDescriptor(weight, [n, k], [k, 1], blocks[1])
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    constexprs = {"EPILOGUE": mode, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
                  "GROUP_M": cfg.group_m}
    kernel = _int8_gemm_epilogue_kernel[grid](a_desc, b_desc, *args, **constexprs, num_warps=cfg.num_warps,
                                              num_stages=cfg.num_stages)
    if plan is None:
        raw = None
        if not _INTERPRET and kernel is not None and hasattr(type(kernel), "__getitem__"):
            raw = TmaLauncher.of(kernel, constexpr_tail(_int8_gemm_epilogue_kernel, constexprs), blocks)
        _PLANS[key] = (cfg, (grid[0], 1, 1), raw)


def gemm_gated_residual(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        residual: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``residual + gate[:, None] * y`` for y = the int8 product of rows x_q (scales x_scale) with weight, in
    residual's dtype: residual [B, S, N] (any layout: made contiguous), gate [B, N]; where `epilogue_gemm_usable`."""
    bsz, seq, n = residual.shape
    residual = residual.contiguous()
    gate = gate if gate.stride(-1) == 1 else gate.contiguous()
    out = torch.empty_like(residual)
    if out.numel():
        _launch(GATED_RESIDUAL, x_q, x_scale, weight, weight_scale, out, seq,
                (residual, gate, x_scale, x_scale, x_scale), (gate.stride(0) if bsz > 1 else 0, 0, 0, 0.0))
    return out


def gemm_norm_rope(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   norm_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float, seq: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """rope(rms_norm(y, norm_weight, eps), cos, sin) per head of size len(norm_weight), for y = the int8 product of
    rows x_q with weight ([M, N] of `dtype`, M = B * seq): cos/sin fp32 [B or 1, seq, head_dim / 2] with unit last
    stride and one layout; where `epilogue_gemm_usable` with the head size."""
    m = x_q.shape[0]
    n = weight.shape[0]
    head_dim = norm_weight.shape[0]
    out = torch.empty((m, n), dtype=dtype, device=x_q.device)
    if m:
        batch = m // seq
        cs_b = 0 if cos.shape[0] == 1 and batch != 1 else cos.stride(0)
        _launch(NORM_ROPE, x_q, x_scale, weight, weight_scale, out, seq,
                (x_scale, x_scale, norm_weight.contiguous(), cos, sin), (0, cs_b, cos.stride(1), float(eps)),
                head_dim)
    return out


def describe() -> dict[str, Any]:
    """What this module can build here (for benchmarks' environment records)."""
    return {"triton": _TRITON_IMPORTED, "descriptors": G._TensorDescriptor is not None, "interpreter": bool(_INTERPRET)}
