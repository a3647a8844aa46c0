"""A benchmark's JSON report: printed, and written where asked (atomically, so that a run stopped while writing leaves
no half file). Paths and other values JSON has no type for are written as their text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from library.files.safetensors_io import write_atomic


def write_report(report: Any, out: Path | None) -> None:
    text = json.dumps(report, indent=1, default=str)
    if out is not None:
        write_atomic(out, lambda tmp: Path(tmp).write_text(text + "\n", encoding="utf-8"))
    print(text)
