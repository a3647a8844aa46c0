"""The trainer end to end on the tiny snapshot when things go wrong: a diverging run stops with the good saves kept,
a resume that cannot be exact is refused or warned about, and bad outputs are refused before any model is read."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch

from library.errors import UserError
from library.files.safetensors_io import load_safetensors
from library.training import checkpoints, state_io
from library.training.output_folder import OutputLock
from tests.test_trainer import base_args, make_toy_dataset, train


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_toy_dataset(tmp_path_factory.mktemp("toy"))


def test_a_diverging_run_stops_and_keeps_the_good_saves(tiny_snapshot, toy_data, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(UserError, match=r"The loss was (nan|inf) at step \d+, so training stopped; the files saved"):
        train(base_args(tiny_snapshot, toy_data, out, "--learning_rate", "1e6", "--max_train_steps", "6",
                        "--save_every_n_steps", "1"))
    saves = sorted(out.glob("*.safetensors"))
    assert saves and not (out / "toy.safetensors").exists()  # no final file from the diverged weights
    for path in saves:
        assert all(torch.isfinite(t).all() for t in load_safetensors(path).values()), path
    assert not (out / ".toy.lock").exists()  # the lock went with the run


def test_a_resume_that_cannot_be_exact_is_refused_or_warned_about(tiny_snapshot, toy_data, tmp_path, caplog):
    common = ("--learning_rate", "1e-3", "--max_train_steps", "4", "--save_state")
    out = tmp_path / "out"
    train(base_args(tiny_snapshot, toy_data, out, *common, "--save_every_n_steps", "2"))
    state = out / "toy-step00000002-state"
    assert (state / "manifest.json").exists() and state_io.verify_folder(state) is not None
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []  # no temp folder, no lock

    changed = base_args(tiny_snapshot, toy_data, tmp_path / "other", *common, "--resume", str(state))
    changed[changed.index("--seed") + 1] = "8"
    with pytest.raises(UserError, match=re.escape("cannot continue exactly: --seed is 8, the state's run had 7")):
        train(changed)

    final_state = out / "toy-state"
    before = json.loads((final_state / "train_state.json").read_text())
    with caplog.at_level(logging.WARNING):
        run = train([*changed[:changed.index("--output_dir") + 1], str(out),
                     *changed[changed.index("--output_dir") + 2:], "--resume_inexact"])
    assert run.global_step == 4
    assert "--resume_inexact: --seed is 8, the state's run had 7" in caplog.text
    after = checkpoints.TrainState.read(final_state)  # the final state was replaced, whole
    assert state_io.verify_folder(final_state) is not None and after.run.seed == 8 and before["run"]["seed"] == 7


@pytest.mark.parametrize("case, message", [
    ("locked", "Another trainer .* is writing 'toy'"),
    ("file", "--output_dir '.*' is a file, not a folder"),
    ("name", "--output_name '../x' is not a plain file name"),
    ("steps", "--max_train_steps 0 trains nothing"),
    ("prompts", "prompts.txt line 1: .*must be a finite number"),
    ("resume", "lacks 'optimizer.bin'"),
])
def test_bad_outputs_and_options_are_refused_before_loading(tiny_snapshot, toy_data, tmp_path, case, message):
    out = tmp_path / "out"
    extra: list[str] = []
    lock = None
    if case == "locked":
        out.mkdir()
        lock = OutputLock.acquire(out, "toy")
    elif case == "file":
        out.write_text("not a folder")
    elif case == "name":
        extra = ["--output_name", "../x"]
    elif case == "steps":
        extra = ["--max_train_steps", "0"]
    elif case == "prompts":
        (tmp_path / "prompts.txt").write_text("a cat --l nan\n")
        extra = ["--sample_prompts", str(tmp_path / "prompts.txt")]
    else:
        from tests.test_state_io import saved

        state = saved(tmp_path)
        (state / "optimizer.bin").unlink()
        extra = ["--resume", str(state)]
    try:
        with pytest.raises(UserError, match=message):
            train(base_args(tiny_snapshot, toy_data, out, *extra))
    finally:
        if lock is not None:
            lock.release()


def test_a_network_module_that_is_not_a_network(tiny_snapshot, toy_data, tmp_path):
    argv = base_args(tiny_snapshot, toy_data, tmp_path / "out", "--max_train_steps", "1")
    argv[argv.index("--network_module") + 1] = "json"
    with pytest.raises(UserError, match="--network_module 'json' is not a network module"):
        train(argv)
