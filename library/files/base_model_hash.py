"""The base-model keys of a LoRA's metadata, as sd-scripts' train_network.py writes them, without slowing the start.

For the DiT (`sd_model`) and the VAE (`vae`):
- `ss_<model>_name`: the file name (never the folder it is in);
- `ss_<model>_hash`: the old 8-digit model hash of stable-diffusion-webui: the first 8 hex digits of the sha256 of
  the 64 KiB at offset 0x100000 (sd-scripts' `model_hash`); read at once (it costs one 64 KiB read);
- `ss_new_<model>_hash`: the sha256 (64 hex digits) of the whole file (sd-scripts' `calculate_sha256`, what
  stable-diffusion-webui and Civitai call the SHA256 / AutoV2 hash).

A sharded checkpoint (`diffusion_pytorch_model-00001-of-00003.safetensors`, ...) is treated as one file: its shards
concatenated in order. The name is the first shard's, the old hash reads the 64 KiB at 0x100000 of the
concatenation (inside the first shard whenever that is larger than 1.06 MB), and the sha256 is that of the
concatenation, so `cat diffusion_pytorch_model-0000*-of-00003.safetensors | sha256sum` gives it. For a single file
(a ComfyUI checkpoint, flux2-vae.safetensors) all three are exactly sd-scripts' values.

The sha256 of a 10 GB checkpoint takes seconds to minutes, so sd-scripts' way (hash before training) is not
followed: `BaseModelHashes.start()` hashes in a background thread beside the training, and a JSON cache in the
user's cache folder (`cache_dir()`) remembers the result by path, size and modification time, so a second run on
the same files has it at once. A save made before the thread is done leaves `ss_new_<model>_hash` out of that file;
`metadata(wait=True)` (the final save) waits for it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from library.files.safetensors_io import write_text_atomic

logger = logging.getLogger(__name__)

LEGACY_HASH_OFFSET = 0x100000
LEGACY_HASH_LENGTH = 0x10000
READ_BLOCK = 1 << 22

CACHE_DIR_ENV = "MOSS_IMAGE_SCRIPTS_CACHE"
CACHE_FILE_NAME = "model_hashes.json"
CACHE_VERSION = 1


# ------------------------------------------------------------------------------------------------ hashing
def legacy_model_hash(files: Sequence[str | os.PathLike]) -> str:
    """sd-scripts' `model_hash` of the concatenation of `files`: sha256 of the 64 KiB at 0x100000, 8 hex digits
    (the sha256 of nothing, e3b0c442, for a model smaller than 1 MiB, as sd-scripts gives)."""
    return hashlib.sha256(_read_span(files, LEGACY_HASH_OFFSET, LEGACY_HASH_LENGTH)).hexdigest()[:8]


def _read_span(files: Sequence[str | os.PathLike], offset: int, length: int) -> bytes:
    out = bytearray()
    for path in files:
        size = os.path.getsize(path)
        if offset >= size:
            offset -= size
            continue
        with open(path, "rb") as f:
            f.seek(offset)
            out += f.read(length - len(out))
        offset = 0
        if len(out) >= length:
            break
    return bytes(out)


def sha256_of_files(files: Sequence[str | os.PathLike], block: int = READ_BLOCK) -> str:
    """sha256 (hex) of the concatenation of `files`, streamed (sd-scripts' `calculate_sha256` for one file)."""
    digest = hashlib.sha256()
    buffer = bytearray(block)
    view = memoryview(buffer)
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                digest.update(view[:n])
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------------ cache
def cache_dir() -> Path:
    """Where the hash cache lives: $MOSS_IMAGE_SCRIPTS_CACHE, else $XDG_CACHE_HOME/moss-image-scripts, else
    %LOCALAPPDATA%\\moss-image-scripts on Windows, else ~/.cache/moss-image-scripts."""
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "moss-image-scripts"
    local = os.environ.get("LOCALAPPDATA")
    if os.name == "nt" and local:
        return Path(local) / "moss-image-scripts"
    return Path.home() / ".cache" / "moss-image-scripts"


def _signature(files: Sequence[Path]) -> list[list[str | int]]:
    """(absolute path, size, mtime in ns) of each file: a cached hash holds while these are unchanged."""
    out: list[list[str | int]] = []
    for f in files:
        st = os.stat(f)
        out.append([str(Path(f).resolve()), st.st_size, st.st_mtime_ns])
    return out


class HashCache:
    """sha256 of model files by (path, size, mtime): one small JSON file; unreadable or unwritable means no cache."""

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = Path(path) if path is not None else cache_dir() / CACHE_FILE_NAME
        self._lock = threading.Lock()

    @staticmethod
    def _key(signature: list[list[str | int]]) -> str:
        return "\n".join(str(entry[0]) for entry in signature)

    def _read(self) -> dict[str, dict]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or not isinstance(data.get("entries"), dict):
            return {}
        return data["entries"]

    def get(self, files: Sequence[Path]) -> str | None:
        signature = _signature(files)
        entry = self._read().get(self._key(signature))
        if isinstance(entry, dict) and entry.get("files") == signature and isinstance(entry.get("sha256"), str):
            return entry["sha256"]
        return None

    def put(self, files: Sequence[Path], sha256: str) -> None:
        signature = _signature(files)
        with self._lock:
            entries = self._read()
            entries[self._key(signature)] = {"files": signature, "sha256": sha256}
            try:
                write_text_atomic(json.dumps({"version": CACHE_VERSION, "entries": entries}, indent=1), self.path)
            except OSError as e:
                logger.debug("the model hash cache '%s' cannot be written (%s): hashes are not cached", self.path, e)


# ------------------------------------------------------------------------------------------------ run
@dataclass(frozen=True)
class _Model:
    key: str  # "sd_model" or "vae": the middle of the metadata key names
    files: tuple[Path, ...]


def _lower_thread_priority() -> None:
    """The hashing thread yields the CPU to the training (Linux: a thread has its own nice value)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


class BaseModelHashes:
    """The base-model keys of one run. `models`: {"sd_model": [files], "vae": [files]} (a sharded model: its shards
    in order). Names and old hashes are read in the constructor; `start()` computes the sha256s not in the cache in
    a daemon thread."""

    def __init__(self, models: Mapping[str, Sequence[str | os.PathLike]], cache: HashCache | None = None) -> None:
        self.models = [_Model(key, tuple(Path(f) for f in files)) for key, files in models.items() if files]
        self.cache = cache
        self._base: dict[str, str] = {}
        self._sha256: dict[str, str] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        for m in self.models:
            self._base[f"ss_{m.key}_name"] = m.files[0].name
            self._base[f"ss_{m.key}_hash"] = legacy_model_hash(m.files)
            cached = self._cached(m)
            if cached is not None:
                self._sha256[m.key] = cached

    def _cached(self, model: _Model) -> str | None:
        if self.cache is None:
            return None
        try:
            return self.cache.get(model.files)
        except OSError:
            return None

    def start(self) -> BaseModelHashes:
        todo = [m for m in self.models if m.key not in self._sha256]
        if todo:
            self._thread = threading.Thread(target=self._hash_all, args=(todo,), name="base-model-sha256", daemon=True)
            self._thread.start()
        return self

    def _hash_all(self, todo: list[_Model]) -> None:
        _lower_thread_priority()
        for m in todo:
            try:
                digest = sha256_of_files(m.files)
            except OSError as e:
                logger.warning("cannot hash the base model file '%s' (%s): ss_new_%s_hash is left out",
                               m.files[0].name, e, m.key)
                continue
            with self._lock:
                self._sha256[m.key] = digest
            if self.cache is not None:
                self.cache.put(m.files, digest)

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def pending_keys(self) -> list[str]:
        """The ss_new_*_hash keys not known yet."""
        with self._lock:
            return [f"ss_new_{m.key}_hash" for m in self.models if m.key not in self._sha256]

    def metadata(self, wait: bool = False) -> dict[str, str]:
        """The keys known now (with `wait`, after the background hashing has finished)."""
        if wait and not self.done():
            logger.info("waiting for the sha256 of the base model files (%s)", ", ".join(self.pending_keys()))
            self._thread.join()
        with self._lock:
            return {**self._base, **{f"ss_new_{key}_hash": value for key, value in self._sha256.items()}}
