"""The weight change of one LoRA-family module, from its tensors: the math the networks train and the merge adds.

For a Linear weight W (out x in) and a module of rank r with scale s = alpha / r (`library.lora.conventions`):

- LoRA: dW = s * up @ down, with up (out x r) and down (r x in).
- LoHa (Hadamard product of two low-rank pairs): dW = s * (w1_a @ w1_b) * (w2_a @ w2_b), element by element, with
  w1_a, w2_a (out x r) and w1_b, w2_b (r x in). Its rank is that of each pair; the product reaches rank r^2.
- LoKr (Kronecker product): dW = s * kron(w1, w2) with w1 (a x c), w2 (b x d), out = a * b, in = c * d. Each factor is
  a full matrix (`lokr_w1`, `lokr_w2`) or a low-rank pair (`lokr_w1_a` @ `lokr_w1_b`, `lokr_w2_a` @ `lokr_w2_b`); when
  both are full there is no rank and s = 1. The sizes come from `factorization` of in and out.

`hadamard_product` has a backward that keeps only the four small factors (it recomputes the two products), so a LoHa
module holds no full-size tensor between forward and backward apart from what F.linear keeps. `kron_linear` applies
a Kronecker-product weight to an input without forming it: kron(w1, w2) @ x is w1 @ X @ w2^T on x reshaped to
(c, d), exact and cheap.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from library.errors import UserError
from library.lora.conventions import ALGORITHM_LABELS, ALPHA, LORA_DOWN, LORA_UP, alpha_scale, module_algorithm


def factorization(dimension: int, factor: int = -1) -> tuple[int, int]:
    """(m, n) with m * n = dimension and m <= n: with a `factor` > 0 that divides the dimension, m = min(factor,
    dimension / factor); otherwise the most balanced split whose smaller part does not exceed `factor` (no limit for
    -1). 3072 -> (48, 64), 16384 -> (128, 128), with factor 8: 3072 -> (8, 384). A prime dimension gives (1, dim)."""
    if factor > 0 and dimension % factor == 0:
        return min(factor, dimension // factor), max(factor, dimension // factor)
    limit = dimension if factor < 0 else factor
    best = (1, dimension)
    m = 2
    while m * m <= dimension and m <= limit:
        if dimension % m == 0:
            best = (m, dimension // m)
        m += 1
    return best


class _HadamardProduct(torch.autograd.Function):
    """(w1a @ w1b) * (w2a @ w2b) whose backward recomputes the two products from the factors it kept."""

    @staticmethod
    def forward(ctx, w1a: torch.Tensor, w1b: torch.Tensor, w2a: torch.Tensor, w2b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(w1a, w1b, w2a, w2b)
        return (w1a @ w1b) * (w2a @ w2b)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        w1a, w1b, w2a, w2b = ctx.saved_tensors
        g1 = grad * (w2a @ w2b)
        g2 = grad * (w1a @ w1b)
        return g1 @ w1b.T, w1a.T @ g1, g2 @ w2b.T, w2a.T @ g2


def hadamard_product(w1a: torch.Tensor, w1b: torch.Tensor, w2a: torch.Tensor, w2b: torch.Tensor) -> torch.Tensor:
    """The unscaled LoHa product (w1_a @ w1_b) * (w2_a @ w2_b)."""
    return _HadamardProduct.apply(w1a, w1b, w2a, w2b)


def kron_linear(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """x @ kron(w1, w2)^T for x (..., c * d), w1 (a x c), w2 (b x d): (..., a * b), without forming kron(w1, w2).
    `w2` may be a low-rank pair (w2_a, w2_b), applied as its two factors."""
    a, c = w1.shape
    if isinstance(w2, tuple):
        w2_a, w2_b = w2
        b, d = w2_a.shape[0], w2_b.shape[1]
        blocks = x.reshape(*x.shape[:-1], c, d)
        right = (blocks @ w2_b.T) @ w2_a.T
    else:
        b, d = w2.shape
        right = x.reshape(*x.shape[:-1], c, d) @ w2.T
    return (w1 @ right).reshape(*x.shape[:-1], a * b)


def lokr_factor(parts: Mapping[str, torch.Tensor], which: str) -> torch.Tensor:
    """LoKr factor `which` ("w1" or "w2"): the full matrix, or the product of its low-rank pair."""
    full = parts.get(f"lokr_{which}")
    return full if full is not None else parts[f"lokr_{which}_a"] @ parts[f"lokr_{which}_b"]


def module_rank(algorithm: str, parts: Mapping[str, torch.Tensor]) -> int | None:
    """The rank alpha is divided by; None for a LoKr module whose two factors are full matrices."""
    if algorithm == "lora":
        return int(parts[LORA_DOWN].shape[0])
    if algorithm == "loha":
        return int(parts["hada_w1_b"].shape[0])
    for which in ("w2", "w1"):
        if f"lokr_{which}_b" in parts:
            return int(parts[f"lokr_{which}_b"].shape[0])
    return None


def module_scale(algorithm: str, parts: Mapping[str, torch.Tensor]) -> float:
    """alpha / rank with the alpha rule (1 for a LoKr of two full factors)."""
    rank = module_rank(algorithm, parts)
    return 1.0 if rank is None else alpha_scale(parts.get(ALPHA), rank)


def delta_shape(algorithm: str, parts: Mapping[str, torch.Tensor]) -> tuple[int, int]:
    """(out, in) of the weight change a module stands for (its factors checked for consistency)."""
    if algorithm == "lora":
        up, down = parts[LORA_UP], parts[LORA_DOWN]
        shapes_fit = up.dim() == 2 and down.dim() == 2 and up.shape[1] == down.shape[0]
        out_in = (int(up.shape[0]), int(down.shape[1]))
    elif algorithm == "loha":
        w1a, w1b, w2a, w2b = (parts[k] for k in ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"))
        shapes_fit = all(t.dim() == 2 for t in (w1a, w1b, w2a, w2b)) and w1a.shape[1] == w1b.shape[0] and (
            w2a.shape[1] == w2b.shape[0] and w1a.shape[0] == w2a.shape[0] and w1b.shape[1] == w2b.shape[1])
        out_in = (int(w1a.shape[0]), int(w1b.shape[1]))
    else:
        shapes = [_lokr_factor_shape(parts, w) for w in ("w1", "w2")]
        shapes_fit = None not in shapes
        out_in = (shapes[0][0] * shapes[1][0], shapes[0][1] * shapes[1][1]) if shapes_fit else (0, 0)
    if not shapes_fit:
        raise UserError(
            f"A {ALGORITHM_LABELS[algorithm]} module has tensors of shapes {_shapes(parts)} that do not fit together:"
            " the file is damaged."
        )
    return out_in


def _lokr_factor_shape(parts: Mapping[str, torch.Tensor], which: str) -> tuple[int, int] | None:
    full = parts.get(f"lokr_{which}")
    if full is not None:
        return (int(full.shape[0]), int(full.shape[1])) if full.dim() == 2 else None
    a, b = parts[f"lokr_{which}_a"], parts[f"lokr_{which}_b"]
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        return None
    return int(a.shape[0]), int(b.shape[1])


def _shapes(parts: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in parts.items() if k != ALPHA}


def delta_weight(
    parts: Mapping[str, torch.Tensor], algorithm: str | None = None, device: torch.device | str | None = None
) -> torch.Tensor:
    """The scaled weight change (out x in) of one module in fp32, on `device` (default: where its tensors are)."""
    algorithm = algorithm or module_algorithm(parts, "module")
    delta_shape(algorithm, parts)
    f32 = {k: v.to(device, torch.float32) for k, v in parts.items() if k != ALPHA}
    if algorithm == "lora":
        product = f32[LORA_UP] @ f32[LORA_DOWN]
    elif algorithm == "loha":
        product = hadamard_product(f32["hada_w1_a"], f32["hada_w1_b"], f32["hada_w2_a"], f32["hada_w2_b"])
    else:
        product = torch.kron(lokr_factor(f32, "w1"), lokr_factor(f32, "w2"))
    return product * module_scale(algorithm, parts)
