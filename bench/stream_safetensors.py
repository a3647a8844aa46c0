"""Streamed safetensors writing for the full-size benchmark snapshots: one tensor (or row chunk) in memory at a time.

A file is planned before anything is computed: a list of `Piece`s, each naming the tensors it yields (`Spec`: name,
shape, dtype) and a `produce()` that yields them, in order, as CPU tensors whose bytes follow one another (a big
tensor may come in several row chunks). The header is written from the plan, then each piece is produced and written
and dropped, so a file of any size costs the memory of its largest piece. Pieces are laid out widest dtype first and
small constant tensors (the ComfyUI `.comfy_quant` markers) last, so every tensor starts aligned to its element size.
Each file is written to a temporary name and renamed (`library.files.safetensors_io.write_atomic`).

Random tensors (`random_piece`) are deterministic: each row chunk has its own generator, seeded from the run seed, the
tensor name and the chunk index, so a tensor's values do not depend on which other tensors or files a run writes, nor
on the number of threads; they do depend on the device (CPU and CUDA generators differ).
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from library.files.safetensors_io import write_atomic, write_text_atomic

logger = logging.getLogger(__name__)

CHUNK_ELEMENTS = 1 << 24  # random values are drawn in row chunks of at most this many elements (64 MiB in fp32)

_ST_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int8: "I8",
    torch.uint8: "U8",
}


@dataclass(frozen=True)
class Spec:
    """One tensor of a file: name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass
class Piece:
    """Tensors written together: `produce()` yields CPU tensors whose bytes, in order, are those of `specs`."""

    specs: list[Spec]
    produce: Callable[[], Iterable[torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


@dataclass
class FileJob:
    """One safetensors file: streamed pieces, then small constant tensors, and the header metadata."""

    path: Path
    pieces: list[Piece]
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=lambda: {"format": "pt"})

    def ordered_pieces(self) -> list[Piece]:
        """The pieces in file order: stably by their widest element, widest first (as safetensors itself orders
        tensors), so that each tensor starts at a multiple of its element size."""
        return sorted(self.pieces, key=lambda p: -max(_itemsize(s.dtype) for s in p.specs))

    def ordered_constants(self) -> list[tuple[str, torch.Tensor]]:
        return sorted(self.constants.items(), key=lambda kv: -kv[1].element_size())

    def specs(self) -> list[Spec]:
        streamed = [s for p in self.ordered_pieces() for s in p.specs]
        return streamed + [Spec(k, tuple(v.shape), v.dtype) for k, v in self.ordered_constants()]

    def header(self) -> bytes:
        return header_bytes(self.specs(), self.metadata)

    @property
    def nbytes(self) -> int:
        """Size of the file on disk."""
        return len(self.header()) + sum(s.nbytes for s in self.specs())


def header_bytes(specs: list[Spec], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length + JSON header (padded with spaces to 8 bytes) for tensors laid out in the order given.
    Raises ValueError when a tensor would start at an offset that is not a multiple of its element size."""
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for spec in specs:
        size = _itemsize(spec.dtype)
        if offset % size:
            raise ValueError(f"tensor '{spec.name}' ({spec.dtype}) would start at the unaligned offset {offset}")
        header[spec.name] = {"dtype": _ST_DTYPES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _raw_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def write_file(root: Path, job: FileJob) -> int:
    """Write `job` under `root` (temporary name, then renamed); returns the size in bytes. Each piece must yield
    exactly its planned bytes."""
    path = root / job.path

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(job.header())
            for piece in job.ordered_pieces():
                written = 0
                for t in piece.produce():
                    written += f.write(_raw_bytes(t))
                    del t
                if written != piece.nbytes:
                    names = ", ".join(s.name for s in piece.specs)
                    raise RuntimeError(f"{names}: produced {written} bytes, planned {piece.nbytes}")
            for _, t in job.ordered_constants():
                f.write(_raw_bytes(t))

    write_atomic(path, write)
    return path.stat().st_size


# ----------------------------------------------------------------------------------------------------- sharding
def split_by_size(pieces: list[Piece], shards: int) -> list[list[Piece]]:
    """Consecutive groups of about equal byte size (the official shards split the key order the same way)."""
    target = sum(p.nbytes for p in pieces) / shards
    groups: list[list[Piece]] = [[]]
    acc = 0
    for piece in pieces:
        if acc >= target * len(groups) and len(groups) < shards:
            groups.append([])
        groups[-1].append(piece)
        acc += piece.nbytes
    if len(groups) != shards:
        raise ValueError(f"{len(pieces)} tensors do not fill {shards} shards")
    return groups


def shard_jobs(folder: Path, stem: str, pieces: list[Piece], shards: int) -> tuple[list[FileJob], dict]:
    """`stem-0000k-of-0000n.safetensors` jobs and the content of their `stem.safetensors.index.json`."""
    jobs, weight_map = [], {}
    for i, group in enumerate(split_by_size(pieces, shards), start=1):
        name = f"{stem}-{i:05d}-of-{shards:05d}.safetensors"
        jobs.append(FileJob(folder / name, group))
        weight_map.update({s.name: name for p in group for s in p.specs})
    total = sum(p.nbytes for p in pieces)
    return jobs, {"metadata": {"total_size": total}, "weight_map": weight_map}


def write_json(root: Path, rel: Path, payload: object) -> int:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(json.dumps(payload, indent=2) + "\n", path)
    return path.stat().st_size


# ------------------------------------------------------------------------------------------------- random values
@dataclass(frozen=True)
class Init:
    """How a tensor's values are drawn: `normal` mean + std * N(0, 1), `log_uniform` log(U(low, high)), `zeros`."""

    kind: str
    a: float = 0.0
    b: float = 1.0


def chunk_seed(seed: int, name: str, index: int) -> int:
    return (int(seed) & 0xFFFFFFFF) << 32 | zlib.crc32(f"{name}#{index}".encode())


def draw(init: Init, shape: tuple[int, ...], seed: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    if init.kind == "zeros":
        return torch.zeros(shape, dtype=dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    if init.kind == "normal":
        x = torch.randn(shape, generator=g, device=device).mul_(init.b).add_(init.a)
    elif init.kind == "log_uniform":
        x = torch.rand(shape, generator=g, device=device).mul_(init.b - init.a).add_(init.a).log_()
    else:
        raise ValueError(f"unknown init {init.kind!r}")
    return x.to(dtype).cpu()


def _row_chunks(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Shapes of the row chunks a tensor is drawn in (one chunk for small tensors and 0-d ones)."""
    if len(shape) == 0 or math.prod(shape) <= CHUNK_ELEMENTS:
        return [shape]
    row = math.prod(shape[1:])
    rows = max(1, CHUNK_ELEMENTS // row)
    return [(min(rows, shape[0] - start), *shape[1:]) for start in range(0, shape[0], rows)]


class RandomSource:
    """Draws the row chunks of random tensors; on the CPU several chunks are drawn at once in threads (the torch CPU
    generator is single-threaded), ahead of the writer by at most 2 x threads chunks."""

    def __init__(self, seed: int, device: torch.device, threads: int | None = None):
        self.seed = seed
        self.device = device
        self.threads = 1 if device.type != "cpu" else max(1, threads or min(os.cpu_count() or 1, 16))
        self._pool = ThreadPoolExecutor(self.threads) if self.threads > 1 else None

    def chunks(self, spec: Spec, init: Init) -> Iterator[torch.Tensor]:
        tasks = [(shape, chunk_seed(self.seed, spec.name, i)) for i, shape in enumerate(_row_chunks(spec.shape))]
        if self._pool is None or len(tasks) == 1:
            for shape, s in tasks:
                yield draw(init, shape, s, self.device, spec.dtype)
            return
        pending: deque[Future] = deque()
        for shape, s in tasks:
            pending.append(self._pool.submit(draw, init, shape, s, self.device, spec.dtype))
            if len(pending) >= 2 * self.threads:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()

    def piece(self, spec: Spec, init: Init) -> Piece:
        return Piece([spec], lambda: self.chunks(spec, init))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
