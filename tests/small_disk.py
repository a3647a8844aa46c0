"""Real file-system failures for tests: a tiny tmpfs (a full disk) and a read-only mount, where this process may mount
(root on Linux); `None` otherwise, and the tests that need them are skipped there."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path


def can_mount() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "geteuid") and os.geteuid() == 0


@contextlib.contextmanager
def mounted_tmpfs(folder: Path, size_kib: int, read_only: bool = False) -> Iterator[Path | None]:
    """A tmpfs of `size_kib` KiB at `folder` (read-only with `read_only`), unmounted afterwards; yields None when it
    cannot be mounted."""
    folder.mkdir(parents=True, exist_ok=True)
    options = f"size={size_kib}k" + (",ro" if read_only else "")
    if not can_mount() or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                                         capture_output=True).returncode != 0:
        yield None
        return
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def fill(folder: Path, leave_bytes: int = 0) -> None:
    """Fill the disk of `folder` up to `leave_bytes` of free space."""
    import shutil

    free = shutil.disk_usage(folder).free - leave_bytes
    with open(folder / "filler.bin", "wb") as f:
        while free > 0:
            chunk = min(free, 1 << 20)
            try:
                f.write(b"\0" * chunk)
                f.flush()
            except OSError:
                break
            free -= chunk
