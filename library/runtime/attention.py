"""Attention backends for the DiT: `torch` (SDPA), `xformers`, `flash`, `sageattn`, with optional per-sample splitting.

Tensors are [B, S, H, D]. A key mask `key_mask` [B, S] (True = attend) marks padded text tokens. Backends that take
no mask (xformers, flash, sageattn) need `split_attn`: each sample then runs alone on its valid tokens only, which is
exact. Packages are imported only when their mode is used, and a missing one is a clear error.

A tuple of ints in place of the mask (`Segments`) says that the sequence is several sequences side by side (the
sampler's conditional and unconditional passes packed into one, `library.moss_image.cfg_packing`): each attends only
within itself, as one call per segment, with no mask.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from library.errors import UserError

logger = logging.getLogger(__name__)

ATTN_MODES = ("torch", "xformers", "flash", "sageattn")

# lengths of the sequences packed side by side along S (they add up to S)
Segments = tuple[int, ...]


def segment_starts(segments: Segments) -> list[int]:
    """Where each packed sequence starts along S."""
    return [sum(segments[:i]) for i in range(len(segments))]

_PACKAGES = {"xformers": "xformers", "flash": "flash-attn", "sageattn": "sageattention"}


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
    mask = None if key_mask is None else key_mask[:, None, None, :]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)


def _import_backend(mode: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    try:
        if mode == "xformers":
            import xformers.ops as xops

            return lambda q, k, v: xops.memory_efficient_attention(q, k, v)
        if mode == "flash":
            from flash_attn import flash_attn_func

            return lambda q, k, v: flash_attn_func(q, k, v)
        if mode == "sageattn":
            from sageattention import sageattn

            return lambda q, k, v: sageattn(q, k, v, tensor_layout="NHD")
    except ImportError as e:
        raise UserError(
            f"--attn_mode {mode} needs the '{_PACKAGES[mode]}' package, which is not installed ({e}):"
            f" install it or use --attn_mode torch."
        ) from e
    raise UserError(f"Unknown --attn_mode '{mode}': choose one of {', '.join(ATTN_MODES)}.")


class Attention:
    """The attention function of one model: backend + split mode, validated once."""

    def __init__(self, mode: str = "torch", split_attn: bool = False):
        if mode not in ATTN_MODES:
            raise UserError(f"Unknown --attn_mode '{mode}': choose one of {', '.join(ATTN_MODES)}.")
        if mode == "xformers" and not split_attn:
            raise UserError("--attn_mode xformers requires --split_attn (xformers gets no padding mask here).")
        self.mode = mode
        self.split_attn = split_attn or mode in ("flash", "sageattn")
        self._fn = _sdpa if mode == "torch" else None

    def _backend(self) -> Callable[..., torch.Tensor]:
        if self._fn is None:
            self._fn = _import_backend(self.mode)
        return self._fn

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 key_mask: torch.Tensor | Segments | None) -> torch.Tensor:
        """`key_mask` None means every key is valid (the caller drops an all-true mask once per forward); `Segments`:
        packed sequences, each attending within itself (see `segment_outputs`)."""
        if isinstance(key_mask, tuple):
            return torch.cat(self.segment_outputs(q, k, v, key_mask), dim=1)
        return self._attend(q, k, v, key_mask)

    def segment_outputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        segments: Segments) -> list[torch.Tensor]:
        """Each packed sequence's attention over itself, [B, length, H, D] in order: the same call, on views of q, k
        and v, that the sequence alone would make."""
        if sum(segments) != q.shape[1]:
            raise ValueError(f"segments {segments} do not add up to the sequence length {q.shape[1]}")
        return [self._attend(q[:, a:a + n], k[:, a:a + n], v[:, a:a + n], None)
                for a, n in zip(segment_starts(segments), segments)]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None
                ) -> torch.Tensor:
        fn = self._backend()
        if not self.split_attn:
            return fn(q, k, v, key_mask)
        if key_mask is None and self.mode != "torch":
            return fn(q, k, v)
        return self._split(fn, q, k, v, key_mask)

    def _split(self, fn, q, k, v, key_mask):  # type: ignore[no-untyped-def]
        out = torch.zeros_like(q)
        for b in range(q.shape[0]):
            idx = slice(None) if key_mask is None else key_mask[b].nonzero(as_tuple=True)[0]
            qb, kb, vb = q[b : b + 1, idx], k[b : b + 1, idx], v[b : b + 1, idx]
            ob = fn(qb, kb, vb, None) if self.mode == "torch" else fn(qb, kb, vb)
            if key_mask is None:
                out[b : b + 1] = ob
            else:
                out[b : b + 1, idx] = ob
        return out
