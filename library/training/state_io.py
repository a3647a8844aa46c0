"""Training-state folders written atomically and verified before they are used.

A state folder `<stem>-state/` is never written in place. The files (accelerate's `optimizer.bin`, `scheduler.bin`,
`random_states_<i>.pkl`, ..., and the trainer's own) go into a temp folder beside it, `.<stem>-state.tmp/`; then
every file is fsynced, `manifest.json` (the name, size and sha256 of every other file) is written last, and the temp
folder is renamed into place. A folder that exists already is first renamed aside to `.<stem>-state.old/` and removed
only after the new one is in place, so at every moment one whole state exists under a known name: a process killed at
any point leaves either the previous state or the new one (`recover` puts back the one an interrupted rename left
aside). A folder is accepted for `--resume` only when its files match the manifest exactly: nothing missing, nothing
extra, every size and hash the same; anything else is a sentence naming the file.

The temp and aside folders (`TEMP_SUFFIX`, `OLD_SUFFIX`) are recognised by their names; `leftover_folders` lists those
a killed save left, so the trainer can remove them at the start (only its own, under its output lock).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from library.errors import UserError
from library.files.safetensors_io import WriteError, as_os_error, fsync_file, fsync_folder, write_text_atomic

logger = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "moss-image-scripts training state"
MANIFEST_VERSION = 1
TEMP_SUFFIX = ".tmp"  # `.<name>.tmp/`: a state being written
OLD_SUFFIX = ".old"  # `.<name>.old/`: the state being replaced, until the new one is in place
_HASH_CHUNK = 4 * 2**20


def temp_folder(folder: Path) -> Path:
    return folder.parent / f".{folder.name}{TEMP_SUFFIX}"


def old_folder(folder: Path) -> Path:
    return folder.parent / f".{folder.name}{OLD_SUFFIX}"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


def _walk(folder: Path) -> list[str]:
    """The files of a folder (subfolders included) as relative POSIX names, sorted."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def write_manifest(folder: Path) -> dict[str, FileEntry]:
    """fsync every file of `folder`, then write its manifest (last, itself atomic) and fsync the folder."""
    entries: dict[str, FileEntry] = {}
    for name in _walk(folder):
        if name == MANIFEST_FILE:
            continue
        path = folder / name
        fsync_file(path)
        entries[name] = FileEntry(path.stat().st_size, sha256_of(path))
    body = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION,
            "files": {k: {"size": v.size, "sha256": v.sha256} for k, v in entries.items()}}
    write_text_atomic(json.dumps(body, indent=1), folder / MANIFEST_FILE)
    fsync_folder(folder)
    return entries


def read_manifest(folder: Path) -> dict[str, FileEntry] | None:
    """The manifest's entries; None when the folder has no manifest (a state of an earlier version, or not ours).
    A manifest that cannot be read is a UserError."""
    path = folder / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
        if body.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"format {body.get('format')!r}")
        return {name: FileEntry(int(e["size"]), str(e["sha256"])) for name, e in body["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"The state folder '{folder}' has a damaged {MANIFEST_FILE} ({e}): the folder cannot be"
                        " trusted; resume from another state.") from e


def verify_folder(folder: Path, hashes: bool = True) -> dict[str, FileEntry] | None:
    """Check `folder` against its manifest: every listed file present with its size (and, with `hashes`, its
    sha256), no file that the manifest does not list. Returns the entries, or None without a manifest; a mismatch is
    a UserError naming the file."""
    entries = read_manifest(folder)
    if entries is None:
        return None
    present = set(_walk(folder)) - {MANIFEST_FILE}
    for name, entry in entries.items():
        path = folder / name
        if name not in present:
            raise UserError(f"The state folder '{folder}' lacks '{name}', which its manifest lists: the folder is"
                            " incomplete; resume from another state.")
        size = path.stat().st_size
        if size != entry.size:
            raise UserError(f"'{path}' has {size} bytes, but the manifest of its state folder says {entry.size}: the"
                            " file is damaged (truncated or replaced); resume from another state.")
    extra = sorted(present - set(entries))
    if extra:
        raise UserError(f"The state folder '{folder}' holds '{extra[0]}', which its manifest does not list: the"
                        " folder mixes files of two saves; resume from another state.")
    if hashes:
        for name, entry in entries.items():
            if sha256_of(folder / name) != entry.sha256:
                raise UserError(f"'{folder / name}' does not match the sha256 in the manifest of its state folder: the"
                                " file is damaged or comes from another save; resume from another state.")
    return entries


def is_complete(folder: Path) -> bool:
    """Whether `folder` is a whole state: it has a manifest and matches it (sizes and hashes)."""
    if not folder.is_dir():
        return False
    try:
        return verify_folder(folder) is not None
    except (UserError, OSError):
        return False


def recover(folder: Path) -> bool:
    """After a save killed between its two renames, `folder` is missing while the new state (complete, in the temp
    folder) or the previous one (aside) exists: put the newer whole one back under `folder`. Returns whether it did."""
    if folder.exists():
        return False
    for candidate, what in ((temp_folder(folder), "the new state"), (old_folder(folder), "the previous state")):
        if is_complete(candidate):
            os.replace(candidate, folder)
            fsync_folder(folder.parent)
            logger.warning("%s: a save was interrupted while it replaced this state; %s was put back", folder, what)
            return True
    return False


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def leftover_folders(parent: Path, is_ours: Callable[[str], bool]) -> list[Path]:
    """The temp and aside folders in `parent` left by killed saves of states whose names pass `is_ours`."""
    if not parent.is_dir():
        return []
    found = []
    for entry in parent.iterdir():
        name = entry.name
        for suffix in (TEMP_SUFFIX, OLD_SUFFIX):
            if name.startswith(".") and name.endswith(suffix) and entry.is_dir() and is_ours(name[1:-len(suffix)]):
                found.append(entry)
    return sorted(found)


def commit(temp: Path, folder: Path) -> None:
    """Put the sealed temp folder in place of `folder`: an existing folder goes aside first and is removed only
    once the new one is in place."""
    aside = old_folder(folder)
    if aside.exists():
        remove_tree(aside)
    if folder.exists():
        os.replace(folder, aside)
    os.replace(temp, folder)
    fsync_folder(folder.parent)
    if aside.exists():
        remove_tree(aside)
        fsync_folder(folder.parent)


def save_state_folder(folder: Path, write: Callable[[Path], None], accelerator: Any) -> None:
    """Write a state folder atomically. `write(temp)` fills the temp folder on every process (accelerate's
    `save_state` and, on the main process, the trainer's files); the main process seals and commits it. A failure
    (disk full, read-only folder, ...) is a UserError; the previous state stays untouched and the temp folder goes."""
    temp = temp_folder(folder)
    main = accelerator.is_main_process
    try:
        if main:
            if temp.exists():
                remove_tree(temp)
            temp.mkdir(parents=True)
        accelerator.wait_for_everyone()
        write(temp)
        accelerator.wait_for_everyone()
        if main:
            write_manifest(temp)
            commit(temp, folder)
        accelerator.wait_for_everyone()
    except UserError:
        if main:
            remove_tree(temp)
        raise
    except Exception as e:  # accelerate's torch.save reports a full disk as a RuntimeError
        if main:
            remove_tree(temp)
        os_error = as_os_error(e, folder.parent if folder.parent.is_dir() else Path("."))
        if os_error is None:
            raise
        raise WriteError.of(os_error, f"the training state '{folder.name}'", folder.parent) from e
