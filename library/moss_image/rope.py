"""RoPE of the MOSS-Image DiT: the cos/sin tables of a forward's 3-axis positions (text index, image row, image
column), cached per axis and per image size (`RopeTables`), and the rotation of interleaved pairs (`apply_rope`).
The q/k head norm + RoPE as one kernel is `library.moss_image.dit.norm_rope`."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from library.runtime.eager_fusion import eager_fused

__all__ = ["RopeTables", "apply_rope", "rope_cos_sin"]


def rope_cos_sin(positions: torch.Tensor, axes_dims: tuple[int, ...], theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, S, head_dim/2] (fp32) for integer positions [B, S, n_axes], one frequency band per axis."""
    angles = []
    for axis, dim in enumerate(axes_dims):
        freqs = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim)
        angles.append(positions[..., axis].double()[..., None] * freqs)
    ang = torch.cat(angles, dim=-1).float()
    return torch.cos(ang), torch.sin(ang)


class _RotationTable:
    """cos + i sin of the last cos/sin pair seen: every block of a forward (and q and k) gets the same pair, so they
    share one complex table (and backward keeps one, as it keeps the shared cos/sin in the plain form)."""

    def __init__(self) -> None:
        self._key: tuple[Any, Any, tuple[int, int]] | None = None
        self._table: torch.Tensor | None = None

    def table(self, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if torch.is_inference(cos) or torch.is_inference(sin):  # no version counter to tell an in-place change
            return torch.complex(cos, sin)
        key = self._key
        if key is not None and key[0]() is cos and key[1]() is sin and key[2] == (cos._version, sin._version):
            assert self._table is not None
            return self._table
        self._table = torch.complex(cos, sin)
        self._key = (weakref.ref(cos), weakref.ref(sin), (cos._version, sin._version))
        return self._table


_ROTATIONS = _RotationTable()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of x [B, S, H, D] by the angles behind cos/sin [B, S, D/2]."""
    if eager_fused():  # (x0 + i x1)(cos + i sin), one fp32 complex product (inductor does not take complex tensors)
        xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
        rotated = xc * _ROTATIONS.table(cos, sin)[:, :, None]
        return torch.view_as_real(rotated).flatten(-2).to(x.dtype)
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    c, s = cos[:, :, None], sin[:, :, None]
    out = torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2)
    return out.to(x.dtype)


class RopeTables:
    """RoPE cos/sin of a forward, assembled from cached per-axis tables (no float64 work per forward).

    The table of an axis holds the angles of the positions 0..n-1 (grown when a longer one is needed; the value of a
    position never depends on the table length) and the image part of a grid (rows x columns) is cached per size, so
    each bucket or image size computes its tables once per device."""

    def __init__(self, axes_dims: tuple[int, ...], theta: float):
        self.axes_dims = tuple(axes_dims)
        self.theta = theta
        self._axes: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        self._grids: dict[tuple[int, int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def axis(self, axis: int, length: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [n >= length, dim/2] of the positions 0..n-1 on `axis`."""
        device = torch.device(device)
        cached = self._axes.get((axis, device))
        if cached is None or cached[0].shape[0] < length:
            n = max(length, 2 * cached[0].shape[0] if cached is not None else 64)
            pos = torch.arange(n, device=device)[None, :, None]
            cos, sin = rope_cos_sin(pos, (self.axes_dims[axis],), self.theta)
            cached = self._axes[(axis, device)] = (cos[0], sin[0])
        return cached

    def grid(self, h: int, w: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [h*w, (dim_row + dim_col)/2] of the row and column axes of the image tokens (row-major)."""
        device = torch.device(device)
        key = (h, w, device)
        if key not in self._grids:
            rc, rs = self.axis(1, h, device)
            cc, cs = self.axis(2, w, device)
            rows = torch.arange(h, device=device).repeat_interleave(w)
            cols = torch.arange(w, device=device).repeat(h)
            self._grids[key] = (torch.cat([rc[rows], cc[cols]], dim=-1), torch.cat([rs[rows], cs[cols]], dim=-1))
        return self._grids[key]

    def cos_sin(self, text_lengths: list[int], t_pad: int, h: int, w: int, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B, t_pad + h*w, head_dim/2] of the positions of `MossImage`: text token i at (i, 0, 0), image
        token (r, c) at (valid text length, r, c); `text_lengths` are host integers (one per sample)."""
        t_cos, t_sin = self.axis(0, t_pad + 1, device)
        g_cos, g_sin = self.grid(h, w, device)
        z_cos = torch.cat([self.axis(1, 1, device)[0][0], self.axis(2, 1, device)[0][0]])  # position 0 of rows/cols
        z_sin = torch.cat([self.axis(1, 1, device)[1][0], self.axis(2, 1, device)[1][0]])
        n = h * w
        out = []
        for table, zero, grid in ((t_cos, z_cos, g_cos), (t_sin, z_sin, g_sin)):
            text = torch.cat([table[:t_pad], zero.expand(t_pad, -1)], dim=-1)
            rows = [torch.cat([text, torch.cat([table[length].expand(n, -1), grid], dim=-1)]) for length in text_lengths]
            out.append(torch.stack(rows))
        return out[0], out[1]
