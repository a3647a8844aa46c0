"""Safetensors plumbing: shard discovery, lazy per-tensor reading with key filters, fused/split adapters, atomic save.

Only safetensors files are ever read (no pickle). Two reading modes:
- memory-mapped (default) through `safetensors.safe_open`;
- `disable_mmap=True` (`--disable_mmap_load_safetensors`): the header is parsed here and each tensor's bytes are read
  with a plain seek + read, which avoids mmap page-cache pressure on network drives and some Windows setups.
In both modes a tensor is read only when asked for, so key filters cost nothing for the skipped tensors.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from library.errors import UserError

logger = logging.getLogger(__name__)

KeyFilter = Callable[[str], bool]

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}

_SHARD_RE = re.compile(r"^(?P<head>.*?)(?P<index>\d{5})-of-(?P<total>\d{5})(?P<tail>.*)$")


def check_safetensors_path(path: str | os.PathLike, what: str = "model file") -> Path:
    """Return `path` as a Path after checking it exists and is a .safetensors file (we load nothing else)."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"The {what} '{p}' does not exist: check the path.")
    if p.is_dir():
        raise UserError(f"The {what} '{p}' is a folder: give the path of a .safetensors file inside it.")
    if p.suffix != ".safetensors":
        raise UserError(
            f"The {what} '{p}' is not a .safetensors file: only safetensors are loaded (no pickle formats);"
            " convert it to safetensors first."
        )
    return p


def discover_shards(first_shard: str | os.PathLike) -> list[Path]:
    """All shards of a sharded checkpoint, given the first one (`...-00001-of-0000N...`); a plain file is its own list.

    Both `model-00001-of-00004.safetensors` and the hub's `model.safetensors-00001-of-00004.safetensors` spellings
    are understood. A missing sibling is a clear error, never a silently partial model.
    """
    p = check_safetensors_path(first_shard)
    m = _SHARD_RE.match(p.name)
    if m is None:
        return [p]
    total = int(m.group("total"))
    width = len(m.group("index"))
    if int(m.group("index")) != 1:
        logger.info("'%s' is shard %s of %d: loading all %d shards beside it", p.name, m.group("index"), total, total)
    shards = []
    for i in range(1, total + 1):
        name = f"{m.group('head')}{i:0{width}d}-of-{m.group('total')}{m.group('tail')}"
        shard = p.with_name(name)
        if not shard.exists():
            raise UserError(
                f"Shard '{name}' of the sharded checkpoint '{p}' is missing: all {total} shards must be in '{p.parent}'."
            )
        shards.append(shard)
    return shards


@dataclass(frozen=True)
class _TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict[str, _TensorInfo], dict[str, str], int]:
    """Parse a safetensors header: (tensor infos, metadata, byte offset of the data section)."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise ValueError("file shorter than 8 bytes")
            (n,) = struct.unpack("<Q", raw_len)
            if n > 100_000_000:
                raise ValueError(f"header length {n} is implausible")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        raise UserError(f"'{p}' is not a readable safetensors file ({e}): re-download or re-create it.") from e
    metadata = header.pop("__metadata__", None) or {}
    infos = {
        k: _TensorInfo(v["dtype"], tuple(v["shape"]), v["data_offsets"][0], v["data_offsets"][1])
        for k, v in header.items()
    }
    return infos, metadata, 8 + n


class SafetensorsFile:
    """One safetensors file read tensor by tensor (mmap or plain reads). Use as a context manager or call close()."""

    def __init__(self, path: str | os.PathLike, disable_mmap: bool = False):
        self.path = Path(path)
        self.disable_mmap = disable_mmap
        self._infos, self.metadata, self._data_start = read_safetensors_header(self.path)
        self._handle = None
        self._safe = None
        self.reads = 0  # number of tensors read, for tests and diagnostics

    def keys(self) -> list[str]:
        return list(self._infos)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._infos[key].shape

    def dtype(self, key: str) -> torch.dtype:
        return _DTYPES[self._infos[key].dtype]

    def get_tensor(self, key: str) -> torch.Tensor:
        self.reads += 1
        if not self.disable_mmap:
            if self._safe is None:
                from safetensors import safe_open

                self._safe = safe_open(str(self.path), framework="pt", device="cpu")
            return self._safe.get_tensor(key)
        info = self._infos[key]
        if self._handle is None:
            self._handle = open(self.path, "rb")
        self._handle.seek(self._data_start + info.start)
        buf = bytearray(self._handle.read(info.end - info.start))
        dtype = _DTYPES[info.dtype]
        if len(buf) == 0:
            return torch.empty(info.shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(info.shape)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        self._safe = None

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TensorSource:
    """A lazy view of the tensors of one or more safetensors files (the shards of one checkpoint).

    `key_filter` drops keys before anything is read; `key_map` renames the kept keys (return None to drop a key).
    """

    def __init__(
        self,
        paths: Iterable[str | os.PathLike],
        disable_mmap: bool = False,
        key_filter: KeyFilter | None = None,
        key_map: Callable[[str], str | None] | None = None,
    ):
        self.files = [SafetensorsFile(p, disable_mmap) for p in paths]
        self._where: dict[str, tuple[SafetensorsFile, str]] = {}
        for f in self.files:
            for k in f.keys():
                if key_filter is not None and not key_filter(k):
                    continue
                new_key = key_map(k) if key_map is not None else k
                if new_key is None:
                    continue
                if new_key in self._where:
                    raise UserError(f"Tensor '{new_key}' appears twice in the checkpoint ('{f.path}'): the files overlap.")
                self._where[new_key] = (f, k)

    @property
    def metadata(self) -> dict[str, str]:
        merged: dict[str, str] = {}
        for f in self.files:
            merged.update(f.metadata)
        return merged

    @property
    def reads(self) -> int:
        return sum(f.reads for f in self.files)

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def shape(self, key: str) -> tuple[int, ...]:
        f, k = self._where[key]
        return f.shape(k)

    def dtype(self, key: str) -> torch.dtype:
        f, k = self._where[key]
        return f.dtype(k)

    def get_tensor(self, key: str) -> torch.Tensor:
        f, k = self._where[key]
        return f.get_tensor(k)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for key in self.keys():
            yield key, self.get_tensor(key)

    def close(self) -> None:
        for f in self.files:
            f.close()

    def __enter__(self) -> "TensorSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class SplitSpec:
    """How one fused source tensor splits into named pieces along `dim` (e.g. qkv -> q, k, v)."""

    source_key: str
    new_keys: tuple[str, ...]
    sizes: tuple[int, ...]
    dim: int = 0


class SplitTensorAdapter:
    """Wraps a TensorSource and serves the pieces of fused tensors under their new names.

    Each fused source tensor is read ONCE: the first request for any of its pieces reads and splits it, and the other
    pieces wait in a cache keyed by their NEW names until they are asked for (then they leave the cache). Keys that are
    not part of a split pass through unchanged.
    """

    def __init__(self, source: TensorSource, splits: Iterable[SplitSpec]):
        self.source = source
        self._piece_of: dict[str, tuple[SplitSpec, int]] = {}
        self._split_sources: set[str] = set()
        for spec in splits:
            self._split_sources.add(spec.source_key)
            for i, k in enumerate(spec.new_keys):
                self._piece_of[k] = (spec, i)
        self._cache: dict[str, torch.Tensor] = {}

    def keys(self) -> list[str]:
        plain = [k for k in self.source.keys() if k not in self._split_sources]
        return plain + list(self._piece_of)

    def __contains__(self, key: str) -> bool:
        return key in self._piece_of or (key in self.source and key not in self._split_sources)

    def shape(self, key: str) -> tuple[int, ...]:
        if key in self._piece_of:
            spec, i = self._piece_of[key]
            shape = list(self.source.shape(spec.source_key))
            shape[spec.dim] = spec.sizes[i]
            return tuple(shape)
        return self.source.shape(key)

    def dtype(self, key: str) -> torch.dtype:
        if key in self._piece_of:
            return self.source.dtype(self._piece_of[key][0].source_key)
        return self.source.dtype(key)

    def get_tensor(self, key: str) -> torch.Tensor:
        if key not in self._piece_of:
            return self.source.get_tensor(key)
        if key in self._cache:
            return self._cache.pop(key)
        spec, index = self._piece_of[key]
        fused = self.source.get_tensor(spec.source_key)
        if fused.shape[spec.dim] != sum(spec.sizes):
            raise UserError(
                f"Tensor '{spec.source_key}' has size {fused.shape[spec.dim]} along dim {spec.dim}, expected"
                f" {sum(spec.sizes)} (= {' + '.join(map(str, spec.sizes))}): the checkpoint does not match the model config."
            )
        pieces = torch.split(fused, list(spec.sizes), dim=spec.dim)
        for i, (k, piece) in enumerate(zip(spec.new_keys, pieces)):
            if i != index:
                self._cache[k] = piece
        return pieces[index]


def load_safetensors(
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    disable_mmap: bool = False,
    key_filter: KeyFilter | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Read one safetensors file into a dict (only the keys passing `key_filter`); floating tensors cast to `dtype`."""
    p = check_safetensors_path(path)
    out: dict[str, torch.Tensor] = {}
    with TensorSource([p], disable_mmap=disable_mmap, key_filter=key_filter) as src:
        for k in src.keys():
            t = src.get_tensor(k)
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            out[k] = t.to(device)
    return out


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The `__metadata__` dict of a safetensors file (empty when absent)."""
    return read_safetensors_header(check_safetensors_path(path))[1]


def _default_mode() -> int:
    """The permissions a plainly created file gets (0o666 less the umask); mkstemp's 0o600 would hide shared files."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def write_atomic(path: str | os.PathLike, write: Callable[[str], None], suffix: str = ".tmp") -> Path:
    """Call `write(temp_path)` on a temp file beside `path`, give it the usual permissions and rename it over `path`:
    a reader never sees a half-written file, and a failure leaves neither the file nor the temp file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=suffix, dir=p.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, _default_mode())
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return p


def save_file_atomic(
    tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str] | None = None
) -> None:
    """Write a safetensors file atomically (see `write_atomic`)."""
    from safetensors.torch import save_file

    contiguous = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    write_atomic(path, lambda tmp: save_file(contiguous, tmp, metadata=meta or None))


def write_text_atomic(text: str, path: str | os.PathLike) -> None:
    """Write a small text file (JSON config, etc.) atomically."""
    write_atomic(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def describe_key_mismatch(what: str, path: str | os.PathLike, missing: list[str], unexpected: list[str]) -> str:
    """One sentence for a checkpoint whose keys do not match the model (first few of each, with counts)."""

    def few(keys: list[str]) -> str:
        head = ", ".join(sorted(keys)[:5])
        return head + (", ..." if len(keys) > 5 else "")

    parts = []
    if missing:
        parts.append(f"{len(missing)} missing ({few(missing)})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected ({few(unexpected)})")
    return (
        f"The {what} '{path}' does not match the model: {'; '.join(parts)} keys;"
        " check that the file is the right model (and not a LoRA or another architecture)."
    )
