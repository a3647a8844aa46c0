"""bench/kill9_trials.py runs and finds every save intact (one trial per kind, to keep it short)."""

from __future__ import annotations

import json
import os

import pytest

from bench import kill9_trials


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the trials fork child processes")
def test_kill9_trials_report_intact_saves(tiny_snapshot, capsys):
    assert kill9_trials.main(["--trials", "1", "--snapshot", str(tiny_snapshot), "--seed", "3"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["results"]) == set(kill9_trials.KINDS)
    for kind, tally in report["results"].items():
        assert tally["trials"] == 1 and tally["corrupted"] == 0 and tally["leftovers_after_cleanup"] == 0, kind
        assert tally["intact"] + tally["absent"] + tally["refused"] >= 1 and tally["remade_wrong"] == 0, kind
