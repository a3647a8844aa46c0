"""The output folder before the first step: a usable folder, a plain output name, one trainer per output, no
leftovers of killed saves, and room for what the run will save.

- `check_output_dir`: `--output_dir` is a folder (made when missing) that can be written, else one sentence;
  `check_output_name`: `--output_name` is a plain file name (no folder separators, no `..`).
- `OutputLock`: `<output_dir>/.<output_name>.lock`, held with an OS file lock (fcntl / msvcrt) for the whole run;
  a second trainer on the same output is refused with a sentence naming the holder. The OS drops the lock of a
  process that dies, so the file a killed run leaves is simply taken over.
- `remove_leftovers`: under the lock, the temp files (`library.files.safetensors_io.leftover_temp_files`) and temp
  state folders (`library.training.state_io.leftover_folders`) that killed saves of THIS output name left; a state
  whose replacement was interrupted between its two renames is put back first (`state_io.recover`).
- `check_free_space`: the folder's disk has room for one LoRA file and, with `--save_state`, one state
  (`estimate_save_sizes`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from library.errors import UserError
from library.files.safetensors_io import describe_os_error, leftover_temp_files
from library.training import state_io
from library.training.checkpoints import saved_stem_pattern

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT_NAME = "last"
LOCK_SUFFIX = ".lock"
STATE_SLOTS = 3  # a state holds the fp32 weights and about two optimizer values per weight (AdamW's moments)
SPACE_MARGIN = 1.1
SPACE_SLACK_BYTES = 16 * 2**20


def output_name(args: argparse.Namespace) -> str:
    return args.output_name or DEFAULT_OUTPUT_NAME


def check_output_name(name: str) -> None:
    """A plain file name: the saves must land in --output_dir."""
    if not name or ".." in name or any(c in name for c in ("/", "\\", "\0", os.sep)):
        raise UserError(f"--output_name '{name}' is not a plain file name: give a name without folders, separators"
                        " or '..' (the files are saved in --output_dir).")


def check_output_dir(path: str) -> Path:
    """--output_dir as a folder that exists (made when missing) and can be written."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--output_dir '{path}' is a file, not a folder: give a folder for the LoRA files.")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(describe_os_error(e, "the output folder", folder.parent)) from e
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"--output_dir '{path}' is not writable: choose a folder you can write to or change its"
                        " permissions.")
    return folder


# ------------------------------------------------------------------------------------------------------- lock
def _try_lock(fd: int) -> bool:
    try:
        import fcntl
    except ImportError:  # Windows
        import msvcrt

        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as e:  # a file system without locks (some network mounts): run, but say so
        logger.warning("the output folder's file system cannot lock files (%s): a second trainer on the same output"
                       " would not be refused", e.strerror)
    return True


def _unlock(fd: int) -> None:
    try:
        import fcntl
    except ImportError:
        import msvcrt

        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
        return
    fcntl.flock(fd, fcntl.LOCK_UN)


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
        return f"process {info['pid']} on {info['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


@dataclass
class OutputLock:
    """The lock of one output (`--output_dir` + `--output_name`); `release()` when the run ends."""

    path: Path
    fd: int | None = None

    @staticmethod
    def acquire(folder: Path, name: str) -> OutputLock:
        path = folder / f".{name}{LOCK_SUFFIX}"
        for _ in range(10):  # the file may be removed by a releasing holder between our open and our lock
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise UserError(describe_os_error(e, f"the lock file '{path.name}'", folder)) from e
            if not _try_lock(fd):
                os.close(fd)
                raise UserError(f"Another trainer ({_holder(path)}) is writing '{name}' in '{folder}' (its lock is"
                                f" '{path.name}'): wait for it to finish, or give this run another --output_name or"
                                " --output_dir.")
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
            if same:
                break
            _unlock(fd)
            os.close(fd)
        else:
            raise UserError(f"The lock file '{path}' keeps changing: another trainer is starting on the same output;"
                            " give this run another --output_name or --output_dir.")
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode("utf-8"))
        os.fsync(fd)
        return OutputLock(path, fd)

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.remove(self.path)  # while still held: no one else can have taken it
        except OSError:
            pass
        _unlock(self.fd)
        os.close(self.fd)
        self.fd = None


# -------------------------------------------------------------------------------------------------- leftovers
def remove_leftovers(folder: Path, name: str) -> int:
    """Put back a state whose replacement was interrupted, then remove the temp files and folders that killed saves
    of output `name` left in `folder`; call it while holding the output's lock. Returns how many were removed."""
    ours = saved_stem_pattern(name)

    def is_ours(target: str) -> bool:
        stem = target[: -len(".safetensors")] if target.endswith(".safetensors") else target
        return ours.fullmatch(stem) is not None

    for leftover in state_io.leftover_folders(folder, is_ours):
        state_io.recover(folder / leftover.name[1:].rsplit(".", 1)[0])
    removed = 0
    for path in leftover_temp_files(folder, is_ours) + state_io.leftover_folders(folder, is_ours):
        if path.is_dir():
            state_io.remove_tree(path)
        elif path.exists():
            path.unlink()
        removed += 1
        logger.info("removed %s, left by a save that was interrupted", path)
    return removed


# ---------------------------------------------------------------------------------------------------- space
def estimate_save_sizes(num_params: int, save_bytes_per_param: int) -> tuple[int, int]:
    """(LoRA file bytes, state folder bytes) for a network of `num_params` trainable values."""
    lora = num_params * save_bytes_per_param + 2**20  # + the header (names, metadata)
    state = num_params * 4 * STATE_SLOTS + 2**20
    return lora, state


def check_free_space(folder: Path, lora_bytes: int, state_bytes: int | None) -> None:
    """The folder's disk has room for one LoRA file (and one state when `state_bytes` is given)."""
    needed = lora_bytes + (state_bytes or 0)
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return
    if free < needed * SPACE_MARGIN + SPACE_SLACK_BYTES:
        what = f"a LoRA file (about {lora_bytes / 2**20:.0f} MiB)"
        if state_bytes:
            what += f" and a training state (about {state_bytes / 2**20:.0f} MiB)"
        raise UserError(f"--output_dir '{folder}' has {free / 2**20:.0f} MiB free, too little for {what}: free some"
                        " space or choose another folder.")


def network_save_sizes(network: Any, save_dtype: Any) -> tuple[int, int]:
    """`estimate_save_sizes` for a created network and the --save_precision dtype."""
    num_params = sum(p.numel() for p in network.get_trainable_params())
    return estimate_save_sizes(num_params, save_dtype.itemsize)
