"""Safetensors plumbing: shard discovery, lazy per-tensor reading with key filters, fused/split adapters, atomic save.

Only safetensors files are ever read (no pickle). Two reading modes:
- memory-mapped (default) through `safetensors.safe_open`;
- `disable_mmap=True` (`--disable_mmap_load_safetensors`): the header is parsed here and each tensor's bytes are read
  with a plain seek + read, which avoids mmap page-cache pressure on network drives and some Windows setups.
In both modes a tensor is read only when asked for, so key filters cost nothing for the skipped tensors. Before either
mode reads anything, the header is checked against the file: every tensor's byte range must match its dtype and shape
and lie inside the file, so a truncated or tampered file is one sentence, never a crash in the mmap reader.

Reading straight to a GPU (`TensorSource.iter_tensors(keys, device)`, `stream_tensors`): the wanted byte ranges are
read in file order, in chunks of `STAGING_BYTES`, by `READ_THREADS` threads (plain `preadv`, no mmap, whatever
`disable_mmap` says) into a few pinned staging buffers, and copied from there into each tensor's own device memory
with asynchronous copies; a staging buffer is refilled once its copies are done (a CUDA event). No tensor ever exists
in pageable host memory, and the threads overlap the reads with the copies. For the CPU the per-tensor path above is
kept (memory-mapped tensors need no copy at all). `DIRECT_DEVICE_READS = False` turns the staged path off (each
tensor is then read to the CPU and moved with `.to(device)`, as before): for comparisons in `bench.loading`, which
also reads `STREAM_TIMES` (where the staged reads spent the host's time). The pinned buffers come from torch's cache
of pinned memory, so a later load of the same process does not pin memory again.

Writing (`write_atomic` and the savers built on it): a temp file beside the target, `.<name>.<8 random chars><suffix>`
(`TEMP_NAME_RE`; `leftover_temp_files` finds those of a killed writer), flushed and fsynced, renamed over the target,
then the folder fsynced, so neither a crash nor a power cut leaves a half-written file. A full disk, a read-only
folder or any other OS error becomes one sentence naming the file, and the temp file is removed.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import shutil
import struct
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from library.errors import UserError

logger = logging.getLogger(__name__)

KeyFilter = Callable[[str], bool]
TensorHook = Callable[[str, torch.Tensor], torch.Tensor]  # (model key, tensor) -> tensor, e.g. a LoRA merge

STAGING_BYTES = 64 * 2**20  # one staging buffer (and one read): large reads, few copies
STAGING_BUFFERS = 4  # buffers in flight: reads of the next chunks overlap the copies of this one
READ_THREADS = 4  # preadv releases the GIL; a few threads read the page cache faster than one
READ_GAP_BYTES = 2**20  # skipped bytes (unwanted tensors) up to this size are read through, not seeked over
DIRECT_DEVICE_READS = True  # False: the per-tensor path (read to the CPU, then .to(device)); for bench.loading

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

# bytes per element of every safetensors dtype (also those torch cannot read here), for the header check
_ITEM_SIZES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2,
    "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "C64": 8,
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
    """Parse a safetensors header: (tensor infos, metadata, byte offset of the data section). The header is checked
    against the file (`_check_tensor_ranges`): a damaged or truncated file is a UserError naming it."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise ValueError("file shorter than 8 bytes")
            (n,) = struct.unpack("<Q", raw_len)
            if n > 100_000_000 or 8 + n > size:
                raise ValueError(f"header length {n} does not fit in the file of {size} bytes")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        infos = {k: _tensor_info(k, v) for k, v in header.items()}
        _check_tensor_ranges(infos, size - 8 - n)
    except (OSError, ValueError) as e:
        raise UserError(f"'{p}' is not a readable safetensors file ({e}): it is damaged or truncated; re-download or"
                        " re-create it.") from e
    return infos, metadata, 8 + n


def _tensor_info(key: str, entry: object) -> _TensorInfo:
    """One header entry, its types checked (ValueError naming the tensor otherwise)."""
    try:
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]  # type: ignore[index]
        if not (isinstance(dtype, str) and isinstance(shape, list) and isinstance(offsets, list) and len(offsets) == 2):
            raise TypeError
        if not all(isinstance(v, int) and v >= 0 for v in (*shape, *offsets)):
            raise TypeError
    except (KeyError, TypeError) as e:
        raise ValueError(f"tensor '{key}' has a malformed header entry") from e
    return _TensorInfo(dtype, tuple(shape), offsets[0], offsets[1])


def _check_tensor_ranges(infos: dict[str, _TensorInfo], data_size: int) -> None:
    """Every tensor's bytes lie inside the data section and have the size its dtype and shape call for."""
    for key, info in infos.items():
        if info.end > data_size or info.start > info.end:
            raise ValueError(f"tensor '{key}' spans bytes {info.start} to {info.end} of a data section of {data_size}"
                             " bytes (the file is truncated)")
        item = _ITEM_SIZES.get(info.dtype)
        if item is not None and info.end - info.start != math.prod(info.shape) * item:
            raise ValueError(f"tensor '{key}' ({info.dtype}, shape {list(info.shape)}) has {info.end - info.start}"
                             " bytes instead of the size its dtype and shape give")


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


# ----------------------------------------------------------------------------------- staged reads to a device
@dataclass
class _Chunk:
    """One read: bytes [start, end) of the file, copied to pieces of tensors (tensor index, offset in the tensor's
    bytes, offset in the chunk, length)."""

    start: int
    end: int
    pieces: list[tuple[int, int, int, int]] = field(default_factory=list)
    completes: list[int] = field(default_factory=list)  # tensors whose last bytes are in this chunk


def plan_chunks(spans: Sequence[tuple[int, int]], chunk_bytes: int = STAGING_BYTES,
                gap_bytes: int = READ_GAP_BYTES) -> list[_Chunk]:
    """Reads of at most `chunk_bytes` that cover the byte ranges `spans` (sorted by start, not overlapping, none
    empty): gaps up to `gap_bytes` are read through, a larger one starts a new read; a tensor larger than a chunk
    spans several."""
    chunks: list[_Chunk] = []
    current: _Chunk | None = None
    for index, (start, end) in enumerate(spans):
        pos = start
        while pos < end:
            if current is None or pos > current.end + gap_bytes or pos >= current.start + chunk_bytes:
                current = _Chunk(pos, pos)
                chunks.append(current)
            take = min(end, current.start + chunk_bytes) - pos
            current.pieces.append((index, pos - start, pos - current.start, take))
            pos += take
            current.end = pos
        current.completes.append(index)  # type: ignore[union-attr]
    return chunks


@dataclass
class StreamTimes:
    """Where `stream_tensors` spent the host's time, summed over its calls (seconds; for `bench.loading`): making
    the staging buffers and the threads (`setup_s`), waiting for the reader threads (`read_wait_s`), queueing the
    copies to the device (`copy_s`), in the caller between two tensors (`consumer_s`: the loader's cast, tensor hook
    and bookkeeping) and waiting for the last copies at the end (`drain_s`)."""

    calls: int = 0
    bytes: int = 0
    setup_s: float = 0.0
    read_wait_s: float = 0.0
    copy_s: float = 0.0
    consumer_s: float = 0.0
    drain_s: float = 0.0

    def reset(self) -> None:
        for name, value in StreamTimes().__dict__.items():
            setattr(self, name, value)

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in self.__dict__.items()}


STREAM_TIMES = StreamTimes()


def _read_exactly(fd: int, view: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise UserError(f"'{path}' ended while reading its tensors (byte {offset + done}): the file was truncated"
                            " or replaced during the load; re-download or re-create it.")
        done += n


class _Staging:
    """The staging buffers (pinned for CUDA) and, per buffer, the event that marks its copies as done."""

    def __init__(self, device: torch.device, chunk_bytes: int, count: int):
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.current_stream(device) if self.cuda else None  # where the copies to `device` go
        self.buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=self.cuda) for _ in range(count)]
        self.views = [memoryview(b.numpy()) for b in self.buffers]
        self.events = [torch.cuda.Event() if self.cuda else None for _ in range(count)]
        self.used = [False] * count

    def wait(self, slot: int) -> None:
        """Block until the copies out of buffer `slot` are done (they were queued before this is called)."""
        event = self.events[slot]
        if event is not None and self.used[slot]:
            event.synchronize()  # releases the GIL

    def record(self, slot: int) -> None:
        event = self.events[slot]
        if event is not None:
            event.record(self.stream)
        self.used[slot] = True

    def drain(self) -> None:
        for slot in range(len(self.buffers)):
            self.wait(slot)


def stream_tensors(
    file: SafetensorsFile, keys: Sequence[str], device: str | torch.device,
    chunk_bytes: int | None = None, buffers: int | None = None, threads: int | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(key, tensor)` for `keys` of `file`, each tensor in its own memory on `device`, in file order (see
    the module docstring; None takes `STAGING_BYTES` / `STAGING_BUFFERS` / `READ_THREADS`). On CUDA the copies are
    queued on the current stream: work queued after the yield on that stream sees the data; the host needs a
    synchronize before reading it."""
    device = torch.device(device)
    chunk_bytes = chunk_bytes or STAGING_BYTES
    buffers = buffers or STAGING_BUFFERS
    threads = threads or READ_THREADS
    infos = [(k, file._infos[k]) for k in keys]
    for key, info in infos:
        if info.dtype not in _DTYPES:
            raise UserError(f"Tensor '{key}' of '{file.path}' has the dtype {info.dtype}, which cannot be loaded here.")
    ordered = sorted((info.start, key) for key, info in infos)
    empty = [key for start, key in ordered if file._infos[key].end == file._infos[key].start]
    wanted = [key for start, key in ordered if file._infos[key].end > file._infos[key].start]
    for key in empty:
        yield key, torch.empty(file._infos[key].shape, dtype=_DTYPES[file._infos[key].dtype], device=device)
    if not wanted:
        return
    base = file._data_start
    spans = [(base + file._infos[k].start, base + file._infos[k].end) for k in wanted]
    chunks = plan_chunks(spans, chunk_bytes)
    targets: list[torch.Tensor | None] = [None] * len(wanted)
    times = STREAM_TIMES
    began = time.perf_counter()
    staging = _Staging(device, min(chunk_bytes, max(c.end - c.start for c in chunks)), buffers)
    fd = os.open(file.path, os.O_RDONLY)
    pool = ThreadPoolExecutor(max_workers=max(1, min(threads, buffers)), thread_name_prefix="safetensors-read")
    file.reads += len(wanted)
    times.calls += 1
    times.bytes += sum(end - start for start, end in spans)
    times.setup_s += time.perf_counter() - began

    def fill(index: int) -> None:
        slot = index % buffers
        staging.wait(slot)
        chunk = chunks[index]
        _read_exactly(fd, staging.views[slot][: chunk.end - chunk.start], chunk.start, file.path)

    pending: dict[int, Future[None]] = {}
    try:
        for index in range(min(buffers, len(chunks))):
            pending[index] = pool.submit(fill, index)
        for index, chunk in enumerate(chunks):
            began = time.perf_counter()
            pending.pop(index).result()
            queued = time.perf_counter()
            times.read_wait_s += queued - began
            slot = index % buffers
            source = staging.buffers[slot]
            for tensor_index, at, offset, length in chunk.pieces:
                target = targets[tensor_index]
                if target is None:
                    info = file._infos[wanted[tensor_index]]
                    target = torch.empty(info.end - info.start, dtype=torch.uint8, device=device)
                    targets[tensor_index] = target
                target[at : at + length].copy_(source[offset : offset + length], non_blocking=staging.cuda)
            staging.record(slot)
            if index + buffers < len(chunks):
                pending[index + buffers] = pool.submit(fill, index + buffers)
            times.copy_s += time.perf_counter() - queued
            for tensor_index in chunk.completes:
                info = file._infos[wanted[tensor_index]]
                raw = targets[tensor_index]
                targets[tensor_index] = None
                assert raw is not None  # every non-empty tensor has pieces in the chunks before its last one
                away = time.perf_counter()
                yield wanted[tensor_index], raw.view(_DTYPES[info.dtype]).reshape(info.shape)
                times.consumer_s += time.perf_counter() - away
    finally:
        began = time.perf_counter()
        for future in pending.values():
            future.cancel()
        pool.shutdown(wait=True)
        staging.drain()
        os.close(fd)
        times.drain_s += time.perf_counter() - began


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

    def iter_tensors(
        self, keys: Iterable[str], device: str | torch.device = "cpu", staged: bool | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(key, tensor)` for `keys`, on `device`: with `staged` (default: for CUDA, unless
        `DIRECT_DEVICE_READS` is off) file by file in file order through `stream_tensors`, else in the given order,
        `get_tensor(key).to(device)` per tensor."""
        device = torch.device(device)
        keys = list(keys)
        if staged is None:
            staged = device.type == "cuda" and DIRECT_DEVICE_READS
        if not staged:
            for key in keys:
                yield key, self.get_tensor(key).to(device)
            return
        by_file: dict[int, list[str]] = {}
        names: dict[tuple[int, str], str] = {}
        for key in keys:
            f, k = self._where[key]
            by_file.setdefault(id(f), []).append(k)
            names[(id(f), k)] = key
        for f in self.files:
            if id(f) in by_file:
                for k, tensor in stream_tensors(f, by_file[id(f)], device):
                    yield names[(id(f), k)], tensor

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
        pieces = self._split(spec, fused)
        for i, (k, piece) in enumerate(zip(spec.new_keys, pieces)):
            if i != index:
                self._cache[k] = piece
        return pieces[index]

    def _split(self, spec: SplitSpec, fused: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if fused.shape[spec.dim] != sum(spec.sizes):
            raise UserError(
                f"Tensor '{spec.source_key}' has size {fused.shape[spec.dim]} along dim {spec.dim}, expected"
                f" {sum(spec.sizes)} (= {' + '.join(map(str, spec.sizes))}): the checkpoint does not match the model"
                " config."
            )
        return torch.split(fused, list(spec.sizes), dim=spec.dim)

    def iter_tensors(
        self, keys: Iterable[str], device: str | torch.device = "cpu", staged: bool | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(key, tensor)` for `keys` (new names) on `device`, as `TensorSource.iter_tensors` reads them; a
        fused tensor is read once and its wanted pieces are yielded together."""
        keys = list(keys)
        wanted = set(keys)
        plain = [k for k in keys if k not in self._piece_of]
        fused = list(dict.fromkeys(self._piece_of[k][0].source_key for k in keys if k in self._piece_of))
        specs = {self._piece_of[k][0].source_key: self._piece_of[k][0] for k in keys if k in self._piece_of}
        for key, tensor in self.source.iter_tensors(plain + fused, device, staged):
            spec = specs.get(key) if key in self._split_sources else None
            if spec is None:
                yield key, tensor
                continue
            for new_key, piece in zip(spec.new_keys, self._split(spec, tensor)):
                if new_key in wanted:  # on a GPU each piece gets its own memory (a merged q frees its old one)
                    yield new_key, piece.clone() if piece.device.type == "cuda" else piece


# ------------------------------------------------------------------------------------------ loader helpers
def read_device(loading_device: torch.device) -> torch.device:
    """Where the tensors are read to: the loading device (straight to the GPU), or the CPU with the staged reads
    off (`DIRECT_DEVICE_READS`: the per-tensor path, read to the CPU and moved after the cast)."""
    return loading_device if DIRECT_DEVICE_READS else torch.device("cpu")


def load_dtype_for_hook(checkpoint_dtype: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor hook gets a float tensor in: one that holds both the checkpoint's values and the model's
    (bf16 -> fp32 gives fp32; bf16 -> bf16 bf16; fp32 -> bf16 fp32; fp16 -> bf16 fp32), so the hook's result is
    rounded once, by the final cast to `dtype`."""
    return checkpoint_dtype if dtype is None else torch.promote_types(checkpoint_dtype, dtype)


def hooked_tensor(key: str, t: torch.Tensor, dtype: torch.dtype | None, hook: TensorHook | None) -> torch.Tensor:
    """A tensor as read, through `hook` (in `load_dtype_for_hook`'s dtype) and cast to `dtype` (floats only)."""
    if not t.is_floating_point():
        return hook(key, t) if hook is not None else t
    if hook is not None:
        t = hook(key, t.to(load_dtype_for_hook(t.dtype, dtype)))
    return t.to(dtype) if dtype is not None else t


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


# the temp files of `write_atomic`: "." + the target's name + "." + mkstemp's 8 random characters + the suffix
TEMP_NAME_RE = re.compile(r"^\.(?P<target>.+)\.[a-z0-9_]{8}(?P<suffix>\.tmp(\.npz)?)$")


def leftover_temp_files(folder: str | os.PathLike, target: Callable[[str], bool]) -> list[Path]:
    """The temp files `write_atomic` left in `folder` (a writer killed before its rename) whose target name passes
    `target`; only that naming pattern is ever matched."""
    p = Path(folder)
    if not p.is_dir():
        return []
    found = []
    for entry in p.iterdir():
        m = TEMP_NAME_RE.match(entry.name)
        if m and entry.is_file() and target(m.group("target")):
            found.append(entry)
    return sorted(found)


STALE_TEMP_SECONDS = 600  # a temp file this old belongs to a killed writer (a write takes seconds)


def remove_stale_temp_files(targets: Iterable[str | os.PathLike], older_than: float = STALE_TEMP_SECONDS) -> int:
    """Remove the temp files of `targets` (files written with `write_atomic`) that killed writers left, once they are
    `older_than` seconds old: for folders that other processes may be writing at the same moment (cache files), where
    a younger temp file may be a live write. Returns how many were removed."""
    by_folder: dict[Path, set[str]] = {}
    for target in targets:
        t = Path(target)
        by_folder.setdefault(t.parent, set()).add(t.name)
    removed = 0
    now = time.time()
    for folder, names in by_folder.items():
        for path in leftover_temp_files(folder, names.__contains__):
            try:
                if now - path.stat().st_mtime >= older_than:
                    path.unlink()
                    removed += 1
            except OSError:
                pass  # removed meanwhile, or not ours to remove
    if removed:
        logger.info("removed %d temp files left by interrupted writes", removed)
    return removed


def fsync_folder(folder: str | os.PathLike) -> None:
    """Make a rename or a new entry in `folder` durable (a no-op where folders cannot be opened, as on Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems do not sync folders; the rename itself is still atomic
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike) -> None:
    """Flush a written file's data to the disk (opened for writing: Windows flushes only such handles)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except PermissionError:  # a read-only file: POSIX flushes through any handle
        fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class WriteError(UserError, OSError):
    """A write that failed for an OS reason (disk full, read-only folder, ...), as one sentence. It is an OSError too,
    with the errno of the cause, so callers that tolerate failed writes (caches of hashes, say) keep doing so."""

    @staticmethod
    def of(cause: OSError, what: str, folder: str | os.PathLike) -> "WriteError":
        error = WriteError(describe_os_error(cause, what, folder))
        error.errno = cause.errno
        return error


NEARLY_FULL_BYTES = 64 * 2**20  # a write that failed with less free space than this failed for want of room
_OS_ERROR_CODE_RE = re.compile(r"os error (\d+)")


def as_os_error(e: BaseException, folder: str | os.PathLike) -> OSError | None:
    """The OS error behind a failed write: an OSError itself; the errno that safetensors (Rust: "os error 28") gives
    in its message; ENOSPC when a writer that reports no errno (torch.save: "unexpected pos ...") failed on a disk
    with almost no room left; else None."""
    if isinstance(e, OSError):
        return e
    m = _OS_ERROR_CODE_RE.search(str(e))
    if m:
        code = int(m.group(1))
        return OSError(code, os.strerror(code))
    try:
        nearly_full = shutil.disk_usage(folder).free < NEARLY_FULL_BYTES
    except OSError:
        nearly_full = False
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) if nearly_full else None


def describe_os_error(e: OSError, what: str, folder: str | os.PathLike) -> str:
    """One sentence for an OS error while writing `what` in `folder`: disk full, read-only, not allowed, ..."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = f" ({shutil.disk_usage(folder).free / 2**20:.0f} MiB free)"
        except OSError:
            free = ""
        return (f"No space left on the disk of '{folder}'{free} while writing {what}: free some space or choose"
                " another folder (nothing was half-written; an earlier file of that name is unchanged).")
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return (f"'{folder}' is not writable ({e.strerror}) while writing {what}: choose a folder you can write to"
                " or change its permissions.")
    if e.errno == errno.ENOTDIR or (e.errno == errno.EEXIST and Path(folder).exists() and not Path(folder).is_dir()):
        return f"'{folder}' is a file, not a folder, so {what} cannot be written there: give a folder."
    return f"Writing {what} in '{folder}' failed ({e.strerror or e}): check the folder and the disk."


def write_atomic(path: str | os.PathLike, write: Callable[[str], None], suffix: str = ".tmp") -> Path:
    """Call `write(temp_path)` on a temp file beside `path`, give it the usual permissions, fsync it and rename it
    over `path`, then fsync the folder: a reader never sees a half-written file, and a failure leaves neither the
    file nor the temp file. An OS error (disk full, read-only folder, ...) is a UserError naming the file."""
    p = Path(path)
    tmp: str | None = None
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=suffix, dir=p.parent)
        os.close(fd)
        write(tmp)
        os.chmod(tmp, _default_mode())
        fsync_file(tmp)
        os.replace(tmp, p)
        tmp = None
        fsync_folder(p.parent)
    except Exception as e:
        os_error = as_os_error(e, p.parent if p.parent.is_dir() else p.parent.parent)
        if os_error is None:
            raise
        raise WriteError.of(os_error, f"'{p.name}'", p.parent) from e
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
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
