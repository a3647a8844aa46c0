"""The forward int8 GEMM's variants and launch configurations, and the M buckets of its pinned per-shape table
(`library.quant.int8_gemm_kernels` builds, chooses and launches them)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from library.quant.convrot_quant_kernels import _next_pow2

__all__ = ["DEFAULT_GEMM_TABLE", "GEMM_KERNELS", "GEMM_KERNEL_ENV", "GEMM_TABLE_ENV", "GEMM_VARIANTS", "GemmConfig",
           "GemmVariant", "gemm_m_bucket"]


@dataclasses.dataclass(frozen=True)
class GemmVariant:
    """One forward int8 GEMM kernel: tensor-descriptor (TMA) or pointer loads, one tile per program or persistent
    (a grid of at most one program per SM looping over the tiles), Triton's warp specialisation or not."""

    name: str
    tma: bool
    persistent: bool
    warp_specialize: bool = False
    split_tail: bool = False  # the last partial wave's tiles split along K (a workspace and counters)


GEMM_VARIANTS: dict[str, GemmVariant] = {v.name: v for v in (
    GemmVariant("ptr", tma=False, persistent=False),
    GemmVariant("tma", tma=True, persistent=False),
    GemmVariant("ptr_persistent", tma=False, persistent=True),
    GemmVariant("tma_persistent", tma=True, persistent=True),
    GemmVariant("tma_persistent_ws", tma=True, persistent=True, warp_specialize=True),
    GemmVariant("tma_split_tail", tma=True, persistent=True, split_tail=True),
)}
# "auto": the pinned table's choice for this GPU and shape where it has one, else "ptr" autotuned
GEMM_KERNELS: tuple[str, ...] = ("auto", *GEMM_VARIANTS)
GEMM_KERNEL_ENV = "MOSS_INT8_GEMM"  # forces a variant (benchmarks), like set_gemm_kernel
GEMM_TABLE_ENV = "MOSS_INT8_GEMM_TABLE"  # another table file instead of the shipped one (benchmarks)
DEFAULT_GEMM_TABLE = Path(__file__).with_name("int8_gemm_table.json")
_M_BUCKET_MAX = 8192



@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """A launch configuration of the forward GEMM kernels. `epi_subtile` (the epilogue in two column halves) and
    `flatten` (the tile and K loops flattened for the pipeliner) apply to the persistent kernels only."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_stages: int = 3
    num_warps: int = 8
    epi_subtile: bool = False
    flatten: bool = True

    def meta(self, variant: GemmVariant) -> dict[str, Any]:
        """The kernel's block constexprs for `variant`."""
        meta = {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_K": self.block_k, "GROUP_M": self.group_m}
        if variant.persistent:
            meta.update(EPI_SUBTILE=self.epi_subtile, FLATTEN=self.flatten and not variant.warp_specialize,
                        WARP_SPEC=variant.warp_specialize)
        return meta

    def options(self) -> dict[str, int]:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> GemmConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown int8 GEMM configuration keys {sorted(unknown)}; known: {sorted(names)}")
        return cls(**d)


def gemm_m_bucket(m: int) -> int:
    """The M bucket of the autotuner key and of the pinned table: the next power of two, at most 8192."""
    return min(_next_pow2(m), _M_BUCKET_MAX)
