"""Checks before the first step: option bounds, the output name and folder, the per-output lock, the leftovers of
killed saves, the room for saves, the sample prompts, the network module."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import moss_image_train_network as trainer_script
from library.errors import UserError
from library.training import output_folder, run_checks, state_io
from library.training.output_folder import OutputLock

REPO = Path(__file__).resolve().parent.parent


def parse(*argv: str):
    return trainer_script.setup_parser().parse_args(["--output_dir", "out", "--network_module", "networks.lora_generic",
                                                     *argv])


# ------------------------------------------------------------------------------------------------------ bounds
@pytest.mark.parametrize("argv, message", [
    (["--max_train_steps", "0"], "--max_train_steps 0 trains nothing"),
    (["--max_train_steps", "-5"], "--max_train_steps -5 trains nothing"),
    (["--max_train_epochs", "0"], "--max_train_epochs 0 trains nothing"),
    (["--save_every_n_steps", "-1"], "--save_every_n_steps -1 is negative"),
    (["--save_every_n_epochs", "-2"], "--save_every_n_epochs -2 is negative"),
    (["--save_last_n_steps", "-1"], "--save_last_n_steps -1 is negative"),
    (["--sample_every_n_steps", "-1"], "--sample_every_n_steps -1 is negative"),
    (["--validate_every_n_epochs", "-1"], "--validate_every_n_epochs -1 is negative"),
    (["--seed", "-1"], "--seed -1 is out of range: give 0 to 4294967295, or leave --seed out"),
    (["--seed", str(2**32)], "is out of range"),
    (["--max_nan_loss_steps", "0"], "--max_nan_loss_steps 0 is below 1"),
    (["--output_name", "../../x"], "--output_name '../../x' is not a plain file name"),
    (["--output_name", "sub/x"], "is not a plain file name"),
    (["--output_name", "sub\\x"], "is not a plain file name"),
])
def test_out_of_range_options_are_refused(argv, message):
    with pytest.raises(UserError, match=message.replace("(", "\\(").replace(")", "\\)")):
        run_checks.check_run_options(parse(*argv))


def test_counts_of_zero_mean_off_and_epochs_override_steps():
    run_checks.check_run_options(parse("--save_every_n_steps", "0", "--save_every_n_epochs", "0", "--seed", "0"))
    run_checks.check_run_options(parse("--max_train_steps", "0", "--max_train_epochs", "2"))  # steps are unused


# -------------------------------------------------------------------------------------------------------- lock
def test_a_second_trainer_on_the_same_output_is_refused(tmp_path):
    lock = OutputLock.acquire(tmp_path, "toy")
    try:
        info = json.loads((tmp_path / ".toy.lock").read_text())
        assert info["pid"] == os.getpid()
        with pytest.raises(UserError, match=rf"Another trainer \(process {os.getpid()} on .*\) is writing 'toy'"):
            OutputLock.acquire(tmp_path, "toy")
        OutputLock.acquire(tmp_path, "other").release()  # another output name in the same folder is fine
    finally:
        lock.release()
    assert not (tmp_path / ".toy.lock").exists()
    OutputLock.acquire(tmp_path, "toy").release()


_HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from library.training.output_folder import OutputLock
    OutputLock.acquire(Path(sys.argv[1]), "toy")
    print("locked", flush=True)
    time.sleep(60)
""")


def _holder(folder: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(folder)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_the_lock_of_a_live_process_holds_and_a_killed_ones_is_taken_over(tmp_path):
    proc = _holder(tmp_path)
    try:
        with pytest.raises(UserError, match=f"process {proc.pid}"):
            OutputLock.acquire(tmp_path, "toy")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert (tmp_path / ".toy.lock").exists()  # the killed holder's file stays behind ...
    OutputLock.acquire(tmp_path, "toy").release()  # ... and is taken over


def test_prepare_output_locks_and_removes_only_our_leftovers(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    ours = [".toy.safetensors.abcd1234.tmp", ".toy-step00000004.safetensors.k2k2k2k2.tmp", ".toy-000002-state.tmp",
            ".toy-state.old"]
    others = [".toy2.safetensors.abcd1234.tmp", ".toy-v2-state.tmp", "toy-state.tmp", ".notes.tmp"]
    for name in ours + others:
        (out / name).mkdir() if "state" in name else (out / name).write_bytes(b"x")
    lock = run_checks.prepare_output(parse("--output_dir", str(out), "--output_name", "toy"))
    try:
        assert sorted(p.name for p in out.iterdir()) == sorted(others + [".toy.lock"])
    finally:
        lock.release()


def test_prepare_output_puts_back_a_state_a_killed_save_left_aside(tmp_path):
    from tests.test_state_io import saved

    folder = saved(tmp_path)
    os.replace(folder, state_io.old_folder(folder))
    lock = run_checks.prepare_output(parse("--output_dir", str(tmp_path), "--output_name", "toy"))
    lock.release()
    assert state_io.verify_folder(folder) is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name]


# ------------------------------------------------------------------------------------------------------ room
def test_too_little_room_for_the_saves_is_refused(tmp_path):
    import shutil

    free = shutil.disk_usage(tmp_path).free
    output_folder.check_free_space(tmp_path, 2**20, 2**20)
    with pytest.raises(UserError, match=r"MiB free, too little for a LoRA file \(about .* MiB\) and a training state"):
        output_folder.check_free_space(tmp_path, free // 2, free // 2)
    lora, state = output_folder.estimate_save_sizes(10_000_000, 2)
    assert lora >= 20_000_000 and state >= 120_000_000  # fp32 weights and two optimizer values per weight


# ------------------------------------------------------------------------------------------- prompts, network
def test_a_bad_sample_prompt_file_is_found_before_training(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat --w 30 --h 64\n")
    with pytest.raises(UserError, match="p.txt line 1: image width 30 is not a positive multiple of 16"):
        run_checks.check_sample_prompts(parse("--sample_prompts", str(prompts)))
    prompts.write_text("a cat --l nan\n")
    with pytest.raises(UserError, match="must be a finite number"):
        run_checks.check_sample_prompts(parse("--sample_prompts", str(prompts)))
    with pytest.raises(UserError, match="does not exist"):
        run_checks.check_sample_prompts(parse("--sample_prompts", str(tmp_path / "missing.txt")))


def test_a_module_that_is_not_a_network_is_refused():
    import json as not_a_network

    with pytest.raises(UserError, match="--network_module 'json' is not a network module .*create_network"):
        run_checks.check_network_module(not_a_network, parse("--network_module", "json"))
    with pytest.raises(UserError, match="created a dict, which is not a network .*apply_to"):
        run_checks.check_network({}, parse())
