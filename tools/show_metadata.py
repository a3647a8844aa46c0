"""Show the metadata of a LoRA (or any safetensors) file: modelspec.*, ss_* training keys, tensors, hash check.

    python tools/show_metadata.py my_moss_lora.safetensors [--full] [--json] [--no_verify]

The hashes stored at save time (sshs_model_hash, sshs_legacy_hash, modelspec.hash_sha256) are recomputed from the
file. Each is OK, MISMATCH, stale (left behind by a tool that rewrote the file while the tensor data still matches
sshs_model_hash: sd-scripts' resize_lora updates only sshs_*), not checked (a format computed otherwise, e.g.
LyCORIS' "0x..." sshs_model_hash) or not stored.

Which files are ours: `modelspec.implementation_version` starts with "moss-image-scripts/" (the trainer writes it;
networks/convert_moss_image_lora.py and tools that rewrite a file from ours, such as resize_lora, keep it). The exit status is 1 only when
a file of ours has a MISMATCH: its tensor data is not what was saved. Another tool's file is shown, never judged
(exit status 0): it may compute or update its hashes differently. Errors reading the file: exit status 2.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from library.errors import UserError
from library.files.model_spec import IMPLEMENTATION_NAME, file_legacy_hash, file_model_hash
from library.files.safetensors_io import SafetensorsFile, check_safetensors_path, read_metadata

TRUNCATE = 160


def _part_of(lora_name: str) -> str:
    if lora_name.startswith("lora_unet_"):
        return "DiT"
    return "text encoder" if lora_name.startswith("lora_te_") else "other"


def _lora_summary(path: Path) -> dict[str, Any]:
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


# ------------------------------------------------------------------------------------------------ hash check
HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
HEX8 = re.compile(r"^[0-9a-fA-F]{8}$")
PREFIXED_HEX64 = re.compile(r"^0x[0-9a-fA-F]{64}$")
# statuses: OK, MISMATCH (a hash that should hold does not), stale (a hash the last writer left behind while the
# tensor data still matches sshs_model_hash), not checked (a format we do not compute), not stored
OK, MISMATCH, STALE, NOT_CHECKED, NOT_STORED = "OK", "MISMATCH", "stale", "not checked", "not stored"


@dataclass(frozen=True)
class HashRow:
    key: str
    stored: str | None
    computed: str | None
    status: str
    note: str = ""


def file_origin(metadata: dict[str, str]) -> str:
    """The tool that wrote the file, from `modelspec.implementation_version` ("<tool>/<commit>"): ours writes
    "moss-image-scripts/...", sd-scripts "sd-scripts/..."; "another tool" when the key is missing. A file that
    another tool rewrote from ours keeps our key (sd-scripts' resize_lora copies the metadata)."""
    version = metadata.get("modelspec.implementation_version", "")
    tool = version.split("/", 1)[0] if "/" in version else ""
    return tool or "another tool"


def is_our_file(metadata: dict[str, str]) -> bool:
    return file_origin(metadata) == IMPLEMENTATION_NAME


def _check_model_hash(stored: str, data_hash: str) -> HashRow:
    key = "sshs_model_hash"
    if HEX64.match(stored):
        return HashRow(key, stored, data_hash, OK if stored.lower() == data_hash else MISMATCH)
    if PREFIXED_HEX64.match(stored):
        return HashRow(key, stored, None, NOT_CHECKED, "LyCORIS' format: a sha256 over each tensor serialised alone,"
                                                       " in the network's own order, which the file does not keep")
    return HashRow(key, stored, None, NOT_CHECKED, "not the sha256 hex digest sd-scripts writes")


def _check_legacy_hash(path: Path, stored: str, data_ok: bool) -> HashRow:
    key = "sshs_legacy_hash"
    if not HEX8.match(stored):
        return HashRow(key, stored, None, NOT_CHECKED, "not the 8 hex digits sd-scripts writes")
    computed = file_legacy_hash(path)
    if computed == stored.lower():
        return HashRow(key, stored, computed, OK)
    if data_ok:  # the legacy hash covers the serialised ss_* keys too: an edited key changes it, not the tensors
        return HashRow(key, stored, computed, STALE, "the ss_* metadata was edited after the hash was written; the"
                                                    " tensor data matches sshs_model_hash")
    return HashRow(key, stored, computed, MISMATCH)


def _check_modelspec_hash(stored: str, data_hash: str, data_ok: bool) -> HashRow:
    key = "modelspec.hash_sha256"
    if not PREFIXED_HEX64.match(stored):
        return HashRow(key, stored, None, NOT_CHECKED, "not '0x' and a sha256 hex digest")
    computed = "0x" + data_hash
    if stored.lower() == computed:
        return HashRow(key, stored, computed, OK)
    if data_ok:
        return HashRow(key, stored, computed, STALE, "left from before the file was rewritten by a tool that updates"
                                                    " only sshs_* (sd-scripts' resize_lora, for one); the"
                                                    " tensor data matches sshs_model_hash")
    return HashRow(key, stored, computed, MISMATCH)


def check_hashes(path: Path, metadata: dict[str, str]) -> list[HashRow]:
    """One row per hash key: sshs_model_hash (sha256 of the tensor data), sshs_legacy_hash (sd-scripts' short hash of
    the re-serialised file), modelspec.hash_sha256 ('0x' + the tensor-data sha256).

    sshs_model_hash is the reference: sd-scripts and every tool built on its code recompute it whenever they write a
    file, so when it matches, the tensor data is intact and a different value in the other two keys is `stale`
    (left by a tool that does not update them), not damage."""
    data_hash = file_model_hash(path)
    stored_model = metadata.get("sshs_model_hash")
    model_row = _check_model_hash(stored_model, data_hash) if stored_model is not None else None
    data_ok = model_row is not None and model_row.status == OK
    rows = [model_row or HashRow("sshs_model_hash", None, None, NOT_STORED)]
    legacy = metadata.get("sshs_legacy_hash")
    rows.append(_check_legacy_hash(path, legacy, data_ok) if legacy is not None
                else HashRow("sshs_legacy_hash", None, None, NOT_STORED))
    spec = metadata.get("modelspec.hash_sha256")
    rows.append(_check_modelspec_hash(spec, data_hash, data_ok) if spec is not None
                else HashRow("modelspec.hash_sha256", None, None, NOT_STORED))
    return rows


def is_damaged(metadata: dict[str, str], rows: list[HashRow]) -> bool:
    """True when a file of ours has a hash that should hold and does not: its tensor data is not what we saved.
    Another tool's file is never judged: it may compute or update its hashes differently."""
    return is_our_file(metadata) and any(r.status == MISMATCH for r in rows)


def verdict(metadata: dict[str, str], rows: list[HashRow]) -> str:
    origin = file_origin(metadata)
    checked = [r for r in rows if r.status in (OK, MISMATCH, STALE)]
    stale = [r.key for r in rows if r.status == STALE]
    if not checked:
        return f"written by {origin}: no hash that can be recomputed here, nothing verified"
    if not is_our_file(metadata):
        if any(r.status == MISMATCH for r in rows):
            return (f"written by {origin}: some stored hashes differ from the file; not judged as damage (that tool may"
                    " compute or update them differently)")
        return f"written by {origin}: the stored hashes that can be recomputed match"
    if is_damaged(metadata, rows):
        return ("DAMAGED or changed: the tensor data is not what moss-image-scripts saved (a tool that does not"
                " update sshs_model_hash rewrote it, or the file is corrupt); exit status 1")
    if stale:
        return f"intact: the tensor data matches; {', '.join(stale)} left stale by a tool that rewrote the file"
    return "intact: every stored hash matches"


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


def format_report(path: Path, metadata: dict[str, str], summary: dict[str, Any], hashes: list[HashRow] | None,
                  full: bool) -> str:
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
        for row in hashes:
            detail = f" (computed {row.computed})" if row.status in (MISMATCH, STALE) else ""
            note = f": {row.note}" if row.note else ""
            lines.append(f"  {row.key:<22} : {row.stored or '-'}  {row.status}{detail}{note}")
        lines.append(f"  verdict: {verdict(metadata, hashes)}")
    return "\n".join(lines)


def setup_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Show the metadata of a LoRA .safetensors file.")
    parser.add_argument("file", help="LoRA file (.safetensors)")
    parser.add_argument("--full", action="store_true", help="show long values (JSON keys pretty-printed) in full")
    parser.add_argument("--json", action="store_true", help="print the raw metadata as one JSON object")
    parser.add_argument("--no_verify", action="store_true", help="do not recompute the stored hashes")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = setup_parser().parse_args(argv)
    try:
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
    return 1 if hashes is not None and is_damaged(metadata, hashes) else 0


if __name__ == "__main__":
    sys.exit(main())
