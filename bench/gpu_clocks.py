#!/usr/bin/env python
"""Summarise a GPU clock log by its busy phases: mean, lowest and highest SM clock and mean power of each stretch
where the GPU drew at least a given power, and the clock-event reasons seen. A sample of at least `--min_power_w`
watts (default 500) is busy.

The log is what ``nvidia-smi`` writes beside a benchmark, for example

    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active \\
        --format=csv -lms 500 > clocks.csv &
    python -m bench.checkpointing ...
    python -m bench.gpu_clocks clocks.csv

The phases come in the order the benchmark ran its configurations (one per timed phase), so they can be matched to
its rows. Reason 0x4 is the software power cap, 0x1 the GPU idle.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any


def _column(header: list[str], name: str) -> int | None:
    for i, title in enumerate(header):
        if title.strip().split(" [")[0] == name:
            return i
    return None


def _number(text: str) -> float:
    return float(text.strip().split()[0])


def read_log(path: Path) -> list[dict[str, Any]]:
    """The samples of an nvidia-smi CSV log: time, SM clock (MHz), power (W) and the clock-event reasons."""
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    if not rows:
        return []
    header = rows[0]
    idx = {name: _column(header, name) for name in ("timestamp", "clocks.sm", "clocks.current.sm", "power.draw",
                                                     "clocks_event_reasons.active")}
    clock = idx["clocks.current.sm"] if idx["clocks.current.sm"] is not None else idx["clocks.sm"]
    if clock is None or idx["power.draw"] is None:
        raise SystemExit(f"{path}: no clocks.sm or power.draw column in its header; log them with nvidia-smi"
                         " --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active --format=csv")
    samples = []
    for row in rows[1:]:
        try:
            samples.append({"time": row[idx["timestamp"]].strip() if idx["timestamp"] is not None else "",
                            "clock_mhz": _number(row[clock]), "power_w": _number(row[idx["power.draw"]]),
                            "reason": (row[idx["clocks_event_reasons.active"]].strip()
                                       if idx["clocks_event_reasons.active"] is not None else "")})
        except (IndexError, ValueError):  # a line cut off when the logger was stopped
            continue
    return samples


def phases(samples: list[dict[str, Any]], min_power_w: float, max_gap: int) -> list[dict[str, Any]]:
    """Stretches of samples at or above `min_power_w`, joined across at most `max_gap` samples below it."""
    out: list[list[dict[str, Any]]] = []
    current: list[dict[str, Any]] = []
    gap = 0
    for s in samples:
        if s["power_w"] >= min_power_w:
            current.append(s)
            gap = 0
        elif current:
            gap += 1
            if gap > max_gap:
                out.append(current)
                current, gap = [], 0
    if current:
        out.append(current)
    return [_summary(p) for p in out]


def _summary(p: list[dict[str, Any]]) -> dict[str, Any]:
    clocks = [s["clock_mhz"] for s in p]
    return {"start": p[0]["time"], "end": p[-1]["time"], "samples": len(p),
            "clock_mean_mhz": round(sum(clocks) / len(clocks)), "clock_min_mhz": min(clocks),
            "clock_max_mhz": max(clocks), "power_mean_w": round(sum(s["power_w"] for s in p) / len(p)),
            "reasons": sorted({s["reason"] for s in p if s["reason"]})}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_clocks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log", type=Path, help="the nvidia-smi CSV log")
    ap.add_argument("--min_power_w", type=float, default=500.0, help="a sample at this power or more is busy")
    ap.add_argument("--max_gap", type=int, default=4, help="samples below the power that still join two stretches")
    args = ap.parse_args(argv)
    if not args.log.is_file():
        print(f"{args.log}: no such file; give the CSV that nvidia-smi wrote", file=sys.stderr)
        return 2
    for phase in phases(read_log(args.log), args.min_power_w, args.max_gap):
        print(json.dumps(phase))
    return 0


if __name__ == "__main__":
    sys.exit(main())
