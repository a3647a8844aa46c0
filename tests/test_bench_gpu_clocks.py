"""bench/gpu_clocks.py: an nvidia-smi clock log split into its busy phases, with their clocks and power."""

from __future__ import annotations

import json

from bench import gpu_clocks

HEADER = ("timestamp, clocks.current.sm [MHz], power.draw [W], temperature.gpu,"
          " clocks_event_reasons.active\n")


def _log(tmp_path, rows):
    path = tmp_path / "clocks.csv"
    path.write_text(HEADER + "".join(f"t{i}, {c} MHz, {p} W, 50, {r}\n" for i, (c, p, r) in enumerate(rows))
                    + "t99, 19")  # the last line cut off when the logger was stopped
    return path


def test_busy_phases_with_their_clocks_power_and_reasons(tmp_path, capsys):
    idle, capped = "0x0000000000000001", "0x0000000000000004"
    rows = [(345, 80, idle), (1800, 680, capped), (1700, 690, capped), (1980, 300, "0x0"), (1900, 660, capped),
            (345, 80, idle), (345, 80, idle), (345, 80, idle), (1980, 600, "0x0"), (1960, 620, "0x0")]
    found = gpu_clocks.phases(gpu_clocks.read_log(_log(tmp_path, rows)), min_power_w=500, max_gap=2)
    assert [(p["start"], p["end"], p["samples"]) for p in found] == [("t1", "t4", 3), ("t8", "t9", 2)]
    assert found[0]["clock_mean_mhz"] == 1800 and found[0]["clock_min_mhz"] == 1700
    assert found[0]["power_mean_w"] == 677 and found[0]["reasons"] == [capped]
    assert found[1]["clock_max_mhz"] == 1980
    assert gpu_clocks.main([str(tmp_path / "clocks.csv"), "--max_gap", "2"]) == 0
    assert [json.loads(line)["samples"] for line in capsys.readouterr().out.splitlines()] == [3, 2]


def test_a_missing_log_is_refused(tmp_path, capsys):
    assert gpu_clocks.main([str(tmp_path / "none.csv")]) == 2
    assert "no such file" in capsys.readouterr().err
