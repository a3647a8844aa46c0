"""Show the metadata of a LoRA (or any safetensors) file: modelspec.*, ss_* training keys, tensors, hash check.

    python tools/show_metadata.py my_moss_lora.safetensors [--full] [--json] [--no_verify]

The hashes stored at save time (sshs_model_hash, sshs_legacy_hash, modelspec.hash_sha256) are recomputed from the
file and reported as OK / MISMATCH (exit status 1 on a mismatch: the file was modified or damaged).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from library.errors import UserError

TRUNCATE = 160


def _part_of(lora_name: str) -> str:
    if lora_name.startswith("lora_unet_"):
        return "DiT"
    return "text encoder" if lora_name.startswith("lora_te_") else "other"


def _lora_summary(path: Path) -> dict[str, Any]:
    from library.files.safetensors_io import SafetensorsFile

    with SafetensorsFile(path) as f:
        keys = f.keys()
        dtypes = Counter(str(f.dtype(k)).replace("torch.", "") for k in keys)
        ranks: Counter[int] = Counter()
        modules = Counter()
        alphas: Counter[float] = Counter()
        for key in keys:
            name, _, suffix = key.partition(".")
            if suffix == "lora_down.weight":
                ranks[f.shape(key)[0]] += 1
                modules[_part_of(name)] += 1
            elif suffix == "alpha":
                alphas[round(float(f.get_tensor(key).float().item()), 6)] += 1
    return {
        "tensors": len(keys),
        "dtypes": dict(dtypes),
        "modules": dict(modules),
        "ranks": dict(sorted(ranks.items())),
        "alphas": dict(sorted(alphas.items())),
    }


def check_hashes(path: Path, metadata: dict[str, str]) -> list[tuple[str, str, str | None, str]]:
    """(key, stored, computed, status) for each stored hash; status is OK, MISMATCH or 'not stored'."""
    from library.files.model_spec import file_legacy_hash, file_model_hash

    model_hash = file_model_hash(path)
    rows = []
    for key, compute in (
        ("sshs_model_hash", lambda: model_hash),
        ("sshs_legacy_hash", lambda: file_legacy_hash(path)),
        ("modelspec.hash_sha256", lambda: "0x" + model_hash),
    ):
        stored = metadata.get(key)
        if stored is None:
            rows.append((key, "-", None, "not stored"))
            continue
        computed = compute()
        rows.append((key, stored, computed, "OK" if computed.lower() == stored.lower() else "MISMATCH"))
    return rows


def _format_value(value: str, full: bool) -> str:
    text = value
    if value[:1] in "{[":
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = None
        if parsed is not None and full:
            pretty = json.dumps(parsed, indent=2, ensure_ascii=False)
            return "\n" + "\n".join("      " + line for line in pretty.splitlines())
    if not full and len(text) > TRUNCATE:
        text = text[:TRUNCATE] + f"... ({len(value)} chars, --full shows all)"
    return text


def format_report(path: Path, metadata: dict[str, str], summary: dict[str, Any],
                  hashes: list[tuple[str, str, str | None, str]] | None, full: bool) -> str:
    lines = [f"file: {path} ({path.stat().st_size:,} bytes)"]
    lines.append(
        f"tensors: {summary['tensors']} {summary['dtypes']}; LoRA modules: {summary['modules'] or 'none'};"
        f" ranks: {summary['ranks'] or '-'}; alphas: {summary['alphas'] or '-'}"
    )
    groups = (
        ("modelspec", [k for k in metadata if k.startswith("modelspec.")]),
        ("training (ss_*)", [k for k in metadata if k.startswith("ss_")]),
        ("other", [k for k in metadata if not k.startswith(("modelspec.", "ss_", "sshs_"))]),
    )
    if not metadata:
        lines.append("metadata: none")
    for title, keys in groups:
        if not keys:
            continue
        lines.append(f"[{title}]")
        width = max(len(k) for k in keys)
        for key in sorted(keys):
            lines.append(f"  {key:<{width}} : {_format_value(metadata[key], full)}")
    if hashes is not None:
        lines.append("[hashes]")
        for key, stored, computed, status in hashes:
            detail = "" if status in ("OK", "not stored") else f" (computed {computed})"
            lines.append(f"  {key:<22} : {stored}  {status}{detail}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Show the metadata of a LoRA .safetensors file.")
    parser.add_argument("file", help="LoRA file (.safetensors)")
    parser.add_argument("--full", action="store_true", help="show long values (JSON keys pretty-printed) in full")
    parser.add_argument("--json", action="store_true", help="print the raw metadata as one JSON object")
    parser.add_argument("--no_verify", action="store_true", help="do not recompute the stored hashes")
    args = parser.parse_args(argv)
    try:
        from library.files.safetensors_io import check_safetensors_path, read_metadata

        path = check_safetensors_path(args.file, "LoRA file")
        metadata = read_metadata(path)
        if args.json:
            print(json.dumps(metadata, indent=2, ensure_ascii=False, sort_keys=True))
            return 0
        hashes = None if args.no_verify else check_hashes(path, metadata)
        print(format_report(path, metadata, _lora_summary(path), hashes, args.full))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1 if hashes and any(row[3] == "MISMATCH" for row in hashes) else 0


if __name__ == "__main__":
    sys.exit(main())
