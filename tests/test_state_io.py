"""State folders: written in a temp folder, sealed with a manifest and renamed into place; verified before a resume;
put back after a save killed between its renames; the checks of an exact resume."""

from __future__ import annotations

import json
import logging
import os
import pickle
from pathlib import Path

import pytest
import torch

from library.errors import UserError
from library.training import checkpoints, host_random, state_io
from library.training.checkpoints import RunFingerprint, TrainState
from tests.test_write_failures import MainProcess


def write_files(run: str):
    """A `write(temp)` as the trainer's: accelerate's pickles, the network, the train state of run `run`."""
    def write(temp: Path) -> None:
        torch.save({"state": {0: {"exp_avg": torch.full((8,), float(len(run)))}}, "run": run}, temp / "optimizer.bin")
        torch.save({"last_epoch": 3}, temp / "scheduler.bin")
        torch.save({"random_state": (3, tuple(range(625)), None), "numpy_random_seed": ("MT19937",),
                    "torch_manual_seed": torch.get_rng_state()}, temp / "random_states_0.pkl")
        host_random.save_host_generator(host_random.new_host_generator(7), temp, 0)
        (temp / "network.safetensors").write_bytes(run.encode() * 100)
        TrainState(1, 3, fingerprint()).write(temp)
    return write


def fingerprint(**changes) -> RunFingerprint:
    values = dict(seed=7, batch_sizes=(2,), gradient_accumulation_steps=1, num_processes=1, dataset_config="c",
                  dataset_files="f")
    values.update(changes)
    return RunFingerprint(**values)


def saved(tmp_path: Path, run: str = "first") -> Path:
    folder = tmp_path / "toy-step00000003-state"
    state_io.save_state_folder(folder, write_files(run), MainProcess())
    return folder


def test_a_state_is_sealed_with_a_manifest_and_verified(tmp_path):
    folder = saved(tmp_path)
    entries = state_io.verify_folder(folder)
    assert set(entries) == {"optimizer.bin", "scheduler.bin", "random_states_0.pkl", "host_random_0.safetensors",
                            "network.safetensors", "train_state.json"}
    assert entries["network.safetensors"].size == 500
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # no temp or aside folder left
    assert checkpoints.check_resume_folder(str(folder)) == folder


def test_overwriting_keeps_the_previous_state_until_the_new_one_is_whole(tmp_path):
    folder = saved(tmp_path, "first")
    before = state_io.verify_folder(folder)

    def dies_halfway(temp: Path) -> None:
        write_files("second")(temp)
        (temp / "optimizer.bin").write_bytes(b"half")
        raise KeyboardInterrupt  # as a kill while writing: nothing after this runs

    with pytest.raises(KeyboardInterrupt):
        state_io.save_state_folder(folder, dies_halfway, MainProcess())
    assert state_io.verify_folder(folder) == before
    state_io.save_state_folder(folder, write_files("second"), MainProcess())
    assert state_io.verify_folder(folder)["network.safetensors"].size == 600
    assert torch.load(folder / "optimizer.bin")["run"] == "second"


@pytest.mark.parametrize("interrupted_after", ["aside", "sealed"])
def test_a_save_killed_between_its_renames_is_put_back(tmp_path, interrupted_after, caplog):
    folder = saved(tmp_path, "first")
    temp = state_io.temp_folder(folder)
    temp.mkdir()
    write_files("second")(temp)
    state_io.write_manifest(temp)
    if interrupted_after == "aside":  # the old folder renamed aside, the new one not yet in
        os.replace(folder, state_io.old_folder(folder))
        with caplog.at_level(logging.WARNING):
            assert checkpoints.check_resume_folder(str(folder)) == folder
        assert "the new state was put back" in caplog.text
        assert torch.load(folder / "optimizer.bin")["run"] == "second"
    else:  # sealed but not renamed: the folder is the previous state, whole; the temp folder is a leftover
        assert not state_io.recover(folder)
        assert state_io.leftover_folders(tmp_path, lambda n: n == folder.name) == [temp]


def test_an_aside_state_comes_back_when_the_new_one_is_incomplete(tmp_path):
    folder = saved(tmp_path)
    os.replace(folder, state_io.old_folder(folder))
    state_io.temp_folder(folder).mkdir()  # a new state that was never sealed
    assert state_io.recover(folder)
    assert state_io.verify_folder(folder) is not None


def test_damaged_and_mixed_folders_are_refused_naming_the_file(tmp_path):
    folder = saved(tmp_path)
    (folder / "optimizer.bin").write_bytes((folder / "optimizer.bin").read_bytes()[:-5])
    with pytest.raises(UserError, match="optimizer.bin' has .* bytes, but the manifest .* says .*damaged"):
        checkpoints.check_resume_folder(str(folder))

    folder = saved(tmp_path)
    raw = bytearray((folder / "scheduler.bin").read_bytes())
    raw[-30] ^= 0xFF  # same size, other bytes
    (folder / "scheduler.bin").write_bytes(bytes(raw))
    with pytest.raises(UserError, match="scheduler.bin' does not match the sha256"):
        checkpoints.check_resume_folder(str(folder))

    folder = saved(tmp_path)
    (folder / "random_states_0.pkl").unlink()
    with pytest.raises(UserError, match="lacks 'random_states_0.pkl'.*incomplete"):
        checkpoints.check_resume_folder(str(folder))

    folder = saved(tmp_path)
    (folder / "random_states_1.pkl").write_bytes(b"from another run")
    with pytest.raises(UserError, match="holds 'random_states_1.pkl', which its manifest does not list.*mixes"):
        checkpoints.check_resume_folder(str(folder))

    folder = saved(tmp_path)
    (folder / "manifest.json").write_text("{not json")
    with pytest.raises(UserError, match="damaged manifest.json"):
        checkpoints.check_resume_folder(str(folder))


def test_resume_folder_sentences(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        checkpoints.check_resume_folder(str(tmp_path / "nope"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is not a folder"):
        checkpoints.check_resume_folder(str(tmp_path / "file"))
    (tmp_path / "sd").mkdir()
    (tmp_path / "sd" / "optimizer.bin").write_bytes(b"x")
    with pytest.raises(UserError, match="not a state saved by this trainer"):
        checkpoints.check_resume_folder(str(tmp_path / "sd"))


# ----------------------------------------------------------------------------------------- exact resume
def test_every_change_that_breaks_exactness_is_named(tmp_path, caplog):
    folder = saved(tmp_path)
    assert checkpoints.check_resume(folder, fingerprint(), 0, inexact=False).step == 3
    changed = fingerprint(seed=8, batch_sizes=(4,), gradient_accumulation_steps=2, num_processes=2,
                          dataset_config="c2", dataset_files="f2")
    with pytest.raises(UserError) as e:
        checkpoints.check_resume(folder, changed, 0, inexact=False)
    for phrase in ("--seed is 8, the state's run had 7", "batch sizes are [4]", "--gradient_accumulation_steps is 2",
                   "2 processes", "dataset settings differ", "dataset's files differ", "add --resume_inexact"):
        assert phrase in str(e.value)
    with caplog.at_level(logging.WARNING):
        assert checkpoints.check_resume(folder, changed, 0, inexact=True).step == 3
    assert "--resume_inexact: --seed is 8" in caplog.text and "will not match" in caplog.text


class Hostile:
    def __reduce__(self):
        return (os.system, ("touch hostile_pickle_ran",))


@pytest.mark.parametrize("damage", ["missing", "truncated", "hostile", "incomplete"])
def test_an_unusable_random_state_is_named(tmp_path, damage, monkeypatch):
    folder = tmp_path / "state"
    folder.mkdir()
    write_files("x")(folder)
    path = folder / "random_states_0.pkl"
    if damage == "missing":
        path.unlink()
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:100])
    elif damage == "hostile":
        path.write_bytes(pickle.dumps({"random_state": Hostile()}))
    else:
        torch.save({"random_state": (3, (), None)}, path)
    state_io.write_manifest(folder)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="random state random_states_0.pkl"):
        checkpoints.check_resume(folder, fingerprint(), 0, inexact=False)
    assert not (tmp_path / "hostile_pickle_ran").exists()


def test_states_of_earlier_versions_need_resume_inexact(tmp_path):
    folder = tmp_path / "old-state"
    folder.mkdir()
    write_files("x")(folder)
    (folder / "train_state.json").write_text(json.dumps({"current_epoch": 1, "current_step": 3}))
    assert checkpoints.check_resume_folder(str(folder)) == folder  # no manifest: cannot be verified, still a state
    with pytest.raises(UserError, match="no manifest.json.*does not record the seed"):
        checkpoints.check_resume(folder, fingerprint(), 0, inexact=False)
    assert checkpoints.check_resume(folder, fingerprint(), 0, inexact=True).step == 3


def test_the_steps_random_state_is_restored_and_checked(tmp_path):
    folder = saved(tmp_path)
    g = host_random.new_host_generator(7)
    first = torch.rand(4, generator=g)
    restored = torch.Generator().manual_seed(123)
    assert host_random.load_host_generator(restored, folder, 0)
    assert torch.equal(torch.rand(4, generator=restored), first)  # the saved state is the one before any draw
    assert not torch.equal(torch.rand(4, generator=host_random.new_host_generator(7, 1)), first)  # per process
    (folder / "host_random_0.safetensors").unlink()
    state_io.write_manifest(folder)
    with pytest.raises(UserError, match="host_random_0.safetensors is missing .a state of an earlier version"):
        checkpoints.check_resume(folder, fingerprint(), 0, inexact=False)
    assert checkpoints.check_resume(folder, fingerprint(), 0, inexact=True).step == 3
    assert not host_random.load_host_generator(restored, folder, 0)  # untouched: the run goes on inexactly
    (folder / "host_random_0.safetensors").write_bytes(b"not a safetensors file")
    state_io.write_manifest(folder)
    with pytest.raises(UserError, match="host_random_0.safetensors cannot be read"):
        checkpoints.check_resume(folder, fingerprint(), 0, inexact=False)


def test_seed_of_the_state_is_used_without_seed(tmp_path):
    import argparse

    folder = saved(tmp_path)
    args = argparse.Namespace(resume=str(folder), seed=None)
    checkpoints.seed_from_state(args)
    assert args.seed == 7
    args = argparse.Namespace(resume=str(folder), seed=3)
    checkpoints.seed_from_state(args)
    assert args.seed == 3
